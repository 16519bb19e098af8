"""Sans-IO SASL layer for AMQP 1.0 (§5.3): a server state machine and a client replay helper.

Theory of operation — ``SaslServer``
------------------------------------
The client opens with a protocol header (§2.2). ``SASL_HEADER`` starts the SASL layer; the plain
``AMQP_HEADER`` means "no SASL" and is reported as ``NoSasl`` so the caller decides (allowed only
when anonymous access is enabled); anything else raises ``NotThisProtocol`` whose ``reply`` is
our own SASL header (§2.2: on a header mismatch the server writes the header it supports and
closes). Non-AMQP bytes are rejected as soon as the first byte disagrees with ``AMQP``.

States::

    AWAIT_HEADER --SASL hdr--> AWAIT_INIT --sasl-init--> AWAIT_DECISION
         |                        (we queue our SASL header + sasl-mechanisms)
         +--AMQP hdr--> DONE (NoSasl)         accept() -> AWAIT_AMQP_HEADER --AMQP hdr--> DONE
                                              reject() -> FAILED (AuthFailed)

``receive_data()`` buffers bytes, ``next_event()`` advances and returns one event or
``NEED_DATA``, ``data_to_send()`` drains our output. After ``AuthRequested`` the caller checks the
credentials and calls ``accept()`` or ``reject()``, which queue the ``sasl-outcome``. After a
successful outcome the next event is ``AmqpHeaderReceived`` once the client's AMQP header is in,
and ``leftover()`` returns *every* byte received after the sasl-init frame (the client's AMQP
header and whatever it pipelined after it) for handing to proton's Transport (created without a
SASL layer). Mechanisms needing challenges (SCRAM, GSSAPI) are not implemented: a
``sasl-response`` from the client is a protocol error.

Theory of operation — ``SaslClient``
------------------------------------
The broker's own side of a connection it dials (a cluster peer, :mod:`broker.amqp.peer`). It
writes the SASL header at once, reads the server's SASL header and sasl-mechanisms, answers with
one sasl-init — PLAIN with the configured credential, or ANONYMOUS without one — and reads the
sasl-outcome::

    AWAIT_HEADER --SASL hdr--> AWAIT_MECHANISMS --mechanisms (ours offered)--> AWAIT_OUTCOME
                                  | (ours not offered: LoginRefused(SYS_PERM), FAILED)
    AWAIT_OUTCOME --outcome ok--> DONE (LoginAccepted(leftover))
                  --outcome ≠ ok--> FAILED (LoginRefused(code))

A server that answers with anything but the SASL header raises ``NotThisProtocol``; a frame out
of turn (a sasl-challenge: neither PLAIN nor ANONYMOUS has one) raises ``SaslProtocolError``;
both carry ``amqp:connection:framing-error``. After ``LoginAccepted`` the stream belongs to
proton's client Transport (created without a SASL layer), which writes the AMQP header first;
``leftover`` holds any server bytes after the outcome.

Theory of operation — ``SaslClientReplay``
------------------------------------------
The router authenticates a client itself, then opens an upstream connection to a broker and
replays the client's recorded SASL header + sasl-init there. ``SaslClientReplay`` queues those
bytes (pipelined, §5.3.2 lets a client send sasl-init before it sees sasl-mechanisms), then
consumes the upstream's SASL header, sasl-mechanisms and sasl-outcome and reports
``UpstreamAuthOk(leftover)`` or ``UpstreamAuthFailed(code, leftover)``; ``leftover`` is any
upstream bytes after the outcome (usually the start of the broker's AMQP header).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from broker.wire.frames import (
    AMQP_HEADER,
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    TLS_HEADER,
    FrameReader,
    SaslChallenge,
    SaslInit,
    SaslMechanisms,
    SaslOutcome,
    decode_performative,
    encode_frame,
)
from broker.wire.codec import Symbol
from broker.wire.errors import (
    LocalProtocolError,
    NotThisProtocol,
    RemoteProtocolError,
    SaslProtocolError,
)

__all__ = [
    "SaslServer", "SaslClientReplay", "SaslHeaderReceived", "AuthRequested", "AuthFailed",
    "AmqpHeaderReceived", "NoSasl", "UpstreamAuthOk", "UpstreamAuthFailed", "parse_plain",
    "check_protocol_header", "NEED_DATA", "SaslState", "SaslClient", "SaslClientState", "LoginAccepted",
    "LoginRefused", "plain_response",
]

_PREFIX = b"AMQP"


# -- events ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SaslHeaderReceived:
    """The client's SASL protocol header arrived; our header and mechanisms are queued."""


@dataclass(frozen=True, slots=True)
class AuthRequested:
    """The client sent sasl-init; call ``accept()`` or ``reject()``."""

    mechanism: str
    initial_response: bytes | None
    hostname: str | None


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """Authentication failed (``reject()`` or an unoffered mechanism); outcome is queued.

    Flush ``data_to_send()`` and close the connection.
    """

    code: int
    description: str


@dataclass(frozen=True, slots=True)
class AmqpHeaderReceived:
    """After a successful outcome the client's AMQP header arrived; see ``leftover()``."""

    header: bytes


@dataclass(frozen=True, slots=True)
class NoSasl:
    """The client sent the plain AMQP header without SASL. ``leftover`` starts with it."""

    leftover: bytes


@dataclass(frozen=True, slots=True)
class UpstreamAuthOk:
    """The upstream broker accepted the replayed sasl-init."""

    leftover: bytes


@dataclass(frozen=True, slots=True)
class UpstreamAuthFailed:
    """The upstream broker refused the replayed sasl-init (``code`` from its sasl-outcome)."""

    code: int
    leftover: bytes


@dataclass(frozen=True, slots=True)
class LoginAccepted:
    """The server accepted our sasl-init; ``leftover`` is any server bytes after the outcome."""

    leftover: bytes


@dataclass(frozen=True, slots=True)
class LoginRefused:
    """The server refused our login (``code`` of its sasl-outcome, §5.3.3.6), or does not offer
    our mechanism (reported as ``SYS_PERM``: retrying as-is will not help)."""

    code: int
    description: str

    @property
    def auth(self) -> bool:
        """True for ``auth`` (bad credentials), the outcome an operator must fix."""
        return self.code == SaslOutcome.AUTH


class SaslState(enum.Enum):
    AWAIT_HEADER = "AWAIT_HEADER"
    AWAIT_INIT = "AWAIT_INIT"
    AWAIT_DECISION = "AWAIT_DECISION"
    AWAIT_AMQP_HEADER = "AWAIT_AMQP_HEADER"
    DONE = "DONE"
    FAILED = "FAILED"


# -- helpers -----------------------------------------------------------------------------------


def check_protocol_header(data: bytes, accepted: tuple[bytes, ...], reply: bytes) -> bytes | None:
    """Validate the start of a stream against the protocol headers in ``accepted``.

    Returns the matching 8-byte header, or ``None`` if more bytes are needed. Raises
    ``NotThisProtocol(data, reply=reply)`` as soon as ``data`` cannot begin an accepted header:
    after one byte for non-AMQP traffic (TLS ClientHello, HTTP), after 8 bytes for a wrong AMQP
    protocol id or version (§2.2).
    """
    n = min(len(data), 8)
    head = bytes(data[:n])
    if head[:4] != _PREFIX[: min(n, 4)]:
        raise NotThisProtocol(f"not AMQP: stream starts with {head!r}", bytes(data), reply=reply)
    if n < 8:
        if any(h[:n] == head for h in accepted):
            return None
        if n <= 4:
            return None
        raise NotThisProtocol(f"unsupported AMQP protocol header {head!r}", bytes(data), reply=reply)
    if head in accepted:
        return head
    if head == TLS_HEADER:
        what = "TLS protocol header (id 2) where TLS is not expected"
    else:
        what = f"unsupported AMQP protocol header {head!r}"
    raise NotThisProtocol(what, bytes(data), reply=reply)


def parse_plain(initial_response: bytes | None) -> tuple[str, str, str]:
    """Split a SASL PLAIN response (RFC 4616: ``authzid NUL authcid NUL passwd``).

    Returns ``(authzid, user, password)`` (authzid may be ``""``). Raises ``RemoteProtocolError``
    with ``amqp:unauthorized-access`` if it is missing, malformed or not UTF-8.
    """
    if not initial_response:
        raise RemoteProtocolError("PLAIN without an initial response", "amqp:unauthorized-access")
    parts = bytes(initial_response).split(b"\x00")
    if len(parts) != 3 or not parts[1]:
        raise RemoteProtocolError("malformed PLAIN response", "amqp:unauthorized-access")
    try:
        authzid, user, password = (p.decode("utf-8") for p in parts)
    except UnicodeDecodeError:
        raise RemoteProtocolError("PLAIN response is not UTF-8", "amqp:unauthorized-access") from None
    return authzid, user, password


def _sasl_frame(performative) -> bytes:
    return _sasl_frame_cached(performative)


@functools.lru_cache(maxsize=64)
def _sasl_frame_cached(performative) -> bytes:
    # Mechanisms and outcome frames repeat on every connection: encode each once.
    return encode_frame(FRAME_SASL, 0, performative)


def _decode_sasl(frame) -> object:
    if frame.type != FRAME_SASL:
        raise SaslProtocolError(f"expected a SASL frame, got frame type 0x{frame.type:02x}")
    return decode_performative(frame.body)


# -- the server --------------------------------------------------------------------------------


class SaslServer:
    """Server side of the SASL exchange (§5.3); see the module docstring.

    ``mechanisms`` is the ordered list offered to clients, e.g. ``["PLAIN", "EXTERNAL"]`` (add
    ``"ANONYMOUS"`` only when anonymous access is enabled). ``max_frame_bytes`` bounds each SASL
    frame (§5.3.1 requires at least 512).
    """

    def __init__(self, mechanisms, max_frame_bytes: int = 65536):
        self.mechanisms = tuple(Symbol(m) for m in mechanisms)
        if not self.mechanisms:
            raise LocalProtocolError("SaslServer needs at least one mechanism")
        self.state = SaslState.AWAIT_HEADER
        self._reader = FrameReader(max(max_frame_bytes, 512), keep_raw=True)
        self._out = bytearray()
        self._pending_event = None
        self._leftover_taken = False
        #: The client's sasl-init, once received.
        self.init: SaslInit | None = None
        #: The client's sasl-init frame, exactly as sent (for upstream replay).
        self.init_frame_bytes: bytes | None = None
        #: Set by ``accept(user)``.
        self.user: str | None = None

    # -- input / output ------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        """Feed bytes received from the client."""
        if self._leftover_taken:
            raise LocalProtocolError("leftover() was taken: feed further bytes to the next layer")
        if self.state is SaslState.FAILED:
            return  # we are closing; nothing the client says matters any more
        self._reader.receive_data(data)

    def data_to_send(self) -> bytes:
        """Return and clear the bytes queued for the client."""
        out = bytes(self._out)
        self._out.clear()
        return out

    @property
    def offered_header(self) -> bytes:
        """The protocol header this server speaks first (our reply on a mismatch)."""
        return SASL_HEADER

    # -- decisions -----------------------------------------------------------------------------
    def accept(self, user: str | None = None) -> None:
        """Authentication succeeded: queue ``sasl-outcome(ok)``."""
        if self.state is not SaslState.AWAIT_DECISION:
            raise LocalProtocolError(f"accept() in state {self.state.name}")
        self.user = user
        self._out += _sasl_frame(SaslOutcome(SaslOutcome.OK))
        self.state = SaslState.AWAIT_AMQP_HEADER

    def reject(self, code: int = SaslOutcome.AUTH, description: str = "authentication failed") -> None:
        """Authentication failed: queue ``sasl-outcome(code)`` (1 auth, 2 sys, 3 sys-perm, 4 sys-temp)."""
        if self.state is not SaslState.AWAIT_DECISION:
            raise LocalProtocolError(f"reject() in state {self.state.name}")
        if not 1 <= code <= 4:
            raise LocalProtocolError(f"sasl-outcome code {code} is not a failure code")
        self._fail(code, description)

    def _fail(self, code: int, description: str) -> None:
        self._out += _sasl_frame(SaslOutcome(code))
        self.state = SaslState.FAILED
        self._pending_event = AuthFailed(code, description)

    def leftover(self) -> bytes:
        """Every byte received after the sasl-init frame (or from the AMQP header on ``NoSasl``).

        Call once, after ``AmqpHeaderReceived`` or ``NoSasl``; later bytes go to the next layer.
        """
        if self.state is not SaslState.DONE:
            raise LocalProtocolError(f"leftover() in state {self.state.name}")
        self._leftover_taken = True
        return self._reader.take_leftover()

    # -- events --------------------------------------------------------------------------------
    def next_event(self):
        """Advance the state machine; return one event or ``NEED_DATA``.

        Raises ``NotThisProtocol`` for a wrong protocol header and ``RemoteProtocolError``
        subclasses (``FramingError``, ``DecodeError``, ``SaslProtocolError``) for a bad SASL
        exchange.
        """
        state = self.state
        if state is SaslState.AWAIT_HEADER:
            return self._await_header()
        if state is SaslState.AWAIT_INIT:
            return self._await_init()
        if state is SaslState.AWAIT_AMQP_HEADER:
            r = self._reader
            hdr = check_protocol_header(r.peek(r.buffered), (AMQP_HEADER,), AMQP_HEADER)
            if hdr is None:
                return NEED_DATA
            self.state = SaslState.DONE
            return AmqpHeaderReceived(hdr)
        if state is SaslState.FAILED and self._pending_event is not None:
            ev, self._pending_event = self._pending_event, None
            return ev
        # AWAIT_DECISION: waiting for the caller; DONE/FAILED: nothing more to say.
        return NEED_DATA

    def _await_header(self):
        r = self._reader
        hdr = check_protocol_header(r.peek(r.buffered), (SASL_HEADER, AMQP_HEADER), SASL_HEADER)
        if hdr is None:
            return NEED_DATA
        if hdr == AMQP_HEADER:
            self.state = SaslState.DONE
            return NoSasl(r.peek(r.buffered))
        r.next_protocol_header()
        # §5.3.1: the server answers the SASL header with its own and sasl-mechanisms.
        self._out += SASL_HEADER
        self._out += _sasl_frame(SaslMechanisms(self.mechanisms))
        self.state = SaslState.AWAIT_INIT
        return SaslHeaderReceived()

    def _await_init(self):
        while True:
            frame = self._reader.next_event()
            if frame is NEED_DATA:
                return NEED_DATA
            if frame.type == FRAME_SASL and not frame.body:
                continue  # an empty frame (heartbeat) is harmless
            perf = _decode_sasl(frame)
            if not isinstance(perf, SaslInit):
                raise SaslProtocolError(f"expected sasl-init, got {_name(perf)}")
            self.init = perf
            self.init_frame_bytes = frame.raw
            if perf.mechanism not in self.mechanisms:
                self._fail(
                    SaslOutcome.AUTH,
                    f"mechanism {perf.mechanism} not offered (offered: {', '.join(self.mechanisms)})",
                )
                return self.next_event()
            self.state = SaslState.AWAIT_DECISION
            return AuthRequested(str(perf.mechanism), perf.initial_response, perf.hostname)


def _name(perf) -> str:
    if perf is None:
        return "an empty frame"
    return getattr(perf, "NAME", None) or f"performative {perf.descriptor!r}"


# -- the client-side replay helper -------------------------------------------------------------


class SaslClientReplay:
    """Replay a recorded client SASL handshake to an upstream broker (sans-IO).

    ``sasl_init_bytes`` is the client's SASL header followed by its sasl-init frame exactly as
    received. ``data_to_send()`` returns them at once (pipelined). Feed upstream bytes with
    ``receive_data()`` and poll ``next_event()`` for ``UpstreamAuthOk`` / ``UpstreamAuthFailed``.
    Raises ``NotThisProtocol`` if the upstream does not answer with a SASL header and
    ``SaslProtocolError`` if it sends a challenge (we cannot answer for the client).
    """

    def __init__(self, sasl_init_bytes: bytes, max_frame_bytes: int = 65536):
        if not bytes(sasl_init_bytes[:8]) == SASL_HEADER:
            raise LocalProtocolError("sasl_init_bytes must start with the SASL header")
        self._out = bytearray(sasl_init_bytes)
        self._reader = FrameReader(max(max_frame_bytes, 512))
        self._stage = 0  # 0 header, 1 mechanisms, 2 outcome, 3 done
        #: The mechanisms the upstream offered, once known.
        self.upstream_mechanisms: tuple[str, ...] | None = None

    def receive_data(self, data: bytes) -> None:
        """Feed bytes received from the upstream."""
        if self._stage == 3:
            raise LocalProtocolError("SASL replay is finished: pump upstream bytes directly")
        self._reader.receive_data(data)

    def data_to_send(self) -> bytes:
        """Return and clear the bytes to write upstream."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def next_event(self):
        """Return ``UpstreamAuthOk``, ``UpstreamAuthFailed`` or ``NEED_DATA``."""
        r = self._reader
        if self._stage == 0:
            if check_protocol_header(r.peek(r.buffered), (SASL_HEADER,), b"") is None:
                return NEED_DATA
            r.next_protocol_header()
            self._stage = 1
        while self._stage in (1, 2):
            frame = r.next_event()
            if frame is NEED_DATA:
                return NEED_DATA
            if not frame.body:
                continue
            perf = _decode_sasl(frame)
            if self._stage == 1:
                if not isinstance(perf, SaslMechanisms):
                    raise SaslProtocolError(f"upstream sent {_name(perf)}, expected sasl-mechanisms")
                self.upstream_mechanisms = tuple(str(m) for m in perf.sasl_server_mechanisms)
                self._stage = 2
            else:
                if isinstance(perf, SaslChallenge):
                    raise SaslProtocolError("upstream sent a sasl-challenge the router cannot answer")
                if not isinstance(perf, SaslOutcome):
                    raise SaslProtocolError(f"upstream sent {_name(perf)}, expected sasl-outcome")
                self._stage = 3
                leftover = r.take_leftover()
                if perf.code == SaslOutcome.OK:
                    return UpstreamAuthOk(leftover)
                return UpstreamAuthFailed(perf.code, leftover)
        return NEED_DATA



# -- the client ----------------------------------------------------------------------------------


class SaslClientState(enum.Enum):
    AWAIT_HEADER = "AWAIT_HEADER"
    AWAIT_MECHANISMS = "AWAIT_MECHANISMS"
    AWAIT_OUTCOME = "AWAIT_OUTCOME"
    DONE = "DONE"
    FAILED = "FAILED"


_OUTCOME_TEXT = {SaslOutcome.AUTH: "authentication failed", SaslOutcome.SYS: "system error",
                 SaslOutcome.SYS_PERM: "permanent system error", SaslOutcome.SYS_TEMP: "temporary system error"}


def plain_response(user: str, password: str, authzid: str = "") -> bytes:
    """A SASL PLAIN initial response (RFC 4616: ``authzid NUL authcid NUL passwd``)."""
    return f"{authzid}\x00{user}\x00{password}".encode("utf-8")


class SaslClient:
    """Client side of the SASL exchange (§5.3) for connections the broker dials; see the module
    docstring. ``credentials`` (user, password) selects PLAIN; None selects ANONYMOUS."""

    def __init__(self, credentials: tuple[str, str] | None = None, *, hostname: str | None = None,
                 max_frame_bytes: int = 65536):
        self.mechanism = "PLAIN" if credentials is not None else "ANONYMOUS"
        self._response = plain_response(*credentials) if credentials is not None else b""
        self.hostname = hostname
        self.state = SaslClientState.AWAIT_HEADER
        self._reader = FrameReader(max(max_frame_bytes, 512))
        self._out = bytearray(SASL_HEADER)
        #: The mechanisms the server offered, once known.
        self.server_mechanisms: tuple[str, ...] | None = None

    def receive_data(self, data: bytes) -> None:
        """Feed bytes received from the server."""
        if self.state in (SaslClientState.DONE, SaslClientState.FAILED):
            raise LocalProtocolError(f"SASL client is {self.state.value}: nothing more to read")
        self._reader.receive_data(data)

    def data_to_send(self) -> bytes:
        """Return and clear the bytes to write to the server."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def next_event(self):
        """Return ``LoginAccepted``, ``LoginRefused`` or ``NEED_DATA``; raises a Remote error."""
        r = self._reader
        st = SaslClientState
        if self.state is st.AWAIT_HEADER:
            if check_protocol_header(r.peek(r.buffered), (SASL_HEADER,), b"") is None:
                return NEED_DATA
            r.next_protocol_header()
            self.state = st.AWAIT_MECHANISMS
        while self.state in (st.AWAIT_MECHANISMS, st.AWAIT_OUTCOME):
            frame = r.next_event()
            if frame is NEED_DATA:
                return NEED_DATA
            if not frame.body:
                continue  # an empty frame (§2.3.2) carries nothing
            perf = _decode_sasl(frame)
            if self.state is st.AWAIT_MECHANISMS:
                if not isinstance(perf, SaslMechanisms):
                    raise SaslProtocolError(f"server sent {_name(perf)}, expected sasl-mechanisms")
                self.server_mechanisms = tuple(str(m) for m in perf.sasl_server_mechanisms)
                if self.mechanism not in self.server_mechanisms:
                    self.state = st.FAILED
                    return LoginRefused(SaslOutcome.SYS_PERM, f"server does not offer {self.mechanism} "
                                                              f"(offers {', '.join(self.server_mechanisms)})")
                self._out += encode_frame(FRAME_SASL, 0, SaslInit(Symbol(self.mechanism), self._response,
                                                                  self.hostname))
                self.state = st.AWAIT_OUTCOME
            else:
                if isinstance(perf, SaslChallenge):
                    raise SaslProtocolError(f"server sent a sasl-challenge, which {self.mechanism} does not have")
                if not isinstance(perf, SaslOutcome):
                    raise SaslProtocolError(f"server sent {_name(perf)}, expected sasl-outcome")
                if perf.code == SaslOutcome.OK:
                    self.state = st.DONE
                    return LoginAccepted(r.take_leftover())
                self.state = st.FAILED
                return LoginRefused(perf.code, _OUTCOME_TEXT.get(perf.code, f"outcome code {perf.code}"))
        return NEED_DATA
