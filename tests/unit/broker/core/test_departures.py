"""broker.core.departures: which condition each client gets, the close schedule, request bodies."""

from __future__ import annotations

import proton
import pytest

from broker.wire.codec import Int, Symbol
from broker.amqp.engine import to_proton
from broker.core.departures import (
    ALL,
    CloseRequestError,
    ConnectionFacts,
    Selector,
    Target,
    close_offsets,
    parse_close_request,
    plan_departures,
    target_from_connector,
)

CONNS = [
    ConnectionFacts("c1", "app-1", "app", True, False),     # follows redirects
    ConnectionFacts("c2", "app-2", "app", False, False),    # unmodified client
    ConnectionFacts("c3", "bridge", "cluster-user", True, True),   # the cluster's own: never
    ConnectionFacts("c4", "app-1", "admin", False, False),
]


E = "end-of-stream"   # no Close: the socket is closed (broker.core.departures.END_OF_STREAM)


@pytest.mark.parametrize("selector, target, want", [
    (ALL, Target("10.0.0.2", 5672), [("c1", "amqp:connection:redirect"), ("c2", E), ("c4", E)]),
    (ALL, None, [("c1", E), ("c2", E), ("c4", E)]),
    (Selector("container-id", "app-1"), Target("h", 1), [("c1", "amqp:connection:redirect"), ("c4", E)]),
    (Selector("user", "app"), None, [("c1", E), ("c2", E)]),
    (Selector("user", "cluster-user"), Target("h", 1), []),
])
def test_plan(selector, target, want):
    assert [(d.conn_id, d.condition) for d in plan_departures(CONNS, selector, target, "why")] == want


def test_plan_with_forced_for_the_unmodified():
    got = plan_departures(CONNS, ALL, Target("h", 1), "why", "amqp:connection:forced")
    assert [(d.conn_id, d.condition) for d in got] == [
        ("c1", "amqp:connection:redirect"), ("c2", "amqp:connection:forced"), ("c4", "amqp:connection:forced")]
    with pytest.raises(ValueError):
        plan_departures(CONNS, ALL, None, "why", "amqp:connection:redirect")


def test_redirect_info_names_the_target_and_its_backups_as_artemis_and_the_router_do():
    t = target_from_connector("amqp://10.0.0.2:5673", ["amqp://10.0.0.3:5674", "tcp-nonsense"])
    d = plan_departures(CONNS[:1], ALL, t, "failing back")[0]
    assert d.description == "failing back: reconnect to 10.0.0.2:5673"
    assert list(d.info) == ["port", "network-host", "failover-server-list"]
    assert type(d.info[Symbol("port")]) is Int
    assert d.info["failover-server-list"] == [{"network-host": "10.0.0.3", "scheme": "amqp",
                                               "hostname": "10.0.0.3", "port": 5674}]
    p = to_proton(d.info)
    assert all(type(k) is proton.symbol for k in p)
    assert type(p[proton.symbol("port")]) is proton.int32


@pytest.mark.parametrize("connector", [None, "", "amqp://h", "amqp://:5672", "amqp://h:x"])
def test_no_target_without_host_and_port(connector):
    assert target_from_connector(connector) is None


def test_offsets_spread_at_the_rate():
    assert close_offsets(3, None) == [0.0, 0.0, 0.0]
    assert close_offsets(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert close_offsets(0, 3.0) == []


def test_good_bodies():
    r = parse_close_request({"container-id": "c", "redirect": "[::1]:5672", "rate-per-second": 3})
    assert (r.selector, r.target, r.rate_per_second) == (Selector("container-id", "c"), Target("::1", 5672), 3.0)
    assert parse_close_request({"all": True}).target is None
    assert parse_close_request({"all": True}).unmodified == "end-of-stream"
    assert parse_close_request({"all": True, "unmodified": "amqp:connection:forced"}).unmodified == \
        "amqp:connection:forced"
    assert str(Target("::1", 1)) == "[::1]:1" and str(Target("h", 2)) == "h:2"


@pytest.mark.parametrize("body, field", [
    (None, "body"), ({}, "selector"), ({"user": "a", "container-id": "b"}, "selector"), ({"all": 1}, "all"),
    ({"user": None}, "user"), ({"all": True, "redirect": ":5"}, "redirect"),
    ({"all": True, "redirect": "::1:5"}, "redirect"), ({"all": True, "redirect": "h:70000"}, "redirect"),
    ({"all": True, "redirect": 5}, "redirect"), ({"all": True, "rate-per-second": -1}, "rate-per-second"),
    ({"all": True, "rate-per-second": True}, "rate-per-second"),
    ({"all": True, "rate-per-second": float("inf")}, "rate-per-second"), ({"all": True, "x": 1}, "x"),
    ({"all": True, "rate-per-second": 1e-300}, "rate-per-second"), ({"all": True, "redirect": "h:\u00b2"}, "redirect"),
    ({"all": True, "unmodified": "amqp:connection:redirect"}, "unmodified"), ({"all": True, "unmodified": 1}, "unmodified"),
])
def test_bad_bodies_name_the_field(body, field):
    with pytest.raises(CloseRequestError) as ei:
        parse_close_request(body)
    assert ei.value.field == field and str(ei.value).startswith(field)
