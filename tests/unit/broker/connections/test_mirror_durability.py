"""A mirror sends a change to its target only once the change is durable on the source.

Otherwise a source killed between sending an acknowledgement's event and writing the
acknowledgement comes back holding a message its target already removed: the two sites differ
for good (it sank one CI run of test_mirror's source-killed test). A real node and journal; the
peer is a recorder (what the mirror link would put on the wire)."""

from __future__ import annotations

import trio

from broker.config import load_config
from broker.connections.mirror import MirrorSender, MirrorSource, MirrorTarget
from broker.connections.mirror_wire import BROKER_ID, MIRROR_CAPABILITY
from broker.core.addresses import ANYCAST
from broker.node import Node
from broker.store.journal import Journal
from tests.brokerproc import write_config


class _Link:
    remote_capabilities = (MIRROR_CAPABILITY,)       # a target without batches: one event per transfer
    remote_properties = {BROKER_ID: "target-node"}


class _Sender:
    def __init__(self, peer):
        self.peer = peer
        self.sent: list[bytes] = []

    def send(self, body: bytes, token) -> None:
        self.sent.append(body)


class _Peer:
    name = "dr"
    before_output = None

    def __init__(self):
        self.link = None

    def sender(self, address, outcome, **kw):
        self.link = _Sender(self)
        return self.link

    def wake(self) -> None:
        pass


def _node(tmp_path):
    path = write_config(tmp_path, config={"addresses.orders": {"routing-types": ["anycast"]}})
    path.write_text(path.read_text() + '\n[broker-connections.dr]\nuri = "amqp://127.0.0.1:1"\n'
                    "[broker-connections.dr.mirror]\n")
    cfg = load_config(path)
    journal = Journal.open(tmp_path / "journal")
    node = Node(cfg, None, "a" * 32, journal, components=(MirrorTarget(),))
    node.core.declare_address("orders", [ANYCAST])
    source = MirrorSource(cfg.broker_connections[0])
    source.install(node)
    peer = _Peer()
    sender = MirrorSender(source, peer, restart=lambda: None)
    sender._check(_Link())
    return node, journal, source, peer.link


def test_an_event_goes_to_the_target_only_after_the_journal_wrote_its_cause(tmp_path):
    node, journal, source, wire = _node(tmp_path)
    wire.sent.clear()
    source.flush_events(); trio.run(_commit_once, node)     # the topology announced at install
    announced = len(wire.sent)

    node.core.publish("orders", b"m1", True)
    source.flush_events()                                     # the round's events become a batch
    assert wire.sent[announced:] == [], "an event left before its message was written"
    assert journal.written_seq < journal.last_seq

    trio.run(_commit_once, node)                              # the committer writes and fsyncs
    assert journal.synced_seq == journal.last_seq
    assert len(wire.sent) == announced + 1
    journal.close()


async def _commit_once(node: Node) -> None:
    """Run the node's committer until it has nothing left to write, then stop it."""
    async with trio.open_nursery() as n:
        n.start_soon(node.committer)
        while getattr(node, "write_gates", None) or node.journal.synced_seq < node.journal.last_seq:
            await trio.sleep(0.01)
        await trio.sleep(0.01)
        n.cancel_scope.cancel()
