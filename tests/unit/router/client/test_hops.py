"""The client helpers' pure rules: what a router's Close means (router.client.hops) and what a
management-API answer means (router.client.lookup), table-driven."""

from __future__ import annotations

import pytest

from broker.wire.frames import FOLLOWS_REDIRECT
from router.client.errors import RedirectError, RedirectLoop, RouterRefused, TooManyRedirects
from router.client.hops import FORCED, REDIRECT, Follow, GiveUp, HopPlan, Retry, is_failed_open
from router.client.lookup import Answer, AnswerCache, parse_answer

FRONT = "amqp://app:p%40ss@router.test:5672"
NOT_READY = "Connection router main is not ready"  # Artemis AMQPRoutingHandler text, exactly


def redirect(host, port, **extra):
    return REDIRECT, "Connection router main redirected this connection", {"network-host": host, "port": port, **extra}


def test_the_capability_is_one_symbol_name():
    assert FOLLOWS_REDIRECT == "lodestone:follows-redirect"


@pytest.mark.parametrize("props, failed", [
    (None, False), ({}, False), ({"amqp:connection-establishment-failed": True}, True),
    ({"amqp:connection-establishment-failed": False}, False), ({"node-id": "x"}, False), ([1], False)])
def test_failed_open_is_read_from_the_open_properties(props, failed):
    assert is_failed_open(props) is failed


def test_a_redirect_keeps_scheme_credentials_and_path():
    plan = HopPlan("amqps://app:p%40ss@router.test:5671/vhost")
    d = plan.on_close(*redirect("10.0.0.7", 15672))
    assert d == Follow("amqps://app:p%40ss@10.0.0.7:15672/vhost", None)
    assert plan.hops == ["amqps://app:p%40ss@router.test:5671/vhost", d.url]


def test_ipv6_hosts_are_bracketed_and_hostname_becomes_the_virtual_host():
    plan = HopPlan(FRONT)
    assert plan.on_close(*redirect("::1", 5000, hostname="tenant.test")) == \
        Follow("amqp://app:p%40ss@[::1]:5000", "tenant.test")


@pytest.mark.parametrize("info", [{}, {"network-host": "", "port": 1}, {"network-host": "h"},
                                  {"network-host": 7, "port": 1}, {"network-host": "h", "port": "x"}])
def test_a_redirect_without_an_address_gives_up(info):
    d = HopPlan(FRONT).on_close(REDIRECT, "bad", info)
    assert isinstance(d, GiveUp) and type(d.error) is RedirectError


def test_a_hop_back_to_an_address_visited_is_a_loop():
    plan = HopPlan(FRONT)
    assert isinstance(plan.on_close(*redirect("b", 2)), Follow)
    d = plan.on_close(*redirect("router.test", 5672))
    assert isinstance(d, GiveUp) and isinstance(d.error, RedirectLoop)
    assert d.error.hops == [FRONT, "amqp://app:p%40ss@b:2", FRONT] and "redirect loop" in str(d.error)


@pytest.mark.parametrize("max_hops, followed", [(0, 0), (1, 1), (3, 3)])
def test_hops_are_bounded(max_hops, followed):
    plan = HopPlan(FRONT, max_hops=max_hops)
    for i in range(followed):
        assert isinstance(plan.on_close(*redirect(f"h{i}", 1)), Follow)
    d = plan.on_close(*redirect("last", 1))
    assert isinstance(d, GiveUp) and isinstance(d.error, TooManyRedirects)
    assert f"more than {max_hops} redirects" in str(d.error)


def test_not_ready_is_retried_at_the_front_door_after_each_backoff_then_given_up():
    plan = HopPlan(FRONT, refusal_backoff_s=(0.1, 0.4))
    plan.on_close(*redirect("r2", 1))  # a router chain: the retry starts the journey afresh
    assert plan.on_close(FORCED, NOT_READY, None) == Retry(FRONT, 0.1)
    assert plan.hops == [FRONT]
    assert plan.on_close(FORCED, NOT_READY, None) == Retry(FRONT, 0.4)
    d = plan.on_close(FORCED, NOT_READY, None)
    assert isinstance(d, GiveUp) and isinstance(d.error, RouterRefused)
    assert d.error.transient and d.error.attempts == 3 and "gave up after 3 attempts" in str(d.error)


def test_an_opened_connection_forgets_the_refusals():
    plan = HopPlan(FRONT, refusal_backoff_s=(0.1,))
    assert isinstance(plan.on_close(FORCED, NOT_READY, None), Retry)
    plan.established()
    assert isinstance(plan.on_close(FORCED, NOT_READY, None), Retry)


def test_rejected_is_final():
    d = HopPlan(FRONT).on_close(FORCED, "Connection router main rejected this connection", None)
    assert isinstance(d, GiveUp) and not d.error.transient and d.error.attempts == 1


@pytest.mark.parametrize("cond", ["amqp:unauthorized-access", "amqp:resource-limit-exceeded", None])
def test_other_closes_are_not_ours(cond):
    assert HopPlan(FRONT).on_close(cond, "x", None) is None


@pytest.mark.parametrize("body, answer", [
    ({"nodeID": "n1", "local": False, "outcome": "OK",
      "connector": {"params": {"host": "10.0.0.7", "port": 15672, "sslEnabled": False}}},
     Answer("10.0.0.7", 15672, False, "n1", "OK")),
    ({"nodeID": "n1", "outcome": "OK", "connector": {"params": {"host": "h", "port": "5671", "sslEnabled": "true"}}},
     Answer("h", 5671, True, "n1", "OK")),
    ({"nodeID": None, "connector": None, "outcome": "REFUSED_UNAVAILABLE"},
     Answer(None, None, False, None, "REFUSED_UNAVAILABLE")),
    ({"nodeID": "n0", "local": True, "connector": None, "outcome": "OK"}, Answer(None, None, False, "n0", "LOCAL")),
    ({"nodeID": "n1", "connector": {"params": {"host": "h", "port": "x"}}, "outcome": "OK"},
     Answer(None, None, False, "n1", "MALFORMED")),
    ("not json object", Answer(None, None, False, None, "MALFORMED")),
    # Artemis' own getTargetAsJSON has no outcome: a connector means OK
    ({"nodeID": "n2", "local": False, "connector": {"params": {"host": "a", "port": 1}}},
     Answer("a", 1, False, "n2", "OK")),
])
def test_management_answers(body, answer):
    assert parse_answer(body) == answer


def test_answer_cache_expires_ttl_after_the_fetch():
    c = AnswerCache(ttl_s=10)
    a = Answer("h", 1, False, "n", "OK")
    c.put("k", a, now=100.0)
    assert c.get("k", 109.9) == a and c.get("k", 110.0) is None and c.get("k", 100.0) is None
    c.put("k", a, now=0.0)
    c.invalidate("k")
    assert c.get("k", 0.0) is None
