"""The mirror (``[broker-connections.<name>.mirror]``, docs/broker-connections.md "Mirror") between
real broker processes: A mirrors to B. Unmodified python-qpid-proton clients on both; B's queues
are the oracle (its management API and what a consumer on B gets), checked against what was
sent to and consumed on A; kills with SIGKILL in the middle of the stream."""

from __future__ import annotations

from pathlib import Path

import pytest
from proton import Data, Message, symbol
from proton.reactor import Copy, LinkOption
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN, BrokerProcess, write_config
from tests.haproc import send
from tests.integration.test_broker_connections import depth, view as source_view
from tests.serverproc import free_ports, http_json, metric_by_label
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def start(tmp_path: Path, name: str, *, port: int = 0, extra: str = "") -> BrokerProcess:
    workdir = tmp_path / name
    path = write_config(workdir, name=name, config={
        "acceptors.amqp": {"port": port},
        "addresses.orders": {"routing-types": ["anycast"]},
        "addresses.audit": {"routing-types": ["anycast"]},
        "addresses.events": {"routing-types": ["multicast"]}})
    path.write_text(path.read_text() + "\n" + extra)
    return BrokerProcess(workdir, path).start()


def mirror(uri: str, *, user: str = "admin", password: str = "admin", **keys) -> str:
    lines = ["[broker-connections.dr]", f'uri = "{uri}"', f'user = "{user}"', f'password = "{password}"',
             "retry-interval-ms = 200", "[broker-connections.dr.mirror]"]
    lines += [f"{k.replace('_', '-')} = {str(v).lower() if isinstance(v, bool) else repr(v)}" for k, v in keys.items()]
    return "\n".join(lines) + "\n"


def delete_queue(node: BrokerProcess, name: str) -> int:
    status, body = http_json(f"{node.management_url}/api/v1/queues/{name}", method="DELETE", auth=ADMIN)
    return status


def mirrored_pair(tmp_path: Path, procs: list, **mirror_keys) -> tuple[BrokerProcess, BrokerProcess]:
    """B, then A mirroring to it (``mirror_keys``: the mirror's table), once the link is up."""
    b = start(tmp_path, "b")
    procs.append(b)
    a = start(tmp_path, "a", extra=mirror(b.amqp_url, **mirror_keys))
    procs.append(a)
    wait_for(lambda: source_view(a)["mirror"]["attached"], 20, what="the mirror attached")
    return a, b


def target_events(b: BrokerProcess) -> dict:
    status, text = http_json(b.management_url + "/metrics", auth=ADMIN)
    assert status == 200
    return metric_by_label(text, "lodestone_broker_mirror_target_events_total")


def consume(b: BrokerProcess, address: str, n: int) -> list:
    """Exactly ``n`` messages from ``address`` (accepted one by one)."""
    c = BlockingConnection(b.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    try:
        r = c.create_receiver(address, credit=min(n, 100))
        out = []
        for _ in range(n):
            out.append(r.receive(timeout=20).body)
            r.accept()
        return out
    finally:
        c.close()


def browse(b: BrokerProcess, address: str) -> list:
    """Every message waiting in ``address``'s queue, in order, without taking any (a browser)."""
    c = BlockingConnection(b.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    out = []
    try:
        r = c.create_receiver(address, credit=5000, options=Copy())
        while True:
            try:
                out.append(r.receive(timeout=1.0).body)
            except Exception:   # proton's Timeout: the queue is read
                return out
    finally:
        c.close()


def test_a_mirror_copies_sends_and_acknowledgements(tmp_path, procs):
    a, b = mirrored_pair(tmp_path, procs)
    send(a, "orders", [f"o-{i}" for i in range(200)])
    wait_for(lambda: depth(b, "orders") == 200, 30, what="200 mirrored to B")
    assert depth(a, "orders") == 200
    assert consume(a, "orders", 100) == [f"o-{i}" for i in range(100)]
    wait_for(lambda: depth(b, "orders") == 100, 30, what="100 acknowledgements mirrored")
    assert consume(b, "orders", 100) == [f"o-{i}" for i in range(100, 200)]   # exactly the other 100
    assert consume(a, "orders", 100) == [f"o-{i}" for i in range(100, 200)]
    wait_for(lambda: source_view(a)["mirror"]["pending"] == 0, 30, what="every event accepted")
    assert depth(a, "orders") == 0 and depth(b, "orders") == 0
    m = source_view(a)["mirror"]
    assert (m["sends"], m["acks"], m["target_node_id"]) == (200, 200, b.node_id)
    assert m["batching"] is True and m["sent"] == m["acknowledged"] == 400 + 2   # + createQueue of orders, audit
    ev = target_events(b)
    assert (ev["sends"], ev["acks"], ev["acks_not_found"], ev["duplicates"], ev["bad_events"]) == (200, 200, 100, 0, 0)
    assert delete_queue(a, "orders") == 204                 # queue-removal (default true)
    wait_for(lambda: depth(b, "orders") == -1, 30, what="the queue deleted on B too")


def _same_on_both(a: BrokerProcess, b: BrokerProcess, address: str = "orders") -> list:
    wait_for(lambda: source_view(a)["mirror"]["pending"] == 0 and source_view(a)["mirror"]["attached"], 60,
             what="every event accepted by B")
    on_a, on_b = browse(a, address), browse(b, address)
    assert len(set(on_b)) == len(on_b), f"{len(on_b) - len(set(on_b))} stored twice on B"
    assert on_b == on_a, f"A holds {len(on_a)}, B {len(on_b)}; missing on B: {sorted(set(on_a) - set(on_b))[:5]}, " \
                         f"extra on B: {sorted(set(on_b) - set(on_a))[:5]}"
    return on_a


def test_the_target_killed_and_restarted_mid_stream_ends_holding_what_the_source_holds(tmp_path, procs):
    (port,) = free_ports(1)
    b = start(tmp_path, "b", port=port)
    procs.append(b)
    a = start(tmp_path, "a", extra=mirror(f"amqp://127.0.0.1:{port}"))
    procs.append(a)
    wait_for(lambda: source_view(a)["mirror"]["attached"], 20, what="the mirror attached")
    for k in range(10):
        send(a, "orders", [f"o-{k}-{i}" for i in range(100)])
        if k in (3, 7):
            b.kill()                                     # SIGKILL, events in flight
        consume(a, "orders", 30)                         # acknowledgements, some while B is down
        if k in (4, 8):
            b.restart()
    held = _same_on_both(a, b)
    assert len(held) == 1000 - 300
    assert held == [f"o-{k}-{i}" for k in range(10) for i in range(100)][300:]


def test_the_source_killed_and_restarted_mid_stream_ends_with_the_same_on_both(tmp_path, procs):
    a, b = mirrored_pair(tmp_path, procs)
    for k in range(4):
        send(a, "orders", [f"o-{k}-{i}" for i in range(250)])
        consume(a, "orders", 50)
        a.kill()                                         # SIGKILL: the store-and-forward queue is journaled
        a.restart()
        wait_for(lambda: source_view(a)["mirror"]["attached"], 20, what="the mirror attached again")
    held = _same_on_both(a, b)
    sent = [f"o-{k}-{i}" for k in range(4) for i in range(250)]
    # an acknowledgement not yet written when A was killed comes back to A (and so stays on B)
    assert 1000 - 200 <= len(held) <= 1000 and held == [x for x in sent if x in set(held)]


def test_a_user_without_the_mirror_permission_is_refused(tmp_path, procs):
    b = start(tmp_path, "b")
    procs.append(b)
    a = start(tmp_path, "a", extra=mirror(b.amqp_url, user="app", password="app"))
    procs.append(a)
    wait_for(lambda: target_events(b).get("refused", 0) >= 1, 20, what="B refused the mirror")
    assert "amqp:unauthorized-access" in a.stderr_text()
    assert "may not mirror into" in b.stderr_text()
    assert not source_view(a)["mirror"]["attached"]
    send(a, "orders", ["kept"])                          # held on A, in its store-and-forward queue
    assert source_view(a)["mirror"]["pending"] >= 1 and depth(b, "orders") == 0


class _MirrorAttach(LinkOption):
    """What a mirror's attach carries: ``amq.mirror`` on the target and the source's id."""

    def apply(self, link):
        d = link.target.capabilities
        d.put_array(False, Data.SYMBOL)
        d.enter()
        d.put_symbol(symbol("amq.mirror"))
        d.exit()
        link.properties = {symbol("x-opt-amq-bkr-id"): "rogue-node"}


def test_a_malformed_event_closes_that_connection_only_with_its_condition(tmp_path, procs):
    b = start(tmp_path, "b")
    procs.append(b)
    c = BlockingConnection(b.amqp_url, user="admin", password="admin", allowed_mechs="PLAIN", timeout=10)
    snd = c.create_sender("$ACTIVEMQ_ARTEMIS_MIRROR_rogue", options=_MirrorAttach())
    with pytest.raises(Exception):
        snd.send(Message(body="not an event"))           # no annotations: not the format
        snd.send(Message(body="again"))
    cond = c.conn.remote_condition
    assert cond is not None and cond.name == "amqp:decode-error"
    try:
        c.close()
    except Exception:   # already closed by the broker
        pass
    assert target_events(b)["bad_events"] == 1
    send(b, "orders", ["still-serving"])                  # everyone else is served
    assert consume(b, "orders", 1) == ["still-serving"]


def test_address_filter_and_the_option_flags(tmp_path, procs):
    b = start(tmp_path, "b")
    procs.append(b)
    a = start(tmp_path, "a", extra=mirror(b.amqp_url, address_filter="orders,audit,!audit.secret",
                                          message_acknowledgements=False, queue_removal=False) + """
[addresses."audit.secret"]
routing-types = ["anycast"]
[addresses."orders.eu"]
routing-types = ["anycast"]
""")
    procs.append(a)
    wait_for(lambda: source_view(a)["mirror"]["attached"], 20, what="the mirror attached")
    send(a, "orders", [f"o-{i}" for i in range(10)])
    send(a, "orders.eu", [f"e-{i}" for i in range(5)])     # "orders" is a prefix: mirrored
    send(a, "audit.secret", [f"s-{i}" for i in range(5)])  # excluded: the exclusion wins
    send(a, "events", ["nobody-listens"])                 # outside the filter (and no subscriber)
    wait_for(lambda: depth(b, "orders") == 10 and depth(b, "orders.eu") == 5, 30, what="mirrored to B")
    assert depth(b, "audit.secret") == -1                 # never created there
    consume(a, "orders", 10)                              # message-acknowledgements = false
    wait_for(lambda: source_view(a)["mirror"]["pending"] == 0, 30, what="all accepted")
    assert depth(a, "orders") == 0 and depth(b, "orders") == 10
    m = source_view(a)["mirror"]
    assert (m["sends"], m["acks"]) == (15, 0)
    assert delete_queue(a, "orders.eu") == 204             # queue-removal = false: B keeps it
    send(a, "orders", ["after"])                            # an event after the (unsent) deletion
    wait_for(lambda: depth(b, "orders") == 11, 30, what="the later send on B")
    assert depth(b, "orders.eu") == 5 and depth(a, "orders.eu") == -1


def test_queue_creation_off_sends_messages_but_not_queues(tmp_path, procs):
    a, b = mirrored_pair(tmp_path, procs, queue_creation=False)
    c = BlockingConnection(a.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    try:
        c.create_receiver("events", name="sub-1")          # a multicast subscription queue on A
    finally:
        c.close()
    send(a, "orders", [f"o-{i}" for i in range(3)])        # anycast: created on B with the first send
    wait_for(lambda: depth(b, "orders") == 3, 30, what="orders on B")
    wait_for(lambda: source_view(a)["mirror"]["pending"] == 0, 30, what="all accepted")
    assert target_events(b).get("queues_created", 0) == 0


class _ProtonMirrorTarget:
    """A mirror target that is not Lodestone, as Artemis would be: python-qpid-proton listening,
    answering the mirror's attach with ``amq.mirror`` and an id but without Lodestone's batch
    capability, keeping every transfer it accepts (decoded by proton, the independent codec) and
    the Open's properties."""

    def __init__(self) -> None:
        import threading

        from proton.handlers import MessagingHandler
        from proton.reactor import Container

        target = self
        self.transfers: list[Message] = []
        self.offered: list = []
        self.open_properties: dict = {}
        self.port = free_ports(1)[0]
        self.ready = threading.Event()

        class Handler(MessagingHandler):
            def __init__(self) -> None:
                super().__init__(auto_accept=True)

            def on_start(self, event) -> None:
                target.acceptor = event.container.listen(f"127.0.0.1:{target.port}")
                target.ready.set()

            def on_connection_opened(self, event) -> None:
                target.open_properties = dict(event.connection.remote_properties or {})

            def on_link_opening(self, event) -> None:
                link = event.link
                asked = link.remote_target.capabilities
                asked.rewind()
                target.offered.append(list(asked.get_object() or []) if asked.next() is not None else [])
                link.target.address = link.remote_target.address
                caps = link.target.capabilities
                caps.put_array(False, Data.SYMBOL)
                caps.enter()
                caps.put_symbol("amq.mirror")
                caps.exit()
                link.properties = {symbol("x-opt-amq-bkr-id"): "proton-target"}

            def on_message(self, event) -> None:
                target.transfers.append(event.message)

        self.container = Container(Handler())
        self.thread = threading.Thread(target=self.container.run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def stop(self) -> None:
        self.container.stop()
        self.thread.join(10)


def test_a_target_without_batches_gets_one_artemis_event_per_transfer(tmp_path, procs):
    t = _ProtonMirrorTarget()
    try:
        a = start(tmp_path, "a", extra="[broker-connections.dr]\n"
                                       f'uri = "amqp://127.0.0.1:{t.port}"\nretry-interval-ms = 200\n'
                                       "[broker-connections.dr.mirror]\n")
        procs.append(a)
        wait_for(lambda: source_view(a)["mirror"]["attached"], 20, what="the mirror attached to proton")
        send(a, "orders", [f"o-{i}" for i in range(300)])
        assert consume(a, "orders", 120) == [f"o-{i}" for i in range(120)]
        wait_for(lambda: source_view(a)["mirror"]["pending"] == 0, 30, what="every event accepted by proton")
        m = source_view(a)["mirror"]
        assert m["batching"] is False
        assert t.open_properties[symbol("broker-connection-info")] == {"connectionName": "dr", "nodeId": a.node_id}
        assert m["sent"] == m["acknowledged"] == m["transfers"] == len(t.transfers)
        assert "x-opt-lodestone-mirror-batch" in {str(c) for c in t.offered[0]}   # asked for, not offered
        sends = [x for x in t.transfers if x.instructions and "x-opt-amq-mr-id" in x.instructions]
        acks = [x for x in t.transfers if x.annotations and x.annotations.get("x-opt-amq-mr-ev-type") == "postAck"]
        assert not [x for x in t.transfers if x.annotations and "x-opt-lodestone-mirror-batch" in x.annotations]
        assert [x.body for x in sends] == [f"o-{i}" for i in range(300)]     # in order, each once
        by_id = {x.instructions["x-opt-amq-mr-id"]: x.body for x in sends}
        assert sorted(by_id[x.body] for x in acks) == sorted(f"o-{i}" for i in range(120))
        assert {x.instructions["x-opt-amq-mr-trg-q"] for x in sends} == {"orders"}
    finally:
        t.stop()
