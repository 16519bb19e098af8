"""The edge's pure pieces: what a routed client gets by acceptor mode (``route.action_for``) and
every ``EdgeError``'s wire reply (``errors.reply_frames``), table-driven."""

from __future__ import annotations

import pytest

from broker.wire.codec import Symbol
from broker.wire.frames import (AMQP_HEADER, FOLLOWS_REDIRECT, NEED_DATA, Close, FrameReader, Open,
                                decode_performative)
from router.core.decide import Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.policies import create_policy
from router.core.pool import Pool
from router.net.edge import errors
from router.net.edge.context import AcceptorSettings
from router.net.edge.route import PROXY, REDIRECT, action_for, refusal_text
from router.net.stats import COUNTER_NAMES
from router.policies import Target
from router.sniff.amqp import Detected


def _detected(caps, mechanism="PLAIN") -> Detected:
    return Detected(open=Open("c", desired_capabilities=tuple(Symbol(x) for x in caps) if caps else None),
                    user="u", mechanism=mechanism, client_bytes=b"", sasl_init_bytes=None)


def _decision(ok: bool):
    pool = Pool([Target("n1", "10.0.0.1", 5672, name="b1")], quorum_size=1)
    if ok:
        pool.report_probe("b1", True, node_id="n1", now=0.0)
    router = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("FIRST_ELEMENT", {}), pool=pool)
    return router.decide(ConnectionInfo("1.2.3.4:5", container_id="k"), 0.0)


@pytest.mark.parametrize("mode, caps, mechanism, expected", [
    ("redirect", None, "PLAIN", REDIRECT),
    ("redirect", None, "EXTERNAL", REDIRECT),
    ("proxy", [FOLLOWS_REDIRECT], "PLAIN", PROXY),       # proxy mode ignores the capability
    ("proxy", None, "EXTERNAL", errors.ExternalNotProxied),
    ("auto", [FOLLOWS_REDIRECT], "PLAIN", REDIRECT),
    ("auto", ["x:other", FOLLOWS_REDIRECT], "PLAIN", REDIRECT),
    ("auto", [FOLLOWS_REDIRECT], "EXTERNAL", REDIRECT),  # a redirect needs no replay
    ("auto", None, "PLAIN", PROXY),
    ("auto", ["x:other"], "PLAIN", PROXY),
    ("auto", ["lodestone:follows-redirects"], "PLAIN", PROXY),  # exact symbol only
    ("auto", None, "EXTERNAL", errors.ExternalNotProxied),
])
def test_what_a_routed_client_gets_by_mode(mode, caps, mechanism, expected):
    s = AcceptorSettings(name="a", mode=mode, router="r")
    d = _decision(True)
    assert d.ok
    if isinstance(expected, str):
        assert action_for(s, d, _detected(caps, mechanism)) == expected
    else:
        with pytest.raises(expected) as info:
            action_for(s, d, _detected(caps, mechanism))
        assert info.value.condition == "amqp:not-implemented"


@pytest.mark.parametrize("mode", ["redirect", "proxy", "auto"])
def test_a_decision_without_target_is_refused_in_every_mode(mode):
    d = _decision(False)
    assert not d.ok
    with pytest.raises(errors.RouteRefused) as info:
        action_for(AcceptorSettings(name="a", mode=mode, router="r"), d, _detected([FOLLOWS_REDIRECT]))
    assert info.value.description == refusal_text("r", d)
    assert info.value.description.startswith("Connection router r is not ready")


@pytest.mark.parametrize("err, condition, counter, action", [
    (errors.SourceRefused("x"), "amqp:resource-limit-exceeded", None, None),
    (errors.RouteRefused("x"), "amqp:connection:forced", "refused", "refused"),
    (errors.ExternalNotProxied("x"), "amqp:not-implemented", "proxy_external_refused", "refused_external"),
    (errors.UpstreamUnreachable("x"), "amqp:connection:forced", "upstream_connect_failed", "upstream_failed"),
    (errors.UpstreamFdExhausted("x"), "amqp:connection:forced", "upstream_fd_exhausted", "upstream_failed"),
    (errors.UpstreamTimeout("x"), "amqp:connection:forced", "upstream_connect_timeout", "upstream_failed"),
    (errors.UpstreamProtocolError("x"), "amqp:connection:forced", "upstream_protocol_error", "upstream_failed"),
    (errors.UpstreamAuthRefused("x"), "amqp:unauthorized-access", "upstream_auth_failed", "upstream_failed"),
])
def test_every_edge_error_carries_its_wire_reply(err, condition, counter, action):
    assert (err.condition, err.counter, err.action) == (condition, counter, action)
    assert counter is None or counter in COUNTER_NAMES
    data = errors.reply_frames(err)
    assert data.startswith(AMQP_HEADER)
    reader = FrameReader()
    reader.receive_data(data[len(AMQP_HEADER):])
    perfs = []
    while (f := reader.next_event()) is not NEED_DATA:
        perfs.append(decode_performative(f.body))
    assert isinstance(perfs[0], Open) and perfs[0].properties[Symbol("amqp:connection-establishment-failed")]
    assert isinstance(perfs[1], Close)
    assert (perfs[1].error.condition, perfs[1].error.description) == (condition, "x")
