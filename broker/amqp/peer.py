"""Connections this broker dials to a peer broker (cluster bridges, later replication/mirroring).

Theory of operation
-------------------
A :class:`PeerConnection` keeps one AMQP connection to ``amqp://host:port`` (``amqps`` with a
CA file) alive for its owner. :meth:`PeerConnection.run` loops: dial (TCP, then TLS), log in with
the sans-IO :class:`broker.wire.sasl.SaslClient` (PLAIN with the cluster credential, or
ANONYMOUS), then run a client-mode :class:`broker.amqp.engine.AmqpEngine` (its host: the node,
or any :class:`broker.amqp.host.EngineHost`) with the same socket pump as accepted connections
(:func:`broker.amqp.pump.pump_engine`: read the socket dry, writer on wake, proton's heartbeats
and idle timeout through ``tick``). Our Open carries our container-id and the Open property
``node-id``.

The owner's links survive reconnects: :meth:`PeerConnection.sender` and
:meth:`PeerConnection.receiver` register a :class:`PeerSender` / :class:`PeerReceiver` that is
attached on every connection. A sender is at-least-once: every message stays *unacknowledged*
until the remote settles it; ``on_outcome(token, state)`` tells the owner when it was accepted
(or rejected/released/modified). When a connection is lost, the unacknowledged messages are sent
again, in order, on the next one (so the remote may see duplicates; duplicate detection comes
with the bridges), and the owner is told through ``on_event(PeerConnected(reconnect=True,
resent=n))``.

Reconnecting follows Artemis's cluster-connection retry settings (:class:`RetrySettings`): the
n-th wait is ``retry-interval × multiplier^(n-1)``, at most ``max-retry-interval``;
``initial-connect-attempts`` bounds the attempts before the first connection ever made,
``reconnect-attempts`` the attempts after one was lost (-1: forever); a connection that opens
resets the count. What happened goes to ``on_event``: :class:`PeerAttemptStarted` (each attempt),
:class:`PeerConnected`,
:class:`PeerLoginRefused` (logged once per peer until a login succeeds again, then retried with
back-off), :class:`PeerDisconnected` (with the AMQP condition: the peer's Close, ours — e.g.
``amqp:connection:framing-error`` for garbage, which proton or the SASL client detects and
answers — or none for a plain socket loss), :class:`PeerConnectFailed`, and :class:`PeerGaveUp`
when the attempts are spent.

Only this module's shell uses the clock and the network; the back-off arithmetic is pure
(:meth:`RetrySettings.delay_s`, :meth:`RetrySettings.may_retry`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit

import trio

from broker.amqp.engine import AmqpEngine
from broker.amqp.links import Incoming, OwnedLink
from broker.amqp.pump import RECV_BYTES, next_sasl_event, pump_engine
from broker.wire.sasl import LoginAccepted, LoginRefused, SaslClient
from broker.wire.errors import RemoteProtocolError
from broker.wire.io.trioutil import Wakeup

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.host import EngineHost

log = logging.getLogger("lodestone.broker.peer")

__all__ = ["RetrySettings", "PeerConnection", "PeerSender", "PeerReceiver", "PeerAttemptStarted", "PeerConnected",
           "PeerDisconnected",
           "PeerLoginRefused", "PeerConnectFailed", "PeerGaveUp", "open_peer_connection"]

_peer_ids = itertools.count(1)


# -- settings (pure) -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RetrySettings:
    """Artemis's cluster-connection retry settings (defaults as Artemis has them)."""

    retry_interval_ms: int = 500
    retry_interval_multiplier: float = 1.0
    max_retry_interval_ms: int = 2000
    reconnect_attempts: int = -1         # after a connection was lost; -1: forever
    initial_connect_attempts: int = -1   # before the first connection; -1: forever

    def __post_init__(self):
        if self.retry_interval_ms < 0 or self.max_retry_interval_ms < 0:
            raise ValueError("retry intervals must be >= 0")
        if self.retry_interval_multiplier < 1.0:
            raise ValueError("retry-interval-multiplier must be >= 1.0")

    def delay_s(self, failures: int) -> float:
        """The wait after the ``failures``-th failed attempt in a row (1-based), in seconds."""
        ms = self.retry_interval_ms * self.retry_interval_multiplier ** max(failures - 1, 0)
        return min(ms, self.max_retry_interval_ms) / 1000.0

    def may_retry(self, failures: int, *, connected_before: bool) -> bool:
        """Whether another attempt follows ``failures`` failed attempts in a row."""
        limit = self.reconnect_attempts if connected_before else self.initial_connect_attempts
        return limit < 0 or failures < limit


# -- events for the owner ----------------------------------------------------------------------------

@dataclass(frozen=True)
class PeerAttemptStarted:
    """An attempt starts (the first, or one after the back-off wait)."""

    attempt: int


@dataclass(frozen=True)
class PeerConnected:
    """The peer's Open arrived. ``reconnect``: an earlier connection existed; ``resent``: the
    messages written on an earlier connection and not acknowledged, sent again on this one."""

    attempt: int
    reconnect: bool
    resent: int
    container_id: str | None
    node_id: str | None


@dataclass(frozen=True)
class PeerLoginRefused:
    """The peer's SASL outcome was not ok (``auth``: wrong credential)."""

    attempt: int
    code: int
    description: str

    @property
    def auth(self) -> bool:
        return self.code == 1


@dataclass(frozen=True)
class PeerDisconnected:
    """An open connection ended (``condition`` None: the socket just went; ``remote``: the
    condition is the one the peer closed with, not an error found on this side such as an
    idle timeout)."""

    condition: str | None
    description: str | None
    remote: bool = False


@dataclass(frozen=True)
class PeerConnectFailed:
    """The attempt failed before the peer's Open (refused, TLS, garbage, timeout)."""

    attempt: int
    condition: str | None
    description: str


@dataclass(frozen=True)
class PeerGaveUp:
    """The retry settings allow no more attempts; :meth:`PeerConnection.run` returns."""

    attempts: int


# -- the owner's links -------------------------------------------------------------------------------

class PeerSender:
    """A sending link to an address at the peer; at-least-once (see the module docstring).

    ``send(body, token)`` queues an encoded AMQP message; ``on_outcome(token, state)`` is called
    once the remote settles it (``state``: accepted, rejected, released, modified). Messages not
    settled yet are in :attr:`unacked` (token → body) and are sent again after a reconnect.
    """

    def __init__(self, peer: "PeerConnection", address: str, name: str, on_outcome: Callable[[Any, str], None]):
        self.peer = peer
        self.address = address
        self.name = name
        self.on_outcome_cb = on_outcome   # the owner's: (token, state)
        self.unacked: "collections.OrderedDict[Any, bytes]" = collections.OrderedDict()
        self._queued: collections.deque = collections.deque()  # tokens waiting for credit / a link
        self._link: OwnedLink | None = None
        self._transferred: set = set()  # unacknowledged tokens written on some connection
        self.attached = False
        self.sent = 0      # transfers written (resends included)
        self.accepted = 0
        self.capabilities: tuple[str, ...] = ()
        self.properties: dict = {}
        self.check_attach: Callable[[OwnedLink], str | None] | None = None

    def send(self, body: bytes, token: Any) -> None:
        """Send one encoded message; ``token`` names it in ``on_outcome`` (must be unique)."""
        if token in self.unacked:
            raise ValueError(f"token {token!r} is already unacknowledged")
        self.unacked[token] = bytes(body)
        self._queued.append(token)
        self._pump()

    def withdraw(self, token: Any) -> bool:
        """Stop (re)sending ``token`` (its owner sends it elsewhere); an outcome that still comes
        for it is reported as usual. False when it was not unacknowledged here."""
        self._transferred.discard(token)
        try:
            self._queued.remove(token)
        except ValueError:
            pass
        return self.unacked.pop(token, None) is not None

    # the engine's link handler (broker.amqp.links)
    def on_attached(self, link: OwnedLink) -> None:
        if self.check_attach is not None:
            why = self.check_attach(link)
            if why is not None:
                link.engine.close_with("amqp:precondition-failed", why)
                return
        self.attached = True
        self.peer._refusal_logged = False
        self._pump()

    def on_detached(self, link: OwnedLink, condition) -> None:
        self.attached = False
        self._link = None
        self.peer._link_detached(self, condition)

    def on_credit(self, link: OwnedLink) -> None:
        self._pump()

    def on_outcome(self, link: OwnedLink, token: Any, state: str) -> None:
        """The peer settled one of our transfers (this runs once per message)."""
        if state == "accepted" or state == "rejected":
            self.unacked.pop(token, None)
            self._transferred.discard(token)
            if state == "accepted":
                self.accepted += 1
        else:  # released/modified: the remote did not take it; send it again
            self._queued.append(token)
        self.on_outcome_cb(token, state)
        self._pump()

    # the connection's side
    def _attach(self, engine: AmqpEngine) -> int:
        """A new connection: attach again and queue every unacknowledged message (in order);
        returns how many of them were written before (the ones sent again)."""
        self._queued = collections.deque(self.unacked)
        self._link = engine.open_link(self, name=self.name, sender=True, address=self.address,
                                      capabilities=self.capabilities, properties=self.properties)
        return len(self._transferred)

    def _pump(self) -> None:
        link = self._link
        if link is None or not self.attached:
            return
        queued = self._queued
        moved = False
        while queued and link.credit > 0:
            token = queued.popleft()
            body = self.unacked.get(token)
            if body is None:
                continue
            link.send(body, token)
            self._transferred.add(token)
            self.sent += 1
            moved = True
        if moved:
            self.peer.wake()


class PeerReceiver:
    """A receiving link from an address at the peer: ``on_message(body) -> state`` for each
    message ("accepted" by default; "released"/"rejected" also understood); the disposition is
    sent after the callback returns (at-least-once). Credit is topped up to ``credit``."""

    def __init__(self, peer: "PeerConnection", address: str, name: str, on_message: Callable[[bytes], str | None],
                 credit: int):
        self.peer = peer
        self.address = address
        self.name = name
        self.on_message_cb = on_message   # the owner's: body -> "accepted" | "released" | "rejected"
        self.credit = credit
        self._link: OwnedLink | None = None
        self.attached = False
        self.received = 0

    def on_attached(self, link: OwnedLink) -> None:
        self.attached = True

    def on_detached(self, link: OwnedLink, condition) -> None:
        self.attached = False
        self._link = None
        self.peer._link_detached(self, condition)

    def on_message(self, link: OwnedLink, data: bytes, delivery: Incoming) -> None:
        self.received += 1
        state = self.on_message_cb(data) or "accepted"
        if state == "synced":   # stored: accepted once the host's journal has it on disk
            delivery.accept_when_synced()
        else:
            delivery.settle(state)
        self.peer.wake()

    def _attach(self, engine: AmqpEngine) -> int:
        self._link = engine.open_link(self, name=self.name, sender=False, address=self.address, credit=self.credit)
        return 0


# -- the connection --------------------------------------------------------------------------------

class _LoginRefused(Exception):
    def __init__(self, ev: LoginRefused):
        super().__init__(ev.description)
        self.ev = ev


class PeerConnection:
    """One peer connection kept alive by :meth:`run` (see the module docstring).

    ``url``: ``amqp://host:port`` or ``amqps://host:port`` (then ``ca_file`` verifies the peer,
    or ``ssl_context`` is used as given). ``alternates``: more such URLs, tried in turn while
    attempts fail; after a connection that opened, ``url`` is tried first again (Artemis's broker
    connections). ``credentials``: (user, password) for PLAIN, None for ANONYMOUS. ``on_event``
    gets the connection's events (PeerConnected, …); :attr:`url` is the target of the current
    attempt.
    """

    def __init__(self, host: "EngineHost", url: str, *, credentials: tuple[str, str] | None = None,
                 retry: RetrySettings = RetrySettings(), ca_file: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, name: str | None = None,
                 on_event: Callable[[object], None] | None = None, idle_timeout_s: float | None = None,
                 alternates: Sequence[str] = ()):
        self.host = host
        #: where it dials: ``url`` first, then the ``alternates`` in turn while attempts fail;
        #: after a connection that opened, the first again (Artemis's broker connections)
        self.targets = [_target(u) for u in (url, *alternates)]
        self._turn = 0
        self.url, self.hostname, self.port, self.tls = self.targets[0]
        if any(t[3] for t in self.targets) and ssl_context is None:
            ssl_context = ssl.create_default_context(cafile=ca_file)
        self.ssl_context = ssl_context
        self.credentials = credentials
        self.retry = retry
        self.name = name or f"peer-{next(_peer_ids)}"
        self.on_event = on_event or (lambda ev: None)
        #: our Open's idle-time-out for this connection (None: the host's); the peer must send
        #: something that often, and proton sends heartbeats at half the peer's
        self.idle_timeout_s = idle_timeout_s
        self.links: list = []
        #: called right before each write of the connection (the engine's ``before_output``): an
        #: owner that batches sends them here, so a batch leaves in the next write
        self.before_output: Callable[[], None] | None = None
        #: more properties of our Open on each connection (a broker connection's
        #: ``broker-connection-info``, as Artemis sends it)
        self.open_properties: dict = {}
        self.engine: AmqpEngine | None = None
        self.attempts = 0            # every attempt made
        self.connections = 0         # connections that opened
        self.auth_failures = 0
        self._auth_logged = False
        self._wakeup: Wakeup | None = None
        self._names = itertools.count(1)
        self._links_refused = False   # this connection ended because the peer refused a link
        self._refusal_logged = False
        self.links_refused = 0

    # -- the owner's API ------------------------------------------------------------------------
    def sender(self, address: str, on_outcome: Callable[[Any, str], None], *, name: str | None = None,
               capabilities: tuple[str, ...] = (), properties: dict | None = None,
               on_attached: Callable[["OwnedLink"], str | None] | None = None) -> PeerSender:
        """A sender to ``address`` at the peer, attached on every connection (at-least-once).
        ``capabilities``/``properties`` go on its attach; ``on_attached(link)`` checks the
        peer's answer (a string: why the link is not the one we need — the connection is closed
        with it and dialled again later)."""
        s = PeerSender(self, address, name or f"{self.name}-snd-{next(self._names)}", on_outcome)
        s.capabilities, s.properties, s.check_attach = tuple(capabilities), dict(properties or {}), on_attached
        self._add_link(s)
        return s

    def receiver(self, address: str, on_message: Callable[[bytes], str | None], *, credit: int = 100,
                 name: str | None = None) -> PeerReceiver:
        """A receiver from ``address`` at the peer, attached on every connection."""
        r = PeerReceiver(self, address, name or f"{self.name}-rcv-{next(self._names)}", on_message, credit)
        self._add_link(r)
        return r

    @property
    def connected(self) -> bool:
        e = self.engine
        return e is not None and e.opened and not e.closed

    def _add_link(self, link) -> None:
        self.links.append(link)
        if self.connected:
            link._attach(self.engine)
            self.wake()

    def wake(self) -> None:
        """Something is ready to send: the connection's writer runs."""
        if self._wakeup is not None:
            self._wakeup.set()

    def close(self, condition: str, description: str) -> None:
        """Close the current connection with ``condition`` (what follows is the retry policy's:
        a peer with ``reconnect_attempts = 0`` ends ``run``)."""
        if self.engine is not None:
            self.engine.close_with(condition, description)
            self.wake()

    def _link_detached(self, link, condition) -> None:
        if condition is not None and self.engine is not None and not self.engine.closed:
            # the peer refused or closed one of our links: the link is needed, so start over —
            # with back-off, as after a failed attempt (logged once until a link attaches again)
            self._links_refused = True
            self.links_refused += 1
            if not self._refusal_logged:
                self._refusal_logged = True
                log.warning("peer detached a link; reconnecting with back-off (further refusals are counted, "
                            "not logged)", extra={"fields": {
                                "peer": self.name, "link": link.name, "condition": condition.name,
                                "description": condition.description}})
            self.engine.close_with("amqp:connection:forced", f"link {link.name} detached: {condition.name}")

    def _emit(self, ev) -> None:
        self.on_event(ev)

    # -- the loop -------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Connect and stay connected per :attr:`retry`; returns once the attempts are spent."""
        task_status.started(self)
        failures = 0
        while True:
            self.attempts += 1
            self.url, self.hostname, self.port, self.tls = self.targets[self._turn % len(self.targets)]
            self._emit(PeerAttemptStarted(self.attempts))
            self._links_refused = False
            opened = await self._attempt(self.attempts)
            if opened and not self._links_refused:
                failures = 0
            self._turn = 0 if opened else self._turn + 1
            failures += 1
            if not self.retry.may_retry(failures, connected_before=self.connections > 0):
                log.warning("peer connection: giving up", extra={"fields": {
                    "peer": self.name, "url": self.url, "attempts": self.attempts}})
                self._emit(PeerGaveUp(self.attempts))
                return
            await trio.sleep(self.retry.delay_s(failures))

    async def _attempt(self, attempt: int) -> bool:
        """One connection attempt, kept up until it ends; True if the peer's Open arrived."""
        settings = self.host.settings
        stream = None
        try:
            with trio.fail_after(settings.handshake_timeout_s):
                stream = await trio.open_tcp_stream(self.hostname, self.port)
                try:
                    stream.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
                except OSError:
                    pass
                if self.tls:
                    stream = trio.SSLStream(stream, self.ssl_context, server_hostname=self.hostname)
                    await stream.do_handshake()
                leftover = await self._login(stream)
            return await self._run_engine(stream, leftover, attempt)
        except _LoginRefused as exc:
            self.auth_failures += 1
            ev = PeerLoginRefused(attempt, exc.ev.code, exc.ev.description)
            self.host.count("peer_login_refused")
            if not self._auth_logged:  # once per peer until a login succeeds again
                self._auth_logged = True
                log.warning("peer refused our login (retrying with back-off; further refusals are "
                            "counted, not logged)", extra={"fields": {
                                "peer": self.name, "url": self.url, "code": exc.ev.code,
                                "description": exc.ev.description}})
            self._emit(ev)
        except RemoteProtocolError as exc:  # garbage during the handshake: cut off
            self.host.count("peer_protocol_error")
            log.info("peer connection: protocol error", extra={"fields": {
                "peer": self.name, "condition": exc.condition, "description": exc.description}})
            self._emit(PeerConnectFailed(attempt, exc.condition, exc.description))
        except trio.TooSlowError:
            self.host.count("peer_connect_timeout")
            self._emit(PeerConnectFailed(attempt, None, "handshake timeout"))
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError) as exc:
            self.host.count("peer_connect_failed")
            log.debug("peer connection failed: %r", exc, extra={"fields": {"peer": self.name}})
            self._emit(PeerConnectFailed(attempt, None, _describe(exc)))
        finally:
            if stream is not None:
                await trio.aclose_forcefully(stream)
        return False

    async def _login(self, stream) -> bytes:
        sasl = SaslClient(self.credentials, hostname=self.hostname,
                          max_frame_bytes=self.host.settings.max_frame_bytes)
        await stream.send_all(sasl.data_to_send())
        ev = await next_sasl_event(sasl, stream, RECV_BYTES)
        if ev is None:
            raise trio.BrokenResourceError("peer closed the connection during SASL")
        if isinstance(ev, LoginAccepted):
            return ev.leftover
        raise _LoginRefused(ev)

    async def _run_engine(self, stream, leftover: bytes, attempt: int) -> bool:
        wakeup = Wakeup()
        engine = AmqpEngine(self.host, conn_id=f"{self.name}-{attempt}", principal=None, source=self.url,
                            tls=self.tls, wake=wakeup.set, client=True, hostname=self.hostname,
                            open_properties=self.open_properties)
        if self.idle_timeout_s is not None:
            engine.transport.idle_timeout = self.idle_timeout_s
        opened = False
        reconnect = self.connections > 0

        def connection_opened(_engine) -> None:
            nonlocal opened
            opened = True
            self.connections += 1
            self._auth_logged = False
            resent = sum(link._attach(engine) for link in self.links)
            props = engine.remote_properties or {}
            log.info("peer connection open", extra={"fields": {
                "peer": self.name, "url": self.url, "container_id": engine.container_id,
                "reconnect": reconnect, "resent": resent}})
            self._emit(PeerConnected(attempt, reconnect, resent, engine.container_id,
                                     props.get("node-id") if isinstance(props, dict) else None))

        engine.on_open = connection_opened
        engine.before_output = self.before_output
        self.engine = engine
        self._wakeup = wakeup
        broken = None
        try:
            await pump_engine(engine, stream, wakeup, leftover=leftover,
                              open_timeout_s=self.host.settings.handshake_timeout_s, close_grace_s=1.0)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as group:
            broken = group.exceptions[0]
        finally:
            engine.finish()
            self._wakeup = None
            for link in self.links:  # until the next connection attaches them again
                link.attached = False
                link._link = None
        err = engine.error
        cond = err.name if err is not None else None
        desc = err.description if err is not None else (repr(broken) if broken else None)
        if opened:
            log.info("peer connection closed", extra={"fields": {
                "peer": self.name, "condition": cond, "description": desc}})
            self._emit(PeerDisconnected(cond, desc, err is not None and err is engine.remote_error))
        else:
            if cond is not None:
                self.host.count("peer_protocol_error")
            self._emit(PeerConnectFailed(attempt, cond, desc or "closed before open"))
        return opened


def _target(url: str) -> tuple[str, str, int, bool]:
    """``(url, host, port, tls)`` of an ``amqp[s]://host:port`` URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("amqp", "amqps") or not parts.hostname:
        raise ValueError(f"peer url {url!r}: expected amqp://host:port or amqps://host:port")
    tls = parts.scheme == "amqps"
    return url, parts.hostname, parts.port or (5671 if tls else 5672), tls


def _describe(exc: BaseException) -> str:
    """The error and what caused it (trio's BrokenResourceError wraps the ssl/OS error)."""
    cause = exc.__cause__ or exc.__context__
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return f"{text} ({type(cause).__name__}: {cause})" if cause is not None else text


def open_peer_connection(nursery: trio.Nursery, host: "EngineHost", url: str, **kw) -> PeerConnection:
    """Start a :class:`PeerConnection` in ``nursery`` and return it (its links can be added at once)."""
    peer = PeerConnection(host, url, **kw)
    nursery.start_soon(peer.run)
    return peer
