"""OpenAMQ's shared queues on real broker processes (docs/cluster.md "Shared queues"): three
defined primaries (ports named up front) and two secondaries; the address ``work`` is declared
``shared = true`` in every broker's config. Clients are unmodified python-qpid-proton
connections. Counts are exact: every acknowledged message delivered, none twice, each
producer's messages in the order it sent them. Waits are on the state the brokers report."""

from __future__ import annotations

import collections
import threading
import time

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN
from tests.clusterproc import cluster_view, start_node, wait_until
from tests.serverproc import free_ports, http_json

pytestmark = pytest.mark.timeout(300)

FAST = {"retry-interval-ms": 100, "max-retry-interval-ms": 300, "connection-ttl-ms": 3000}
SHARED = {"addresses.work": {"routing-types": ["anycast"], "shared": True}}


def _start(tmp_path, procs, name, primaries, *, port=None, partition="primary", extra=None, config=None):
    ex = {**FAST, "partition": partition, "primaries": primaries, **(extra or {})}
    config = {**SHARED, **(config or {})}
    if port is not None:
        ex["connector"] = f"amqp://127.0.0.1:{port}"
        config["acceptors.amqp"] = {"port": port}
    node = start_node(tmp_path, name, extra=ex, config=config)
    procs.append(node)
    return node


def _cluster(tmp_path, procs, *, secondaries=2, extra=None, config=None):
    ports = free_ports(3)
    primaries = [f"amqp://127.0.0.1:{p}" for p in ports]
    ps = [_start(tmp_path, procs, f"p{i}", primaries, port=port, extra=extra, config=config)
          for i, port in enumerate(ports)]
    ss = [_start(tmp_path, procs, f"s{i}", primaries, partition="secondary", extra=extra, config=config)
          for i in range(secondaries)]
    ids = [p.node_id for p in ps]
    wait_until(lambda: all(cluster_view(n)["root"] == ids[0] for n in ps + ss), 30, "p0 root everywhere")
    return ps, ss


def _connect(node):
    return BlockingConnection(node.amqp_url, timeout=20, user="app", password="app", allowed_mechs="PLAIN")


def _send(node, tag: str, n: int, *, start: int = 0) -> list[str]:
    """Send ``n`` durable messages ``tag-i``; returns those acknowledged (accepted)."""
    c = _connect(node)
    acked = []
    try:
        s = c.create_sender("work")
        for i in range(start, start + n):
            body = f"{tag}-{i}"
            s.send(Message(body=body, durable=True))
            acked.append(body)
    finally:
        c.close()
    return acked


def _remote_consumers(node, n: int) -> None:
    """``node`` knows ``n`` consumers on other brokers' copies of the shared queue."""
    def known():
        return sum(b["consumers"] for b in cluster_view(node)["remote_bindings"] if b["queue"] == "work") == n
    wait_until(known, 30, f"{n} remote consumers of work known to {node.workdir.name}")


class Consumer:
    """A consumer in a thread: receives and accepts until stopped; bodies in arrival order."""

    def __init__(self, node, credit: int = 50):
        self.node = node
        self.got: list[str] = []
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, args=(credit,), daemon=True)
        self.t.start()
        assert self.ready.wait(20)

    def _run(self, credit):
        try:
            c = _connect(self.node)
            r = c.create_receiver("work", credit=credit)
            self.ready.set()
            while not self.stop.is_set():
                try:
                    m = r.receive(timeout=0.2)
                except Exception:
                    continue
                self.got.append(m.body)
                r.accept()
            c.close()
        except BaseException as exc:   # noqa: BLE001 - reported by the test
            self.error = exc
            self.ready.set()

    def close(self):
        self.stop.set()
        self.t.join(20)
        assert self.error is None, self.error


def _send_one(node, body: str):
    """Send one durable message with proton's reactor; (outcome, the rejection's condition)."""
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    class One(MessagingHandler):
        def __init__(self):
            super().__init__(auto_settle=True)
            self.state, self.cond = None, None

        def on_start(self, event):
            conn = event.container.connect(node.amqp_url, user="app", password="app", allowed_mechs="PLAIN")
            event.container.create_sender(conn, "work")

        def on_sendable(self, event):
            if self.state is None and event.sender.credit:
                event.sender.send(Message(body=body, durable=True))
                self.state = "sent"

        def _done(self, event, state):
            self.state = state
            self.cond = event.delivery.remote.condition
            event.connection.close()

        def on_accepted(self, event):
            self._done(event, "accepted")

        def on_rejected(self, event):
            self._done(event, "rejected")

    h = One()
    Container(h).run()
    return h.state, h.cond


def _in_order(got: list[str], tag: str) -> list[int]:
    return [int(b.rsplit("-", 1)[1]) for b in got if b.startswith(tag + "-")]


def test_producers_on_two_brokers_one_consumer_on_a_secondary_one_order(tmp_path, procs):
    ps, ss = _cluster(tmp_path, procs)
    root = ps[0]
    con = Consumer(ss[1])
    _remote_consumers(root, 1)
    results = {}
    threads = [threading.Thread(target=lambda n, t: results.__setitem__(t, _send(n, t, 300)), args=(node, tag))
               for node, tag in ((ps[1], "a"), (ss[0], "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results["a"]) == len(results["b"]) == 300
    wait_until(lambda: len(con.got) >= 600, 60, "600 messages at the consumer")
    time.sleep(0.5)   # anything more now would be a duplicate
    con.close()
    assert collections.Counter(con.got) == collections.Counter(results["a"] + results["b"])
    assert _in_order(con.got, "a") == list(range(300)) and _in_order(con.got, "b") == list(range(300))
    # none of it was stored on the brokers the producers used: they relayed to the root
    for n in (ps[1], ss[0]):
        q = n.queue("work")
        assert q is not None and q["enqueued"] == 0, q
    view = cluster_view(ps[1])["shared"]
    assert view["counters"]["relayed"] == 300 and view["counters"]["relay_accepted"] == 300
    status, text = http_json(ss[0].management_url + "/metrics", auth=ADMIN, timeout_s=10)
    assert status == 200 and 'lodestone_broker_cluster_shared_events_total{event="relay_accepted"} 300' in text
    # the secondaries have no bridge to each other: s0's messages reached s1 through the root
    to_s1 = [b for b in cluster_view(root)["bridges"] if b["to"] == ss[1].node_id]
    assert to_s1 and to_s1[0]["acked"] >= 600, to_s1
    assert all(b["to"] != ss[1].node_id for b in cluster_view(ss[0])["bridges"])


def test_two_consumers_on_two_brokers_compete(tmp_path, procs):
    ps, ss = _cluster(tmp_path, procs, secondaries=1)
    c1, c2 = Consumer(ps[2]), Consumer(ss[0])
    _remote_consumers(ps[0], 2)
    sent = _send(ps[1], "m", 400)
    wait_until(lambda: len(c1.got) + len(c2.got) >= 400, 60, "400 messages at the two consumers")
    time.sleep(0.5)
    c1.close()
    c2.close()
    assert collections.Counter(c1.got + c2.got) == collections.Counter(sent)
    assert c1.got and c2.got, (len(c1.got), len(c2.got))
    assert _in_order(c1.got, "m") == sorted(_in_order(c1.got, "m"))
    assert _in_order(c2.got, "m") == sorted(_in_order(c2.got, "m"))


def test_root_killed_under_load_a_new_root_serves_and_the_old_roots_messages_come_back_once(tmp_path, procs):
    """Two producers (on p2 and on the secondary) stream numbered durable messages; no consumer
    yet, so the root holds them. Once 300 are acknowledged the root is SIGKILLed: p1 is root
    within seconds and both producers go on (their sends in flight move to p1). The old root
    restarts: what it had acknowledged comes to p1, and a consumer then gets every acknowledged
    message once, each producer's in order per root. A send in flight to the old root when it
    died is sent to p1 again; if the old root had stored it too, its copy carries the relay id
    and p1 drops it."""
    ps, ss = _cluster(tmp_path, procs, secondaries=1)
    ids = [p.node_id for p in ps]
    acked: dict[str, list[str]] = {"a": [], "b": []}
    killed = threading.Event()
    t_kill = {}

    def produce(node, tag):
        c = _connect(node)
        try:
            snd = c.create_sender("work")
            for i in range(400):
                body = f"{tag}-{i}"
                snd.send(Message(body=body, durable=True))
                acked[tag].append(body)
                if killed.is_set() and "after" not in t_kill and tag == "a":
                    t_kill["after"] = time.monotonic() - t_kill["t"]
        finally:
            c.close()

    threads = [threading.Thread(target=produce, args=(n, tag), daemon=True) for n, tag in ((ps[2], "a"), (ss[0], "b"))]
    for t in threads:
        t.start()
    wait_until(lambda: len(acked["a"]) + len(acked["b"]) >= 300, 60, "300 acknowledged")
    t_kill["t"] = time.monotonic()
    ps[0].kill()
    killed.set()
    for t in threads:
        t.join(120)
    assert len(acked["a"]) == len(acked["b"]) == 400
    wait_until(lambda: cluster_view(ps[1])["root"] == ids[1], 30, "p1 root")
    print(f"first acknowledgement on p2 after the root's SIGKILL: {t_kill.get('after', float('nan')):.2f} s")
    assert t_kill["after"] < 5.0
    uncertain = sum(cluster_view(n)["shared"]["counters"].get("resent_after_root_change", 0) for n in (ps[2], ss[0]))
    ps[0].restart()
    wait_until(lambda: cluster_view(ps[0])["election"]["state"] == "active" and cluster_view(ps[0])["root"] == ids[1],
               30, "the old root back, not root")
    con = Consumer(ss[0])
    wait_until(lambda: len(set(con.got)) >= 800, 60, "every acknowledged message at the consumer")
    time.sleep(1.0)
    con.close()
    counts = collections.Counter(con.got)
    assert set(counts) == set(acked["a"] + acked["b"])
    twice = sorted(b for b, n in counts.items() if n > 1)
    dropped = cluster_view(ps[1])["counters"].get("duplicates_dropped", 0)
    print(f"sends in flight to the old root at its death: {uncertain}; the old root's copies the new root dropped: "
          f"{dropped}; delivered twice: {len(twice)} {twice[:10]}")
    assert not twice
    assert cluster_view(ps[0])["shared"]["counters"].get("moved", 0) >= 1   # the old root handed its messages over
    for tag in ("a", "b"):   # per root, each producer's order: what the new root got first, then the old root's
        seq = _in_order(list(dict.fromkeys(con.got)), tag)
        runs = sum(1 for x, y in zip(seq, seq[1:]) if y < x)
        assert runs <= 1, (tag, seq)


def test_no_root_sends_are_held_then_refused_and_flow_once_a_root_is_back(tmp_path, procs):
    """Two of the three primaries killed: the root resigns (1 of 3). A send on a secondary is
    held for call-timeout-ms, then rejected with amqp:precondition-failed saying there is no
    root; nothing of it is stored. A send made while a primary is coming back is held and then
    flows to the root; the consumer gets exactly the accepted messages."""
    ps, ss = _cluster(tmp_path, procs, secondaries=1, extra={"call-timeout-ms": 3000})
    ids = [p.node_id for p in ps]
    ps[1].kill()
    ps[2].kill()
    wait_until(lambda: cluster_view(ss[0])["root"] is None and not cluster_view(ps[0])["is_root"], 30, "no root")
    t0 = time.monotonic()
    state, cond = _send_one(ss[0], "refused-0")
    waited = time.monotonic() - t0
    print(f"refused after {waited:.2f} s: {cond}")
    assert state == "rejected" and cond is not None
    assert cond.name == "amqp:precondition-failed" and "has no root" in cond.description, cond
    assert 2.5 <= waited < 10, waited
    view = cluster_view(ss[0])["shared"]
    assert view["counters"]["refused_no_root"] == 1 and view["relaying"] == 0
    # a send held while a primary comes back: it flows to the root once elected
    result = {}

    def held_send():
        conn = _connect(ss[0])
        try:
            snd = conn.create_sender("work")
            snd.send(Message(body="held-1", durable=True))
            result["ok"] = time.monotonic()
        except Exception as exc:   # noqa: BLE001
            result["error"] = exc
        finally:
            conn.close()
    t = threading.Thread(target=held_send, daemon=True)
    t.start()
    wait_until(lambda: cluster_view(ss[0])["shared"]["held_without_root"] == 1, 10, "the send held")
    ps[1].restart()
    t.join(30)
    assert "ok" in result, result
    wait_until(lambda: cluster_view(ss[0])["root"] == ids[0], 30, "p0 root again")
    con = Consumer(ss[0])
    wait_until(lambda: len(con.got) >= 1, 30, "the held message")
    time.sleep(1.0)
    con.close()
    assert con.got == ["held-1"], con.got
    for n in (ps[0], ps[1], ss[0]):
        q = n.queue("work")
        assert q is None or q["depth"] == 0, (n.workdir.name, q)


def test_a_shared_queue_declared_through_the_management_api(tmp_path, procs):
    """``POST /api/v1/addresses`` with ``"shared": true`` on a secondary: every broker lists it as
    shared; a send on a primary that is not the root is stored on the root only, and a consumer
    on the secondary gets it. A bad value is a 400."""
    ps, ss = _cluster(tmp_path, procs, secondaries=1)
    status, body = http_json(ss[0].management_url + "/api/v1/addresses", "POST",
                             {"name": "jobs", "routing_types": ["anycast"], "shared": True}, auth=ADMIN, timeout_s=10)
    assert status == 201, body
    status, body = http_json(ss[0].management_url + "/api/v1/addresses", "POST",
                             {"name": "bad", "shared": "yes"}, auth=ADMIN, timeout_s=10)
    assert status == 400 and "shared" in str(body)

    def shared_everywhere():
        for n in ps + ss:
            st, addrs = http_json(n.management_url + "/api/v1/addresses", auth=ADMIN, timeout_s=10)
            if not any(a["name"] == "jobs" and a["shared"] for a in addrs):
                return False
        return True
    wait_until(shared_everywhere, 30, "jobs shared on every broker")
    c = _connect(ps[2])
    try:
        s = c.create_sender("jobs")
        for i in range(20):
            s.send(Message(body=f"j-{i}", durable=True))
    finally:
        c.close()
    assert ps[0].queue("jobs")["depth"] == 20 and ps[2].queue("jobs")["enqueued"] == 0
    c = _connect(ss[0])
    try:
        r = c.create_receiver("jobs", credit=20)
        got = []
        for _ in range(20):
            got.append(r.receive(timeout=20).body)
            r.accept()
    finally:
        c.close()
    assert got == [f"j-{i}" for i in range(20)]
    # a producer's _AMQ_DUPL_ID is checked on the root, where the message is stored
    c = _connect(ps[1])
    try:
        s = c.create_sender("jobs")
        for _ in range(2):
            s.send(Message(body="once", durable=True, properties={"_AMQ_DUPL_ID": "order-1"}))
    finally:
        c.close()
    assert ps[0].queue("jobs")["depth"] == 1
    st, addrs = http_json(ps[0].management_url + "/api/v1/addresses", auth=ADMIN, timeout_s=10)
    assert next(a for a in addrs if a["name"] == "jobs")["duplicates_dropped"] == 1


def test_a_secondarys_subscriber_gets_another_secondarys_messages_through_the_root(tmp_path, procs):
    """A private subscription queue on one secondary, its publisher on the other (``max-hops =
    2``): the secondaries have no bridge to each other, so the publisher's broker learns the
    subscription through the primaries and routes it through the root; every message once, in
    order. The root SIGKILLed: the route moves to the new root."""
    ps, ss = _cluster(tmp_path, procs, extra={"max-hops": 2},
                      config={"addresses.news": {"routing-types": ["multicast"]}})
    ids = [p.node_id for p in ps]
    c = _connect(ss[1])
    try:
        r = c.create_receiver("news", credit=500)

        def route():
            return [b for b in cluster_view(ss[0])["remote_bindings"]
                    if b["address"] == "news" and b["node_id"] == ss[1].node_id and b["distance"] == 2
                    and b["connected"]]
        wait_until(route, 30, "s0 knows s1's subscription, two hops away")

        def take(n):
            out = []
            for _ in range(n):
                out.append(r.receive(timeout=20).body)
                r.accept()
            try:
                extra = r.receive(timeout=0.5).body
            except Exception:   # noqa: BLE001 - the timeout: nothing more, as expected
                extra = None
            assert extra is None, f"a copy too many: {extra}"
            return out

        sent = [f"n-{i}" for i in range(200)]
        cs = _connect(ss[0])
        try:
            snd = cs.create_sender("news")
            for b in sent:
                snd.send(Message(body=b, durable=True))
        finally:
            cs.close()
        assert take(200) == sent
        via = {b["to"]: b["acked"] for b in cluster_view(ss[0])["bridges"]}
        assert via[ids[0]] >= 200 and via[ids[1]] == 0 and via[ids[2]] == 0, via   # through the root only
        ps[0].kill()
        wait_until(lambda: cluster_view(ss[0])["root"] == ids[1], 30, "p1 root")
        wait_until(route, 30, "the route still known")
        sent2 = [f"m-{i}" for i in range(50)]
        cs = _connect(ss[0])
        try:
            snd = cs.create_sender("news")
            for b in sent2:
                snd.send(Message(body=b, durable=True))
        finally:
            cs.close()
        assert take(50) == sent2
        via = {b["to"]: b["acked"] for b in cluster_view(ss[0])["bridges"] if b["to"] != ids[0]}
        assert via[ids[1]] >= 50 and via[ids[2]] == 0, via   # through the new root
    finally:
        c.close()


def test_messages_a_consumer_left_behind_go_back_to_the_root_and_on_once(tmp_path, procs):
    """50 messages wait on the root. A consumer on p2 attaches: the root hands them all to p2. It
    takes 5 and goes away; p2 has no consumer left, so the other 45 go back to the root, and a consumer
    on the secondary gets them, each once and in order. (A message that makes that round trip must
    not be taken for a copy of itself on its way back.)"""
    ps, ss = _cluster(tmp_path, procs, secondaries=1)
    sent = _send(ps[1], "r", 50)
    wait_until(lambda: ps[0].queue("work")["depth"] == 50, 30, "50 waiting on the root")
    c = _connect(ps[2])
    try:
        r = c.create_receiver("work", credit=5)
        first = []
        for _ in range(5):
            first.append(r.receive(timeout=20).body)
            r.accept()
        # all 50 handed to p2 (5 of them delivered; proton sends the acceptances with its close)
        wait_until(lambda: (ps[2].queue("work")["depth"], ps[0].queue("work")["depth"]) == (50, 0), 30,
                   "the 50 handed to p2")
    finally:
        c.close()
    wait_until(lambda: ps[2].queue("work")["depth"] == 0 and ps[0].queue("work")["depth"] == 45, 30,
               "the 45 back on the root")
    con = Consumer(ss[0])
    wait_until(lambda: len(con.got) >= 45, 30, "the 45 at the secondary's consumer")
    time.sleep(0.5)
    con.close()
    assert first + con.got == sent
