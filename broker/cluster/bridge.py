"""The cluster bridge: a node's connections to the other nodes of its cluster (the shell).

Theory of operation
-------------------
:class:`ClusterNode` makes one node part of a cluster (Artemis ``ClusterConnectionImpl``). It
keeps one outbound :class:`Bridge` per other member — a :class:`broker.amqp.peer.PeerConnection`
(client-mode engine, SASL PLAIN with the cluster credential, Artemis's retry settings) carrying
two links (:mod:`broker.wire.cluster`):

* ``$lodestone.cluster.notifications`` (we receive): the other node's queues and consumers as
  binding notifications. After every (re)connection it sends ``hello``, ``reset`` and a snapshot,
  then changes as they happen. What a neighbour tells us is kept per neighbour (``learned``);
  the core's :class:`~broker.core.bindings.ClusterBindings` holds, per (node, queue), the entry
  at the smallest distance (``max-hops``: a neighbour passes on what it learned, one hop
  farther; :meth:`ClusterBindings.put` drops what is too far);
* ``$lodestone.cluster.forward`` (we send): the messages the core routes to that neighbour.

**Store and forward.** ``Broker.on_forward`` puts each forwarded copy, wrapped in its envelope
(dup-id, targets, the producer's bytes untouched), in the neighbour's store-and-forward queue
``$lodestone.sf.<cluster>.<node id>`` — a queue of the core, so a durable message is in the
journal before the producer is answered, and survives a restart of this node. The bridge is that
queue's consumer: a message leaves it only when the neighbour accepted it, which the neighbour
does only after *its* journal holds it (the same group commit as producers). A bridge that
reconnects sends again what was not accepted; the receiving node's duplicate cache
(:mod:`broker.core.duplicates`, ``id-cache-size`` per origin node, kept in the journal with the
message it vouches for when ``persist-id-cache``) drops what it already stored. So a message is
forwarded exactly once across kills of either side.

**A producer's duplicate id** (``_AMQ_DUPL_ID``, Artemis duplicate detection) is checked by the
node a producer sent the message to, and again by each node that stores a forwarded copy, in its
own cache of the address (a producer that resends through another node is caught where the first
copy went). A message moved by redistribution or scale-down (the envelope's ``moved``) is dropped
only for the target queues here that hold a copy of the same id already (``DuplicateIds.holds``:
the producer's resend, stored here before the first copy moved in); elsewhere it is stored — its
id may be known here because the message passed through — and remembered. A copy moving away
releases its queue's hold (``_move``).

**Serving other nodes** (:meth:`ClusterNode.attach`, the node's internal link service): an
inbound cluster connection (logged in as the cluster user, with the cluster key if one is set)
may attach the two addresses above. A forwarded message is checked, then enqueued in each
target queue here (or forwarded on, for a target farther away) in one journal group with its
duplicate id; it is accepted after the fsync. Anything that is not the format, or a
notification that lies about who sent it, cuts that connection off with the AMQP condition and
a log line; everyone else keeps being served.

**Redistribution.** :meth:`ClusterNode.redistributor` sleeps until the next queue's
``redistribution-delay-ms`` ends (or the bindings change), then moves due queues' messages, in
order, to the node the core picks (``Broker.take_for_redistribution``): each take and its
store-and-forward enqueue are one journal group, so a message moves exactly once.

**Accounting.** Per neighbour: forwarded, accepted, pending, duplicates dropped; the activity log
gets ``forward``, ``redistribute`` and ``forward-in`` records per neighbour and address
(``docs/broker.md``); ``/metrics`` and ``GET /api/v1/cluster`` read :meth:`ClusterNode.describe`.
"""

from __future__ import annotations

import collections
import hmac
import itertools
import logging
import math
import os
import struct
import time
from dataclasses import replace
from itertools import count
from typing import TYPE_CHECKING

import trio

from broker.amqp.links import Incoming, OwnedLink
from broker.amqp.message import body_duplicate_key
from broker.wire.frames import CLUSTER_MEMBERS, MAX_CLUSTER_MEMBERS
from broker.amqp.host import INTERNAL_PREFIX
from broker.amqp.peer import (PeerConnected, PeerConnectFailed, PeerConnection, PeerDisconnected, PeerGaveUp,
                              PeerLoginRefused, RetrySettings)
from broker.wire.discovery import DiscoveryGroup
from broker.wire.cluster import (FORWARD_ADDRESS, NOTIFY_ADDRESS, SHARED_ADDRESS, AddressNote, BackupsNote, BindingNote,
                                     ElectionNote, Forwarded, Hello,
                                     ProtocolError, Reset, Unbinding, decode_forwards, decode_note, encode_forward,
                                     encode_note)
from broker.cluster.root import RootElection
from broker.cluster.shared import SharedQueues
from broker.cluster.state import ClusterState
from broker.cluster.settings import address_clustered, parse_connector, same_endpoint
from broker.core.addresses import ANYCAST
from broker.core.balancing import LoadBalancing
from broker.core.bindings import RemoteBinding
from broker.core.deliveries import DEFAULT_PRIORITY, Message, Outcome, Relayed
from broker.core.duplicates import MISSING, ORIGIN_RECORDS, DuplicateCache
from broker.core.queues import Subscription
from broker.wire.io.trioutil import Wakeup
from broker.wire.io.udp import listen

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine
    from broker.cluster.settings import ClusterConfig
    from broker.node import Node

log = logging.getLogger("lodestone.broker.cluster")

__all__ = ["ClusterNode", "Bridge", "SF_PREFIX", "DUP_PREFIX", "CLUSTER_ROLE"]

SF_PREFIX = "$lodestone.sf."
DUP_PREFIX = ORIGIN_RECORDS   # "$lodestone.records.dupids.<origin>": the per-origin caches' journal records
CLUSTER_ROLE = "$cluster"
SF_WINDOW = 1000          # forwarded messages in flight per bridge (unaccepted)
BATCH_MESSAGES = 256      # forwarded messages in one transfer at most
BATCH_BYTES = 256 * 1024  # and about this many bytes
FORWARD_CREDIT = 1000     # credit we grant an inbound forward link
NOTIFY_BACKLOG = 200_000  # notifications waiting for a subscriber's credit before it is cut off
REDISTRIBUTE_BATCH = 500
MAX_UNANSWERED_DISCOVERED = 64  # bridges to discovered members that have not answered yet


def _loopback(ip: str | None) -> bool:
    import ipaddress
    try:
        addr = ipaddress.ip_address(ip or "")
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


class _Member:
    __slots__ = ("node_id", "connector", "management_url", "since", "started_ms")

    def __init__(self, node_id: str, connector: str, management_url: str, started_ms: int = 0):
        self.node_id = node_id
        self.connector = connector
        self.management_url = management_url
        self.since = time.time()
        self.started_ms = started_ms


# -- outbound ------------------------------------------------------------------------------------

class Bridge:
    """Our connection to one other node (see the module doc)."""

    def __init__(self, cluster: "ClusterNode", url: str):
        self.cluster = cluster
        self.url = url
        cfg = cluster.cfg
        retry = RetrySettings(cfg.retry_interval_ms, cfg.retry_interval_multiplier, cfg.max_retry_interval_ms,
                              cfg.reconnect_attempts, cfg.initial_connect_attempts)
        self.peer = PeerConnection(cluster.node, url, credentials=(cfg.user, cfg.password), retry=retry,
                                   ca_file=cfg.ca_file, name=f"bridge-{cluster.node.short_id}-{url}",
                                   on_event=self._event,
                                   idle_timeout_s=cfg.connection_ttl_ms / 1000.0 if cfg.connection_ttl_ms > 0 else None)
        self.sender = self.peer.sender(FORWARD_ADDRESS, self._outcome)
        self.receiver = self.peer.receiver(NOTIFY_ADDRESS, self._note, credit=1000)
        self.peer.before_output = self._flush  # a batch goes out with the connection's next write
        #: shared queues' sends relayed to this node when it is the root (broker.cluster.shared)
        self.shared_sender = (self.peer.sender(SHARED_ADDRESS, cluster.shared.outcome)
                              if cluster.shared is not None else None)
        self.node_id: str | None = None
        self.connected = False
        self.since: float | None = None
        self.sf = None
        self.sub: Subscription | None = None
        self.forwarded = 0
        self.transfers = 0       # transfers on the forward link (each carries a batch)
        self._batch: list[Message] = []   # handed out by the store-and-forward queue, not yet sent
        self._batch_bytes = 0
        self.inflight_bytes = 0  # forwarded and not yet acknowledged (confirmation-window-bytes)
        self.acked = 0
        self.bytes_acked = 0
        self.cancel_scope: trio.CancelScope | None = None
        self.stopped = False
        self.retire = False   # stop at the next disconnect (we reached a duplicate of ourselves)
        self.login_refused = 0
        self.failures = 0        # connection attempts that failed, and connections lost (the root election)
        self.lost_silently = False   # the last connection ended by our idle time-out (the root election)

    # -- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        with trio.CancelScope() as scope:
            self.cancel_scope = scope
            await self.peer.run()
        self.stopped = True

    def stop(self) -> None:
        self.stopped = True
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()
        if self.sub is not None and self.sf is not None:
            self._batch = []
            self.sf.remove_subscription(self.sub)  # what was in flight goes back to the queue
            self.sub = None

    # -- connection events ---------------------------------------------------------------------
    def _event(self, ev) -> None:
        c = self.cluster
        if isinstance(ev, PeerConnected):
            if ev.node_id == c.node.node_id:
                props = (self.peer.engine.remote_properties if self.peer.engine is not None else None) or {}
                started = props.get("started-ms") if isinstance(props, dict) else None
                if isinstance(started, int) and started != c.started_ms:
                    # another active node with our node id (a copied data directory): close
                    # (after our attaches went out, so the other node sees and logs it too),
                    # then stop on the disconnect
                    self.retire = True
                    self.peer.engine.close_with("amqp:precondition-failed",
                                                c._duplicate_of_us(ev.node_id, self.url, started))
                    return
                else:
                    log.info("cluster connector reaches this node itself; not bridging to it",
                             extra={"fields": {"connector": self.url}})
                    c.self_urls.add(self.url)
                self.stop()
                return
            self.connected = True
            self.since = time.time()
            c.bridge_up(self, ev.node_id)
            self._flush()
        elif isinstance(ev, (PeerDisconnected, PeerConnectFailed, PeerGaveUp)):
            if self.retire:
                self.stop()
                return
            self.failures += 1
            # lost by this side's idle time-out, not by the peer's socket closing: it may live on
            # (proton's "local-idle-timeout expired"; a socket the peer's kernel closed is an EOF)
            self.lost_silently = isinstance(ev, PeerDisconnected) and not ev.remote \
                and "idle-timeout" in (ev.description or "")
            if c.election is not None:
                c.election.changed()
            was = self.connected
            self.connected = False
            if was:
                c.bridge_down(self)
            if isinstance(ev, PeerGaveUp):
                c.bridge_gave_up(self)
        elif isinstance(ev, PeerLoginRefused):
            self.login_refused += 1
            c.counters["bridge_login_refused"] += 1

    # -- store and forward -----------------------------------------------------------------------
    def attach_sf(self, sf) -> None:
        if self.sf is sf and self.sub is not None:
            return
        if self.sub is not None and self.sf is not None:
            self.sf.remove_subscription(self.sub)
        self.sf = sf
        self.inflight_bytes = 0
        self._batch = []
        self._batch_bytes = 0
        self.sub = Subscription(self._sf_sink, owner=self)
        self.sub.credit = SF_WINDOW
        sf.add_subscription(self.sub)

    def _sf_sink(self, sub: Subscription, msg: Message) -> None:
        """The store-and-forward queue hands out a message: it joins the batch that goes out in
        one transfer right before the bridge connection next writes (``_flush``)."""
        self.forwarded += 1
        self.inflight_bytes += len(msg.body)
        window = self.cluster.cfg.confirmation_window_bytes
        if window > 0 and self.inflight_bytes >= window:
            sub.credit = 0  # Artemis confirmation-window-size: wait for acknowledgements
        batch = self._batch
        batch.append(msg)
        self._batch_bytes += len(msg.body)
        if self._batch_bytes >= BATCH_BYTES or len(batch) >= BATCH_MESSAGES:
            self._flush()
        elif len(batch) == 1:
            self.peer.wake()  # the writer's take_output calls _flush first

    def _flush(self) -> None:
        """Send the batch as one transfer (the engine's ``before_output``; also when it is full)."""
        batch = self._batch
        if not batch:
            return
        self._batch = []
        self._batch_bytes = 0
        body = batch[0].body if len(batch) == 1 else b"".join(m.body for m in batch)
        self.sender.send(body, tuple(m.mid for m in batch))
        self.transfers += 1

    def _outcome(self, mids, state: str) -> None:
        if state not in ("accepted", "rejected"):
            return  # released/modified: the other node did not take it; PeerSender sends it again
        sub, sf = self.sub, self.sf
        if sub is None or sf is None:
            return
        accepted = state == "accepted"
        if not accepted:  # the other node could not take it (it logged why): dead-letter it here
            log.warning("cluster peer rejected forwarded messages", extra={"fields": {
                "peer": self.node_id, "state": state, "messages": len(mids)}})
        unacked = sub.unacked
        for mid in mids:
            msg = unacked.get(mid)
            if msg is None:
                continue
            self.inflight_bytes -= len(msg.body)
            if accepted:
                self.acked += 1
                self.bytes_acked += len(msg.body)
                self.cluster.account(self.node_id, msg, sf)
                sf.settle(sub, mid, Outcome.ACCEPTED)
            else:
                sf.settle(sub, mid, Outcome.REJECTED)
        window = self.cluster.cfg.confirmation_window_bytes
        if window <= 0 or self.inflight_bytes < window:
            # top up in batches (a quarter of the window, or when nothing is in flight): one
            # dispatch hands out many messages instead of one per acknowledgement
            free = SF_WINDOW - len(unacked)
            if free >= SF_WINDOW // 4 or not unacked:
                sub.credit = free
                sf.credit_changed(sub)

    @property
    def pending(self) -> int:
        sf = self.sf
        if sf is None:
            return 0
        return len(sf.messages) + sum(len(s.unacked) for s in sf.subs)

    # -- notifications from the other node -------------------------------------------------------
    def _note(self, body: bytes) -> str:
        c = self.cluster
        engine = self.peer.engine
        if engine is not None and engine.error is not None:
            # we are closing this connection (e.g. cut it off for a bad notification just before,
            # in the same read): nothing more the peer says on it is believed
            return "released"
        try:
            note = decode_note(body)
            c.apply_note(self, note)
        except ProtocolError as exc:
            c.counters["bad_notifications"] += 1
            log.warning("cluster peer sent a bad notification; cutting the connection off", extra={"fields": {
                "peer": self.node_id, "connector": self.url, "condition": exc.condition,
                "description": exc.description}})
            if engine is not None:
                engine.close_with(exc.condition, exc.description)
            return "rejected"
        return "accepted"

    def describe(self) -> dict:
        return {"to": self.node_id, "connector": self.url, "connected": self.connected,
                "forwarded": self.forwarded, "acked": self.acked, "pending": self.pending,
                "transfers": self.transfers,
                "duplicates_dropped": self.cluster.duplicates_from(self.node_id),
                "since": self.since}


# -- inbound (served on the node's accepted connections) ----------------------------------------------

class _ForwardIn:
    """A neighbour's forward link into this node."""

    def __init__(self, cluster: "ClusterNode", engine: "AmqpEngine", peer_node: str | None):
        self.cluster = cluster
        self.engine = engine
        self.peer_node = peer_node
        self.link = None
        self.received = 0

    def on_attached(self, link: OwnedLink) -> None:
        self.link = link
        link.credit_window = FORWARD_CREDIT
        link.flow(FORWARD_CREDIT)

    def on_detached(self, link: OwnedLink, condition) -> None:
        self.link = None

    def on_message(self, link: OwnedLink, data: bytes, delivery: Incoming) -> None:
        """One forwarded message."""
        self.received += 1
        self.cluster.receive_forward(self, delivery, data)


class _SharedIn:
    """A broker's relay of shared-queue sends into this node (the root, see broker.cluster.shared)."""

    def __init__(self, shared: SharedQueues | None, engine: "AmqpEngine"):
        self.shared = shared
        self.engine = engine

    def on_attached(self, link: OwnedLink) -> None:
        link.credit_window = FORWARD_CREDIT
        link.flow(FORWARD_CREDIT)

    def on_detached(self, link: OwnedLink, condition) -> None:
        pass

    def on_message(self, link: OwnedLink, data: bytes, delivery: Incoming) -> None:
        if self.engine.error is not None:
            return
        if self.shared is None:   # no root election here: this node is never a root
            delivery.release()
            return
        self.shared.receive(self.engine, delivery, data)


class _NotifyOut:
    """A neighbour's notification link out of this node: hello, reset, snapshot, then changes."""

    def __init__(self, cluster: "ClusterNode", engine: "AmqpEngine"):
        self.cluster = cluster
        self.engine = engine
        self.link = None
        self.backlog: collections.deque = collections.deque()

    def on_attached(self, link: OwnedLink) -> None:
        self.link = link
        c = self.cluster
        c.subscribers.add(self)
        for note in c.snapshot():
            self.backlog.append(encode_note(note))
        self.pump()

    def on_credit(self, link: OwnedLink) -> None:
        self.pump()

    def on_detached(self, link: OwnedLink, condition) -> None:
        self.link = None
        self.cluster.subscribers.discard(self)

    def push(self, data: bytes) -> None:
        if self.link is None:
            return
        self.backlog.append(data)
        if len(self.backlog) > NOTIFY_BACKLOG:
            self.cluster.counters["notify_backlog_exceeded"] += 1
            self.engine.close_with("amqp:resource-limit-exceeded", "cluster notifications not read")
            self.link = None
            self.cluster.subscribers.discard(self)
            return
        self.pump()

    def pump(self) -> None:
        link = self.link
        if link is None:
            return
        moved = False
        while self.backlog and link.credit > 0:
            link.send(self.backlog.popleft())   # pre-settled
            moved = True
        if moved:
            self.engine.wake()


# -- the cluster ---------------------------------------------------------------------------------------

class ClusterNode:
    """This node's part of a cluster (see the module doc)."""

    def __init__(self, node: "Node", cfg: "ClusterConfig", *, connector: str, management_url: str = ""):
        self.node = node
        self.cfg = cfg
        self.core = core = node.core
        self.connector = connector
        self.management_url = management_url
        self.started_ms = int(time.time() * 1000)
        self.mode = LoadBalancing(cfg.message_load_balancing)
        core.load_balancing = self.mode
        core.cluster.max_hops = cfg.max_hops
        core.on_forward = self._on_forward
        core.add_consumer_listener(self._consumers_changed)
        core.add_queue_listener(self._queue_changed)
        self._include, self._exclude = cfg.address_filter
        self.bridges: dict[str, Bridge] = {}           # by connector URL
        self.by_node: dict[str, Bridge] = {}           # by the node id it reached
        self.members: dict[str, _Member] = {}
        self.self_urls: set[str] = {connector}
        self.subscribers: set[_NotifyOut] = set()
        self.learned: dict[str, dict[tuple[str, str], RemoteBinding]] = {}  # via -> (node, queue) -> binding
        self.counters: collections.Counter = collections.Counter()
        self.activity: dict[str, dict[tuple[str, str], list[int]]] = {}  # peer -> (address, direction) -> [n, bytes]
        self.redistributed = 0
        self._epoch = os.urandom(8)
        self._seq = count(1)
        #: bridges to start: connect() queues them, run() starts each in its own nursery
        self._to_start, self._starts = trio.open_memory_channel(math.inf)
        self._changed = Wakeup()
        self._sf: dict[str, object] = {}   # node id -> its store-and-forward queue
        self.groups: dict[str, str | None] = {}   # node id -> its scale-down group (from its hello)
        #: node id -> the HA backups it told us of (its ``backups`` notifications; cleared by its hello)
        self.member_backups: dict[str, tuple[tuple[str, str, bool], ...]] = {}
        self._told_backups: tuple[tuple[str, str, bool], ...] = ()   # what we last told the others
        self.scaling_down = False
        self.scaled_down = 0
        self.identities: dict[str, tuple[str, int]] = {}  # node id -> (connector, start ms) seen inbound
        self.duplicate_of: str | None = None  # set when this node is the newcomer of a duplicate id
        self.discovery_cfg = next((d for d in node.cfg.discovery_groups if d.name == cfg.discovery_group), None) \
            if cfg.discovery_group else None
        self.discovery = DiscoveryGroup(node.node_id, (self.discovery_cfg.refresh_timeout_ms / 1000.0
                                                       if self.discovery_cfg else 10.0), cluster=cfg.name, key=cfg.key)
        self.state = ClusterState(cfg.max_state_bytes)
        #: called (no arguments) whenever the live members may have changed: a bridge came up or
        #: went down, a hello named a member's connector (an embedded router's cluster pool)
        self.membership_listeners: list = []
        #: OpenAMQ's root election (``[cluster] primaries``; broker.cluster.root), else None
        self.election: RootElection | None = RootElection(self) if cfg.elects_root else None
        #: OpenAMQ's shared queues (broker.cluster.shared): with a root election only
        self.shared: SharedQueues | None = SharedQueues(self) if cfg.elects_root else None
        for decl in node.cfg.addresses:
            self.state.offer(AddressNote(decl.name, tuple(sorted(decl.routing_types)), decl.filter, 0, node.node_id,
                                         shared=decl.shared))
        if self.shared is not None:
            for e in self.state:
                self.shared.set_shared(e.name, e.shared and not e.deleted)
        # the per-origin duplicate caches live in the core (broker.core.duplicates), restored with
        # the node's other records by Node.recover

    # -- lifecycle ---------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._start_bridges, nursery)
            for url in self.cfg.static_connectors:
                self.connect(url)
            if self.election is not None:
                for url in self.cfg.primaries:   # every node dials every defined primary
                    self.connect(url)
                nursery.start_soon(self.election.run)
                nursery.start_soon(self.shared.run)
            nursery.start_soon(self.redistributor)
            if self.discovery_cfg is not None:
                nursery.start_soon(self._discover)
                nursery.start_soon(self._initial_wait)
            task_status.started(self)

    # -- discovery (broker.wire.discovery, broker.wire.io.udp) -------------------------------
    async def _discover(self) -> None:
        """Follow the discovery group: dial members as they are heard; forget one that goes
        silent and is not connected. A group the host cannot join is retried (logged once)."""
        d = self.discovery_cfg
        logged = False
        while True:
            try:
                await listen(d.group_address, d.group_port, self.discovery, self._discovered,
                             bind_address=d.local_bind_address)
            except OSError as exc:
                self.counters["discovery_join_failed"] += 1
                if not logged:
                    logged = True
                    log.error("cannot listen to discovery group %s (%s:%d): %s; retrying every refresh timeout",
                              d.name, d.group_address, d.group_port, exc)
                await trio.sleep(d.refresh_timeout_ms / 1000.0)

    async def _initial_wait(self) -> None:
        d = self.discovery_cfg
        await trio.sleep(d.initial_wait_timeout_ms / 1000.0)
        if not self.discovery.entries:
            log.warning("discovery group %s heard no other node within initial-wait-timeout-ms (%d)",
                        d.name, d.initial_wait_timeout_ms)

    def _discovered(self, kind: str, entry) -> None:
        a = entry.announcement
        if kind in ("added", "changed"):
            self.counters[f"discovery_{kind}"] += 1
            url = self._pick_connector(a.connectors)
            b = self.by_node.get(a.node_id)
            if b is None or (kind == "changed" and not b.connected):
                # an unsigned group can be fed made-up members: dial only so many at once that
                # have never answered (they are dropped when their entries expire)
                unanswered = sum(1 for x in self.bridges.values() if x.node_id is None and not x.stopped)
                if unanswered >= MAX_UNANSWERED_DISCOVERED:
                    self.counters["discovery_dial_capped"] += 1
                    return
                self.connect(url)
        elif kind == "removed":
            self.counters["discovery_removed"] += 1
            b = self.by_node.get(a.node_id)
            if b is not None and not b.connected:  # gone for good, as far as discovery knows
                self._retire(b)
                self.by_node.pop(a.node_id, None)
                self.members.pop(a.node_id, None)
                self.member_backups.pop(a.node_id, None)
                self.forget_via(a.node_id)
                self._members_changed()
            for url in a.connectors:  # a bridge that never reached the announced node
                x = self.bridges.get(url)
                if x is not None and x.node_id is None:
                    self._retire(x)

    def _pick_connector(self, connectors) -> str:
        """The announced connector of our own connector's scheme (amqps for a TLS cluster)."""
        scheme = self.connector.split("://", 1)[0]
        return next((c for c in connectors if c.startswith(scheme + "://")), connectors[0])

    def connect(self, url: str) -> Bridge | None:
        """Start a bridge to ``url`` unless one exists (or it is this node)."""
        if url in self.bridges or any(same_endpoint(url, s) for s in self.self_urls):
            return None
        if self.cfg.secondary and not self.election.is_primary_url(url):
            # a secondary connects to the primaries only (OpenAMQ): another secondary's traffic
            # reaches it through them
            self.counters["secondary_not_dialled"] += 1
            return None
        b = Bridge(self, url)
        self.bridges[url] = b
        try:
            self._to_start.send_nowait(b)
        except (trio.ClosedResourceError, trio.BrokenResourceError):   # stopped: it starts no bridge any more
            pass
        return b

    async def _start_bridges(self, nursery: trio.Nursery) -> None:
        async with self._starts:
            async for b in self._starts:
                nursery.start_soon(b.run)

    def stop(self) -> None:
        self._to_start.close()
        for b in list(self.bridges.values()):
            b.stop()

    def _retire(self, b: Bridge) -> None:
        """Stop a bridge for good and forget its connector (it may be dialled again later)."""
        b.stop()
        if self.bridges.get(b.url) is b:
            del self.bridges[b.url]

    # -- filters ------------------------------------------------------------------------------
    def clustered(self, address: str) -> bool:
        """Is ``address`` clustered (the ``address`` filter; internal addresses never are)?"""
        if address.startswith(INTERNAL_PREFIX):
            return False
        return address_clustered(address, self._include, self._exclude)

    # -- bridges -------------------------------------------------------------------------------
    def bridge_up(self, b: Bridge, node_id: str | None) -> None:
        if not node_id:
            log.warning("cluster peer did not say its node id; closing", extra={"fields": {"connector": b.url}})
            if b.peer.engine is not None:
                b.peer.engine.close_with("amqp:precondition-failed", "cluster peer must send its node-id")
            return
        other = self.by_node.get(node_id)
        if other is not None and other is not b:
            # the same node reached through another connector (it restarted on a new port, or
            # two URLs name it): keep the newest, retire the other
            self._retire(other)
        b.node_id = node_id
        self.by_node[node_id] = b
        b.attach_sf(self._sf_queue(node_id))
        self.core.cluster.set_connected(node_id, True)
        self._refresh_via(node_id)
        self._changed.set()
        self._members_changed()
        if self.election is not None:
            self.election.changed()

    def bridge_down(self, b: Bridge) -> None:
        if b.node_id is None:
            return
        self.core.cluster.set_connected(b.node_id, False)
        self._refresh_via(b.node_id)
        self._members_changed()
        if self.election is not None:
            self.election.forget(b.node_id, silently=b.lost_silently)   # what it said held on that connection only

    def bridge_gave_up(self, b: Bridge) -> None:
        if b.node_id is not None and self.by_node.get(b.node_id) is b:
            self.forget_via(b.node_id)
            self.member_backups.pop(b.node_id, None)   # no news of them any more
        self._members_changed()

    def _members_changed(self) -> None:
        for cb in list(self.membership_listeners):
            cb()

    def root_changed(self, old: str | None, new: str | None) -> None:
        """The root as this node knows it changed (``broker.cluster.root``): routes through the
        root are chosen again, and the shared queues follow it."""
        self._members_changed()
        if self.cfg.max_hops > 1:
            for via in list(self.learned):
                self._refresh_via(via)
        if self.shared is not None:
            self.shared.root_changed(old, new)

    @property
    def root(self) -> str | None:
        """The cluster's root as this node knows it (None: no root, or no election)."""
        return self.election.root if self.election is not None else None

    def live_members(self) -> list[tuple[str, str, str]]:
        """``(node id, connector, management URL)`` of every other member whose bridge is
        connected and whose hello named its connector, by node id (Artemis's cluster topology
        as a ``<cluster-connection>`` pool sees it: nodeUP / nodeDown)."""
        out = []
        for node_id in sorted(self.members):
            b = self.by_node.get(node_id)
            m = self.members[node_id]
            if node_id != self.node.node_id and b is not None and b.connected and m.connector:
                out.append((node_id, m.connector, m.management_url))
        return out

    def own_backups(self) -> tuple[tuple[str, str, bool], ...]:
        """This node's HA backups as ``(connector, management URL, in sync)``: a replication
        backup connected to it (in sync once it holds the initial copy), or the shared-store backup
        waiting on its data directory (``broker.ha.shared_store``; in sync: it reads the same files).
        Told to the other members (the ``backups`` notification) and announced by broadcast groups."""
        return tuple(self.node.backups())

    def backups_changed(self) -> None:
        """This node's backups may have changed (a replication backup connected, got in sync or
        was lost; a shared-store backup appeared or went): tell the others when they did."""
        now = self.own_backups()
        if now != self._told_backups:
            self._told_backups = now
            self._broadcast(BackupsNote(self.node.node_id, now))
            self._members_changed()

    def _sf_queue(self, node_id: str):
        q = self._sf.get(node_id)
        if q is not None and not q.deleted:
            return q
        name = f"{SF_PREFIX}{self.cfg.name}.{node_id}"
        q = self.core.queues.get(name)
        if q is None:
            self.core.declare_address(name, [ANYCAST])
            q = self.core.queues[name]
        q.max_delivery_count = 0  # a bridge that reconnects is not a failed delivery
        self._sf[node_id] = q
        return q

    # -- what we tell others -----------------------------------------------------------------
    def _local_note(self, q) -> BindingNote:
        filters = tuple(s.filter_text for s in q.subs if s.filter_text)
        return BindingNote(self.node.node_id, q.name, q.address, q.routing_type, q.filter_text, len(q.subs),
                           filters, 0)

    def hello(self) -> Hello:
        members = tuple((m.node_id, m.connector, m.management_url) for m in self.members.values())
        return Hello(self.node.node_id, self.cfg.name, self.connector, self.management_url, self.started_ms, members,
                     self.node.cfg.ha.scale_down_group_name)

    def snapshot(self) -> list:
        notes: list = [self.hello(), Reset()]
        if self.election is not None:
            notes.append(self.election.note())
        backups = self.own_backups()
        if backups:
            notes.append(BackupsNote(self.node.node_id, backups))
        notes.extend(self.state)
        for q in list(self.core.queues.values()):
            if self.clustered(q.address) and not q.name.startswith(INTERNAL_PREFIX):
                notes.append(self._local_note(q))
        if self.cfg.max_hops > 1:
            for b in self.core.cluster:
                notes.append(BindingNote(b.node_id, b.queue, b.address, b.routing_type, b.filter_text, b.consumers,
                                         b.consumer_filters, b.distance))
        return notes

    def _broadcast(self, note) -> None:
        if not self.subscribers:
            return
        data = encode_note(note)
        for s in list(self.subscribers):
            s.push(data)

    def _consumers_changed(self, ev) -> None:
        q = self.core.queues.get(ev.queue)
        if q is not None and self.clustered(q.address):
            self._broadcast(self._local_note(q))

    def _queue_changed(self, q, created: bool) -> None:
        if not self.clustered(q.address) or q.name.startswith(INTERNAL_PREFIX):
            return
        if created:
            self._broadcast(self._local_note(q))
        else:
            self._broadcast(Unbinding(self.node.node_id, q.name))

    # -- what others tell us -----------------------------------------------------------------
    def apply_note(self, b: Bridge, note) -> None:
        via = b.node_id
        if via is None:
            raise ProtocolError("amqp:precondition-failed", "notification before the peer's node id")
        if isinstance(note, Hello):
            if note.node_id != via:
                raise ProtocolError("amqp:invalid-field", f"hello from {note.node_id!r} on the link of {via!r}")
            self.groups[via] = note.group
            self.member_backups.pop(via, None)   # a backups notification follows if it has any
            m = self.members.get(via)
            if m is None or m.connector != note.connector:
                self.members[via] = _Member(via, note.connector, note.management_url, note.started_ms)
            else:
                m.management_url = note.management_url
            self._members_changed()
            if not self.cfg.allow_direct_connections_only:
                for node_id, connector, _mgmt in note.members:
                    if node_id != self.node.node_id and node_id not in self.by_node and connector:
                        self.connect(connector)
            return
        if isinstance(note, Reset):
            self.forget_via(via)
            return
        if isinstance(note, ElectionNote):
            if note.node_id != via:
                raise ProtocolError("amqp:invalid-field", f"election part of {note.node_id!r} on the link of {via!r}")
            if self.election is not None:   # a node without primaries takes no part
                self.election.heard_note(via, note)
            return
        if isinstance(note, BackupsNote):
            if note.node_id != via:
                raise ProtocolError("amqp:invalid-field", f"backups of {note.node_id!r} on the link of {via!r}")
            if note.backups:
                self.member_backups[via] = note.backups
            else:
                self.member_backups.pop(via, None)
            self._members_changed()
            return
        if isinstance(note, BindingNote):
            if note.distance == 0 and note.node_id != via:
                raise ProtocolError("amqp:invalid-field",
                                    f"binding of node {note.node_id!r} at distance 0 on the link of {via!r}")
            if note.node_id == self.node.node_id or not self.clustered(note.address):
                return
            if note.node_id == via and note.distance != 0:
                return
            rb = RemoteBinding(note.node_id, note.queue, note.address, note.routing_type, note.consumers,
                               note.filter_text, note.consumer_filters, note.distance + 1,
                               via if note.node_id != via else None, b.connected)
            self.learned.setdefault(via, {})[(note.node_id, note.queue)] = rb
            self._settle((note.node_id, note.queue))
            return
        if isinstance(note, AddressNote):
            self._state_note(note)
            return
        if isinstance(note, Unbinding):
            table = self.learned.get(via)
            if table is not None and table.pop((note.node_id, note.queue), None) is not None:
                self._settle((note.node_id, note.queue))

    # -- the replicated cluster state (broker.cluster.state) ----------------------------------
    def _state_note(self, note: AddressNote) -> None:
        if note.name.startswith(INTERNAL_PREFIX):
            raise ProtocolError("amqp:invalid-field", f"address {note.name!r} is internal")
        changed = self.state.offer(note)
        if changed is None:
            if self.state.refused and self.node.log_once("state-cap", time.monotonic()):
                log.warning("cluster state is at its cap (max-state-bytes); declarations beyond it are ignored",
                            extra={"fields": {"bytes": self.state.bytes, "cap": self.state.max_bytes,
                                              "refused": self.state.refused}})
            return
        self._apply_state(changed)
        self._broadcast(changed)

    def _apply_state(self, e: AddressNote) -> None:
        core = self.core
        if self.shared is not None:
            self.shared.set_shared(e.name, e.shared and not e.deleted)
        addr = core.addresses.get(e.name)
        if e.deleted:
            if addr is None:
                return
            if any(q.subs for q in addr.queues.values()):
                self.counters["state_delete_deferred"] += 1
                log.warning("cluster state deletes an address that has consumers here; it stays",
                            extra={"fields": {"address": e.name, "origin": e.origin}})
                return
            core.delete_address(e.name)
            self.counters["state_applied"] += 1
            return
        core.declare_address(e.name, e.routing_types)
        if e.filter_text and ANYCAST in e.routing_types:
            q = core.queues.get(e.name)
            if q is not None and q.filter_text != e.filter_text and core.compile_filter is not None:
                core.set_queue_filter(e.name, core.compile_filter(e.filter_text), e.filter_text)
        self.counters["state_applied"] += 1

    def declare(self, name: str, routing_types, filter_text: str | None, *, deleted: bool = False,
                shared: bool = False) -> bool:
        """An address declared (or deleted) through the management API: into the state, to every
        node. False when it would take the state past its cap (nothing changes)."""
        note = self.state.declaration(AddressNote(name, tuple(sorted(routing_types)), filter_text,
                                                  int(time.time() * 1000), self.node.node_id, deleted, shared))
        if not deleted and not self.state.would_fit(note):
            self.state.refused += 1
            return False
        changed = self.state.offer(note)
        if changed is not None:
            if self.shared is not None:
                self.shared.set_shared(changed.name, changed.shared and not changed.deleted)
            self._broadcast(changed)
        return True

    def forget_via(self, via: str) -> None:
        table = self.learned.pop(via, None)
        for key in list(table or ()):
            self._settle(key)

    def _refresh_via(self, via: str) -> None:
        """The bridge to ``via`` went up or down: the entries learned through it follow."""
        for key in list(self.learned.get(via, ())):
            self._settle(key)

    def _settle(self, key: tuple[str, str]) -> None:
        """Put the best-known binding for (node, queue) in the core (the smallest distance; among
        equals, the one learned through the cluster's root: OpenAMQ routes a secondary's messages
        to another secondary through the root)."""
        best = None
        root = self.root
        for via, table in self.learned.items():
            rb = table.get(key)
            if rb is not None and (best is None or rb.distance < best.distance
                                   or (rb.distance == best.distance and root is not None and via == root
                                       and best.next_hop != root)):
                best = rb
        cluster = self.core.cluster
        old = cluster.get(*key)
        if best is None:
            if old is not None:
                cluster.remove(*key)
                self.core.rotation.forget((old.address, old.queue))
                if self.cfg.max_hops > 1:
                    self._broadcast(Unbinding(*key))
            self._changed.set()
            return
        bridge = self.by_node.get(best.next_hop)
        best = replace(best, connected=bool(bridge is not None and bridge.connected))
        if old == best:
            return
        if old is not None and old.address != best.address:
            cluster.remove(*key)
        if not cluster.put(best) and old is not None:
            cluster.remove(*key)
        if self.cfg.max_hops > 1:
            self._broadcast(BindingNote(best.node_id, best.queue, best.address, best.routing_type, best.filter_text,
                                        best.consumers, best.consumer_filters, best.distance))
        self._changed.set()

    # -- forwarding out ------------------------------------------------------------------------
    def _dup_id(self) -> bytes:
        return self._epoch + struct.pack(">Q", next(self._seq))

    def _on_forward(self, fwd, msg: Message) -> bool:
        """``Broker.on_forward``: one copy for neighbour ``fwd.via`` into its store-and-forward
        queue (``msg`` is the core's fresh copy for this forward: it becomes the queue's entry)."""
        body = msg.body
        env = Forwarded(self._dup_id(), self.node.node_id, msg.address, fwd.targets, 0, msg.durable, msg.priority,
                        msg.expires, body)
        msg.body = encode_forward(env)
        msg.origin = ("forward", len(body))
        msg.priority = DEFAULT_PRIORITY  # one FIFO per neighbour: order per producer is kept
        msg.expires = 0                  # it expires (if at all) where it is delivered
        return self._sf_queue(fwd.via).enqueue(msg)

    def _enqueue_forward(self, via: str, env: Forwarded) -> bool:
        return self._sf_queue(via).enqueue(Message(self.core.next_mid(), encode_forward(env), env.durable,
                                                   env.address, origin=("forward", len(env.message))))

    def account(self, peer: str | None, msg: Message, sf) -> None:
        """A forwarded message was accepted by ``peer``: count it in the activity log."""
        # origin: (why, bytes of the message inside the envelope); after a restart only the
        # envelope's size is known (a few dozen bytes more)
        why, size = msg.origin if isinstance(msg.origin, tuple) else ("forward", len(msg.body))
        direction = "redistribute" if why in ("redistribute", "scale-down") else "forward"
        acc = self.activity.setdefault(peer or "?", {}).setdefault((msg.address, direction), [0, 0])
        acc[0] += 1
        acc[1] += size

    # -- forwarded messages in -------------------------------------------------------------------
    @property
    def caches(self) -> dict[str, DuplicateCache]:
        """The duplicate caches of forwards, per origin node (kept by the core)."""
        return self.core.duplicates.origins

    def duplicates_from(self, node_id: str | None) -> int:
        return self.core.duplicates.dropped_from(node_id)

    def _duplicate_key(self, f: Forwarded) -> bytes | None:
        """The cache key of a forwarded message's ``_AMQ_DUPL_ID`` when this node stores it (a
        target here), else None. One the node it entered accepted is not refused here."""
        me = self.node.node_id
        if not any(node_id == me for node_id, _q in f.targets):
            return None  # only passing through (max-hops): the node that stores it checks
        return body_duplicate_key(f.message)

    def receive_forward(self, fin: _ForwardIn, d: Incoming, data: bytes) -> None:
        """One transfer of a neighbour's forward link: its forwarded messages are stored (or sent
        on) in one journal group with their duplicate ids, and the transfer is accepted once that
        group is durable."""
        engine = fin.engine
        if engine.error is not None:
            return  # we cut this peer off: what it sent after that is not taken (it resends elsewhere/later)
        try:
            fs = decode_forwards(data)
        except ProtocolError as exc:
            self.counters["bad_forwards"] += 1
            log.warning("cluster peer sent a malformed forwarded message; cutting the connection off",
                        extra={"fields": {"peer": fin.peer_node, "source": engine.source, "condition": exc.condition,
                                          "description": exc.description}})
            d.reject(exc.condition, exc.description)
            engine.close_with(exc.condition, exc.description)
            return
        dedup = self.cfg.duplicate_detection
        journal = self.node.journal is not None
        dups = self.core.duplicates
        store = self.core.store
        grouped = journal and any(f.durable for f in fs)
        peer = fin.peer_node
        sync = False
        if grouped:
            store.begin_group()
        try:
            for f in fs:
                if dedup and dups.seen_from(f.origin, f.dup_id):
                    self.counters["duplicates_dropped"] += 1
                    sync = sync or (f.durable and journal)  # the first copy may still wait for its fsync
                    continue
                key = self._duplicate_key(f)
                skip: bool | set[str] = False
                if key is not None:
                    token = dups.lookup(f.address, key)
                    if token is MISSING:
                        pass
                    elif not f.moved:  # the producer's resend, through another node
                        dups.duplicate(f.address)
                        skip = True
                        sync = sync or token is not None
                    else:  # moved here: a queue that holds a copy of this message already skips it
                        me = self.node.node_id
                        skip = {q for n, q in f.targets if n == me and dups.holds(f.address, key, q)}
                        if skip:
                            dups.duplicate(f.address)
                            self.counters["moved_duplicates_dropped"] += 1
                            sync = sync or token is not None
                stored, local, local_stored = self._deliver(f, peer or f.origin, skip_local=skip)
                if stored:
                    sync = True
                if key is not None and local:
                    dups.remember(f.address, key, persist=local_stored, held=local)
                if dedup:
                    dups.remember_from(f.origin, f.dup_id, persist=f.durable and journal)
        finally:
            if grouped and store.end_group():
                sync = True
        if sync:
            d.accept_when_synced()
        else:
            d.accept()

    def _deliver(self, f: Forwarded, peer: str, *, skip_local: bool | set[str] = False) -> tuple[bool, list[str], bool]:
        """Enqueue a forwarded message in its target queues here, or send it on (max-hops):
        ``(store written, the queues here it was enqueued in, a copy here written)``.
        ``skip_local``: the targets here (True) or those named are dropped (a duplicate
        ``_AMQ_DUPL_ID``), the others still go on."""
        core = self.core
        me = self.node.node_id
        stored = local_stored = False
        onward: dict[str, list[tuple[str, str]]] = {}
        local: list[str] = []
        for node_id, qname in f.targets:
            if node_id == me:
                if skip_local is True or (skip_local and qname in skip_local):
                    continue
                q = core.queues.get(qname)
                if q is None and f.create is not None and not qname.startswith(INTERNAL_PREFIX):
                    q = self._create_for_scale_down(f, qname)
                if q is None or q.deleted or qname.startswith(INTERNAL_PREFIX):
                    self.counters["forward_unroutable"] += 1
                    continue
                origin = None
                if f.moved and self.shared is not None and self.shared.is_root and f.address in self.shared.addresses:
                    # a shared message moved to the root keeps its relay id (broker.cluster.shared)
                    origin = Relayed(f.origin, f.dup_id)
                msg = Message(core.next_mid(), f.message, f.durable, f.address, 0, f.priority, f.expires, origin)
                if q.enqueue(msg):
                    stored = local_stored = True
                local.append(q.name)
                continue
            b = core.cluster.get(node_id, qname)
            if b is None or f.hops + 1 >= max(self.cfg.max_hops, 1):
                self.counters["forward_unroutable"] += 1
                continue
            onward.setdefault(b.next_hop, []).append((node_id, qname))
        for via, targets in onward.items():
            if self._enqueue_forward(via, replace(f, targets=tuple(targets), hops=f.hops + 1)):
                stored = True
        if local:
            acc = self.activity.setdefault(peer, {}).setdefault((f.address, "forward-in"), [0, 0])
            acc[0] += len(local)
            acc[1] += len(f.message) * len(local)
        return stored, local, local_stored

    def _create_for_scale_down(self, f: Forwarded, qname: str):
        """A node scaling down moves a queue this node lacks: create it as it was there."""
        rtype, ftext = f.create
        try:
            q = self.core.create_queue_as(qname, f.address, rtype, ftext)
        except (ValueError, KeyError) as exc:
            log.warning("scale-down: cannot create queue %r: %s", qname, exc)
            return None
        if q is not None:
            self.counters["scale_down_queues_created"] += 1
        return q

    # -- the cluster user ---------------------------------------------------------------------
    def check_login(self, user: str, password: str, source_ip: str | None = None) -> bool | None:
        """None: not the cluster user; else whether the password is the cluster password (a
        default or sample password only from a loopback address, as the sample users)."""
        if user != self.cfg.user:
            return None
        if self.cfg.weak_password and not _loopback(source_ip):
            return False
        return hmac.compare_digest(password.encode(), self.cfg.password.encode())

    def _check_identity(self, engine, peer_node, peer_connector, started) -> tuple[str, str] | None:
        """Two active nodes with one node id (a data dir copied): the one that started later is
        refused by everyone, and both are named in the logs. Returns a refusal, or None."""
        if not isinstance(peer_node, str) or not peer_node:
            return ("amqp:precondition-failed", "a cluster connection must send its node-id")
        started = started if isinstance(started, int) else 0
        connector = peer_connector if isinstance(peer_connector, str) else engine.source
        me = self.node.node_id
        if peer_node == me:
            if started == self.started_ms and connector == self.connector:
                return ("amqp:precondition-failed", "a connection to this node itself")
            return ("amqp:precondition-failed", self._duplicate_of_us(peer_node, connector, started))
        known = self.identities.get(peer_node)
        if known is None or known[0] == connector:
            self.identities[peer_node] = (connector, started)
            return None
        if started > known[1]:
            b = self.by_node.get(peer_node)
            if b is None or not b.connected:
                # the node that had this id is gone from here: a backup that took over its id
                # (HA failover, docs/ha.md) — the same member at a new address, not a newcomer
                self.identities[peer_node] = (connector, started)
                self.counters["node_id_moved"] += 1
                log.warning("cluster member %s is now served at %s (was %s): a failover", peer_node, connector,
                            known[0])
                return None
            self._duplicate(peer_node, connector, known[0])
            return ("amqp:precondition-failed", f"duplicate node id {peer_node}: {connector} started after "
                                                f"{known[0]}; the newcomer is refused")
        if started == known[1]:  # the same node, reached at another address (it restarted on a new port)
            self.identities[peer_node] = (connector, started)
            return None
        self._duplicate(peer_node, known[0], connector)  # the older one showed up second
        self.identities[peer_node] = (connector, started)
        return None

    def _duplicate_of_us(self, node_id: str, other: str, other_started: int) -> str:
        """Another active node (at ``other``) has our node id: the one that started later — on a
        tie, the greater connector — is the newcomer. Logs both, remembers when the newcomer is
        us, and returns the refusal's description. Both sides of a connection decide alike."""
        we_are_newer = (self.started_ms, self.connector) > (other_started, other)
        newcomer, keeper = (self.connector, other) if we_are_newer else (other, self.connector)
        self._duplicate(node_id, newcomer, keeper)
        if we_are_newer:
            self.duplicate_of = other
        return f"duplicate node id {node_id}: {newcomer} started after {keeper}; the newcomer is refused"

    def _duplicate(self, node_id: str, newcomer: str, keeper: str) -> None:
        self.counters["duplicate_node_id"] += 1
        if self.node.log_once(f"dup-node {node_id} {newcomer}", time.monotonic()):
            log.error("two active nodes have one node id (a copied data directory?): the newcomer is refused",
                      extra={"fields": {"node_id": node_id, "newcomer": newcomer, "keeps": keeper}})

    def attach(self, engine: "AmqpEngine", link: OwnedLink):
        """The node's internal service for ``$lodestone.`` addresses but replication's (a
        ``broker.amqp.links.LinkService``; see the module doc): the cluster's links."""
        address = link.address
        principal = engine.principal
        if self.scaling_down:
            return ("amqp:resource-limit-exceeded", "this node is scaling down")
        if principal is None or CLUSTER_ROLE not in getattr(principal, "roles", ()):
            return ("amqp:unauthorized-access", f"address {address!r} is for the cluster's own connections")
        if self.cfg.key is not None:
            props = engine.connection.remote_properties or {}
            key = props.get("cluster-key") if isinstance(props, dict) else None
            if not isinstance(key, str) or not hmac.compare_digest(key.encode(), self.cfg.key.encode()):
                self.counters["cluster_key_refused"] += 1
                peer = props.get("node-id") if isinstance(props, dict) else None
                if self.node.log_once(f"cluster-key {peer or engine.container_id}", time.monotonic()):
                    log.warning("cluster peer refused: wrong or missing cluster key (logged once per peer)",
                                extra={"fields": {"peer": peer, "source": engine.source,
                                                  "container_id": engine.container_id}})
                return ("amqp:unauthorized-access", "wrong or missing cluster key")
        props = engine.connection.remote_properties or {}
        if not isinstance(props, dict):
            props = {}
        peer_node = props.get("node-id")
        peer_connector = props.get("cluster-connector")
        refused = self._check_identity(engine, peer_node, peer_connector, props.get("started-ms"))
        if refused is not None:
            return refused
        have = self.by_node.get(peer_node)
        if isinstance(peer_connector, str) and not self.cfg.allow_direct_connections_only \
                and peer_node != self.node.node_id and (have is None or (not have.connected
                                                                         and have.url != peer_connector)):
            try:
                self.connect(parse_connector(peer_connector).__str__())  # a node that dialled us joins
            except ValueError:
                pass
        if address == FORWARD_ADDRESS and link.is_receiver:
            return _ForwardIn(self, engine, peer_node if isinstance(peer_node, str) else None)
        if address == NOTIFY_ADDRESS and link.is_sender:
            return _NotifyOut(self, engine)
        if address == SHARED_ADDRESS and link.is_receiver:
            # accepted even without shared queues here (no primaries): a node that has them opens
            # it on every bridge, and a refused link would cut the whole connection off
            return _SharedIn(self.shared, engine)
        return ("amqp:not-found", f"no cluster link {address!r} in that direction")

    # -- redistribution ------------------------------------------------------------------------
    async def redistributor(self) -> None:
        core = self.core
        while True:
            now = time.time() * 1000.0
            moved = self.redistribute_due(now)
            if moved:
                await trio.sleep(0)
                continue
            nxt = core.next_redistribution_ms(time.time() * 1000.0)
            wait = 1.0 if nxt is None else max(0.0, min(1.0, (nxt - time.time() * 1000.0) / 1000.0))
            with trio.move_on_after(wait):
                await self._changed.wait()

    def redistribute_due(self, now_ms: float) -> int:
        core = self.core
        moved = 0
        for name in core.redistribution.due(now_ms):
            q = core.queues.get(name)
            if q is None:
                core.redistribution.cancel(name)
                continue
            if not q.messages or q.subs:
                continue
            moved += self._move(q, now_ms)
        return moved

    def _move(self, q, now_ms: float) -> int:
        store = self.core.store
        grouped = self.node.journal is not None
        if grouped:
            store.begin_group()
        try:
            picked = self.core.take_for_redistribution(q, now_ms, REDISTRIBUTE_BATCH)
            dups = self.core.duplicates
            for msg, b in picked:
                key = body_duplicate_key(msg.body)
                if key is not None:
                    dups.release(msg.address, key, q.name)  # this copy may come back here

                env = Forwarded(self._dup_id(), self.node.node_id, msg.address, ((b.node_id, b.queue),), 0,
                                msg.durable, msg.priority, msg.expires, msg.body, moved=True)
                sf = self._sf_queue(b.next_hop)
                sf.enqueue(Message(self.core.next_mid(), encode_forward(env), msg.durable, msg.address,
                                   origin=("redistribute", len(msg.body))))
        finally:
            if grouped:
                store.end_group()
        if picked:
            self.redistributed += len(picked)
            log.info("redistributed messages", extra={"fields": {"queue": q.name, "messages": len(picked)}})
        return len(picked)

    # -- scale-down ----------------------------------------------------------------------------
    def scale_down_target(self) -> Bridge | None:
        """The connected node to move everything to: the first of ``scale-down-connectors`` that
        is connected, else any connected member (in the order they joined), among those in this
        node's ``scale-down-group-name`` when one is set."""
        ha = self.node.cfg.ha
        group = ha.scale_down_group_name
        candidates: list[Bridge] = []
        if ha.scale_down_connectors:
            for url in ha.scale_down_connectors:
                b = self.bridges.get(url) or next((x for x in self.bridges.values() if same_endpoint(x.url, url)), None)
                if b is not None:
                    candidates.append(b)
        else:
            candidates = list(self.by_node.values())
        for b in candidates:
            if not b.connected or b.stopped or b.node_id is None:
                continue
            if group is not None and self.groups.get(b.node_id) != group:
                continue
            return b
        return None

    async def scale_down(self, timeout_s: float = 60.0) -> dict:
        """Move every message of every queue (durable or not) to one other node, then wait until
        it has accepted them all (Artemis ``ScaleDownHandler``); see docs/cluster.md."""
        self.scaling_down = True
        ha = self.node.cfg.ha
        for url in ha.scale_down_connectors:
            self.connect(url)
        target = None
        with trio.move_on_after(timeout_s):
            while target is None:
                target = self.scale_down_target()
                if target is None:
                    await trio.sleep(0.05)
        if target is None:
            log.error("scale-down: no node to scale down to; messages stay in this node's journal",
                      extra={"fields": {"connectors": list(ha.scale_down_connectors),
                                        "group": ha.scale_down_group_name}})
            return {"target": None, "messages": 0}
        core = self.core
        moved = 0
        queues = 0
        store = core.store
        for q in list(core.queues.values()):
            if q.name.startswith(INTERNAL_PREFIX) or q.deleted:
                continue
            if q.messages:
                queues += 1
            while q.messages:
                batch = list(itertools.islice(q.messages, REDISTRIBUTE_BATCH))
                grouped = self.node.journal is not None
                if grouped:
                    store.begin_group()
                try:
                    for msg in batch:
                        q.take(msg)
                        env = Forwarded(self._dup_id(), self.node.node_id, msg.address, ((target.node_id, q.name),), 0,
                                        msg.durable, msg.priority, msg.expires, msg.body,
                                        (q.routing_type, q.filter_text), moved=True)
                        self._sf_queue(target.node_id).enqueue(
                            Message(core.next_mid(), encode_forward(env), msg.durable, msg.address,
                                    origin=("scale-down", len(msg.body))))
                finally:
                    if grouped:
                        store.end_group()
                moved += len(batch)
                await trio.sleep(0)
        log.info("scale-down: moving messages", extra={"fields": {"target": target.node_id, "messages": moved,
                                                                   "queues": queues}})
        with trio.move_on_after(timeout_s):
            while any(b.pending for b in self.bridges.values() if b.node_id is not None and not b.stopped):
                await trio.sleep(0.05)
        left = sum(b.pending for b in self.bridges.values() if b.node_id is not None and not b.stopped)
        if left:
            log.error("scale-down: timed out; messages not yet accepted stay in this node's journal",
                      extra={"fields": {"target": target.node_id, "pending": left}})
        else:
            log.info("scale-down: done", extra={"fields": {"target": target.node_id, "messages": moved}})
        self.scaled_down = moved
        return {"target": target.node_id, "messages": moved, "pending": left}

    # -- views ---------------------------------------------------------------------------------
    def open_properties(self) -> dict:
        """What this node adds to the Open of every connection it accepts."""
        return {"started-ms": self.started_ms, CLUSTER_MEMBERS: self.client_topology()}

    def client_topology(self) -> list[dict]:
        """The live members for clients (the Open property ``lodestone:cluster-members``, see
        docs/cluster.md "Topology to clients"): this node first, then every member whose bridge
        is connected, by node id; each ``{"node-id", "connector"}``; at most
        :data:`MAX_CLUSTER_MEMBERS` entries."""
        out = [{"node-id": self.node.node_id, "connector": self.connector}]
        for node_id, connector, _mgmt in self.live_members()[:MAX_CLUSTER_MEMBERS - 1]:
            out.append({"node-id": node_id, "connector": connector})
        return out

    def backup_members(self) -> list[dict]:
        """The HA backups of this node and of the members (what they told us), as members of the
        view with ``"role": "backup"`` and the node id they back up (a router's cluster pool pairs
        them, docs/router.md "HA pairs"). ``connected``: in sync (a replication backup holding the
        initial copy, a shared-store backup waiting on the files) and, for a member's backup, the
        bridge to that member up — what we know of it is what the member told us."""
        out = []
        repl = self.node.replication
        for connector, mgmt, in_sync in self.own_backups():
            out.append({"node_id": self.node.node_id, "role": "backup", "connector": connector,
                        "management_url": mgmt or None, "connected": in_sync,
                        "since": repl.synced_at if repl is not None and in_sync else None})
        for node_id in sorted(self.member_backups):
            m = self.members.get(node_id)
            b = self.by_node.get(node_id)
            up = b is not None and b.connected
            for connector, mgmt, in_sync in self.member_backups[node_id]:
                if m is not None and same_endpoint(connector, m.connector):
                    continue   # the backup has taken the node id over: it is the member now
                out.append({"node_id": node_id, "role": "backup", "connector": connector,
                            "management_url": mgmt or None, "connected": bool(in_sync and up), "since": None})
        return out

    def take_activity(self) -> dict:
        out, self.activity = self.activity, {}
        return out

    def describe(self) -> dict:
        members = []
        for node_id, m in self.members.items():
            b = self.by_node.get(node_id)
            members.append({"node_id": node_id, "connector": m.connector, "management_url": m.management_url,
                            "connected": bool(b is not None and b.connected),
                            "since": b.since if b is not None and b.connected else None})
        members += self.backup_members()
        el = self.election.describe() if self.election is not None else None
        return {"name": self.cfg.name, "node_id": self.node.node_id, "connector": self.connector,
                "duplicate_of": self.duplicate_of,
                "partition": el["partition"] if el else None, "root": el["root"] if el else None,
                "is_root": el["is_root"] if el else False,
                "electorate": el["electorate"] if el else None, "votes": el["votes"] if el else {},
                "election": el,
                "message_load_balancing": self.mode.value, "max_hops": self.cfg.max_hops,
                "members": members, "bridges": [b.describe() for b in self.bridges.values() if not b.stopped],
                "remote_bindings": [{"node_id": b.node_id, "queue": b.queue, "address": b.address,
                                     "routing_type": b.routing_type, "consumers": b.consumers,
                                     "distance": b.distance, "connected": b.connected}
                                    for b in self.core.cluster],
                "discovery": None if self.discovery_cfg is None else {
                    "group": self.discovery_cfg.name, "counters": dict(self.discovery.counters),
                    "entries": [{"node_id": e.node_id, "connectors": list(e.announcement.connectors),
                                 "management_url": e.announcement.management_url,
                                 "backups": [{"connector": c, "management_url": m or None, "in_sync": ok}
                                             for c, m, ok in e.announcement.backups],
                                 "age_s": round(time.monotonic() - e.last_seen, 3)}
                                for e in self.discovery.entries.values()]},
                "broadcast_groups": {name: dict(c) for name, c in self.node.broadcast_counters.items()},
                "state": {"addresses": len(self.state), "bytes": self.state.bytes, "cap_bytes": self.state.max_bytes,
                          "refused": self.state.refused},
                "shared": self.shared.describe() if self.shared is not None else None,
                "redistributed": self.redistributed, "counters": dict(self.counters)}
