"""Broker connections at run time: dial another AMQP 1.0 endpoint and move messages over it
(``[broker-connections.<name>]``; docs/broker-connections.md).

Theory of operation
-------------------
:class:`BrokerConnections` is a component of the node process (``broker.role.Component``): at
each activation it runs every connection that is started — by ``auto-start``, or by ``POST
/api/v1/broker-connections/<name>/start`` — until the activation ends or the connection is
stopped (``…/stop``). A standby node (a passive HA member) runs none: they run wherever the node
id is served.

One :class:`Connection` keeps a ``broker.amqp.peer.PeerConnection`` to the endpoint: the primary
URI, then the alternates in turn while attempts fail, the primary again after a connection that
opened (Artemis's order), ``retry-interval-ms`` between attempts, ``reconnect-attempts`` retries
(-1: forever). It logs each change of state once.

**Senders** (``[[senders]]``): every local queue matched — by ``queue-name``, or by its address
matching ``address-match`` (queues created later too) — gets a consumer (a core
``Subscription`` with :data:`SENDER_CREDIT` messages in flight). Each message handed out goes to
the peer on a ``PeerSender`` to the queue's address (or ``remote-address``) and is settled here
when the peer settles it: accepted → acknowledged; rejected → rejected here too (dead-lettered as
the address settings say); released → sent again. Until then the message stays unacknowledged
here: a lost connection sends it again on the next one (at-least-once; the peer may see a
message twice after a reconnect), a stopped connection or node puts it back on its queue.

**Receivers** (``[[receivers]]``): a ``PeerReceiver`` pulls from the peer's address (the local
destination's name, or ``remote-address``) into the local queue named by ``queue-name`` (it must
exist: receivers create nothing), or into each local address matched by ``address-match``,
routed as a local producer's send. The peer's message is accepted once it is stored (after the
journal's fsync for a durable one), so a crash loses nothing the peer let go of.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import trio

from broker.amqp.message import message_meta
from broker.amqp.peer import (PeerConnected, PeerConnectFailed, PeerConnection, PeerDisconnected, PeerLoginRefused,
                              PeerSender, RetrySettings)
from broker.connections.feed import QueueFeed
from broker.connections.mirror import MirrorSender, MirrorSource
from broker.connections.settings import BrokerConnectionConfig, LinkElement
from broker.core.deliveries import Message
from broker.role import Component
from broker.wire.io.trioutil import Wakeup
from broker.wire.wildcards import wildcard_match

if TYPE_CHECKING:  # pragma: no cover
    from broker.node import Node

log = logging.getLogger("lodestone.broker.connections")

__all__ = ["BrokerConnections", "Connection", "SENDER_CREDIT", "RECEIVER_CREDIT"]

#: passwords that ship in samples (etc/users.toml's admin and app, RabbitMQ's guest): warned about
SAMPLE_PASSWORDS = frozenset({"admin", "app", "guest"})
SENDER_CREDIT = 100      # messages a sender's local consumer holds in flight
RECEIVER_CREDIT = 100    # credit a receiver grants the peer


class BrokerConnections(Component):
    """Every ``[broker-connections.<name>]`` of the node (see the module doc)."""

    name = "broker-connections"

    def __init__(self, configs: tuple[BrokerConnectionConfig, ...]) -> None:
        self.connections = {c.name: Connection(c) for c in configs}

    def activated(self, node: "Node", nursery: trio.Nursery) -> None:
        for c in self.connections.values():
            if c.mirror is not None:   # capturing starts with the activation, connected or not
                c.mirror.install(node)
                nursery.start_soon(c.mirror.run)
        for c in self.connections.values():
            nursery.start_soon(c.supervise, node)

    async def deactivating(self, node: "Node", reason: str, close_listeners) -> None:
        for c in self.connections.values():
            if c.mirror is not None:
                c.mirror.uninstall()

    def stop(self) -> None:
        for c in self.connections.values():
            c.cancel()

    # -- management ----------------------------------------------------------------------------
    def describe(self) -> list[dict]:
        return [c.describe() for c in self.connections.values()]

    def start(self, name: str) -> dict:
        """``POST …/<name>/start``: run it now if the node serves, else from its next activation."""
        c = self.connections[name]
        c.start()
        log.info("broker connection %s: start requested", name)
        return c.describe()

    def stop_connection(self, name: str) -> dict:
        """``POST …/<name>/stop``: close it and keep it closed until started again."""
        c = self.connections[name]
        c.stop()
        log.info("broker connection %s: stopped by request", name)
        return c.describe()


class Connection:
    """One broker connection (see the module doc)."""

    def __init__(self, cfg: BrokerConnectionConfig) -> None:
        self.cfg = cfg
        self.wanted = cfg.auto_start
        self.state = "stopped" if not cfg.auto_start else "starting"
        self.peer: PeerConnection | None = None
        self.since: float | None = None
        self.last_error: str | None = None
        self._changed = Wakeup()
        self._scope: trio.CancelScope | None = None
        self._links: _Links | None = None
        self.mirror = MirrorSource(cfg) if cfg.mirror is not None else None

    def start(self) -> None:
        self.wanted = True
        self._changed.set()

    def stop(self) -> None:
        self.wanted = False
        self.cancel()
        self._changed.set()

    def cancel(self) -> None:
        """End the current session (a stop, or the activation ending)."""
        if self._scope is not None:
            self._scope.cancel()

    @property
    def retry(self) -> RetrySettings:
        """Artemis's broker-connection retries: a fixed interval; ``reconnect-attempts`` counts
        the retries after a failed attempt (so N means N + 1 attempts), before and after the
        first connection alike."""
        n = self.cfg.reconnect_attempts
        limit = -1 if n < 0 else n + 1
        return RetrySettings(retry_interval_ms=self.cfg.retry_interval_ms, retry_interval_multiplier=1.0,
                             max_retry_interval_ms=self.cfg.retry_interval_ms, reconnect_attempts=limit,
                             initial_connect_attempts=limit)

    async def supervise(self, node: "Node") -> None:
        """For one activation: a session whenever the connection is started, until the
        activation ends. A session that gave up leaves it stopped until started again."""
        if self.cfg.password in SAMPLE_PASSWORDS:
            log.warning("broker connection %s logs in with a published sample password (%r): set "
                        "[broker-connections.%s] password", self.cfg.name, self.cfg.password, self.cfg.name)
        try:
            while True:
                while not self.wanted:
                    await self._changed.wait()
                if await self._session(node) == "gave-up":
                    self.wanted = False
        finally:
            if self.state != "failed":
                self._set("stopped", "stopped")

    async def _session(self, node: "Node") -> str:
        """Dial and keep the connection (with its senders and receivers) until cancelled
        (``"stopped"``) or until the attempts are spent (``"gave-up"``)."""
        cfg = self.cfg
        with trio.CancelScope() as scope:
            self._scope = scope
            peer = PeerConnection(node, cfg.uris[0], alternates=cfg.uris[1:], credentials=cfg.credentials,
                                  retry=self.retry, ca_file=cfg.ca_file, name=f"broker-connection-{cfg.name}",
                                  on_event=self._on_event)
            # as Artemis's broker connections say who dials (AMQPBrokerConnection)
            peer.open_properties = {"broker-connection-info": {"connectionName": cfg.name, "nodeId": node.node_id}}
            self.peer = peer
            self._links = links = _Links(node, cfg, peer, self.mirror)
            self._set("connecting", f"dialling {cfg.uri}")
            links.start(self.cancel)
            try:
                await peer.run()
            finally:
                links.stop()
                self._scope = None
            self._set("failed", f"gave up after {peer.attempts} attempts ([broker-connections.{cfg.name}] "
                                f"reconnect-attempts = {cfg.reconnect_attempts})", level=logging.ERROR)
            return "gave-up"
        self._set("stopped", "stopped")
        return "stopped"

    def _on_event(self, ev) -> None:
        if isinstance(ev, PeerConnected):
            self.last_error = None
            self._set("connected", f"connected to {self.peer.url}" + (f" (node {ev.node_id})" if ev.node_id else ""))
        elif isinstance(ev, PeerDisconnected):
            why = " ".join(x for x in (ev.condition, ev.description) if x) or "connection lost"
            self.last_error = why
            self._set("connecting", f"disconnected from {self.peer.url}: {why}; reconnecting")
        elif isinstance(ev, PeerLoginRefused):
            self.last_error = f"login refused at {self.peer.url}: {ev.description}"
            self._set("connecting", self.last_error + "; retrying")
        elif isinstance(ev, PeerConnectFailed):
            self.last_error = f"{self.peer.url}: {ev.description}"

    def _set(self, state: str, why: str, *, level: int = logging.WARNING) -> None:
        if state == self.state and state != "connected":
            return     # each change once: a peer that stays down is not logged at every attempt
        self.state = state
        self.since = time.time()
        log.log(level if state != "connected" else logging.INFO, "broker connection %s: %s", self.cfg.name, why,
                extra={"fields": {"connection": self.cfg.name, "state": state}})

    def describe(self) -> dict:
        cfg, peer, links = self.cfg, self.peer, self._links
        return {"name": cfg.name, "uri": cfg.uri, "state": self.state, "started": self.wanted,
                "connected": self.state == "connected",
                "host": peer.url if peer is not None and self.state == "connected" else None,
                "since": self.since, "attempts": peer.attempts if peer is not None else 0,
                "connections": peer.connections if peer is not None else 0, "last_error": self.last_error,
                "senders": links.describe_senders() if links is not None else [],
                "receivers": links.describe_receivers() if links is not None else [],
                "mirror": (self.mirror.describe(links.mirror if links is not None else None)
                           if self.mirror is not None else None)}


class _Links:
    """The senders' local consumers and the receivers of one connection, over its peer."""

    def __init__(self, node: "Node", cfg: BrokerConnectionConfig, peer: PeerConnection,
                 mirror: MirrorSource | None = None) -> None:
        self.node = node
        self.cfg = cfg
        self.peer = peer
        self.mirror_source = mirror
        self.mirror: MirrorSender | None = None
        self.senders: dict[str, _QueueSender] = {}        # local queue name -> its sender
        self.receivers: dict[tuple, _Receiver] = {}       # (element, local name) -> its receiver
        self._peer_senders: dict[str, PeerSender] = {}    # remote address -> the link there
        self._listening = False

    def start(self, restart) -> None:
        """``restart``: end this session (the connection starts a new one)."""
        core = self.node.core
        if self.mirror_source is not None and self.mirror_source.snf is not None:
            self.mirror = MirrorSender(self.mirror_source, self.peer, restart)
        for q in list(core.queues.values()):
            self._queue_created(q)
        for el in self.cfg.receivers:
            if el.queue_name is not None:
                q = core.queues.get(el.queue_name)
                if q is None:
                    log.warning("broker connection %s: receiver queue-name %r: no such local queue (receivers "
                                "create nothing; declare it in [addresses])", self.cfg.name, el.queue_name)
                    continue
                self._receive(el, q.name, q.address)
            else:
                for address in list(core.addresses):
                    if wildcard_match(el.address_match, address):
                        self._receive(el, address, address)
        core.add_queue_listener(self._queue_changed)
        self._listening = True

    def stop(self) -> None:
        if self._listening:
            self._listening = False
            self.node.core.remove_queue_listener(self._queue_changed)
        for s in list(self.senders.values()):
            s.close()
        self.senders.clear()
        if self.mirror is not None:
            self.mirror.close()

    def peer_sender(self, remote: str) -> PeerSender:
        """The link to ``remote`` at the peer, shared by the local queues that send there; its
        tokens are ``(local queue, message id)``."""
        ps = self._peer_senders.get(remote)
        if ps is None:
            ps = self._peer_senders[remote] = self.peer.sender(
                remote, self._outcome, name=f"{self.peer.name}-to-{len(self._peer_senders) + 1}")
        return ps

    def _outcome(self, token, state: str) -> None:
        s = self.senders.get(token[0])
        if s is not None:
            s.outcome(token, state)

    # -- senders -------------------------------------------------------------------------------
    def _queue_changed(self, queue, created: bool) -> None:
        if created:
            self._queue_created(queue)
        else:
            s = self.senders.pop(queue.name, None)
            if s is not None:
                s.close()

    def _queue_created(self, queue) -> None:
        if queue.name in self.senders or queue.temporary or queue.name.startswith("$"):
            return
        for el in self.cfg.senders:
            if el.queue_name == queue.name or (el.address_match is not None
                                                and wildcard_match(el.address_match, queue.address)):
                self.senders[queue.name] = _QueueSender(self, el, queue)
                return

    def _receive(self, el: LinkElement, local: str, address: str) -> None:
        key = (el, local)
        if key not in self.receivers:
            self.receivers[key] = _Receiver(self, el, local, address)

    def describe_senders(self) -> list[dict]:
        return [s.describe() for s in self.senders.values()]

    def describe_receivers(self) -> list[dict]:
        return [r.describe() for r in self.receivers.values()]


class _QueueSender(QueueFeed):
    """One local queue's consumer, sending what it gets to the peer (see the module doc and
    ``broker.connections.feed``)."""

    def __init__(self, links: _Links, el: LinkElement, queue) -> None:
        self.links = links
        self.remote = el.remote_address or queue.address
        super().__init__(queue, links.peer_sender(self.remote), SENDER_CREDIT)

    def token(self, mid: int) -> Any:
        return (self.queue.name, mid)     # the link to the remote address is shared by queues

    def mids(self, token: Any) -> tuple:
        return (token[1],)

    def rejected_by_peer(self, n: int) -> None:
        log.warning("broker connection %s: the peer rejected a message from queue %s",
                    self.links.cfg.name, self.queue.name)

    def describe(self) -> dict:
        return {"queue": self.queue.name, "remote_address": self.remote, "attached": self.sender.attached,
                "sent": self.sent, "acknowledged": self.acknowledged, "rejected": self.rejected,
                "in_flight": len(self.sub.unacked)}


class _Receiver:
    """A link pulling from the peer into a local queue or address (see the module doc)."""

    def __init__(self, links: _Links, el: LinkElement, local: str, address: str) -> None:
        self.links = links
        self.queue_name = el.queue_name
        self.local = local
        self.address = address
        self.remote = el.remote_address or address
        self.received = self.stored = self.refused = 0
        self.receiver = links.peer.receiver(self.remote, self._message, credit=RECEIVER_CREDIT,
                                            name=f"{links.peer.name}-in-{local}")

    def _message(self, body: bytes) -> str:
        self.received += 1
        core = self.links.node.core
        durable, priority, expires = message_meta(body)
        if self.queue_name is not None:
            q = core.queues.get(self.queue_name)
            if q is None or q.deleted:
                self.refused += 1
                return "released"     # the queue went away: the peer keeps the message
            stored = q.enqueue(Message(core.next_mid(), body, durable, q.address, 0, priority, expires))
        else:
            if self.address not in core.addresses:
                self.refused += 1
                return "released"
            stored = core.publish(self.address, body, durable, priority, expires, None)
        self.stored += 1
        self.links.node.count("messages_in")
        return "synced" if stored else "accepted"

    def describe(self) -> dict:
        return {"local": self.local, "remote_address": self.remote, "attached": self.receiver.attached,
                "received": self.received, "stored": self.stored, "released": self.refused}
