"""Sans-IO AMQP 1.0 handshake sniffer for the router (§2.2 headers, §5.3 SASL, §2.7.1 open).

Theory of operation
-------------------
The router must learn who a client is and what it asks for before choosing a broker: the SASL
identity (``sasl-init``) and the ``open`` performative's container-id and hostname. The sniffer
drives ``broker.wire.sasl.SaslServer`` for the SASL layer, then reads the client's AMQP header
and frames up to its Open::

    SASL  --(AuthRequested: caller calls accept(user) / reject())-->  AMQP header --> Open
                                                                        => Detected(...)

A client that skips SASL (plain AMQP header first) is accepted only when ``allow_no_sasl`` is
true (default: when no authenticator is needed or ANONYMOUS is offered).

When ``authenticator_needed`` is false the router does not check credentials: every sasl-init is
accepted without an ``AuthRequested`` event, the claimed PLAIN user is reported with
``verified=False``, and the upstream broker authenticates the replayed ``sasl_init_bytes``.

``Detected`` carries everything needed to replay the handshake upstream: ``sasl_init_bytes``
(the client's SASL header + sasl-init frame, for ``SaslClientReplay``) and ``client_bytes``
(the client's AMQP header through the end of the Open plus anything pipelined after it).
``Detected.desired_capabilities`` exposes the Open's desired-capabilities (an ``auto`` acceptor
redirects a client that announces ``lodestone:follows-redirect`` and proxies the others).
The client has received our SASL exchange only: the AMQP header and Open it gets next come
from ``redirect_frames``/``refuse_frames`` or from the upstream broker.

Errors: ``NotThisProtocol`` (carrying the bytes read) for non-AMQP input; other
``RemoteProtocolError`` subclasses for a bad handshake, including ``FramingError``
(``amqp:connection:framing-error``) once more than ``max_handshake_bytes`` arrive without a
complete Open. After the AMQP header, errors carry in ``reply`` the header + Open + Close that
tell the client why; flush ``data_to_send()`` first, then write ``reply``, then close.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from broker.wire.frames import (
    AMQP_HEADER,
    DEFAULT_CONTAINER_ID,
    FOLLOWS_REDIRECT,
    FRAME_AMQP,
    NEED_DATA,
    SASL_HEADER,
    FrameReader,
    Open,
    close_frames,
    decode_performative,
    encode_frame,
)
from broker.wire.sasl import (
    AmqpHeaderReceived,
    AuthFailed,
    AuthRequested,
    NoSasl,
    SaslHeaderReceived,
    SaslServer,
    parse_plain,
)
from broker.wire.errors import (
    FramingError,
    LocalProtocolError,
    NotThisProtocol,
    RemoteProtocolError,
)

__all__ = ["HandshakeSniffer", "OpenReader", "Detected", "AuthRequested", "AuthFailed", "NEED_DATA", "NotThisProtocol"]


@dataclass(frozen=True, slots=True)
class Detected:
    """The client's handshake is complete up to its Open."""

    open: Open
    user: str | None
    mechanism: str | None
    client_bytes: bytes
    sasl_init_bytes: bytes | None
    #: True when ``user`` was authenticated by the router (``accept(user)``), False when it is
    #: only the identity the client claimed (``authenticator_needed=False``) or None.
    verified: bool = False
    #: The ``hostname`` field of sasl-init, if the client sent one.
    sasl_hostname: str | None = None

    @property
    def desired_capabilities(self) -> tuple[str, ...]:
        """The Open's ``desired-capabilities`` symbols (§2.7.1), empty when absent."""
        return self.open.desired_capabilities or ()

    @property
    def follows_redirect(self) -> bool:
        """The client announced ``lodestone:follows-redirect`` (``broker.wire.frames.FOLLOWS_REDIRECT``):
        an ``auto`` acceptor redirects it instead of proxying."""
        caps = self.open.desired_capabilities
        return caps is not None and FOLLOWS_REDIRECT in caps

    def proxied_bytes(self) -> bytes:
        """``client_bytes`` as a proxied connection replays them to its broker: the Open without
        ``lodestone:follows-redirect``. A broker redirects (failback, scale-down, its management
        close) only clients that announced it, and a proxied client must come back through the
        router, never be sent past it: without the capability the broker ends its connection
        without a Close (or with ``amqp:connection:forced``, when its management call asks for
        that) and the client reconnects to the router. Unchanged (the same
        object) for the clients that did not announce it."""
        if not self.follows_redirect:
            return self.client_bytes
        return replace_open(self.client_bytes, dataclasses.replace(
            self.open, desired_capabilities=tuple(c for c in self.open.desired_capabilities
                                                  if c != FOLLOWS_REDIRECT) or None))


def replace_open(client_bytes: bytes, new_open: Open) -> bytes:
    """``client_bytes`` (the AMQP header, then frames: empty ones, the Open, anything pipelined
    after it) with the Open frame re-encoded as ``new_open`` on the same channel."""
    data = memoryview(client_bytes)
    off = len(AMQP_HEADER)
    while off + 8 <= len(data):
        size = int.from_bytes(data[off:off + 4], "big")
        doff = data[off + 4]
        if size > doff * 4:  # not an empty frame: the Open (OpenReader checked it)
            channel = int.from_bytes(data[off + 6:off + 8], "big")
            frame = encode_frame(FRAME_AMQP, channel, new_open)
            return bytes(data[:off]) + frame + bytes(data[off + size:])
        off += size
    raise ValueError("no Open frame in the handshake bytes")


# Decoded Opens by frame body: a client reconnecting sends the same Open byte for byte, and
# decoding it is most of the sniffer's cost. ``Open`` is frozen, so sharing one is safe; the
# decode is a pure function of the bytes. Bounded: once full, new bodies are decoded each time,
# and only bodies up to _OPEN_CACHE_MAX_BODY bytes are kept (issue 7: with 64 KiB Opens carrying
# 60,000-character container-ids, 4,096 kept bodies and their decoded strings held ~0.5 GiB for
# the life of the process). A usual Open is 100-300 bytes: at most ~4 MiB in all.
_OPEN_CACHE: dict[bytes, Open] = {}
_OPEN_CACHE_MAX = 4096
_OPEN_CACHE_MAX_BODY = 1024


def _decode_first_performative(body: bytes):
    small = len(body) <= _OPEN_CACHE_MAX_BODY
    perf = _OPEN_CACHE.get(body) if small else None
    if perf is None:
        perf = decode_performative(body)
        if small and isinstance(perf, Open) and len(_OPEN_CACHE) < _OPEN_CACHE_MAX:
            _OPEN_CACHE[body] = perf
    return perf


class HandshakeSniffer:
    """Read a client's AMQP 1.0 handshake; see the module docstring.

    ``mechanisms`` defaults to ``("PLAIN",)`` when an authenticator is needed and to
    ``("PLAIN", "ANONYMOUS")`` otherwise.
    """

    def __init__(
        self,
        authenticator_needed: bool = True,
        max_handshake_bytes: int = 65536,
        *,
        mechanisms=None,
        allow_no_sasl: bool | None = None,
        container_id: str = DEFAULT_CONTAINER_ID,
    ):
        if mechanisms is None:
            mechanisms = ("PLAIN",) if authenticator_needed else ("PLAIN", "ANONYMOUS")
        self.authenticator_needed = authenticator_needed
        self.max_handshake_bytes = max_handshake_bytes
        self.allow_no_sasl = (
            (not authenticator_needed or "ANONYMOUS" in mechanisms)
            if allow_no_sasl is None
            else allow_no_sasl
        )
        self.container_id = container_id
        self.sasl = SaslServer(mechanisms, max_frame_bytes=max_handshake_bytes)
        self._received = 0
        self._frames: OpenReader | None = None  # set once the AMQP layer starts
        self._detected = False
        self._user: str | None = None
        self._verified = False
        self._mechanism: str | None = None
        self._sasl_init_bytes: bytes | None = None

    # -- I/O -----------------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        """Feed bytes received from the client."""
        if self._detected:
            raise LocalProtocolError("handshake already detected: pump further bytes directly")
        self._received += len(data)
        if self._frames is None:
            self.sasl.receive_data(data)
        else:
            self._frames.receive_data(data)

    def data_to_send(self) -> bytes:
        """Bytes to write to the client (our SASL header, mechanisms, outcome)."""
        return self.sasl.data_to_send()

    def accept(self, user: str | None = None) -> None:
        """The router authenticated the client as ``user`` (after ``AuthRequested``)."""
        self.sasl.accept(user)
        self._user = user
        self._verified = user is not None

    def reject(self, code: int = 1, description: str = "authentication failed") -> None:
        """Authentication failed: the client gets sasl-outcome ``code``; then close."""
        self.sasl.reject(code, description)

    # -- events --------------------------------------------------------------------------------
    def next_event(self):
        """Return ``NEED_DATA``, ``AuthRequested``, ``AuthFailed`` or ``Detected``.

        Raises ``NotThisProtocol`` or another ``RemoteProtocolError`` subclass.
        """
        if self._detected:
            return NEED_DATA
        if self._frames is None:
            ev = self._sasl_step()
        else:
            try:
                ev = self._amqp_step()
            except RemoteProtocolError as e:
                if not e.reply:
                    e.reply = close_frames(e.condition, e.description, container_id=self.container_id)
                raise
        if ev is NEED_DATA and self._received > self.max_handshake_bytes:
            err = FramingError(
                f"handshake exceeds {self.max_handshake_bytes} bytes without a complete open"
            )
            if self._frames is not None:
                err.reply = close_frames(err.condition, err.description, container_id=self.container_id)
            raise err
        return ev

    def _sasl_step(self):
        sasl = self.sasl
        while True:
            ev = sasl.next_event()
            if ev is NEED_DATA:
                return NEED_DATA
            if isinstance(ev, SaslHeaderReceived):
                continue
            if isinstance(ev, AuthRequested):
                self._mechanism = ev.mechanism
                self._sasl_init_bytes = SASL_HEADER + sasl.init_frame_bytes
                if self.authenticator_needed:
                    return ev
                # No authenticator: accept; remember the claimed identity, unverified.
                claimed = None
                if ev.mechanism == "PLAIN":
                    try:
                        claimed = parse_plain(ev.initial_response)[1]
                    except RemoteProtocolError:
                        claimed = None
                sasl.accept(claimed)
                self._user = claimed
                self._verified = False
                continue
            if isinstance(ev, AuthFailed):
                return ev
            if isinstance(ev, NoSasl):
                if not self.allow_no_sasl:
                    raise RemoteProtocolError(
                        "client skipped SASL but authentication is required",
                        "amqp:unauthorized-access",
                        reply=SASL_HEADER,
                    )
                return self._start_amqp(sasl.leftover())
            if isinstance(ev, AmqpHeaderReceived):
                return self._start_amqp(sasl.leftover())
            raise AssertionError(f"unexpected SASL event {ev!r}")  # pragma: no cover

    def _start_amqp(self, leftover: bytes):
        self._frames = OpenReader(self.max_handshake_bytes)
        self._frames.receive_data(leftover)
        try:
            return self._amqp_step()
        except RemoteProtocolError as e:
            if not e.reply:
                e.reply = close_frames(e.condition, e.description, container_id=self.container_id)
            raise

    def _amqp_step(self):
        perf = self._frames.next_event()
        if perf is NEED_DATA:
            return NEED_DATA
        self._detected = True
        return Detected(
            open=perf,
            user=self._user,
            mechanism=self._mechanism,
            client_bytes=bytes(self._frames.received),
            sasl_init_bytes=self._sasl_init_bytes,
            verified=self._verified,
            sasl_hostname=self.sasl.init.hostname if self.sasl.init else None,
        )


class OpenReader:
    """The AMQP layer of a handshake once SASL is done: the client's AMQP header (§2.2), then
    frames up to its Open (§2.7.1). Used by :class:`HandshakeSniffer` and by a broker acceptor
    with an embedded router (``broker.routing``), which authenticates with its own SASL layer
    and routes on the Open before its engine sees any of it.

    ``receive_data(bytes)``; ``next_event()`` → ``NEED_DATA`` or the ``Open`` (once), raising
    ``NotThisProtocol``/``FramingError``/``RemoteProtocolError`` for a bad header or first
    frame. ``received`` holds every byte fed so far (header, Open and anything pipelined after
    it), to hand to whatever serves the connection next.
    """

    def __init__(self, max_handshake_bytes: int = 65536) -> None:
        self._frames = FrameReader(max(max_handshake_bytes, 512))
        self.received = bytearray()
        self._header_seen = False

    def receive_data(self, data: bytes) -> None:
        self.received += data
        self._frames.receive_data(data)

    def next_event(self):
        frames = self._frames
        if not self._header_seen:
            hdr = frames.next_protocol_header()
            if hdr is NEED_DATA:
                return NEED_DATA
            if hdr != AMQP_HEADER:  # SaslServer already checked it; belt and braces
                raise NotThisProtocol(f"unexpected protocol header {hdr!r}", bytes(self.received),
                                      reply=AMQP_HEADER)
            self._header_seen = True
        while True:
            frame = frames.next_event()
            if frame is NEED_DATA:
                return NEED_DATA
            if not frame.body:
                continue  # empty frame (heartbeat, §2.4.5)
            if frame.type != FRAME_AMQP:
                raise FramingError(f"frame type 0x{frame.type:02x} where an AMQP open was expected")
            perf = _decode_first_performative(frame.body)
            if not isinstance(perf, Open):
                name = getattr(perf, "NAME", None) or "another performative"
                raise RemoteProtocolError(
                    f"expected open as the first frame, got {name}", "amqp:connection:framing-error"
                )
            if frame.channel != 0:
                raise FramingError(f"open on channel {frame.channel}, must be 0")
            return perf
