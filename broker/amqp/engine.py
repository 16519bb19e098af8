"""One client connection's AMQP 1.0 engine: python-qpid-proton's Transport + Connection + Collector.

Theory of operation
-------------------
Proton implements the AMQP 1.0 connection, session and link state machines (AMQP 1.0 §2.4-§2.7)
and the frame codec; it does no I/O here. :class:`AmqpEngine` owns one ``proton.Transport``
(server mode, created *without* a SASL layer: SASL was already done by
:class:`broker.wire.sasl.SaslServer`), bound to a ``proton.Connection`` with a ``proton.Collector``.

The trio shell (:mod:`broker.amqp.driver`) feeds socket bytes to :meth:`AmqpEngine.push`, which
pushes them into the transport and then handles every collector event:

* remote open of the connection / a session → we open ours;
* remote attach of a link → :meth:`_attach`: resolve the address in the core (auto-create if the
  settings and the principal's ``createAddress`` permission allow), check ``send`` / ``consume``,
  then open the link; refuse with ``amqp:unauthorized-access`` / ``amqp:not-found`` otherwise;
* a complete incoming transfer on a producer link → ``Broker.publish``; the transfer is accepted
  and settled at once, or — if the message went to the journal — after the group-commit fsync
  that covers it (``host.await_sync``). A message carrying ``_AMQ_DUPL_ID`` (found by
  :func:`message_duplicate_id`, only in messages that contain those bytes) goes to
  ``Broker.publish_once`` instead: a duplicate is not routed and is still accepted (Artemis);
  an id neither string nor binary is rejected with ``amqp:invalid-field``;
* flow on a consumer link → the core's :class:`~broker.core.queues.Subscription` gets the credit
  and the queue dispatches; each handed-out message becomes an outgoing transfer (``_sink``);
* a disposition from a consumer → ``Queue.settle`` with the mapped outcome (§3.4);
* local transactions (Part 4): a sending link to a ``coordinator`` target creates the
  connection's :class:`~broker.amqp.txn.TxnCoordinator` (``self.txn``); transfers and
  dispositions carrying ``TransactionalState`` go to it — one attribute check on the producer
  path, nothing on the consumer path's usual outcomes;
* link detach / session end / connection close / transport closed → subscriptions leave their
  queues (unsettled messages return), producers stop.

Output is taken with :meth:`take_output`. Work done *for* this connection by another one (a
producer's message dispatched to our consumer) marks us dirty through ``wake``, which the shell
turns into a write. Proton's own protocol errors (garbage after the header, oversized frames)
make the transport write a Close with the error condition and report end-of-stream; the shell
then flushes and closes this connection only.

Client mode (``client=True``, :mod:`broker.amqp.peer`): the same engine is the dialling side
of a connection to a peer broker — ``Transport(Transport.CLIENT)`` (SASL done by
:class:`broker.wire.sasl.SaslClient`), our Open (container-id, ``hostname``, the ``node-id``
property) sent first. Links are opened by the owner (:meth:`AmqpEngine.open_link`) with a handler
(:class:`broker.amqp.links.LinkHandler`: attach and detach, credit, each message as bytes with a
settle handle, each outcome of what it sent) — they live in ``self.owned``, off the
producer/consumer hot path. On an accepted connection, an attach to a ``$lodestone.`` address
goes to the service the host registered for it (``EngineHost.services``), with the same handler
API.
A link the peer attaches on its own is refused with ``amqp:not-allowed``. A failure before the
peer's Open closes our (already sent) Open with the error; the peer's Close condition becomes
``error``.

Before the client's Open there is no connection for proton to close in every case (a frame cut
short by EOF, a Begin before Open, a client that never sends Open): :meth:`fail_before_open`
then makes :meth:`take_output` finish with our header (if proton has not written it yet), an
Open marked ``amqp:connection-establishment-failed`` and a Close carrying the error
(``frames.close_frames``, §2.4.1/§2.7.9), after which the engine counts as closed.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, Callable

import cproton
from cproton_ffi import ffi, lib
from proton import Collector, Condition, Connection, Data, Delivery, Endpoint, Event, Link, Terminus, Transport
from proton import TransportException, int32, symbol

from broker.amqp.host import INTERNAL_PREFIX
from broker.amqp.links import OUTCOMES, Incoming, LinkHandler, OwnedLink
from broker.amqp.message import (may_carry_duplicate_id, message_duplicate_id, message_header, message_meta,
                                 message_to, with_delivery_count)
from broker.amqp.pn import terminus_capabilities as _capabilities
from broker.amqp.txn import TXN_STATE as _TXN_STATE, TxnCoordinator, is_coordinator
from broker.core.addresses import ANYCAST, MULTICAST, AddressNotFound
from broker.core.deliveries import Outcome
from broker.core.duplicates import DUPLICATE_ID_PROPERTY, InvalidDuplicateId, duplicate_key
from broker.core.filters import SelectorError, consumer_filter
from broker.core.queues import Subscription
from broker.wire.codec import Int, Symbol
from broker.wire.errors import DecodeError
from broker.wire.frames import FOLLOWS_REDIRECT, MIRROR_PREFIX, close_frames

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.host import EngineHost

log = logging.getLogger("lodestone.broker.amqp")

__all__ = ["AmqpEngine", "to_proton", "message_header", "message_meta", "with_delivery_count", "message_duplicate_id",
           "may_carry_duplicate_id"]

UNAUTHORIZED = "amqp:unauthorized-access"
FRAMING_ERROR = "amqp:connection:framing-error"
ILLEGAL_STATE = "amqp:illegal-state"
NOT_FOUND = "amqp:not-found"
INTERNAL = "amqp:internal-error"
DECODE_ERROR = "amqp:decode-error"
RESOURCE_LIMIT = "amqp:resource-limit-exceeded"
INVALID_FIELD = "amqp:invalid-field"

_ACCEPTED = Delivery.ACCEPTED
_RELEASED = Delivery.RELEASED
_REJECTED = Delivery.REJECTED
_MODIFIED = Delivery.MODIFIED
_RECEIVED = Delivery.RECEIVED

# The hot path (transfers, dispositions, flow) calls proton's C API through cffi directly:
# proton's Python wrappers allocate several objects per event and per delivery, which costs
# more than the rest of the broker together. Rare events go through the Python API.
_PN_DELIVERY = cproton.PN_DELIVERY
_PN_LINK_FLOW = cproton.PN_LINK_FLOW
_SLOW_EVENTS = frozenset([
    cproton.PN_CONNECTION_REMOTE_OPEN, cproton.PN_CONNECTION_REMOTE_CLOSE,
    cproton.PN_SESSION_REMOTE_OPEN, cproton.PN_SESSION_REMOTE_CLOSE,
    cproton.PN_LINK_REMOTE_OPEN, cproton.PN_LINK_REMOTE_CLOSE, cproton.PN_LINK_REMOTE_DETACH,
    cproton.PN_TRANSPORT_ERROR, cproton.PN_TRANSPORT_CLOSED,
])
_EVENT_WHAT = {cproton.PN_CONNECTION_REMOTE_OPEN: "open", cproton.PN_SESSION_REMOTE_OPEN: "begin",
               cproton.PN_LINK_REMOTE_OPEN: "attach", cproton.PN_LINK_REMOTE_CLOSE: "detach",
               cproton.PN_LINK_REMOTE_DETACH: "detach", cproton.PN_SESSION_REMOTE_CLOSE: "end",
               cproton.PN_CONNECTION_REMOTE_CLOSE: "close"}
_E_CONN_REMOTE_OPEN = Event.CONNECTION_REMOTE_OPEN
_E_CONN_REMOTE_CLOSE = Event.CONNECTION_REMOTE_CLOSE
_E_SESSION_REMOTE_OPEN = Event.SESSION_REMOTE_OPEN
_E_SESSION_REMOTE_CLOSE = Event.SESSION_REMOTE_CLOSE
_E_LINK_REMOTE_OPEN = Event.LINK_REMOTE_OPEN
_E_LINK_REMOTE_CLOSE = Event.LINK_REMOTE_CLOSE
_E_LINK_REMOTE_DETACH = Event.LINK_REMOTE_DETACH
_E_TRANSPORT_CLOSED = Event.TRANSPORT_CLOSED
_E_TRANSPORT_ERROR = Event.TRANSPORT_ERROR

from broker.amqp.pn import (  # noqa: E402 - the engine's own short names
    pn_collector_peek as _pn_collector_peek,
    pn_collector_pop as _pn_collector_pop,
    pn_event_type as _pn_event_type,
    pn_event_delivery as _pn_event_delivery,
    pn_event_link as _pn_event_link,
    pn_delivery_link as _pn_delivery_link,
    pn_delivery_partial as _pn_delivery_partial,
    pn_delivery_readable as _pn_delivery_readable,
    pn_delivery_pending as _pn_delivery_pending,
    pn_delivery_settled as _pn_delivery_settled,
    pn_delivery_updated as _pn_delivery_updated,
    pn_delivery_settle as _pn_delivery_settle,
    pn_delivery_update as _pn_delivery_update,
    pn_delivery_remote_state as _pn_delivery_remote_state,
    pn_delivery_remote as _pn_delivery_remote,
    pn_delivery as _pn_delivery,
    pn_link_recv as _pn_link_recv,
    pn_link_send as _pn_link_send,
    pn_link_advance as _pn_link_advance,
    pn_link_credit as _pn_link_credit,
    pn_link_flow as _pn_link_flow,
    pn_link_get_drain as _pn_link_get_drain,
    pn_link_drained as _pn_link_drained,
)
_from_buffer = ffi.from_buffer


def _routing_type_from(terminus: Terminus, caps: set[str] | None = None) -> str | None:
    caps = _capabilities(terminus) if caps is None else caps
    if "topic" in caps or "multicast" in caps:
        return MULTICAST
    if "queue" in caps or "anycast" in caps:
        return ANYCAST
    return None


# Terminus capabilities the broker honours (echoed in the attach reply only when in force):
# the routing-type ones (Artemis/Qpid JMS), and those of a dynamic node (Qpid JMS temp queues).
_ROUTING_CAPS = {ANYCAST: ("queue", "anycast"), MULTICAST: ("topic", "multicast")}
_TEMP_CAPS = ("temporary-queue",)
# Qpid JMS asks these for shared subscriptions, which this broker does not have: refuse, never
# hand out an unshared subscription under a shared name
_REFUSED_CAPS = {"shared": "shared subscriptions", "global": "global shared subscriptions"}

SELECTOR_FILTER = "apache.org:selector-filter:string"
SELECTOR_FILTER_CODE = 0x0000468C00000004
NO_LOCAL_FILTER = "apache.org:no-local-filter:list"
NO_LOCAL_FILTER_CODE = 0x0000468C00000003
LINK_STOLEN = "amqp:link:stolen"
RESOURCE_LOCKED = "amqp:resource-locked"
NOT_IMPLEMENTED = "amqp:not-implemented"


class _Refused(Exception):
    """An attach the broker refuses: ``condition`` and ``description`` go into the detach."""

    def __init__(self, condition: str, description: str):
        super().__init__(description)
        self.condition = condition
        self.description = description


def _source_filters(terminus: Terminus) -> tuple[str | None, bool, dict]:
    """``(selector, no_local, applied)`` from a source's filter set (§3.5.8), or ``_Refused``.

    ``applied`` is the part of the filter set in force (echoed in the attach reply, §3.5.3: a
    filter left out of the reply was not applied). A filter the broker does not implement is
    refused with ``amqp:not-implemented`` naming it, rather than ignored.
    """
    data = terminus.filter
    if data is None:
        return None, False, {}
    data.rewind()
    if not data.next():
        return None, False, {}
    fmap = data.get_object()
    if not isinstance(fmap, dict):
        raise _Refused(DECODE_ERROR, "the source's filter set is not a map")
    selector = None
    no_local = False
    applied = {}
    for key, value in fmap.items():
        desc = getattr(value, "descriptor", None)
        inner = getattr(value, "value", None)
        name = str(desc) if desc is not None else None
        if desc == SELECTOR_FILTER_CODE or name == SELECTOR_FILTER:
            if not isinstance(inner, str):
                raise _Refused(INVALID_FIELD, f"filter {key!s}: a selector must be a string")
            selector = inner
            applied[key] = value
        elif desc == NO_LOCAL_FILTER_CODE or name == NO_LOCAL_FILTER:
            no_local = True
            applied[key] = value
        else:
            shown = f"0x{desc:016x}" if isinstance(desc, int) else (name or repr(value))
            raise _Refused(NOT_IMPLEMENTED, f"filter {key!s} ({shown}) is not supported by this broker")
    return selector, no_local, applied


# -- link wrappers ---------------------------------------------------------------------------

class ProducerLink:
    """A client's sending link (our receiver). ``address`` None = anonymous relay."""

    __slots__ = ("link", "impl", "address", "messages", "bytes", "allowed", "routing_type")

    def __init__(self, link: Link, address: str | None):
        self.routing_type: str | None = None
        self.link = link
        self.impl = link._impl
        self.address = address
        self.messages = 0
        self.bytes = 0
        self.allowed: dict[str, bool] = {}  # anonymous relay: per-address send permission


class ConsumerLink:
    """A client's receiving link (our sender), bound to one queue through a Subscription."""

    __slots__ = ("link", "impl", "address", "queue", "sub", "messages", "bytes", "next_tag", "durable_sub",
                 "presettled", "inflight", "engine", "browser")

    def __init__(self, link: Link, address: str, engine: "AmqpEngine | None" = None):
        self.engine = engine
        self.browser = False
        self.link = link
        self.impl = link._impl
        self.inflight: dict = {}  # raw pn_delivery_t* -> message id
        self.address = address
        self.queue = None
        self.sub: Subscription | None = None
        self.messages = 0
        self.bytes = 0
        self.next_tag = 0
        self.durable_sub = False
        self.presettled = False


def read_transfer(link, d) -> bytes:
    """The whole payload of a complete transfer (raw ``pn_link_t*``, ``pn_delivery_t*``), and
    move the link on to the next delivery."""
    n = _pn_delivery_pending(d)
    buf = bytearray(n)
    got = _pn_link_recv(link, _from_buffer(buf), n)
    _pn_link_advance(link)
    if got < n:
        del buf[max(got, 0):]
    return bytes(buf)


def to_proton(value):
    """A value built with :mod:`broker.wire.codec` types (``Symbol``, ``Int``, in maps and
    lists; :func:`broker.wire.frames.redirect_info`, ``failover_server_entries``) as proton
    encodes the same AMQP types (``symbol``, ``int32``)."""
    if isinstance(value, Symbol):
        return symbol(str(value))
    if isinstance(value, Int):
        return int32(int(value))
    if isinstance(value, dict):
        return {to_proton(k): to_proton(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_proton(v) for v in value]
    return value


# -- the engine ------------------------------------------------------------------------------


def _attach_extras(link: Link, owned: OwnedLink) -> None:
    """An owned link's capabilities and properties, onto the attach we send. The capabilities
    go on the target terminus (proton-c 0.40 has no link-level capabilities): the node that
    receives on the link names what it wants (attaching) or offers (answering)."""
    if owned.capabilities:
        data = link.target.capabilities
        data.put_array(False, Data.SYMBOL)
        data.enter()
        for c in owned.capabilities:
            data.put_symbol(symbol(c))
        data.exit()
    if owned.properties:
        link.properties = {symbol(k): v for k, v in owned.properties.items()}


class AmqpEngine:
    """Proton engine for one connection: accepted, or dialled (``client=True``). See the module
    docstring; ``host`` is its :class:`~broker.amqp.host.EngineHost`."""

    def __init__(self, host: "EngineHost", *, conn_id: str, principal, source: str, tls: bool,
                 wake: Callable[[], None], anycast_prefix: str = "", multicast_prefix: str = "",
                 client: bool = False, hostname: str | None = None, open_properties: dict | None = None):
        """``open_properties`` (client mode): more properties of our Open, for this connection."""
        self.host = host
        self.client = client
        self.settings = settings = host.settings
        self._count = host.count
        self.prefixes = tuple((p, rt) for p, rt in ((anycast_prefix, ANYCAST), (multicast_prefix, MULTICAST)) if p)
        self.core = host.core
        self.conn_id = conn_id
        self.principal = principal
        self.user = getattr(principal, "user", None) if principal is not None else None
        self.source = source
        self.tls = tls
        self.wake = wake
        self.container_id: str | None = None
        self.opened = False
        self.closed = False  # transport finished (both directions)
        self.error: Condition | None = None
        #: the condition of the peer's Close (a client engine), apart from errors found here
        self.remote_error: Condition | None = None
        self._wrote_any = False  # proton's protocol header has gone out (it is the first output)
        self._fail_open: tuple[str, str] | None = None  # see fail_before_open()

        self.transport = Transport(Transport.CLIENT if client else Transport.SERVER)
        self.transport.max_frame_size = settings.max_frame_bytes
        # §2.7.1 channel-max bounds the session table proton keeps: channels 0..max-sessions,
        # i.e. one spare channel on which a client asking for one session too many is told why
        # (End with amqp:resource-limit-exceeded, see _slow_event); beyond it proton answers
        # with a framing error
        self.transport.channel_max = min(settings.max_sessions, 65535)
        if settings.idle_timeout_s:
            self.transport.idle_timeout = settings.idle_timeout_s
        self.connection = Connection()
        self.collector = Collector()
        self.connection.collect(self.collector)
        self.transport.bind(self.connection)
        self.window = settings.producer_window
        # keyed by the raw pn_link_t* (cffi pointers hash and compare by address)
        self.producers: dict[object, ProducerLink] = {}
        self.consumers: dict[object, ConsumerLink] = {}
        self._collector_impl = self.collector._impl
        # (address, direction) -> [messages, bytes] folded in from closed links since last flush
        self.activity_done: dict[tuple[str, str], list[int]] = {}
        self.sessions = 0  # sessions open now ([amqp] max-sessions)
        self.refused_links: set = set()  # raw pn_link_t* we refused, until the client detaches them
        self.limits = settings.limits.for_user(self.user)
        self.user_counted = False  # counted against the user's max-connections (Node)
        self.txn: TxnCoordinator | None = None  # once a coordinator link attaches (broker.amqp.txn)
        self.owned: dict = {}  # client mode: raw pn_link_t* -> the owner's handler (open_link)
        self._session = None   # client mode: the session our owned links use
        self.on_open: Callable[["AmqpEngine"], None] | None = None  # client mode: told after the host
        self.remote_properties = None  # client mode: the peer's Open properties
        #: the client's Open desired ``lodestone:follows-redirect`` (frames.FOLLOWS_REDIRECT): a
        #: failback, scale-down or management close may send it ``amqp:connection:redirect``
        self.follows_redirect = False
        self.peer_broker = False
        #: closed to send its client elsewhere (Node.depart): the driver closes the socket soon
        #: after our Close instead of lingering for the client's answer
        self.departing = False
        #: ended without a Close (Node.depart, broker.core.departures.END_OF_STREAM): the pump
        #: writes nothing more and the driver closes the socket
        self.dropped = False
        self.before_output: Callable[[], None] | None = None  # see take_output
        if client:
            conn = self.connection
            conn.container = host.container_id
            if hostname:
                conn.hostname = hostname
            props = {symbol("product"): "lodestone", symbol("node-id"): host.node_id}
            for k, v in host.open_properties.items():
                props[symbol(k)] = v
            for k, v in (open_properties or {}).items():
                props[symbol(k)] = v
            conn.properties = props
            conn.open()

    # -- bytes in / out ------------------------------------------------------------------------
    def push(self, data: bytes) -> None:
        """Feed bytes read from the socket, then handle every resulting event (none once the
        connection was dropped: what a client sends after that is not acted on)."""
        if self.dropped:
            return
        t = self.transport
        while data:
            try:
                cap = t.capacity()
            except TransportException:
                cap = -1
            if cap <= 0:  # the transport reads no more (error or closed): drop the rest
                break
            if len(data) <= cap:
                t.push(data)
                break
            t.push(data[:cap])
            data = data[cap:]
        self.process()

    def close_input(self) -> None:
        """The peer closed its sending side (EOF)."""
        if self._fail_open is not None:
            return  # our failed Open + Close are queued; proton must not write its own close first
        conn = self.connection
        if self.opened and not conn.state & Endpoint.REMOTE_CLOSED and conn.state & Endpoint.LOCAL_ACTIVE:
            # EOF without Close (a crashed client, a truncated frame): say so in our Close
            # (§2.7.9), as proton does for its own framing errors, before the tail goes away.
            self.error = Condition(FRAMING_ERROR, "connection aborted: end of stream before close")
            conn.condition = self.error
            conn.close()
            self.process()
        self.transport.close_tail()
        self.process()
        if not self.opened and not self.closed and self.transport.condition is None:
            # proton answers EOF right after the header with Open+Close(framing-error) itself,
            # but says nothing when the stream ends inside a frame: write that Close ourselves
            self.fail_before_open(FRAMING_ERROR, "end of stream inside a frame before open")

    def fail_before_open(self, condition: str, description: str) -> bool:
        """Close a connection whose client has not opened it (yet) with an AMQP error.

        The next :meth:`take_output` ends with our header (unless already written), a failed
        Open and ``Close(condition, description)``, then marks the engine closed. False (and
        nothing done) once the client's Open has arrived or the engine is closed.
        """
        if self.opened or self.closed or self._fail_open is not None:
            return False
        if self.client:  # our Open went out first: close it with the error (§2.4.1)
            if not self.connection.state & Endpoint.LOCAL_ACTIVE:
                return False
            self.error = Condition(condition, description)
            self.connection.condition = self.error
            self.connection.close()  # (may run inside process(): proton encodes it on take_output)
            self.wake()
            return True
        self._fail_open = (condition, description)
        self.error = Condition(condition, description)
        self.wake()
        return True

    def take_output(self) -> bytes:
        """Everything the transport wants to write now (b"" if nothing). ``before_output`` (a
        client-mode owner's) runs first, so what it sends leaves in this write."""
        if self.before_output is not None and not self.closed:
            self.before_output()
        t = self.transport
        out = []
        while True:
            p = t.pending()
            if p <= 0:
                if p < 0:
                    self._transport_done()
                break
            chunk = t.peek(p)
            t.pop(len(chunk))
            out.append(chunk)
        if self._fail_open is not None and not self.closed:
            if out:
                self._wrote_any = True
            out.append(close_frames(*self._fail_open, header_sent=self._wrote_any, open_sent=False,
                                    container_id=self.host.container_id))
            self._fail_open = None
            self._transport_done()
        elif out and not self._wrote_any:
            self._wrote_any = True
        return b"".join(out) if len(out) != 1 else out[0]

    @property
    def closing(self) -> bool:
        """This side is ending the connection: a Close of ours (an error, shutdown, the idle
        timeout), a transport error, or done. What is left to write must go out within a grace
        period: a peer that reads nothing (a silent partition) must not hold the connection."""
        if self.closed or self.dropped or self._fail_open is not None or self.transport.condition is not None:
            return True
        return bool(self.connection.state & Endpoint.LOCAL_CLOSED)

    def tick(self, now: float) -> float:
        """Run proton's timers (idle timeout, heartbeats); returns the next deadline or 0."""
        deadline = self.transport.tick(now)
        self.process()
        return deadline

    def drop(self) -> None:
        """End the connection without a Close, as a broker that stops would: the pump writes
        nothing more (what proton still holds is discarded) and the driver closes the socket.
        Every client treats that as a lost connection and reconnects at once; after a Close with
        ``amqp:connection:forced`` a proton client waits for its next heartbeat instead."""
        if self.closed:
            return
        self.dropped = True
        self.wake()

    def abort(self, condition: str, description: str, info: dict | None = None) -> None:
        """Close the connection from our side with an error (e.g. shutdown, store failure);
        ``info``: the error's info map, codec types (a redirect's, ``frames.redirect_info``)."""
        if self.closed:
            return
        if not self.opened:
            self.fail_before_open(condition, description)
            return
        self.connection.condition = Condition(condition, description, to_proton(info) if info else None)
        self.connection.close()
        self.process()

    def decode_failed(self, description: str) -> None:
        """The client sent something we cannot decode: close with ``amqp:decode-error`` (§2.8.15)."""
        if self.closed or (self.error is not None and self.error.name == DECODE_ERROR):
            return
        # the connection's close line (Node.connection_closed) logs condition and description
        self._count("decode_error")
        self.error = Condition(DECODE_ERROR, description)
        if not self.opened:
            self.fail_before_open(DECODE_ERROR, description)
            return
        self._cleanup_links()
        self.connection.condition = self.error
        self.connection.close()
        # have proton encode our Close now: an EOF right behind the bad frame (close_tail) would
        # otherwise make it write its own Close(framing-error) instead
        self.transport.pending()
        self.wake()

    def limit_exceeded(self, limit: str, value: int, what: str, *, log_line: bool = True) -> str:
        """Count and log one refusal by a resource limit; returns the AMQP error description."""
        self._count(f"resource_limit_{limit.replace('-', '_')}")
        description = f"{what}: {limit} {value} reached"
        if log_line:
            log.info("resource limit exceeded", extra={"fields": {
                "conn": self.conn_id, "user": self.user, "source": self.source, "limit": limit, "value": value}})
        return description

    # -- events --------------------------------------------------------------------------------
    def process(self) -> None:
        """Handle every pending collector event (fast path for transfers, dispositions, flow)."""
        col = self._collector_impl
        while True:
            ev = _pn_collector_peek(col)
            if not ev:
                return
            t = _pn_event_type(ev)
            try:
                if t == _PN_DELIVERY:
                    self._on_delivery(_pn_event_delivery(ev))
                elif t == _PN_LINK_FLOW:
                    self._on_flow(_pn_event_link(ev))
                elif t in _SLOW_EVENTS:
                    try:
                        self._slow_event(Event.wrap(ev))
                    except UnicodeDecodeError as exc:
                        # proton does not check UTF-8; its Python binding decodes on access
                        self.decode_failed(f"a string in a {_EVENT_WHAT.get(t, 'frame')} is not valid "
                                           f"UTF-8: {exc.reason} at byte {exc.start}")
            finally:
                _pn_collector_pop(col)

    def _slow_event(self, ev: Event) -> None:
        if self._fail_open is not None:
            return  # closing before open: nothing the client sent after that matters
        t = ev.type
        if self.owned and t in (_E_LINK_REMOTE_OPEN, _E_LINK_REMOTE_CLOSE, _E_LINK_REMOTE_DETACH) \
                and ev.link._impl in self.owned:
            self._owned_event(t, ev.link)
            return
        if t is _E_LINK_REMOTE_OPEN:
            if self.client:  # a peer attaching links of its own: not (yet) something we serve
                self._refuse(ev.link, "amqp:not-allowed", "this connection does not accept links from the peer")
                return
            self._attach(ev.link)
        elif t is _E_LINK_REMOTE_CLOSE:
            self._detach(ev.link, closed=True)
        elif t is _E_LINK_REMOTE_DETACH:
            self._detach(ev.link, closed=False)
        elif t is _E_SESSION_REMOTE_OPEN:
            if not self.opened:  # §2.4.1: Open is the first frame; proton lets a Begin through
                self.fail_before_open(ILLEGAL_STATE, "begin received before open")
                return
            session = ev.session
            limit = self.settings.max_sessions
            session.open()
            if self.sessions >= limit:
                # §2.7.2/§2.7.7: answer the begin, then end the session with the error
                session.condition = Condition(RESOURCE_LIMIT, self.limit_exceeded(
                    "max-sessions", limit, f"connection has {self.sessions} sessions open"))
                session.close()
                return
            self.sessions += 1
        elif t is _E_SESSION_REMOTE_CLOSE:
            if ev.session.condition is None or ev.session.condition.name != RESOURCE_LIMIT:
                self.sessions = max(self.sessions - 1, 0)
            self._end_session(ev.session)
        elif t is _E_CONN_REMOTE_OPEN:
            self._open(ev.connection)
        elif t is _E_CONN_REMOTE_CLOSE:
            if self.client and self.error is None:
                self.error = self.remote_error = ev.connection.remote_condition
            self._cleanup_links()
            ev.connection.close()
        elif t is _E_TRANSPORT_ERROR:
            self.error = ev.transport.condition
        elif t is _E_TRANSPORT_CLOSED:
            self._transport_done()

    def _open(self, conn: Connection) -> None:
        if self.client:  # the peer answered our Open
            self.container_id = conn.remote_container
            self.remote_properties = conn.remote_properties
            self.opened = True
            self.host.connection_opened(self)
            if self.on_open is not None:
                self.on_open(self)
            return
        self.container_id = conn.remote_container
        conn.remote_hostname  # noqa: B018 - decoding it checks its UTF-8 (we do not use it)
        caps = conn.remote_desired_capabilities
        self.follows_redirect = bool(caps) and FOLLOWS_REDIRECT in [str(c) for c in caps]
        rprops = conn.remote_properties
        #: another broker's broker connection (its Open carries ``broker-connection-info``, as
        #: Lodestone's and Artemis's do): not a client, never closed as one
        self.peer_broker = bool(rprops) and any(str(k) == "broker-connection-info" for k in rprops)
        conn.container = self.host.container_id
        conn.offered_capabilities = [symbol("ANONYMOUS-RELAY")]
        props = {symbol("product"): "lodestone", symbol("node-id"): self.host.node_id}
        for k, v in self.host.server_open_properties.items():
            props[symbol(k)] = v
        conn.properties = props
        conn.open()
        self.opened = True
        self.host.connection_opened(self)

    # -- client mode: the owner's links -----------------------------------------------------
    def open_link(self, handler: LinkHandler, *, name: str, sender: bool, address: str,
                  credit: int = 0, capabilities: tuple[str, ...] = (), properties: dict | None = None) -> OwnedLink:
        """Client mode: attach a link of ours (a sender to ``address`` at the peer, or a receiver
        from it, its credit kept topped up to ``credit``); ``handler`` gets its events
        (:mod:`broker.amqp.links`). ``capabilities`` are desired, ``properties`` the attach's."""
        if not self.client:
            raise RuntimeError("open_link is for client-mode engines")
        if self._session is None:
            self._session = self.connection.session()
            self._session.open()
        link = self._session.sender(name) if sender else self._session.receiver(name)
        if sender:
            link.target.address = address
            link.source.address = name
        else:
            link.source.address = address
            link.target.address = name
        link.snd_settle_mode = Link.SND_UNSETTLED
        link.rcv_settle_mode = Link.RCV_FIRST
        owned = OwnedLink(self, link._impl, name=name, address=address, is_sender=sender,
                          credit_window=0 if sender else credit)
        owned.capabilities = tuple(capabilities)
        owned.properties = dict(properties or {})
        _attach_extras(link, owned)
        owned.handler = handler
        self.owned[link._impl] = owned
        link.open()
        if credit and not sender:
            link.flow(credit)
        self._count("links_opened")
        self.wake()  # (may run inside process(), from on_open: the events wait for the next pass)
        return owned

    def close_with(self, condition: str, description: str) -> None:
        """Close the connection with an error without handling events now (safe inside a
        handler called by :meth:`process`); proton writes the Close on the next take_output."""
        if self.closed:
            return
        if not self.opened:
            self.fail_before_open(condition, description)
            return
        if self.error is None:
            self.error = Condition(condition, description)
        self.connection.condition = Condition(condition, description)
        self.connection.close()
        self.wake()

    def _owned_event(self, t, link: Link) -> None:
        owned = self.owned[link._impl]
        if t is _E_LINK_REMOTE_OPEN:
            # §2.6.3: a refusal is an attach with a null terminus, followed by a detach; proton
            # shows a null terminus as one without an address (ours always have one)
            theirs = link.remote_target if link.is_sender else link.remote_source
            if theirs.address is not None or theirs.dynamic:
                owned.handler.on_attached(owned)
            return
        del self.owned[link._impl]
        if link.state & Endpoint.LOCAL_ACTIVE:
            link.close()
        owned.handler.on_detached(owned, link.remote_condition)

    # -- attach ----------------------------------------------------------------------------
    def _refuse(self, link: Link, condition: str, description: str) -> None:
        """Refuse an attach (§2.6.3): answer with a null terminus, then detach with the error.

        Proton keeps a refused link until the client answers our detach; a client that keeps
        attaching without ever answering would grow that without bound, so once more refused
        links wait for their detach than ``max-links`` allows, the connection is closed.
        """
        link.condition = Condition(condition, description)
        link.open()
        link.close()
        self.refused_links.add(link._impl)
        limit = self.settings.max_links
        if len(self.refused_links) > limit and self.connection.state & Endpoint.LOCAL_ACTIVE:
            # inside process(): close without re-entering it (abort() would)
            self.error = Condition(RESOURCE_LIMIT, self.limit_exceeded(
                "max-links", limit, f"{len(self.refused_links)} refused links not detached by the client"))
            self._cleanup_links()
            self.connection.condition = self.error
            self.connection.close()
            self.wake()

    def _attach(self, link: Link) -> None:
        # decode every string of the attach we might log or use (UnicodeDecodeError → decode-error)
        link.name, link.remote_source.address, link.remote_target.address  # noqa: B018
        limit = self.settings.max_links
        n = len(self.producers) + len(self.consumers) + (len(self.txn.links) if self.txn is not None else 0)
        if n >= limit:
            self._refuse(link, RESOURCE_LIMIT, self.limit_exceeded(
                "max-links", limit, f"connection has {n} links attached"))
            return
        asked = link.remote_target.address if link.is_receiver else link.remote_source.address
        if asked and (asked.startswith(INTERNAL_PREFIX) or asked.startswith(MIRROR_PREFIX)):
            self._attach_internal(link, asked)
            return
        if link.is_receiver:
            if is_coordinator(link):  # AMQP 1.0 §4.2: a transaction controller
                if self.txn is None:
                    self.txn = TxnCoordinator(self)
                self.txn.attach(link)
                return
            self._attach_producer(link)
        else:
            self._attach_consumer(link)

    def _attach_internal(self, link: Link, address: str) -> None:
        """An attach to a broker-internal address: the service the host registered for it owns
        the link (:mod:`broker.amqp.links`), or it is refused."""
        service = self.host.services.find(address)
        owned = OwnedLink(self, link._impl, name=link.name, address=address, is_sender=link.is_sender)
        handler = service.attach(self, owned) if service is not None else None
        if handler is None or isinstance(handler, tuple):
            cond, desc = handler if isinstance(handler, tuple) else (NOT_FOUND, f"address {address!r} is internal")
            self._refuse(link, cond, desc)
            return
        if link.is_receiver:
            link.target.address = address
            link.source.copy(link.remote_source)
            link.snd_settle_mode = link.remote_snd_settle_mode
            link.rcv_settle_mode = Link.RCV_FIRST
        else:
            link.source.address = address
            link.target.copy(link.remote_target)
            link.snd_settle_mode = Link.SND_UNSETTLED
        _attach_extras(link, owned)
        link.open()
        owned.handler = handler
        self.owned[link._impl] = owned
        self._count("links_opened")
        handler.on_attached(owned)
        self.wake()

    def accept_when_synced(self, d) -> None:
        """Accept a received delivery (raw ``pn_delivery_t*``) once the journal records written so
        far are durable (for an internal link's handler; see ``_publish``)."""
        lib.pn_incref(d)
        self.host.await_sync(self, d)

    def accept(self, d) -> None:
        """Accept and settle a received delivery (raw ``pn_delivery_t*``) now."""
        if not _pn_delivery_settled(d):
            _pn_delivery_update(d, _ACCEPTED)
        _pn_delivery_settle(d)
        self.wake()

    def reject(self, d, condition: str, description: str) -> None:
        self._reject(d, condition, description)
        self.wake()

    def _strip_prefix(self, address: str) -> tuple[str, str | None]:
        """An acceptor's anycast/multicast prefix (Artemis ``anycastPrefix``/``multicastPrefix``)
        names the routing type: ``topic://prices`` is the multicast address ``prices``."""
        for prefix, rt in self.prefixes:
            if address.startswith(prefix) and len(address) > len(prefix):
                return address[len(prefix):], rt
        return address, None

    @staticmethod
    def _reply_terminus(mine: Terminus, theirs: Terminus, *, address: str | None, caps: list[str]) -> None:
        """Our side of the attach: what the client asked for that is in force, and no more."""
        mine.address = address
        mine.durability = theirs.durability
        mine.expiry_policy = theirs.expiry_policy
        mine.timeout = theirs.timeout
        if caps:
            mine.capabilities.put_array(False, Data.SYMBOL)
            mine.capabilities.enter()
            for c in caps:
                mine.capabilities.put_symbol(symbol(c))
            mine.capabilities.exit()

    def _attach_producer(self, link: Link) -> None:
        rtgt = link.remote_target
        asked = rtgt.address
        caps = _capabilities(rtgt)
        if rtgt.dynamic:
            self._refuse(link, NOT_IMPLEMENTED, "a dynamic target (a sender creating a temporary node) is not "
                                                "supported; attach a dynamic receiver for a temporary queue")
            return
        address, rt = self._strip_prefix(asked) if asked else (asked, None)
        echo: list[str] = []
        if address:
            rt = rt or _routing_type_from(rtgt, caps)
            err = self._resolve(address, rt, "send")
            if err:
                self._refuse(link, *err)
                return
            if rt is not None:
                echo = [c for c in _ROUTING_CAPS[rt] if c in caps]
        self._reply_terminus(link.target, rtgt, address=asked, caps=echo)
        link.source.copy(link.remote_source)
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = Link.RCV_FIRST
        link.open()
        pl = ProducerLink(link, address or None)
        pl.routing_type = rt if address else None
        self.producers[link._impl] = pl
        link.flow(self.window)
        self._count("links_opened")

    def _resolve(self, address: str, routing_type: str | None, permission: str) -> tuple[str, str] | None:
        """Check ``permission`` on ``address`` and make it exist; an error tuple or None."""
        host = self.host
        if address.startswith(INTERNAL_PREFIX):
            return NOT_FOUND, f"address {address!r} is internal"
        if not host.authorize(self.principal, permission, address):
            return UNAUTHORIZED, f"user {self.user or '<anonymous>'} may not {permission} on {address!r}"
        core = self.core
        need = core.needs_create(address, routing_type)
        may_create = not need or host.authorize(self.principal, "createAddress", address)
        if need and may_create and core.creates_queue(address, routing_type):
            err = self._queue_quota()
            if err:
                return err
        try:
            core.resolve(address, routing_type, may_create=may_create, owner=self.user)
        except AddressNotFound as exc:
            if need and not may_create and core.settings.for_address(address).auto_create:
                return UNAUTHORIZED, (f"user {self.user or '<anonymous>'} may not createAddress "
                                      f"{address!r}")
            return NOT_FOUND, exc.description
        if need:
            host.address_created(address)
        return None

    def _queue_quota(self) -> tuple[str, str] | None:
        """The user's ``max-queues`` (queues its links created): an error tuple or None."""
        limit = self.limits.max_queues
        if limit < 0:
            return None
        have = self.core.owned[self.user]
        if have < limit:
            return None
        return RESOURCE_LIMIT, self.limit_exceeded(
            "max-queues", limit, f"user {self.user or '<anonymous>'} has created {have} queues")

    def _attach_consumer(self, link: Link) -> None:
        try:
            self._attach_consumer_or_refuse(link)
        except _Refused as r:
            self._refuse(link, r.condition, r.description)

    def _attach_consumer_or_refuse(self, link: Link) -> None:
        """A client's receiving link: the queue it reads, how (browse, filters), and our reply.

        The reply's source carries only what is in force (§3.5.3): the filters applied, the
        distribution mode honoured, the routing-type capabilities used. Anything the broker
        does not do is refused with ``amqp:not-implemented`` naming it.
        """
        rsrc = link.remote_source
        caps = _capabilities(rsrc)
        for cap, what in _REFUSED_CAPS.items():
            if cap in caps:
                raise _Refused(NOT_IMPLEMENTED, f"capability {cap!r}: {what} are not supported by this broker")
        dist = rsrc.distribution_mode
        browse = dist == Terminus.DIST_MODE_COPY
        selector, no_local, applied = _source_filters(rsrc)
        core = self.core
        if rsrc.dynamic:
            q = self._dynamic_queue(link)
            echo = [c for c in _TEMP_CAPS if c in caps]
            address = asked = q.name
            durable = False
            accepts = self._consumer_filter(selector, no_local)
        else:
            asked = rsrc.address
            if not asked:
                raise _Refused(NOT_FOUND, "a consumer link needs a source address (or dynamic = true)")
            address, rt = self._strip_prefix(asked)
            rt = rt or _routing_type_from(rsrc, caps)
            err = self._resolve(address, rt, "consume")
            if err:
                raise _Refused(*err)
            addr = core.addresses[address]
            use_multicast = rt == MULTICAST or (rt is None and ANYCAST not in addr.routing_types)
            echo = [c for c in _ROUTING_CAPS[MULTICAST if use_multicast else ANYCAST] if c in caps]
            durable = False
            if use_multicast and not browse:
                durable = (rsrc.durability != Terminus.NONDURABLE or rsrc.expiry_policy == Terminus.EXPIRE_NEVER)
                q = self._subscription_queue(link, address, durable, selector, no_local)
                accepts = None  # the subscription queue's own filter (Broker.publish) does it
            elif use_multicast:
                raise _Refused(NOT_IMPLEMENTED, "browsing (distribution-mode copy) a multicast address is not "
                                                "supported: browse a queue")
            else:
                try:
                    q = core.anycast_queue(address)
                except KeyError:
                    raise _Refused(NOT_FOUND, f"address {address!r} has no anycast queue") from None
                accepts = self._consumer_filter(selector, no_local)
        self._reply_terminus(link.source, rsrc, address=asked, caps=echo)
        if rsrc.dynamic:
            link.source.dynamic = True
        if browse:
            link.source.distribution_mode = Terminus.DIST_MODE_COPY
        elif dist == Terminus.DIST_MODE_MOVE:
            link.source.distribution_mode = Terminus.DIST_MODE_MOVE
        if applied:
            link.source.filter.put_object(applied)
        link.target.copy(link.remote_target)
        cl = ConsumerLink(link, address, self)
        cl.durable_sub = durable
        cl.browser = browse
        # a browser's deliveries are pre-settled: nothing it is shown is acquired (§3.4, copy)
        cl.presettled = browse or link.remote_snd_settle_mode == Link.SND_SETTLED
        link.snd_settle_mode = Link.SND_SETTLED if browse else link.remote_snd_settle_mode
        link.rcv_settle_mode = Link.RCV_FIRST
        link.open()
        cl.queue = q
        sub = Subscription(self._sink, auto_ack=cl.presettled and not browse, owner=cl, accepts=accepts,
                           browser=browse, filter_text=selector if accepts is not None else None)
        cl.sub = sub
        self.consumers[link._impl] = cl
        self._count("links_opened")
        sub.credit = link.credit
        q.add_subscription(sub)

    def _consumer_filter(self, selector: str | None, no_local: bool):
        try:
            return consumer_filter(selector, self.conn_id if no_local else None)
        except SelectorError as exc:
            raise _Refused(exc.condition, str(exc)) from None

    def _dynamic_queue(self, link: Link):
        """A dynamic source (§3.5.3 ``dynamic``): a temporary queue with a unique address that
        lives as long as the link's consumer (Artemis's temporary queue for a dynamic node)."""
        host = self.host
        name = f"temp.{uuid.uuid4()}"
        if not host.authorize(self.principal, "createAddress", name):
            raise _Refused(UNAUTHORIZED, f"user {self.user or '<anonymous>'} may not createAddress "
                                         f"(a temporary queue)")
        err = self._queue_quota()
        if err:
            raise _Refused(*err)
        host.address_created(name)
        return self.core.temporary_queue(name, owner=self.user)

    def _subscription_queue(self, link: Link, address: str, durable: bool, selector: str | None, no_local: bool):
        """The queue of a multicast subscriber, its selector/no-local as the queue's filter.

        A durable subscription attached by another link (the same container-id and link name on
        another connection) is *stolen*: that link is detached with ``amqp:link:stolen`` and the
        subscription moves here (``[amqp] link-stealing``, on by default; off: this attach is
        refused with ``amqp:resource-locked``). A durable subscription re-attached with another
        selector is a new subscription: the old queue and its messages go (JMS/Artemis).
        """
        core = self.core
        sub_name = f"{self.container_id}.{link.name}"
        try:
            qfilter = consumer_filter(selector, self.conn_id if no_local else None)
        except SelectorError as exc:
            raise _Refused(exc.condition, str(exc)) from None
        if durable:
            existing = core.queues.get(sub_name)
            if existing is not None and existing.address == address:
                for other in list(existing.subs):
                    holder = other.owner
                    if not isinstance(holder, ConsumerLink) or holder.engine is None or holder.engine is self:
                        continue  # (the same connection twice: refused as attached already, below)
                    if not self.settings.link_stealing:
                        raise _Refused(RESOURCE_LOCKED, f"subscription {sub_name!r} is attached by another "
                                                        f"connection (link-stealing is off)")
                    holder.engine.steal(holder, f"subscription {sub_name!r} attached by connection {self.conn_id}")
                if existing.filter_text != selector and not existing.subs:
                    core.delete_queue(sub_name)
        if core.subscription_creates_queue(sub_name, durable=durable):
            err = self._queue_quota()
            if err:
                raise _Refused(*err)
        try:
            q = core.subscription_queue(address, sub_name, durable=durable, owner=self.user)
        except AddressNotFound as exc:
            raise _Refused(NOT_FOUND, exc.description) from None
        if q.subs:
            raise _Refused(RESOURCE_LOCKED, f"subscription {sub_name!r} is attached already")
        core.set_queue_filter(q.name, qfilter, selector)
        if durable and selector is not None and q.durable:
            self.core.store.queue_created(q.definition())  # the selector is part of the subscription
        return q

    def steal(self, cl: ConsumerLink, why: str) -> None:
        """Another connection took this link's durable subscription: detach it with
        ``amqp:link:stolen`` (§2.8.15) — the subscription itself stays (it is not closed)."""
        if self.consumers.get(cl.impl) is not cl:
            return
        self._count("links_stolen")
        log.info("link stolen", extra={"fields": {"conn": self.conn_id, "container_id": self.container_id,
                                                   "link": cl.link.name, "why": why}})
        self._forget_link(cl.link, closed=False)
        link = cl.link
        if link.state & Endpoint.LOCAL_ACTIVE:
            link.condition = Condition(LINK_STOLEN, why)
            link.close()
        self.process()
        self.wake()

    # -- detach ----------------------------------------------------------------------------
    def _detach(self, link: Link, *, closed: bool) -> None:
        self.refused_links.discard(link._impl)
        self._forget_link(link, closed=closed)
        if link.state & Endpoint.LOCAL_ACTIVE:
            if closed:
                link.close()
            else:
                link.detach()

    def _forget_link(self, link: Link, *, closed: bool) -> None:
        if self.txn is not None:
            self.txn.forget_link(link)
        pl = self.producers.pop(link._impl, None)
        if pl is not None:
            self._fold(pl.address or "", "produce", pl)
            return
        cl = self.consumers.pop(link._impl, None)
        if cl is not None:
            self._fold(cl.address, "consume", cl)
            q = cl.queue
            if cl.sub is not None and q is not None:
                q.remove_subscription(cl.sub)
                if closed and cl.durable_sub and not q.deleted and not q.subs:
                    # closing (not detaching) a link destroys its durable terminus (§2.6.3)
                    self.core.delete_queue(q.name)

    def _fold(self, address: str, direction: str, l) -> None:
        if l.messages or l.bytes:
            acc = self.activity_done.setdefault((address, direction), [0, 0])
            acc[0] += l.messages
            acc[1] += l.bytes
            l.messages = l.bytes = 0

    def _end_session(self, session) -> None:
        for w in [w for w in self.producers.values() if w.link.session == session] + \
                 [w for w in self.consumers.values() if w.link.session == session]:
            self._forget_link(w.link, closed=False)
        # the owners' links end with their session: RabbitMQ ends the session (amqp:not-found)
        # instead of refusing an attach to a queue it does not have
        ended = [raw for raw, o in self.owned.items() if o.proton.session == session]
        why = session.remote_condition or Condition("amqp:link:detach-forced", "the peer ended the session")
        for raw in ended:
            o = self.owned.pop(raw)
            o.handler.on_detached(o, why)
        if self.txn is not None:
            self.txn.end_session(session)
        session.close()

    def _cleanup_links(self) -> None:
        if self.owned and not self.client:  # the host's internal links end with the connection
            owned, self.owned = self.owned, {}
            for o in owned.values():
                o.handler.on_detached(o, None)
        for w in list(self.producers.values()):
            self._forget_link(w.link, closed=False)
        for w in list(self.consumers.values()):
            self._forget_link(w.link, closed=False)
        if self.txn is not None:
            self.txn.connection_ended()  # after the consumers left: nothing returns to them

    def finish(self) -> None:
        """The socket is gone: release everything this connection held (idempotent)."""
        self._transport_done()

    def _transport_done(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._cleanup_links()
        if self.error is None and self.transport.condition is not None:
            self.error = self.transport.condition
        self.host.connection_closed(self)

    # -- activity ------------------------------------------------------------------------------
    def take_activity(self) -> dict[tuple[str, str], list[int]]:
        """Counters since the last call, per (address, direction); resets them."""
        out = self.activity_done
        self.activity_done = {}
        for pl in self.producers.values():
            if pl.address is not None:
                self._fold_into(out, pl.address, "produce", pl)
        for cl in self.consumers.values():
            self._fold_into(out, cl.address, "consume", cl)
        return out

    @staticmethod
    def _fold_into(out, address, direction, l) -> None:
        if l.messages or l.bytes:
            acc = out.setdefault((address, direction), [0, 0])
            acc[0] += l.messages
            acc[1] += l.bytes
            l.messages = l.bytes = 0

    # -- flow and deliveries ---------------------------------------------------------------
    def _on_flow(self, link) -> None:
        """Flow on a link (raw ``pn_link_t*``): a consumer's credit changed."""
        cl = self.consumers.get(link)
        if cl is None:
            owned = self.owned.get(link)
            if owned is not None and owned.is_sender:
                owned.handler.on_credit(owned)
            return
        sub = cl.sub
        credit = _pn_link_credit(link)
        sub.credit = credit
        if credit > 0:
            cl.queue.credit_changed(sub)
            if _pn_link_get_drain(link) and _pn_link_credit(link) > 0:
                # §2.6.7 drain: nothing more to send now — consume the rest of the credit
                _pn_link_drained(link)
                sub.credit = 0
        self.wake()

    def _owned_delivery(self, owned: OwnedLink, link, d) -> None:
        """A transfer on a service's receiving link, or a disposition on its sending link
        (:mod:`broker.amqp.links`)."""
        if owned.is_sender:
            if not (_pn_delivery_updated(d) or _pn_delivery_settled(d)):
                return
            remote = _pn_delivery_remote_state(d)
            if remote == _RECEIVED:
                return
            token = owned.inflight.pop(d, None)
            _pn_delivery_settle(d)
            outcome = OUTCOMES.get(remote)
            if token is not None and outcome is not None:
                owned.handler.on_outcome(owned, token, outcome)
            return
        if _pn_delivery_partial(d) or not _pn_delivery_readable(d):
            return
        data = read_transfer(link, d)
        window = owned.credit_window
        if window:
            credit = _pn_link_credit(link)
            if credit < window >> 1:
                _pn_link_flow(link, window - credit)
        owned.handler.on_message(owned, data, Incoming(self, d))

    def _sink(self, sub: Subscription, msg) -> None:
        """Core → wire: send one message on a consumer link."""
        cl: ConsumerLink = sub.owner
        link = cl.impl
        cl.next_tag += 1
        tag = b"%x" % cl.next_tag
        d = _pn_delivery(link, (len(tag), _from_buffer(tag)))
        body = msg.body if msg.delivery_count == 0 else with_delivery_count(msg.body, msg.delivery_count)
        _pn_link_send(link, _from_buffer(body), len(body))
        _pn_link_advance(link)
        cl.messages += 1
        cl.bytes += len(body)
        if cl.presettled:
            _pn_delivery_settle(d)
        else:
            cl.inflight[d] = msg.mid
        self.wake()

    def _on_delivery(self, d) -> None:
        """A transfer arrived or a disposition changed (raw ``pn_delivery_t*``)."""
        link = _pn_delivery_link(d)
        pl = self.producers.get(link)
        if pl is not None:
            if _pn_delivery_partial(d) or not _pn_delivery_readable(d):
                return
            data = read_transfer(link, d)
            if self.txn is not None and _pn_delivery_remote_state(d) == _TXN_STATE:
                self.txn.on_transfer(pl, d, data)  # §4.4.1 transactional send
            else:
                self._publish(pl, d, data)
            credit = _pn_link_credit(link)
            if credit < self.window >> 1:
                _pn_link_flow(link, self.window - credit)
            return
        cl = self.consumers.get(link)
        if cl is None:
            if self.txn is not None and self.txn.on_delivery(link, d):
                return  # a coordinator link's declare / discharge
            owned = self.owned.get(link)
            if owned is not None:
                self._owned_delivery(owned, link, d)
                return
            # a link we refused or forgot: just settle what arrives
            if _pn_delivery_readable(d) and not _pn_delivery_partial(d):
                n = _pn_delivery_pending(d)
                _pn_link_recv(link, _from_buffer(bytearray(n)), n)
                _pn_link_advance(link)
            if _pn_delivery_settled(d):
                _pn_delivery_settle(d)
            return
        # a consumer's disposition
        if not _pn_delivery_updated(d) and not _pn_delivery_settled(d):
            return
        state = _pn_delivery_remote_state(d)
        mid = cl.inflight.pop(d, None)
        if mid is not None:
            q = cl.queue
            sub = cl.sub
            if state == _ACCEPTED:
                q.settle(sub, mid, Outcome.ACCEPTED)
            elif state == _RELEASED:
                q.settle(sub, mid, Outcome.RELEASED)
            elif state == _REJECTED:
                q.settle(sub, mid, Outcome.REJECTED)
            elif state == _MODIFIED:
                disp = _pn_delivery_remote(d)
                q.settle(sub, mid, Outcome.MODIFIED, delivery_failed=bool(lib.pn_disposition_is_failed(disp)),
                         undeliverable_here=bool(lib.pn_disposition_is_undeliverable(disp)))
            elif state == _TXN_STATE and self.txn is not None:
                self.txn.on_disposition(cl, d, mid)  # §4.4.2 transactional acknowledgement
                return
            elif _pn_delivery_settled(d):
                # settled without a terminal outcome: treat as released (§3.4)
                q.settle(sub, mid, Outcome.RELEASED)
            else:
                cl.inflight[d] = mid  # 'received' (§3.4.1) is not terminal: keep waiting
                return
            _pn_delivery_settle(d)
        elif _pn_delivery_settled(d):
            _pn_delivery_settle(d)

    def relay_address(self, pl: ProducerLink, data: bytes) -> tuple[str | None, tuple[str, str] | None]:
        """The anonymous relay (§3.2.4 ``to``): ``(address, None)`` where this producer may send the
        message, else ``(None, (condition, description))``. Counts the message's activity."""
        try:
            address = message_to(data)
        except Exception as exc:  # proton's MessageException family, or UnicodeDecodeError
            self._count("message_decode_error")
            log.info("message rejected: cannot decode its properties", extra={"fields": {
                "conn": self.conn_id, "user": self.user, "source": self.source, "error": type(exc).__name__}})
            return None, (DECODE_ERROR, "message properties cannot be decoded (anonymous relay needs 'to')")
        if not address:
            return None, ("amqp:precondition-failed", "anonymous relay needs the message 'to' field")
        rt = None
        if self.prefixes:
            address, rt = self._strip_prefix(address)
        ok = pl.allowed.get(address)
        if ok is None:
            err = self._resolve(address, rt, "send")
            if len(pl.allowed) < 1024:
                pl.allowed[address] = err is None
            if err:
                return None, err
        elif not ok:
            return None, (UNAUTHORIZED, f"may not send to {address!r}")
        # per-message activity for the relay goes straight to the connection's folded counters
        acc = self.activity_done.setdefault((address, "produce"), [0, 0])
        acc[0] += 1
        acc[1] += len(data)
        return address, None

    def prepare_send(self, pl: ProducerLink, data: bytes):
        """What a producer's send needs before it is routed (``_publish``) or held in a
        transaction (``TxnCoordinator.on_transfer``): ``((address, durable, priority, expires,
        duplicate key), None)``, or ``(None, (condition, description))`` to reject it with —
        the anonymous relay's refusals, an unreadable or invalid ``_AMQ_DUPL_ID``."""
        address = pl.address
        if address is None:
            address, err = self.relay_address(pl, data)
            if err is not None:
                return None, err
        else:
            pl.messages += 1
            pl.bytes += len(data)
        durable, priority, expires = message_meta(data)
        key = None
        if may_carry_duplicate_id(data):  # _AMQ_DUPL_ID (Artemis duplicate detection)
            key, err = self.duplicate_key(data)
            if err is not None:
                return None, err
        return (address, durable, priority, expires, key), None

    def _publish(self, pl: ProducerLink, d, data: bytes) -> None:
        fence = getattr(self.host, "fence", None)
        if fence is not None and fence() is not None:
            # an HA member that lost its coordination lock (broker.ha.quorum): it acknowledges
            # nothing more; the connection ends as if the broker had stopped
            self.drop()
            return
        send, err = self.prepare_send(pl, data)
        if err is not None:
            self._reject(d, *err)
            return
        address, durable, priority, expires, key = send
        core = self.core
        local_only = False
        shared = getattr(self.host, "shared_queues", None)
        if shared is not None and address in shared.addresses:   # OpenAMQ's shared queue (broker.cluster.shared)
            if not shared.is_root:
                self._count("messages_in")
                if _pn_delivery_settled(d):
                    _pn_delivery_settle(d)
                    shared.relay(None, address, data, durable, priority, expires)
                else:
                    lib.pn_incref(d)   # answered with the root's answer (synced / refused)
                    shared.relay((self, d), address, data, durable, priority, expires)
                return
            local_only = shared.backlog(address)
        mark = core.sync_events
        if key is None:
            stored = core.publish(address, data, durable, priority, expires, self.conn_id, local_only=local_only)
        else:
            # a duplicate is not routed but answered as if it were: accepted (after the fsync
            # when its first copy was journaled), as Artemis answers it
            _duplicate, stored = core.publish_once(address, key, data, durable, priority, expires, self.conn_id,
                                                   local_only=local_only)
        self._count("messages_in")
        if _pn_delivery_settled(d):  # pre-settled by the producer (at-most-once): nothing to answer
            _pn_delivery_settle(d)
        elif stored or core.sync_events != mark:   # journaled, or a sync mirror's target must have it
            lib.pn_incref(d)  # keep the delivery alive until the fsync answer (see synced())
            self.host.await_sync(self, d)
        else:
            _pn_delivery_update(d, _ACCEPTED)
            _pn_delivery_settle(d)

    def duplicate_key(self, data: bytes) -> tuple[bytes | None, tuple[str, str] | None]:
        """The cache key of the message's ``_AMQ_DUPL_ID`` (None: it has none), or the
        ``(condition, description)`` to reject the transfer with: an id neither string nor binary
        (``amqp:invalid-field``, as Artemis fails it), application properties that cannot be
        walked (``amqp:decode-error``)."""
        try:
            found = message_duplicate_id(data)
        except InvalidDuplicateId as exc:
            self._count("duplicate_id_invalid")
            return None, (exc.condition, exc.description)
        except DecodeError as exc:
            self._count("message_decode_error")
            log.info("message rejected: cannot read its application properties", extra={"fields": {
                "conn": self.conn_id, "user": self.user, "source": self.source, "error": exc.description}})
            return None, (DECODE_ERROR, f"application-properties cannot be read for "
                                        f"{DUPLICATE_ID_PROPERTY}: {exc.description}")
        if found is None:
            return None, None
        return duplicate_key(found[0], string=found[1]), None

    def _reject(self, d, condition: str, description: str) -> None:
        if _pn_delivery_settled(d):
            _pn_delivery_settle(d)
            return
        dw = Delivery.wrap(d)
        dw.local.condition = Condition(condition, description)
        dw.update(_REJECTED)
        dw.settle()

    def synced(self, deliveries: list) -> None:
        """The journal fsync covering these producer deliveries is done: accept them."""
        closed = self.closed
        for d in deliveries:
            if not closed:
                _pn_delivery_update(d, _ACCEPTED)
                _pn_delivery_settle(d)
            lib.pn_decref(d)
        if not closed:
            self.wake()

    def refused(self, d, condition: str, description: str) -> None:
        """A held producer delivery is rejected after all (a shared queue without a root)."""
        if not self.closed:
            self._reject(d, condition, description)
            self.wake()
        lib.pn_decref(d)

    def sync_failed(self, deliveries: list, description: str) -> None:
        """The journal could not make these durable: reject them (the producer may retry)."""
        closed = self.closed
        for d in deliveries:
            if not closed:
                self._reject(d, INTERNAL, description)
            lib.pn_decref(d)
        if not closed:
            self.wake()

    # -- management view ---------------------------------------------------------------------
    def describe(self) -> dict:
        return {"id": self.conn_id, "container_id": self.container_id, "user": self.user,
                "source": self.source, "tls": self.tls}
