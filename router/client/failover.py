"""A blocking connection that survives a broker failover, and says what the failover lost
(python-qpid-proton; docs/clients.md, "Failover"; docs/ha.md).

    conn = FailoverConnection("amqp://app:secret@router.example:5672",       # or a URL list
                              reconnect_attempts=-1, failure_listener=print)
    snd = conn.sender("orders")
    snd.send(Message(body="...", durable=True))   # retried across a failover, stored once
    rcv = conn.receiver("orders")
    m = rcv.receive(timeout=10); rcv.accept()
    replies = conn.receiver(None, dynamic=True)    # a temporary queue, re-created after a failover
    conn.close()

Theory of operation
-------------------
A :class:`FailoverConnection` holds one ``BlockingConnection`` (opened with
:func:`router.client.connect_following_redirects`, so a router's redirect is followed too) and
the URLs it may reach the same broker at: the ones it was given, then every backup a broker named
in its Open's ``failover-server-list`` (Artemis's property, docs/ha.md). When a call fails
because the connection or a link was lost, it reconnects, re-creates every link it had, and
retries the call. ``failovers`` counts the reconnections.

**Tries.** A *try* is one pass over the URLs: the one that worked last, the others in order,
then the learned backups; the first URL that opens ends the pass. The first try is made at once;
``reconnect_attempts`` more tries follow (``-1``: no limit), ``retry_interval_s`` before the
second, each next wait ``retry_interval_multiplier`` times the last, at most
``max_retry_interval_s``; ``reconnect_attempts = 2`` makes 3 tries. The first connection counts
the same way with ``initial_connect_attempts``. Whatever the counts, no reconnection goes on
past ``reconnect_timeout_s``. (Artemis counts differently: its ``reconnectAttempts = N`` is N
tries in all and 0 is no reconnection — docs/clients.md.) :class:`RetrySchedule` holds the rule.

**What a failover loses, said aloud.** Each broker's Open names its node id and, for a node in
a cluster, when its process started (``started-ms``): together a :class:`BrokerIdentity`. A
reconnection to the same process (same node id, same ``started-ms``) is ``RECONNECTED``: the
broker still holds everything. Any other one is a ``FAILOVER``: only durable messages reach a
backup (replication and shared store keep the journal), so every *non-durable* message a
:class:`FailoverSender` saw accepted by the old process is gone unless something consumed it
first — which the sender cannot know. The count of those is raised as :class:`NonDurableLost`
("up to N") by the first call made on the connection or its links after the failover, before
that call does anything (repeat it), and given to the failure listener. A broker whose Open
names no ``started-ms`` (a node outside a cluster) cannot be told from a restarted one: its
reconnections are reported as failovers. Temporary queues (``receiver(None, dynamic=True)``)
are gone with the process: they are created again, under a new address (``receiver.address``);
a message sent with ``reply_to`` naming an old address of one of them goes with the new
address. A reply already sent to the old address is lost with the queue.

**Failure listener.** ``failure_listener`` (and :meth:`FailoverConnection.add_failure_listener`)
is called with a :class:`FailoverEvent` after each lost connection: ``FAILOVER`` or
``RECONNECTED`` once the links are back, ``DISCONNECT`` when the client gave up (then the call
raises :class:`FailoverError`) — Artemis's ``FAILOVER`` / ``DISCONNECT`` codes, with Artemis's
"reattached to the same server" as ``RECONNECTED``.

**Once and only once.** Every message a :class:`FailoverSender` sends carries Artemis's
duplicate-id application property ``_AMQ_DUPL_ID`` (a UUID, unless the application set one).
A send whose outcome was lost with the connection is sent again, with the same id, after the
reconnection: if the broker had stored it (the acknowledgement was what got lost), its duplicate
detection drops the copy and accepts the send; if not, it is stored now. Either way a durable
message is stored once, and ``send`` returns only when it is.

**Receivers** are at least once: a message received but not yet accepted when the connection
was lost is delivered again after the failover (``accept`` of a message from the lost link
raises :class:`DeliveryLost`; the redelivery comes on the new link). Applications that must not
process a message twice keep the ids they processed (the chaos test does: it counts them).

A call that cannot complete raises :class:`FailoverError`, naming the failover, the tries, the
URLs tried and the last error.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from proton import ConnectionException, LinkException, Message, TransportException
from proton.utils import ConnectionClosed, LinkDetached, SendException

from router.client.topology import parse_urls
from router.client.blocking import connect_following_redirects

__all__ = ["FailoverConnection", "FailoverSender", "FailoverReceiver", "FailoverError", "DeliveryLost",
           "NonDurableLost", "FailoverEvent", "BrokerIdentity", "RetrySchedule", "DUPLICATE_ID",
           "FAILOVER", "RECONNECTED", "DISCONNECT"]

log = logging.getLogger("router.client")

DUPLICATE_ID = "_AMQ_DUPL_ID"
_LOST = (ConnectionException, ConnectionClosed, LinkDetached, LinkException, TransportException, OSError)

#: :attr:`FailoverEvent.kind`: reconnected to another broker process (a backup, a restarted one);
#: reconnected to the same process; gave up.
FAILOVER, RECONNECTED, DISCONNECT = "FAILOVER", "RECONNECTED", "DISCONNECT"


class FailoverError(ConnectionError):
    """A blocking call could not complete across a failover (``tries``: the connection tries of
    the last reconnection, ``tried``: the URLs, ``last``: the last error)."""

    def __init__(self, what: str, tried: list[str], last: BaseException | None, elapsed_s: float,
                 tries: int | None = None):
        counted = f"{tries} tries, " if tries is not None else ""
        super().__init__(f"{what}: the connection was lost and no broker could be reached again within "
                         f"{elapsed_s:.1f} s (failover; {counted}tried {', '.join(tried) or 'nothing'}; "
                         f"last error: {last!r})")
        self.tried = tried
        self.last = last
        self.tries = tries


class DeliveryLost(FailoverError):
    """``accept`` of a message that came on a link lost in a failover: the broker delivers it
    again on the new link."""

    def __init__(self, address: str, cause: BaseException | None = None):
        ConnectionError.__init__(self, f"accept on {address!r}: the message came on a connection lost in a "
                                       "failover; the broker delivers it again")
        self.tried = []
        self.last = cause
        self.tries = None


class NonDurableLost(ConnectionError):
    """A failover took the connection to another broker process: up to ``count`` non-durable
    messages this connection's senders saw accepted by the old one are gone (only durable
    messages reach a backup; the sender cannot know how many were consumed before the loss).
    Raised once, by the first call after the failover, before that call does anything."""

    def __init__(self, count: int, old: "BrokerIdentity", new: "BrokerIdentity", reason: str):
        super().__init__(f"up to {count} non-durable message{'s' if count != 1 else ''} accepted by broker "
                         f"{old} before the failover to {new} {'were' if count != 1 else 'was'} lost ({reason}; "
                         "only durable messages survive a failover)")
        self.count = count
        self.old = old
        self.new = new
        self.reason = reason


# -- pure rules ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RetrySchedule:
    """How many connection tries, how far apart (no I/O, no clock).

    The first try is at once; ``attempts`` more follow (``-1``: no limit), the first of them
    ``interval_s`` after it, each next wait ``multiplier`` times the last, at most
    ``max_interval_s`` (the first wait is ``interval_s`` even above it, as in Artemis)."""

    attempts: int
    interval_s: float
    multiplier: float
    max_interval_s: float

    def __post_init__(self) -> None:
        if self.attempts < -1:
            raise ValueError(f"attempts: {self.attempts} must be -1 (no limit) or >= 0")
        if self.interval_s < 0 or self.max_interval_s < 0 or self.multiplier < 1:
            raise ValueError(f"retry intervals must be >= 0 and the multiplier >= 1: {self}")

    def may_try_again(self, tries: int) -> bool:
        """After ``tries`` tries failed, is another one allowed?"""
        return self.attempts < 0 or tries <= self.attempts

    def next_interval(self, interval_s: float) -> float:
        return min(interval_s * self.multiplier, self.max_interval_s)


@dataclass(frozen=True)
class BrokerIdentity:
    """Which broker process an Open came from: ``node-id`` and, for a cluster node, ``started-ms``."""

    node_id: str | None
    started_ms: int | None

    @classmethod
    def from_properties(cls, props) -> "BrokerIdentity":
        props = props if isinstance(props, dict) else {}
        node_id, started = props.get("node-id"), props.get("started-ms")
        return cls(str(node_id) if node_id is not None else None,
                   int(started) if isinstance(started, int) and not isinstance(started, bool) else None)

    def same_process(self, other: "BrokerIdentity") -> tuple[bool, str]:
        """(same, why): the same process only when both name the same node id and start time."""
        if self.node_id is None or other.node_id is None:
            return False, "the broker names no node id"
        if self.node_id != other.node_id:
            return False, f"node id {self.node_id} -> {other.node_id}"
        if self.started_ms is None or other.started_ms is None:
            return False, "the broker does not say when its process started (no started-ms), so a restart " \
                          "cannot be ruled out"
        if self.started_ms != other.started_ms:
            return False, f"same node id, another process (started-ms {self.started_ms} -> {other.started_ms})"
        return True, "same node id and process"

    def __str__(self) -> str:
        return f"{self.node_id or '?'}" + (f"@{self.started_ms}" if self.started_ms is not None else "")


@dataclass(frozen=True)
class FailoverEvent:
    """What a failure listener gets. ``kind``: :data:`FAILOVER`, :data:`RECONNECTED` or
    :data:`DISCONNECT`; ``cause``: what broke the connection; ``url``: where it reconnected
    (None for DISCONNECT); ``tries``: the connection tries made; ``lost``: the
    :class:`NonDurableLost` of a FAILOVER that lost non-durable messages (else None);
    ``temporary_queues``: old address -> new address of each temporary queue created again;
    ``broker``: the identity reconnected to (None for DISCONNECT); ``error``: the
    :class:`FailoverError` of a DISCONNECT."""

    kind: str
    cause: BaseException | None
    url: str | None
    tries: int
    lost: NonDurableLost | None = None
    temporary_queues: dict[str, str] = field(default_factory=dict)
    broker: BrokerIdentity | None = None
    error: FailoverError | None = None


def _learned_urls(conn, template: str) -> list[str]:
    """``failover-server-list`` of the broker's Open → URLs (credentials of ``template``)."""
    props = getattr(conn.conn, "remote_properties", None) or {}
    fsl = props.get("failover-server-list") if isinstance(props, dict) else None
    out = []
    for m in fsl or ():
        try:
            m = dict(m)
            host, port = str(m["network-host"]), int(m["port"])
            scheme = str(m.get("scheme") or "amqp")
        except (KeyError, TypeError, ValueError):
            continue
        userinfo = template.split("://", 1)[1].rpartition("@")[0]
        out.append(f"{scheme}://{userinfo + '@' if userinfo else ''}{host}:{port}")
    return out


class FailoverConnection:
    """See the module doc. ``urls``: one URL, a list, or ``(url,url,...)``.

    Artemis's reconnection options, in seconds where Artemis has milliseconds (defaults: today's
    behaviour; Artemis's in brackets): ``reconnect_attempts`` -1 [0: no reconnection],
    ``initial_connect_attempts`` -1 [one try], ``retry_interval_s`` 0.1 [2 s],
    ``retry_interval_multiplier`` 2.0 [1.0], ``max_retry_interval_s`` 2.0 [2 s]; the counts are
    retries after a first try made at once (module doc). ``reconnect_timeout_s`` (30) bounds
    every (re)connection whatever the counts. ``failure_listener``: called with each
    :class:`FailoverEvent`. ``kwargs`` go to ``BlockingConnection`` (``user``, ``password``,
    ``allowed_mechs``, ``timeout``, …)."""

    def __init__(self, urls, *, reconnect_timeout_s: float = 30.0, retry_interval_s: float = 0.1,
                 max_retry_interval_s: float = 2.0, retry_interval_multiplier: float = 2.0,
                 reconnect_attempts: int = -1, initial_connect_attempts: int = -1,
                 failure_listener: Callable[[FailoverEvent], Any] | None = None, **kwargs: Any) -> None:
        self.urls = parse_urls(urls)
        self.learned: list[str] = []
        self.reconnect_timeout_s = reconnect_timeout_s
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max_retry_interval_s
        self.reconnect_schedule = RetrySchedule(reconnect_attempts, retry_interval_s, retry_interval_multiplier,
                                       max_retry_interval_s)
        self.initial_schedule = RetrySchedule(initial_connect_attempts, retry_interval_s, retry_interval_multiplier,
                                     max_retry_interval_s)
        self.kwargs = kwargs
        self.links: list = []
        self.failovers = 0
        self.current: str | None = None
        self.conn = None
        self.identity: BrokerIdentity | None = None
        self.listeners: list[Callable[[FailoverEvent], Any]] = [failure_listener] if failure_listener else []
        self.non_durable_accepted = 0       # by the current broker process, since we reached it
        self.temporary_queues: dict[str, str] = {}   # every old temporary address -> its current one
        self._renamed: dict[str, str] = {}  # during one reconnection: old -> new
        self._pending: NonDurableLost | None = None
        self._open(first=True)
        self.identity = BrokerIdentity.from_properties(self.conn.conn.remote_properties)

    # -- connecting ------------------------------------------------------------------------------
    def _candidates(self) -> list[str]:
        order = ([self.current] if self.current else []) + self.urls + self.learned
        return list(dict.fromkeys(order))

    def _open(self, first: bool = False, why: BaseException | None = None) -> int:
        """Connect (see "Tries" in the module doc); returns the number of tries made."""

        schedule = self.initial_schedule if first else self.reconnect_schedule
        start = time.monotonic()
        wait = schedule.interval_s
        tried: list[str] = []
        tries = 0
        last = why
        while True:
            tries += 1
            for url in self._candidates():
                if url not in tried:
                    tried.append(url)
                try:
                    conn = connect_following_redirects(url, **self.kwargs)
                except Exception as exc:   # refused, reset, redirect trouble: the next one
                    last = exc
                    continue
                self.conn = conn
                self.current = url
                for u in _learned_urls(conn, url):
                    if u not in self.learned and u not in self.urls:
                        self.learned.append(u)
                return tries
            elapsed = time.monotonic() - start
            if not schedule.may_try_again(tries) or elapsed + wait > self.reconnect_timeout_s:
                raise FailoverError("connect" if first else "reconnect", tried, last, elapsed, tries)
            time.sleep(wait)
            wait = schedule.next_interval(wait)

    def add_failure_listener(self, listener: Callable[[FailoverEvent], Any]) -> None:
        """Call ``listener(event)`` after each lost connection (:class:`FailoverEvent`)."""
        self.listeners.append(listener)

    def _emit(self, event: FailoverEvent) -> None:
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:   # one listener's failure must not stop the others (as Artemis)
                log.exception("failure listener %r failed", listener)

    def reconnect(self, why: BaseException | None = None) -> None:
        """Open a new connection (see the module doc), re-create every link on it and tell the
        failure listeners; raises :class:`FailoverError` (after a DISCONNECT event) if none opens."""
        old = self.conn
        self.conn = None
        if old is not None:
            try:
                old.close()
            except Exception:
                pass
        try:
            tries = self._open(why=why)
        except FailoverError as exc:
            self._emit(FailoverEvent(DISCONNECT, why, None, exc.tries or 0, error=exc))
            raise
        self.failovers += 1
        self._renamed = {}
        for link in self.links:
            link._attach()
        new = BrokerIdentity.from_properties(self.conn.conn.remote_properties)
        before, self.identity = self.identity, new
        same, reason = before.same_process(new) if before is not None else (False, "no broker known before")
        lost = None
        if same:
            kind = RECONNECTED
        else:
            kind = FAILOVER
            if self.non_durable_accepted:
                lost = NonDurableLost(self.non_durable_accepted + (self._pending.count if self._pending else 0),
                                      before, new, reason)
                self._pending = lost
            self.non_durable_accepted = 0
        log.warning("%s to %s after %d tries (%s)%s", kind.lower(), self.current, tries, reason,
                    f"; {lost}" if lost else "")
        self._emit(FailoverEvent(kind, why, self.current, tries, lost, dict(self._renamed), new))

    def _renamed_queue(self, old: str, new: str) -> None:
        """A temporary queue was created again: ``old`` (and every earlier address) is ``new`` now."""
        for k, v in self.temporary_queues.items():
            if v == old:
                self.temporary_queues[k] = new
        self.temporary_queues[old] = new
        self._renamed[old] = new

    def _check_loss(self) -> None:
        """Raise a :class:`NonDurableLost` not yet raised (once)."""
        lost, self._pending = self._pending, None
        if lost is not None:
            raise lost

    # -- links -----------------------------------------------------------------------------------
    def sender(self, address: str | None) -> "FailoverSender":
        """A sender to ``address`` (None: the anonymous relay; each message names its ``address``)."""
        self._check_loss()
        s = FailoverSender(self, address)
        self.links.append(s)
        return s

    def receiver(self, address: str | None, credit: int = 100, *, dynamic: bool = False) -> "FailoverReceiver":
        """A receiver from ``address``; ``receiver(None, dynamic=True)``: from a temporary queue
        the broker names (``.address``), created again after a failover."""
        self._check_loss()
        r = FailoverReceiver(self, address, credit, dynamic=dynamic)
        self.links.append(r)
        return r

    def _retrying(self, what: str, call):
        """Run ``call()``; when the connection or a link is lost, reconnect and run it again,
        until ``reconnect_timeout_s`` has passed since the first loss."""
        self._check_loss()
        start = None
        while True:
            try:
                return call()
            except _LOST as exc:
                if start is None:
                    start = time.monotonic()
                elapsed = time.monotonic() - start
                if elapsed > self.reconnect_timeout_s:
                    raise FailoverError(what, self._candidates(), exc, elapsed) from exc
                try:
                    self.reconnect(exc)
                except FailoverError as fe:
                    raise FailoverError(what, fe.tried, fe.last, time.monotonic() - start, fe.tries) from exc

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None


class FailoverSender:
    """A sender whose ``send`` is retried across a failover with the message's duplicate id."""

    def __init__(self, owner: FailoverConnection, address: str | None) -> None:
        self.owner = owner
        self.address = address
        self.link = None
        self.resent = 0
        self._attach()

    def _attach(self) -> None:
        self.link = self.owner.conn.create_sender(self.address)

    def send(self, msg: Message, timeout: float | None = None) -> None:
        """Send ``msg`` (stamped with ``_AMQ_DUPL_ID`` if it has none) and return once a broker
        accepted it; raises :class:`NonDurableLost` (before sending) once after a failover that
        lost some, :class:`FailoverError` if no broker can be reached again in time, proton's
        ``SendException`` if the broker refused the message. A ``reply_to`` naming an old
        address of a temporary queue of this connection is replaced by its current one."""
        if msg.properties is None:
            msg.properties = {}
        msg.properties.setdefault(DUPLICATE_ID, str(uuid.uuid4()))
        attempts = 0

        def call():
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                self.resent += 1
            if msg.reply_to in self.owner.temporary_queues:
                msg.reply_to = self.owner.temporary_queues[msg.reply_to]
            try:
                self.link.send(msg, timeout=timeout)
            except SendException as exc:   # released (the broker went away meanwhile): send again
                if getattr(exc, "state", None) is not None and "RELEASED" in str(exc.state).upper():
                    raise ConnectionException("released") from exc
                raise

        self.owner._retrying(f"send to {self.address!r}", call)
        if not msg.durable:
            self.owner.non_durable_accepted += 1


class FailoverReceiver:
    """A receiver re-created after a failover (at least once: see the module doc); a dynamic
    one's temporary queue is created again, under a new ``address``."""

    def __init__(self, owner: FailoverConnection, address: str | None, credit: int, *, dynamic: bool = False) -> None:
        self.owner = owner
        self.dynamic = dynamic
        self.address = address
        self.credit = credit
        self.link = None
        self.generation = 0
        self._last_generation = -1
        self._attach()

    def _attach(self) -> None:
        if self.dynamic:
            old = self.address
            self.link = self.owner.conn.create_receiver(None, credit=self.credit, dynamic=True)
            self.address = self.link.link.remote_source.address
            if old is not None and old != self.address:
                self.owner._renamed_queue(old, self.address)
        else:
            self.link = self.owner.conn.create_receiver(self.address, credit=self.credit)
        self.generation += 1

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; proton's ``Timeout`` if none within ``timeout``."""
        def call():
            m = self.link.receive(timeout=timeout)
            self._last_generation = self.generation
            return m
        return self.owner._retrying(f"receive from {self.address!r}", call)

    def accept(self) -> None:
        """Accept the last message received; raises :class:`DeliveryLost` when it came on a link
        lost since (the broker delivers it again)."""
        self.owner._check_loss()
        if self._last_generation != self.generation:
            raise DeliveryLost(self.address)
        try:
            self.link.accept()
        except _LOST as exc:
            raise DeliveryLost(self.address, exc) from exc
