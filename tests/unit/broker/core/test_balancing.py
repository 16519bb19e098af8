"""Pure tests of cluster load balancing and redistribution (broker.core.balancing).

Every expectation below is worked out by hand from Artemis's ``BindingsImpl.getNextBinding`` /
``redistribute``: a group is [local queue, remote bindings in arrival order]; the rotation
position moves to just past the binding chosen.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from broker.core.balancing import (
    LoadBalancing,
    RedistributionSchedule,
    Rotation,
    next_binding,
    redistribution_deadline,
    redistribution_target,
    route,
)
from broker.core.bindings import ClusterBindings, RemoteBinding
from broker.core.deliveries import Message
from broker.core.queues import ANYCAST, MULTICAST

OFF, STRICT, ON_DEMAND, OFF_R = (LoadBalancing.OFF, LoadBalancing.STRICT, LoadBalancing.ON_DEMAND,
                                 LoadBalancing.OFF_WITH_REDISTRIBUTION)


def text_filter(text):
    """Test filters: the text ``red`` accepts bodies containing ``red``."""
    return lambda m: text in m.body.decode()


class Local:
    """A local queue as balancing sees it (``Queue`` has the same attributes)."""

    node_id = None
    connected = True

    def __init__(self, name, consumers=0, consumer_filter=None, filter=None, routing_type=ANYCAST):
        self.name = name
        self.routing_type = routing_type
        self.consumers = consumers
        self.consumer_filter = consumer_filter
        self.filter = text_filter(filter) if filter else None

    def has_matching_consumer(self, msg):
        if self.consumers <= 0:
            return False
        return msg is None or self.consumer_filter is None or text_filter(self.consumer_filter)(msg)


def msg(body="m"):
    return Message(0, body.encode(), False, "orders")


def cluster(*remotes, max_hops=1):
    c = ClusterBindings(max_hops=max_hops, compile_filter=text_filter)
    for r in remotes:
        c.put(r)
    return c


def rb(node, consumers=0, queue="orders", address="orders", routing_type=ANYCAST, **kw):
    return RemoteBinding(node, queue, address, routing_type, consumers=consumers, **kw)


def anycast_view(local, *remotes, address="orders"):
    c = cluster(*remotes)
    return c.bindings(address, {local.name: local} if local is not None else {})


def destinations(view, mode, n, rotation=None, body="m"):
    """Where n messages go: 'local' or the neighbour's node id, one entry per message copy."""
    rotation = rotation or Rotation()
    out = []
    for _ in range(n):
        d = route(view, msg(body), mode, rotation)
        out.append(tuple(["local"] * len(d.local) + list(d.nodes)))
    return out


# -- anycast: one queue in the cluster per message ------------------------------------------------
@pytest.mark.parametrize("mode,local_consumers,remote_consumers,expected", [
    # OFF: never forwarded
    (OFF, 1, (1, 1), ["local"] * 6),
    (OFF, 0, (1, 1), ["local"] * 6),
    # OFF_WITH_REDISTRIBUTION: like OFF when sending (anycast)
    (OFF_R, 0, (1, 1), ["local"] * 6),
    # STRICT: round robin over every node with the queue, consumers or not, starting local
    (STRICT, 0, (0, 0), ["local", "B", "C", "local", "B", "C"]),
    (STRICT, 1, (0, 5), ["local", "B", "C", "local", "B", "C"]),
    # ON_DEMAND: only nodes with consumers
    (ON_DEMAND, 1, (1, 1), ["local", "B", "C", "local", "B", "C"]),
    (ON_DEMAND, 1, (0, 1), ["local", "C", "local", "C", "local", "C"]),
    (ON_DEMAND, 0, (0, 1), ["C"] * 6),
    (ON_DEMAND, 0, (2, 0), ["B"] * 6),
    # ON_DEMAND, nobody consumes anywhere: the message stays local
    (ON_DEMAND, 0, (0, 0), ["local"] * 6),
])
def test_anycast_modes(mode, local_consumers, remote_consumers, expected):
    view = anycast_view(Local("orders", local_consumers), rb("B", remote_consumers[0]), rb("C", remote_consumers[1]))
    got = destinations(view, mode, 6)
    assert got == [(e,) for e in expected]  # exactly one queue in the cluster per message


def test_strict_alternates_exactly_over_n_nodes():
    nodes = ["B", "C", "D", "E"]
    view = anycast_view(Local("orders"), *(rb(n) for n in nodes))
    got = destinations(view, STRICT, 10)
    assert [g[0] for g in got] == ["local", "B", "C", "D", "E", "local", "B", "C", "D", "E"]


@pytest.mark.parametrize("mode", [STRICT, ON_DEMAND])
@pytest.mark.parametrize("n", [5, 100, 1000])
def test_rotation_is_exactly_fair_over_a_5_node_mesh(mode, n):
    view = anycast_view(Local("orders", 1), *(rb(x, 1) for x in "BCDE"))
    counts = Counter(d[0] for d in destinations(view, mode, n))
    assert counts == {k: n // 5 for k in ["local", "B", "C", "D", "E"]}


def test_rotation_survives_a_binding_leaving():
    c = cluster(rb("B", 1), rb("C", 1))
    local = Local("orders", 1)
    rot = Rotation()
    view = c.bindings("orders", {"orders": local})
    assert destinations(view, ON_DEMAND, 2, rot) == [("local",), ("B",)]
    c.remove("C", "orders")  # the next position (2) is past the end: back to 0, as in Artemis
    assert destinations(c.bindings("orders", {"orders": local}), ON_DEMAND, 3, rot) == [("local",), ("B",), ("local",)]


def test_on_demand_honours_consumer_filters():
    view = anycast_view(Local("orders", 1, consumer_filter="blue"),
                        rb("B", 1, consumer_filters=("red",)), rb("C", 1, consumer_filters=("red",)))
    # red: the local consumer does not want it; B and C alternate
    assert destinations(view, ON_DEMAND, 4, body="red") == [("B",), ("C",), ("B",), ("C",)]
    # green: nobody wants it: the fallback is the local queue (ON_DEMAND keeps it local)
    assert destinations(view, ON_DEMAND, 2, body="green") == [("local",), ("local",)]


def test_an_unfiltered_remote_consumer_takes_everything():
    # B has one consumer with a filter and one without (see broker.core.bindings on Artemis)
    view = anycast_view(Local("orders", 0), rb("B", 2, consumer_filters=("red",)))
    assert destinations(view, ON_DEMAND, 2, body="green") == [("B",), ("B",)]


def test_queue_filters_exclude_bindings_in_every_mode():
    view = anycast_view(Local("orders", 1, filter="red"), rb("B", 1, filter_text="blue"), rb("C", 1))
    assert destinations(view, STRICT, 4, body="red") == [("local",), ("C",), ("local",), ("C",)]
    assert destinations(view, ON_DEMAND, 2, body="blue") == [("B",), ("C",)]
    assert destinations(view, OFF, 1, body="blue") == [()]  # local refuses it, remote not allowed


def test_disconnected_binding_is_skipped_unless_alone():
    view = anycast_view(Local("orders", 1), rb("B", 1, connected=False), rb("C", 1))
    assert destinations(view, STRICT, 4) == [("local",), ("C",), ("local",), ("C",)]
    alone = anycast_view(None, rb("B", 0, connected=False))
    assert destinations(alone, ON_DEMAND, 2) == [("B",), ("B",)]


def test_no_local_queue_remote_without_consumers_still_gets_it():
    # Artemis's fallback: the first matching binding from the rotation position (better than
    # dropping the message); the rotation moves past it, so the fallbacks alternate
    view = anycast_view(None, rb("B"), rb("C"))
    assert destinations(view, ON_DEMAND, 3) == [("B",), ("C",), ("B",)]
    assert destinations(view, OFF, 1) == [()]


# -- multicast: every local subscription, one copy per node ---------------------------------------
def multicast_view(mode_filters=None):
    c = cluster(
        rb("B", 1, queue="b.sub1", address="news", routing_type=MULTICAST),
        rb("B", 0, queue="b.sub2", address="news", routing_type=MULTICAST),
        rb("C", 0, queue="c.sub1", address="news", routing_type=MULTICAST, filter_text="sport"),
    )
    local = {"a.sub1": Local("a.sub1", 1, routing_type=MULTICAST),
             "a.sub2": Local("a.sub2", 0, routing_type=MULTICAST, filter="sport")}
    return c.bindings("news", local)


@pytest.mark.parametrize("mode,body,local,forwards", [
    (STRICT, "sport", ["a.sub1", "a.sub2"], {"B": (("B", "b.sub1"), ("B", "b.sub2")), "C": (("C", "c.sub1"),)}),
    (ON_DEMAND, "sport", ["a.sub1", "a.sub2"], {"B": (("B", "b.sub1"), ("B", "b.sub2")), "C": (("C", "c.sub1"),)}),
    (ON_DEMAND, "news", ["a.sub1"], {"B": (("B", "b.sub1"), ("B", "b.sub2"))}),
    # ARTEMIS-3608: multicast still reaches remote subscriptions under OFF_WITH_REDISTRIBUTION
    (OFF_R, "sport", ["a.sub1", "a.sub2"], {"B": (("B", "b.sub1"), ("B", "b.sub2")), "C": (("C", "c.sub1"),)}),
    (OFF, "sport", ["a.sub1", "a.sub2"], {}),
])
def test_multicast_every_local_subscription_and_one_copy_per_node(mode, body, local, forwards):
    d = route(multicast_view(), msg(body), mode, Rotation())
    assert list(d.local) == local
    assert {f.via: f.targets for f in d.forwards} == forwards


def test_same_named_subscriptions_on_two_nodes_share_the_messages():
    # a shared durable subscription: one routing name on A and B, load-balanced like a queue
    c = cluster(rb("B", 1, queue="shared", address="news", routing_type=MULTICAST))
    view = c.bindings("news", {"shared": Local("shared", 1, routing_type=MULTICAST)})
    assert destinations(view, ON_DEMAND, 4) == [("local",), ("B",), ("local",), ("B",)]


def test_chain_forwards_to_the_next_hop():
    # A - B - C, max-hops 2: A knows C's queue through B
    c = cluster(rb("C", 1, distance=2, via="B"), max_hops=2)
    d = route(c.bindings("orders", {"orders": Local("orders", 0)}), msg(), ON_DEMAND, Rotation())
    assert d.local == () and d.nodes == ("B",) and d.forwards[0].targets == (("C", "orders"),)
    assert not cluster(rb("C", 1, distance=2, via="B"), max_hops=1).count  # too far: ignored


def test_decision_explains_itself():
    view = anycast_view(Local("orders", 0), rb("B", 1), rb("C", 0))
    picks = [route(view, msg(), m, Rotation()).picks for m in (ON_DEMAND, STRICT)]
    assert [(p.node_id, p.why) for p in picks[0]] == [("B", "consumer")]
    assert [(p.node_id, p.why) for p in picks[1]] == [(None, "strict")]
    assert [(p.node_id, p.why) for p in route(anycast_view(Local("orders")), msg(), STRICT, Rotation()).picks] \
        == [(None, "only")]
    assert [(p.why) for p in route(anycast_view(Local("orders"), rb("B")), msg(), ON_DEMAND, Rotation()).picks] \
        == ["fallback"]


def test_seeded_rotation_start_is_reproducible():
    view = anycast_view(Local("orders", 1), *(rb(x, 1) for x in "BCDE"))
    a = destinations(view, STRICT, 7, Rotation(random.Random(7)))
    b = destinations(view, STRICT, 7, Rotation(random.Random(7)))
    assert a == b
    assert Counter(x[0] for x in destinations(view, STRICT, 500, Rotation(random.Random(3)))) \
        == {k: 100 for k in ["local", "B", "C", "D", "E"]}


@pytest.mark.parametrize("group,mode,start,expected", [
    # (has consumer, matches) per binding; index 0 is local
    ([(True, True), (True, True)], ON_DEMAND, 1, (1, 0, "consumer")),
    ([(False, True), (False, True)], ON_DEMAND, 1, (0, 1, "fallback")),  # the local queue wins the fallback
    ([(False, True), (False, True)], STRICT, 1, (1, 0, "strict")),
    ([(False, False), (False, True)], ON_DEMAND, 0, (1, 0, "fallback")),
    ([(True, False), (False, False)], STRICT, 0, None),
    ([(False, True)], ON_DEMAND, 5, (0, 0, "only")),
])
def test_next_binding_table(group, mode, start, expected):
    bindings = []
    for i, (consumer, matches) in enumerate(group):
        text = None if matches else "nomatch"
        if i == 0:
            bindings.append(Local("orders", int(consumer), filter=text))
        else:
            bindings.append(cluster(rb(f"N{i}", int(consumer), filter_text=text)).bindings("orders").group("orders")[0])
    assert next_binding(bindings, msg(), mode, start) == expected


# -- redistribution ------------------------------------------------------------------------------
@pytest.mark.parametrize("delay,now,expected", [
    (-1, 10_000, None),     # never
    (0, 1_000, "B"),        # at once
    (500, 1_499, None),     # not yet
    (500, 1_500, "B"),      # due
])
def test_redistribution_delay(delay, now, expected):
    view = anycast_view(Local("orders", 0), rb("B", 1), rb("C", 0))
    got = redistribution_target(view, "orders", msg(), left_at_ms=1_000, delay_ms=delay, now_ms=now,
                                mode=ON_DEMAND, rotation=Rotation())
    assert got == expected
    assert redistribution_deadline(1_000, delay) == (None if delay < 0 else 1_000 + delay)


@pytest.mark.parametrize("mode,expected", [(ON_DEMAND, "B"), (OFF_R, "B"), (STRICT, None), (OFF, None)])
def test_only_on_demand_and_off_with_redistribution_redistribute(mode, expected):
    view = anycast_view(Local("orders", 0), rb("B", 1))
    assert redistribution_target(view, "orders", msg(), left_at_ms=0, delay_ms=0, now_ms=0, mode=mode,
                                 rotation=Rotation()) == expected


def test_redistribution_rotates_over_nodes_with_matching_consumers():
    view = anycast_view(Local("orders", 0), rb("B", 1), rb("C", 0), rb("D", 1, consumer_filters=("red",)))
    rot = Rotation()
    got = [redistribution_target(view, "orders", msg("red"), left_at_ms=0, delay_ms=0, now_ms=0, mode=ON_DEMAND,
                                 rotation=rot) for _ in range(4)]
    assert got == ["B", "D", "B", "D"]
    blue = [redistribution_target(view, "orders", msg("blue"), left_at_ms=0, delay_ms=0, now_ms=0, mode=ON_DEMAND,
                                  rotation=rot) for _ in range(2)]
    assert blue == ["B", "B"]


def test_no_redistribution_while_a_local_consumer_wants_it_or_nobody_else_does():
    back = anycast_view(Local("orders", 1), rb("B", 1))
    assert redistribution_target(back, "orders", msg(), left_at_ms=0, delay_ms=0, now_ms=0, mode=ON_DEMAND,
                                 rotation=Rotation()) is None
    nobody = anycast_view(Local("orders", 0), rb("B", 0))
    assert redistribution_target(nobody, "orders", msg(), left_at_ms=0, delay_ms=0, now_ms=0, mode=ON_DEMAND,
                                 rotation=Rotation()) is None


def test_schedule_reports_due_queues_and_the_next_deadline():
    s = RedistributionSchedule()
    assert not s.start("never", 0, -1)
    s.start("q1", 1_000, 5_000)
    s.start("q2", 2_000, 0)
    assert s.due(2_000) == ["q2"] and s.next_deadline_ms(2_000) == 6_000
    s.cancel("q1")  # a consumer came back within the delay
    assert s.due(10_000) == ["q2"] and s.next_deadline_ms(2_000) is None
    s.start("q2", 3_000, 1_000)  # restarted (a remote consumer arrived): the delay counts again
    assert s.due(3_500) == [] and s.next_deadline_ms(3_500) == 4_000


def test_rotation_remembers_only_groups_of_two_or_more():
    rot = Rotation()
    route(multicast_view(), msg("sport"), ON_DEMAND, rot)
    assert rot.positions == {}  # every subscription is a group of one: nothing to remember
    view = anycast_view(Local("orders", 1), rb("B", 1))
    route(view, msg(), ON_DEMAND, rot)
    assert rot.positions == {("orders", "orders"): 1}
    rot.forget(("orders", "orders"))
    assert rot.positions == {}
