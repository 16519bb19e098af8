"""The trio shell around the AMQP engine: listeners, TLS, SASL, and the socket pump.

Theory of operation
-------------------
:func:`serve_amqp` binds one acceptor and runs :func:`handle_connection` per client (in the
node's connection nursery, so shutdown can reach every connection). A connection goes through:

1. TLS (acceptors with a ``[tls]`` table): ``trio.SSLStream`` handshake within
   ``[amqp] handshake-timeout-s``; the client certificate, if any, is kept for SASL EXTERNAL.
2. SASL with the sans-IO :class:`broker.wire.sasl.SaslServer` (AMQP 1.0 §5.3): PLAIN checks the
   users file, ANONYMOUS and no-SASL only when the node allows anonymous access, EXTERNAL maps
   the certificate's CN. A failed exchange writes the ``sasl-outcome`` and closes; a bad
   protocol header gets our protocol header (§2.2) and a close; a malformed SASL frame (or EOF
   inside one) after our sasl-mechanisms gets ``sasl-outcome(sys-perm)``, SASL's only way to
   end an exchange (§5.3.3.6). Only this connection is affected.
3. The AMQP engine (:class:`broker.amqp.engine.AmqpEngine`, its host the node) run by
   :func:`broker.amqp.pump.pump_engine` (shared with the peer connections this node dials): the
   reader task reads the socket dry each pass (one large ``receive_some``) and pushes everything
   into proton; a writer task sends whatever proton wants to write whenever the engine (or
   another connection delivering to one of our consumers) wakes it; a ticker runs proton's
   idle-timeout timer. When proton closes the transport (peer Close, protocol error, idle
   timeout) the writer flushes the final frames and the connection ends.

A client that has authenticated but sends no Open within ``[amqp] handshake-timeout-s`` gets
``Close(amqp:connection:forced)`` (after our header and a failed Open). Whenever this side ends a
plain-TCP connection it sends FIN and keeps reading (discarding) for up to ``LINGER_S`` before
closing the socket: closing with unread client bytes in the kernel buffer sends an RST, which can
destroy the Close we just wrote before the client reads it. A TLS connection reads until the
client's close_notify (or EOF), bounded the same way, then sends its own close_notify.

Every timeout of a connection lives here (the handshake deadlines and proton's idle timer).
"""

from __future__ import annotations

import itertools
import logging
import ssl
import struct
from typing import TYPE_CHECKING

import trio

from broker.amqp.engine import AmqpEngine
from broker.wire.frames import FRAME_SASL, NEED_DATA, SASL_HEADER, SaslOutcome, encode_frame, refuse_frames
from broker.amqp.pump import RECV_BYTES, next_sasl_event, pump_engine
from broker.wire.sasl import (
    AmqpHeaderReceived,
    AuthFailed,
    AuthRequested,
    NoSasl,
    SaslHeaderReceived,
    SaslServer,
    SaslState,
    parse_plain,
)
from broker.cluster.bridge import CLUSTER_ROLE
from broker.wire.limits import Admission, source_key
from broker.wire.io.users import Principal
from broker.wire.errors import NotThisProtocol, RemoteProtocolError
from broker.wire.proxyproto import ProxyHeaderReader, ProxyProtocolError
from broker.wire.io.trioutil import Wakeup
from broker.wire.io.tls import capture_sni, sni_of

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import AcceptorConfig
    from broker.node import Node

log = logging.getLogger("lodestone.broker.amqp")

__all__ = ["serve_amqp", "handle_connection", "make_ssl_context"]

HANDSHAKE_TIMEOUT_S = 10.0  # the default of [amqp] handshake-timeout-s
LINGER_S = 2.0
#: the linger of a connection closed to send its client elsewhere (Node.depart): long enough
#: for the Close to be read, short so that a client waiting for the socket to fail sees it fail
DEPARTED_LINGER_S = 0.2
REFUSAL_TIMEOUT_S = 2.0  # a connection over a limit gets this long to hear its refusal
_conn_ids = itertools.count(1)


def make_ssl_context(acceptor: "AcceptorConfig") -> ssl.SSLContext:
    """Server TLS context for an acceptor: its certificate, and client certificates if a CA is set."""
    tls = acceptor.tls
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    if tls.ca_file is not None:
        ctx.load_verify_locations(str(tls.ca_file))
        ctx.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
    if acceptor.router is not None:   # an embedded router may key on the SNI host (SNI_HOST)
        capture_sni(ctx)
    return ctx


async def serve_amqp(node: "Node", acceptor: "AcceptorConfig", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Listen on one acceptor forever; ``task_status.started((host, port))`` once bound."""
    ctx = make_ssl_context(acceptor) if acceptor.tls else None
    try:
        listeners = await trio.open_tcp_listeners(acceptor.port, host=acceptor.host)
    except OSError as exc:  # name the address: "Address already in use" alone tells nothing
        raise OSError(exc.errno, f"acceptor {acceptor.name}: cannot listen on "
                                 f"{acceptor.host}:{acceptor.port}: {exc.strerror}") from None
    host, port = listeners[0].socket.getsockname()[:2]
    task_status.started((host, port))

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await handle_connection(node, acceptor, stream, ctx)
        except Exception:  # a bug in one connection's handling must not stop the node
            node.counters["internal_error"] += 1
            log.exception("connection handler failed; that connection is closed, the node keeps serving")

    await trio.serve_listeners(handler, listeners, handler_nursery=node.connection_nursery)


def _peer(stream: trio.SocketStream) -> str:
    try:
        addr = stream.socket.getpeername()
    except OSError:
        return "?"
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _cert_cn(cert: dict | None) -> str | None:
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


async def handle_connection(node: "Node", acceptor: "AcceptorConfig", sock_stream: trio.SocketStream,
                            ctx: ssl.SSLContext | None) -> None:
    """Serve one accepted client from TLS handshake to close. Never raises for peer misbehaviour."""
    source = _peer(sock_stream)
    source_ip = source.rsplit(":", 1)[0].strip("[]")
    conn_id = f"{node.short_id}-{next(_conn_ids)}"
    stream = sock_stream
    try:
        sock_stream.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
    except OSError:
        pass
    admitted = False
    guard = _Admission(node, acceptor, source_ip)
    try:
        if acceptor.trusts_proxy(source_ip):
            # a router: its PROXY v2 header names the real client (read before TLS and SASL)
            with trio.fail_after(node.cfg.handshake_timeout_s):
                real = await _read_proxy_header(node, sock_stream, source)
            if real is None:
                return
            if real.source is not None:  # LOCAL (the proxy's own check): the peer address stands
                source, source_ip = real.source_text, real.source[0]
                guard.key = source_key(source_ip)   # limits count the real client
        refusal = guard.admit()
        if refusal is _DROP:
            return
        admitted = refusal is None
        cn = None
        if ctx is not None:
            stream = trio.SSLStream(sock_stream, ctx, server_side=True)
            with trio.fail_after(node.cfg.handshake_timeout_s if admitted else REFUSAL_TIMEOUT_S):
                await stream.do_handshake()
            cn = _cert_cn(stream.getpeercert())
        if not admitted:
            # over a limit: a clear AMQP error, without checking credentials, then close
            with trio.fail_after(REFUSAL_TIMEOUT_S):
                await _refuse_unverified(node, acceptor, stream, refusal)
            await (_linger(sock_stream) if stream is sock_stream else _linger_tls(stream))
            return
        with trio.fail_after(node.cfg.handshake_timeout_s):
            result = await _authenticate(node, acceptor, stream, source, source_ip, cn)
        if result is None:
            await (_linger(sock_stream) if stream is sock_stream else _linger_tls(stream))
            return
        guard.authenticated()
        principal, leftover, mechanism = result
        routing = node.routing
        if acceptor.router is not None and routing is not None:
            if CLUSTER_ROLE in principal.roles:   # the cluster's own connections are never routed
                routing.counters["cluster_exempt"] += 1
            else:
                with trio.fail_after(node.cfg.handshake_timeout_s):
                    leftover = await routing.route_connection(
                        acceptor, stream, conn_id, principal, mechanism, source,
                        sni_of(getattr(stream, "_ssl_object", None)) if stream is not sock_stream else None, leftover)
                if leftover is None:  # redirected or refused: the reply is written
                    await (_linger(sock_stream) if stream is sock_stream else _linger_tls(stream))
                    return
        engine = await _pump(node, stream, conn_id, principal, source, ctx is not None, leftover, acceptor)
        # a client we sent elsewhere (engine.departing) may never answer our Close (a proton
        # client on amqp:connection:forced waits for the socket to fail): close it soon, with a
        # reset if it is still there, so that its next write fails and it reconnects
        if stream is sock_stream:
            await _linger(sock_stream, DEPARTED_LINGER_S if engine.departing else LINGER_S, reset=engine.departing)
        else:
            await _linger_tls(stream, DEPARTED_LINGER_S if engine.departing else LINGER_S)
    except trio.TooSlowError:
        node.counters["handshake_timeout"] += 1
        log.info("handshake timeout", extra={"fields": {"conn": conn_id, "source": source}})
    except (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as exc:
        node.counters["connection_broken"] += 1
        log.debug("connection broken: %r", exc, extra={"fields": {"conn": conn_id, "source": source}})
    finally:
        guard.release()
        await trio.aclose_forcefully(stream)


_DROP = object()


class _Admission:
    """One connection's place in its acceptor's limits (``max-connections``, and the per-source
    limits of ``broker.wire.limits``): taken by :meth:`admit`, given back by :meth:`release`."""

    __slots__ = ("node", "acceptor", "key", "state", "authed")

    def __init__(self, node: "Node", acceptor: "AcceptorConfig", source_ip: str):
        self.node = node
        self.acceptor = acceptor
        self.key = source_key(source_ip)
        self.state = ""           # "admitted" | "refusing" | ""
        self.authed = False

    def admit(self):
        """None when admitted; else the refusal text, or ``_DROP`` (close at once)."""
        node, acc = self.node, self.acceptor
        limiter = node.source_limiters[acc.name]
        now = trio.current_time()
        if acc.max_connections and node.acceptor_active[acc.name] >= acc.max_connections:
            reason, text = "acceptor_connections", (f"acceptor {acc.name} is at its limit of "
                                                    f"{acc.max_connections} connections (max-connections)")
            verdict = limiter.refuse(self.key, now)
        else:
            verdict, reason = limiter.admit(self.key, now)
            text = _LIMIT_TEXT.get(reason, "").format(src=self.key, lim=acc.limits)
        if verdict is Admission.ADMIT:
            node.acceptor_active[acc.name] += 1
            self.state = "admitted"
            return None
        node.counters[f"refused_{reason}"] += 1
        if node.log_once(f"{acc.name}/{self.key}/{reason}", now):
            log.warning("connection limit: %s; refusing (logged once per source per interval)", text,
                        extra={"fields": {"acceptor": acc.name, "source": self.key, "limit": reason}})
        if verdict is Admission.DROP:
            node.counters["refused_dropped"] += 1
            return _DROP
        self.state = "refusing"
        return text

    def authenticated(self) -> None:
        if self.state == "admitted" and not self.authed:
            self.authed = True
            self.node.source_limiters[self.acceptor.name].authenticated(self.key)

    def release(self) -> None:
        limiter = self.node.source_limiters[self.acceptor.name]
        if self.state == "admitted":
            self.node.acceptor_active[self.acceptor.name] -= 1
            limiter.release(self.key, authenticated=self.authed)
        elif self.state == "refusing":
            limiter.release_refusal(self.key)
        self.state = ""


_LIMIT_TEXT = {
    "source_connections": "{src} has {lim.max_connections_per_source} connections open "
                          "(max-connections-per-source)",
    "source_unauthenticated": "{src} has {lim.max_unauthenticated_per_source} connections still "
                              "authenticating (max-unauthenticated-per-source)",
    "source_rate": "{src} opens connections faster than {lim.max_connection_rate_per_source:g} per "
                   "second (max-connection-rate-per-source)",
}


async def _refuse_unverified(node: "Node", acceptor: "AcceptorConfig", stream, text: str) -> None:
    """Answer a connection over a limit with ``Close(amqp:resource-limit-exceeded, text)``: its
    SASL exchange is completed without checking the credentials (no hash, nothing granted: the
    only thing the client is sent after it is the refusal)."""
    sasl = SaslServer(acceptor.sasl_mechanisms, node.cfg.max_frame_bytes)
    refusal = refuse_frames("amqp:resource-limit-exceeded", f"{node.cfg.name}: {text}",
                            container_id=node.container_id)
    try:
        while True:
            ev = await next_sasl_event(sasl, stream)
            if ev is None:
                return
            if isinstance(ev, AuthRequested):
                sasl.accept(None)
            elif isinstance(ev, (AmqpHeaderReceived, NoSasl)):
                await stream.send_all(refusal)
                return
            elif isinstance(ev, AuthFailed):
                return
    except (NotThisProtocol, RemoteProtocolError) as exc:
        if exc.reply:
            await stream.send_all(exc.reply)


async def _read_proxy_header(node: "Node", stream: trio.SocketStream, source: str):
    """Read exactly one PROXY v2 header (never a byte more); None after closing on a bad one."""
    reader = ProxyHeaderReader()
    try:
        while True:
            data = await stream.receive_some(max(reader.needed, 1))
            if not data:
                if reader.needed == 16:  # connect + close before any byte: a TCP health probe
                    node.counters["proxy_header_eof"] += 1
                    log.debug("closed before a PROXY header", extra={"fields": {"source": source}})
                    return None
                raise ProxyProtocolError("PROXY protocol: end of stream inside the header")
            reader.receive_data(data)
            ev = reader.next_event()
            if ev is not NEED_DATA:
                node.counters["proxy_header_ok"] += 1
                return ev
    except ProxyProtocolError as exc:
        node.counters["proxy_header_invalid"] += 1
        log.info("connection refused: %s", exc.description, extra={"fields": {"source": source}})
        return None


async def _linger(stream: trio.SocketStream, linger_s: float = LINGER_S, *, reset: bool = False) -> None:
    """Half-close our side and drain the client's bytes until it closes (bounded by ``linger_s``).

    ``reset``: a client still there after ``linger_s`` gets a TCP reset when the caller closes
    the socket (SO_LINGER 0). A proton reactor client stops reading at our Close and, on
    ``amqp:connection:forced`` (which it does not answer), learns that the socket is gone only
    when a write fails: after a reset its next heartbeat fails, after a FIN only the one after."""
    done = False
    try:
        with trio.move_on_after(linger_s):
            await stream.send_eof()
            while await stream.receive_some(RECV_BYTES):
                pass
            done = True
    finally:   # (also when the node's shutdown cancels the linger)
        if reset and not done:
            try:
                stream.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass


async def _linger_tls(stream: trio.SSLStream, linger_s: float = LINGER_S) -> None:
    """TLS: read until the client's close_notify or EOF (bounded by LINGER_S), then send ours.

    A TLS session cannot be half-closed, so this reads first; closing with the client's last
    frames unread would reset the connection and could destroy the Close we just wrote.
    """
    with trio.move_on_after(linger_s):
        try:
            while await stream.receive_some(RECV_BYTES):
                pass
            await stream.aclose()  # our close_notify
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def _authenticate(node: "Node", acceptor: "AcceptorConfig", stream, source: str, source_ip: str,
                        cn: str | None):
    """Run SASL; returns (principal, leftover bytes, mechanism) or None when the connection must
    close."""
    sasl = SaslServer(acceptor.sasl_mechanisms, node.cfg.max_frame_bytes)
    try:
        while True:
            ev = await next_sasl_event(sasl, stream)
            if ev is None:
                if sasl.state is SaslState.AWAIT_INIT:  # EOF before (or inside) sasl-init
                    await stream.send_all(_SASL_SYS_PERM)
                return None
            if isinstance(ev, SaslHeaderReceived):
                continue
            if isinstance(ev, AuthRequested):
                principal, why = await _decide(node, ev, source_ip, cn)
                if principal is None:
                    node.counters["auth_failed"] += 1
                    # one line per source per interval: a login flood must not flood the log
                    if node.log_once(f"auth/{source_key(source_ip)}", trio.current_time()):
                        log.info("authentication failed (further failures from this source are "
                                 "counted, not logged, for the log interval)", extra={"fields": {
                                     "source": source, "mechanism": ev.mechanism, "reason": why}})
                    sasl.reject(description=why)
                else:
                    pending_principal = principal
                    sasl.accept(getattr(principal, "user", None))
                continue
            if isinstance(ev, AuthFailed):
                out = sasl.data_to_send()
                if out:
                    await stream.send_all(out)
                return None
            if isinstance(ev, AmqpHeaderReceived):
                return pending_principal, sasl.leftover(), str(sasl.init.mechanism) if sasl.init else None
            if isinstance(ev, NoSasl):
                if not (acceptor.allow_no_sasl and node.security.anonymous_enabled):
                    node.counters["auth_failed"] += 1
                    log.info("client skipped SASL; refused", extra={"fields": {"source": source}})
                    await stream.send_all(SASL_HEADER)  # §2.2: the header we require, then close
                    return None
                return node.security.anonymous_principal(), sasl.leftover(), None
    except NotThisProtocol as exc:
        node.counters["bad_protocol_header"] += 1
        log.info("not an AMQP client: %s", exc.description, extra={"fields": {"source": source}})
        # what the state machine queued before it raised (e.g. sasl-outcome when the client
        # pipelined a bad AMQP header after sasl-init) goes out before the reply
        await stream.send_all(sasl.data_to_send() + exc.reply)
        return None
    except RemoteProtocolError as exc:
        node.counters["sasl_protocol_error"] += 1
        log.info("SASL protocol error: %s", exc.description,
                 extra={"fields": {"source": source, "condition": exc.condition}})
        out = sasl.data_to_send()
        if exc.reply:
            out += exc.reply
        elif sasl.state is SaslState.AWAIT_INIT:
            out += _SASL_SYS_PERM
        if out:
            await stream.send_all(out)
        return None


_SASL_SYS_PERM = encode_frame(FRAME_SASL, 0, SaslOutcome(SaslOutcome.SYS_PERM))


async def _decide(node: "Node", ev: AuthRequested, source_ip: str, cn: str | None):
    """Check one sasl-init. Returns (principal or None, reason)."""
    security = node.security
    mech = ev.mechanism
    if mech == "PLAIN":
        try:
            _authz, user, password = parse_plain(ev.initial_response)
        except RemoteProtocolError as exc:
            return None, exc.description
        cluster = node.cluster
        if cluster is not None:
            ok = cluster.check_login(user, password, source_ip)
            if ok is not None:  # the cluster user (Artemis cluster-user): its own password, no users file
                if ok:
                    node.counters["cluster_logins"] += 1
                    return Principal(user, (CLUSTER_ROLE,)), "ok"
                node.counters["cluster_login_refused"] += 1
                await trio.sleep(security.login.failure_delay_s)
                return None, f"bad credentials for cluster user {user[:64]!r}"
        # known logins at once; otherwise throttled, fair, on the gate's own threads, and a
        # refusal only after its delay (broker.wire.io.login)
        result = await node.login_gate.login(user, password, source_ip)
        if result.principal is not None:
            return result.principal, "ok"
        return None, f"{result.reason} for user {user[:64]!r}"
    if mech == "ANONYMOUS":
        principal = security.anonymous_principal()
        return (principal, "ok") if principal is not None else (None, "anonymous access is disabled")
    if mech == "EXTERNAL":
        if cn is None:
            return None, "EXTERNAL needs a client certificate"
        principal = security.principal_for_certificate(cn, source_ip)
        return (principal, "ok") if principal is not None else (None, f"no user for certificate CN {cn!r}")
    return None, f"mechanism {mech} not supported"


async def _pump(node: "Node", stream, conn_id: str, principal, source: str, tls: bool, leftover: bytes,
                acceptor: "AcceptorConfig | None" = None) -> AmqpEngine:
    wakeup = Wakeup()
    engine = AmqpEngine(node, conn_id=conn_id, principal=principal, source=source, tls=tls, wake=wakeup.set,
                        anycast_prefix=acceptor.anycast_prefix if acceptor is not None else "",
                        multicast_prefix=acceptor.multicast_prefix if acceptor is not None else "")
    node.engine_started(engine)
    try:
        await pump_engine(engine, stream, wakeup, leftover=leftover, open_timeout_s=node.cfg.handshake_timeout_s,
                          on_open_timeout=lambda: node.count("open_timeout"))
    except* (trio.BrokenResourceError, trio.ClosedResourceError, ssl.SSLError, OSError) as group:
        # the peer reset or vanished (a TLS peer without close_notify too): this connection only
        node.counters["connection_broken"] += 1
        log.debug("connection broken: %r", group.exceptions[0], extra={"fields": {"conn": conn_id, "source": source}})
    finally:
        engine.finish()
        node.engine_finished(engine)
    return engine
