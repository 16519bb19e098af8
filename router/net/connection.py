"""One client connection at the router's edge, from accept to close.

Theory of operation
-------------------
``Acceptor.handle(stream)`` is the whole life of one connection and the one place that owns its
deadlines. Phases, each under its own ``trio.move_on_after``:

1. **TLS** (TLS acceptors only): ``SSLStream.do_handshake`` within ``tls_handshake_timeout_s``.
   The SNI host name comes from the context's ``sni_callback`` (``router.net.tls``); with mTLS the
   verified certificate's CN is the SASL EXTERNAL identity.
2. **Handshake**: SASL + AMQP header + Open, sniffed by ``router.sniff.amqp.HandshakeSniffer``
   within ``handshake_timeout_s`` (one deadline for the whole exchange, so a slow-drip client
   cannot stretch it). The router authenticates the client itself (PLAIN against the users file,
   ANONYMOUS when the users file allows it, EXTERNAL from the certificate); bad credentials get
   a SASL ``auth`` outcome. Garbage, a wrong protocol header, malformed or oversized frames close
   the connection with the error's wire reply; each case has its own counter.
3. **Routing**: ``RouterService.route(ConnectionInfo)`` → ``Decision`` (it may wait for the
   quorum up to quorum-timeout, bounded by the service). One routing-log line per decision.
4. **Redirect mode**: write the Artemis-style redirect (Open with
   ``amqp:connection-establishment-failed`` + Close ``amqp:connection:redirect`` with
   ``network-host``/``port``), or the refusal (Close ``amqp:connection:forced``), then half-close
   and wait at most ``close_linger_s`` for the client's Close/EOF so the frames are not lost to
   a reset.
5. **Proxy mode**: connect to the target (``upstream_connect_timeout_s``, TLS upstream if the
   target says so), replay the client's SASL header + sasl-init (``SaslClientReplay``; the
   client's own credentials), swallow the broker's SASL exchange, send the client's AMQP header
   + Open (+ anything pipelined), then ``router.net.proxy.pump`` with ``idle_timeout_s``. From
   here on the broker speaks for itself: its Open, and its Close with its error, reach the client
   byte for byte. SASL EXTERNAL cannot be replayed (the router holds no client key), so in proxy
   mode an EXTERNAL client is refused with ``amqp:not-implemented`` after its Open.

Whatever happens, ``finally`` closes every stream with ``aclose_forcefully``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import logging
import os
import socket
import ssl
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import trio

from broker.amqp.frames import redirect_frames, refuse_frames
from broker.amqp.sasl import SaslClientReplay, UpstreamAuthFailed, UpstreamAuthOk, parse_plain
from broker.errors import NotThisProtocol, RemoteProtocolError
from router.core.decide import Decision, Outcome
from router.core.keys import ConnectionInfo
from router.net import proxy as proxy_mod
from router.net.stats import EdgeStats
from router.net.tls import peer_common_name, sni_of
from router.routelog import RouteLog, utc_timestamp
from router.sniff.amqp import NEED_DATA, AuthFailed, AuthRequested, Detected, HandshakeSniffer

log = logging.getLogger("router.connection")

_RECEIVE_BYTES = 65536
_SASL_AUTH = 1  # sasl-outcome code "auth" (§5.3.3.6)


class Principal(Protocol):
    """What the users file gives back for an authenticated client (``broker.core.security``)."""

    user: str
    roles: tuple[str, ...]


class Authenticator(Protocol):
    """The users/roles file (``broker.core.security.SecurityConfig``), as the edge uses it."""

    def authenticate(self, user: str, password: str, source_ip: str) -> Principal | None: ...

    def principal_for_certificate(self, cn: str, source_ip: str) -> Principal | None: ...

    def anonymous_principal(self) -> Principal | None: ...


@dataclass
class AcceptorSettings:
    """Everything one acceptor needs at run time (built from ``[[acceptors]]`` by the server)."""

    name: str
    mode: str                                   # "redirect" | "proxy"
    router: str                                 # the router (service) name
    ssl_context: ssl.SSLContext | None = None
    mechanisms: tuple[str, ...] = ("PLAIN",)
    tls_handshake_timeout_s: float = 10.0
    handshake_timeout_s: float = 10.0
    upstream_connect_timeout_s: float = 5.0
    idle_timeout_s: float | None = 300.0
    close_linger_s: float = 1.0
    max_handshake_bytes: int = 65536
    upstream_ssl_context: ssl.SSLContext | None = None
    upstream_tls: bool = False                  # TLS to every target (else only targets with tls = true)
    use_splice: bool = True
    chunk_bytes: int = proxy_mod.DEFAULT_CHUNK_BYTES


class AuthMemo:
    """Successful PLAIN logins, keyed by (user, sha256(password), source host): a reconnecting
    client is authenticated without a worker-thread hop (the users file's own cache still needs
    one call into a thread, which costs more than the rest of a redirect). Bounded LRU; the
    users file is not reloaded at run time, so entries cannot go stale."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._d: OrderedDict = OrderedDict()

    def get(self, key):
        p = self._d.get(key)
        if p is not None:
            self._d.move_to_end(key)
        return p

    def put(self, key, principal) -> None:
        self._d[key] = principal
        if len(self._d) > self.size:
            self._d.popitem(last=False)


@dataclass
class EdgeContext:
    """Process-wide pieces every acceptor shares."""

    stats: EdgeStats
    routelog: RouteLog
    authenticator: Authenticator | None
    worker: int = 0
    auth_memo: AuthMemo = field(default_factory=AuthMemo)
    clock: Callable[[], float] = time.time
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _prefix: str = field(default_factory=lambda: os.urandom(4).hex())

    def next_connection_id(self) -> str:
        return f"{self._prefix}-{self.worker}-{next(self._ids)}"


def format_source(sockaddr) -> tuple[str, str, int]:
    """("host:port" as in ConnectionInfo.source, host, port) for a peer sockaddr."""
    host, port = sockaddr[0], sockaddr[1]
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return text, host, port


_TLS_CLOSE_S = 1.0


async def _connect_tcp(host: str, port: int) -> trio.SocketStream:
    """TCP connect; an IP literal skips trio's resolver and happy-eyeballs machinery (a nursery
    and tasks per connect), which is most of a connect's cost on the proxy's hot path."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return await trio.open_tcp_stream(host, port)
    sock = trio.socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
    try:
        await sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def _close(stream: trio.abc.Stream) -> None:
    """Close a stream; a TLS stream gets its close_notify (bounded by _TLS_CLOSE_S, shielded so
    it also happens when the connection is being cancelled), so TLS peers see a clean end."""
    if isinstance(stream, trio.SSLStream) and getattr(stream, "_lodestone_handshook", False):
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + _TLS_CLOSE_S
            try:
                await stream.aclose()
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
    await trio.aclose_forcefully(stream)


@dataclass
class _Conn:
    """Per-connection facts gathered along the way (for the routing log)."""

    id: str
    source: str
    host: str
    port: int
    started: float
    wall_started: float
    sni: str | None = None
    cert_cn: str | None = None
    user: str | None = None
    roles: tuple[str, ...] = ()
    mechanism: str | None = None
    container_id: str | None = None
    open_hostname: str | None = None


class Acceptor:
    """One configured acceptor: ``handle`` is called for each accepted TCP stream."""

    def __init__(self, settings: AcceptorSettings, service, edge: EdgeContext):
        self.settings = settings
        self.service = service
        self.edge = edge

    def _inc(self, name: str, n: int = 1) -> None:
        self.edge.stats.inc(self.settings.name, name, n)

    # -- the one place that owns every deadline ------------------------------------------------
    async def handle(self, tcp: trio.SocketStream) -> None:
        """Serve one client connection to the end. Never raises for peer behaviour."""
        s = self.settings
        stats = self.edge.stats
        stats.active[s.name] += 1
        self._inc("accepted")
        try:
            source, host, port = format_source(tcp.socket.getpeername())
        except OSError:
            stats.active[s.name] -= 1
            await trio.aclose_forcefully(tcp)
            return
        c = _Conn(self.edge.next_connection_id(), source, host, port, trio.current_time(), self.edge.clock())
        client: trio.abc.Stream = tcp
        upstream: trio.abc.Stream | None = None
        try:
            # 1. TLS
            if s.ssl_context is not None:
                # https_compatible=False: our aclose sends close_notify (TLS peers, e.g. brokers and
                # proton, expect it); a peer's missing close_notify surfaces as a broken stream.
                client = trio.SSLStream(tcp, s.ssl_context, server_side=True)
                with trio.move_on_after(s.tls_handshake_timeout_s) as scope:
                    try:
                        await client.do_handshake()
                    except trio.BrokenResourceError as exc:
                        self._inc("tls_handshake_failed")
                        log.debug("%s: TLS handshake failed: %s", c.source, exc.__cause__ or exc)
                        return
                if scope.cancelled_caught:
                    self._inc("tls_handshake_timeout")
                    return
                self._inc("tls_handshake_ok")
                client._lodestone_handshook = True  # _close may send close_notify
                ssl_object = client._ssl_object  # trio keeps the SSLObject here; SNI lives on it
                c.sni = sni_of(ssl_object)
                c.cert_cn = peer_common_name(ssl_object)

            # 2. SASL + Open
            with trio.move_on_after(s.handshake_timeout_s) as scope:
                detected = await self._sniff(client, c)
            if scope.cancelled_caught:
                self._inc("handshake_timeout")
                return
            if detected is None:
                return

            # 3. Route
            info = ConnectionInfo(source=c.source, sni_host=c.sni, container_id=c.container_id,
                                  user=c.user, roles=c.roles, acceptor=s.name)
            t0 = time.perf_counter_ns()
            decision: Decision = await self.service.route(info)
            decision_us = (time.perf_counter_ns() - t0) // 1000
            self._inc({Outcome.OK: "route_ok", Outcome.REFUSED_UNAVAILABLE: "route_refused_unavailable",
                       Outcome.REFUSED_USE_ANOTHER: "route_refused_use_another"}[decision.outcome])

            target = decision.target if decision.outcome is Outcome.OK else None
            if target is None:
                self._log_decision(c, decision, decision_us, "refused")
                await self._refuse(client, self._refusal_text(decision), "refused")
                return
            if s.mode == "redirect":
                self._log_decision(c, decision, decision_us, "redirected")
                text = (f"Connection router {s.router} redirected this connection to "
                        f"{target.host}:{target.port}")
                await self._send_and_linger(client, redirect_frames(target.host, target.port, text))
                self._inc("redirected")
                return

            # 5. Proxy
            if detected.mechanism == "EXTERNAL":
                self._inc("proxy_external_refused")
                self._log_decision(c, decision, decision_us, "refused_external")
                await self._refuse(client, f"Connection router {s.router} cannot proxy SASL EXTERNAL "
                                           "(the client certificate cannot be replayed to a broker); "
                                           "use PLAIN or a redirect acceptor",
                                   None, condition="amqp:not-implemented")
                return
            upstream, leftover = await self._open_upstream(client, c, target, detected)
            if upstream is None:
                self._log_decision(c, decision, decision_us, "upstream_failed")
                return
            self._log_decision(c, decision, decision_us, "proxied")
            self._inc("proxied")
            if leftover:
                await client.send_all(leftover)
            result = proxy_mod.PumpStats()
            try:
                await proxy_mod.pump(client, upstream, idle_timeout_s=s.idle_timeout_s,
                                     chunk_bytes=s.chunk_bytes, use_splice=s.use_splice, stats=result)
            except trio.Cancelled:
                result.reason = proxy_mod.EndReason.CANCELLED  # drain deadline / shutdown
                self._proxy_closed(c, decision, result)
                raise
            self._proxy_closed(c, decision, result)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # the client vanished in the middle of one of our writes; nothing to tell anybody
            pass
        except Exception:
            self._inc("internal_error")
            log.exception("%s: connection %s failed", s.name, c.id)
        finally:
            stats.active[s.name] -= 1
            if upstream is not None:
                await _close(upstream)
            await _close(client)

    # -- phase 2 ------------------------------------------------------------------------------
    async def _sniff(self, client: trio.abc.Stream, c: _Conn) -> Detected | None:
        s = self.settings
        sniffer = HandshakeSniffer(True, s.max_handshake_bytes, mechanisms=self._mechanisms_for(c),
                                   allow_no_sasl=self._anonymous_allowed())
        try:
            while True:
                ev = sniffer.next_event()
                if ev is NEED_DATA:
                    out = sniffer.data_to_send()
                    if out:
                        await client.send_all(out)
                    try:
                        data = await client.receive_some(_RECEIVE_BYTES)
                    except trio.BrokenResourceError:
                        data = b""
                    if not data:
                        self._inc("handshake_eof")
                        return None
                    sniffer.receive_data(data)
                elif isinstance(ev, AuthRequested):
                    principal = await self._authenticate(ev, c)
                    if principal is None:
                        sniffer.reject(_SASL_AUTH, "authentication failed")
                    else:
                        # ConnectionInfo.user is None for an anonymous client (the contract)
                        c.user = None if ev.mechanism == "ANONYMOUS" else principal.user
                        c.roles, c.mechanism = tuple(principal.roles), ev.mechanism
                        self._inc("auth_ok")
                        sniffer.accept(principal.user)
                elif isinstance(ev, AuthFailed):
                    self._inc("auth_failed")
                    await client.send_all(sniffer.data_to_send())
                    return None
                elif isinstance(ev, Detected):
                    out = sniffer.data_to_send()
                    if out:
                        await client.send_all(out)
                    if ev.sasl_init_bytes is None:
                        # No SASL at all: anonymous (allowed only when the users file allows it)
                        principal = self._anonymous()
                        if principal is None:  # pragma: no cover - the sniffer refuses first
                            return None
                        c.user, c.roles, c.mechanism = None, tuple(principal.roles), None
                    c.container_id = ev.open.container_id
                    c.open_hostname = ev.open.hostname
                    return ev
        except NotThisProtocol as exc:
            self._inc("protocol_header_rejected")
            await self._send_quietly(client, sniffer.data_to_send() + (exc.reply or b""))
            return None
        except RemoteProtocolError as exc:
            self._inc("handshake_oversized" if sniffer._received > s.max_handshake_bytes else "protocol_error")
            log.debug("%s: %s: handshake error %s", s.name, c.source, exc)
            await self._send_quietly(client, sniffer.data_to_send() + (exc.reply or b""))
            return None

    def _anonymous_allowed(self) -> bool:
        return "ANONYMOUS" in self.settings.mechanisms and self._anonymous() is not None

    def _anonymous(self):
        auth = self.edge.authenticator
        return auth.anonymous_principal() if auth is not None else None

    def _mechanisms_for(self, c: _Conn) -> tuple[str, ...]:
        mechs = []
        for m in self.settings.mechanisms:
            if m == "EXTERNAL" and c.cert_cn is None:
                continue  # only offered to clients that presented a verified certificate
            if m == "ANONYMOUS" and self._anonymous() is None:
                continue
            mechs.append(m)
        return tuple(mechs) or ("PLAIN",)

    async def _authenticate(self, ev: AuthRequested, c: _Conn):
        auth = self.edge.authenticator
        if auth is None:
            return None
        try:
            if ev.mechanism == "PLAIN":
                _authzid, user, password = parse_plain(ev.initial_response)
                memo_key = (user, hashlib.sha256(password.encode("utf-8")).digest(), c.host)
                principal = self.edge.auth_memo.get(memo_key)
                if principal is not None:
                    return principal
                # scrypt is deliberately slow (~50 ms): keep it off the event loop
                principal = await trio.to_thread.run_sync(auth.authenticate, user, password, c.host)
                if principal is not None:
                    self.edge.auth_memo.put(memo_key, principal)
                return principal
            if ev.mechanism == "EXTERNAL":
                if c.cert_cn is None:
                    return None
                return auth.principal_for_certificate(c.cert_cn, c.host)
            if ev.mechanism == "ANONYMOUS":
                return auth.anonymous_principal()
        except RemoteProtocolError:
            return None
        return None

    # -- phase 4 ------------------------------------------------------------------------------
    def _refusal_text(self, decision: Decision) -> str:
        r = self.settings.router
        if decision.outcome is Outcome.REFUSED_USE_ANOTHER:
            return f"Connection router {r} rejected this connection"
        reason = getattr(decision.explanation, "reason", "")
        return f"Connection router {r} is not ready" + (f" ({reason})" if reason else "")

    async def _refuse(self, client: trio.abc.Stream, description: str, counter: str | None,
                      condition: str = "amqp:connection:forced") -> None:
        if counter:
            self._inc(counter)
        await self._send_and_linger(client, refuse_frames(condition, description))

    async def _send_and_linger(self, client: trio.abc.Stream, data: bytes) -> None:
        """Write our last frames, half-close, and give the client ``close_linger_s`` to answer
        with its Close and EOF (closing at once could reset the connection before it read them)."""
        try:
            await client.send_all(data)
            if isinstance(client, trio.abc.HalfCloseableStream):
                await client.send_eof()
            with trio.move_on_after(self.settings.close_linger_s):
                while await client.receive_some(_RECEIVE_BYTES):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _send_quietly(self, client: trio.abc.Stream, data: bytes) -> None:
        if not data:
            return
        try:
            with trio.move_on_after(self.settings.close_linger_s):
                await client.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    # -- phase 5 ------------------------------------------------------------------------------
    async def _open_upstream(self, client: trio.abc.Stream, c: _Conn, target,
                             detected: Detected) -> tuple[trio.abc.Stream | None, bytes]:
        """Connect and replay the handshake. Returns (upstream, bytes for the client) or
        (None, b"") after telling the client why not."""
        s = self.settings
        r = s.router
        where = f"{target.name or target.host}:{target.port}" if target.name else f"{target.host}:{target.port}"
        upstream: trio.abc.Stream | None = None
        ok = False
        try:
            with trio.move_on_after(s.upstream_connect_timeout_s) as scope:
                try:
                    upstream = await _connect_tcp(target.host, target.port)
                    if target.tls or s.upstream_tls:
                        ctx = s.upstream_ssl_context or ssl.create_default_context()
                        upstream = trio.SSLStream(upstream, ctx, server_hostname=target.host)
                        await upstream.do_handshake()
                        upstream._lodestone_handshook = True
                except (OSError, trio.BrokenResourceError) as exc:
                    self._inc("upstream_connect_failed")
                    log.info("%s: cannot reach %s: %s", s.name, where, exc)
                    await self._refuse(client, f"Connection router {r} could not reach broker {where}", None)
                    return None, b""
            if scope.cancelled_caught:
                self._inc("upstream_connect_timeout")
                await self._refuse(client, f"Connection router {r} timed out connecting to broker {where}", None)
                return None, b""

            leftover = b""
            with trio.move_on_after(s.upstream_connect_timeout_s) as scope:
                try:
                    if detected.sasl_init_bytes is not None:
                        replay = SaslClientReplay(detected.sasl_init_bytes, max_frame_bytes=s.max_handshake_bytes)
                        await upstream.send_all(replay.data_to_send())
                        while True:
                            ev = replay.next_event()
                            if ev is NEED_DATA:
                                data = await upstream.receive_some(_RECEIVE_BYTES)
                                if not data:
                                    raise RemoteProtocolError("broker closed during SASL")
                                replay.receive_data(data)
                                continue
                            if isinstance(ev, UpstreamAuthFailed):
                                self._inc("upstream_auth_failed")
                                await self._refuse(client, f"broker {where} refused the credentials "
                                                           f"(sasl-outcome {ev.code})", None,
                                                   condition="amqp:unauthorized-access")
                                return None, b""
                            assert isinstance(ev, UpstreamAuthOk)
                            leftover = ev.leftover
                            break
                    await upstream.send_all(detected.client_bytes)
                except (RemoteProtocolError, trio.BrokenResourceError) as exc:
                    self._inc("upstream_protocol_error")
                    log.info("%s: broker %s broke the handshake replay: %s", s.name, where, exc)
                    await self._refuse(client, f"Connection router {r}: broker {where} failed the handshake", None)
                    return None, b""
            if scope.cancelled_caught:
                self._inc("upstream_connect_timeout")
                await self._refuse(client, f"Connection router {r} timed out replaying the handshake to {where}",
                                   None)
                return None, b""
            ok = True
            return upstream, leftover
        finally:
            if not ok and upstream is not None:
                await trio.aclose_forcefully(upstream)

    # -- routing log --------------------------------------------------------------------------
    def _log_decision(self, c: _Conn, decision: Decision, decision_us: int, action: str) -> None:
        s = self.settings
        e = decision.explanation
        t = decision.target
        self.edge.routelog.write({
            "v": 1,
            "event": "route",
            "time": utc_timestamp(self.edge.clock()),
            "connection_id": c.id,
            "worker": self.edge.worker,
            "router": s.router,
            "acceptor": s.name,
            "mode": s.mode,
            "key_type": e.key_type,
            "key_raw": e.raw_key,
            "key_filtered": e.filtered_key,
            "key_transformed": e.key,
            "client_address": c.host,
            "client_port": c.port,
            "sni": c.sni,
            "user": c.user,
            "roles": list(c.roles),
            "sasl_mechanism": c.mechanism,
            "container_id": c.container_id,
            "open_hostname": c.open_hostname,
            "target_name": t.name if t is not None else None,
            "target_node_id": t.node_id if t is not None else None,
            "target_address": f"{t.host}:{t.port}" if t is not None else None,
            "local": decision.local,
            "policy": e.policy,
            "cache": e.cache,
            "cache_hit": e.cache == "hit",
            "cache_tier": e.cache_tier,
            "pin": e.pin,
            "quorum_met": e.quorum_met,
            "ready_targets": e.ready_targets,
            "outcome": decision.outcome.value,
            "action": action,
            "reason": e.reason,
            "decision_us": int(decision_us),
        })

    def _proxy_closed(self, c: _Conn, decision: Decision, result: proxy_mod.PumpStats) -> None:
        s = self.settings
        stats = self.edge.stats
        stats.bytes_up[s.name] += result.bytes_up
        stats.bytes_down[s.name] += result.bytes_down
        self._inc({proxy_mod.EndReason.CLOSED: "proxy_closed",
                   proxy_mod.EndReason.IDLE_TIMEOUT: "proxy_idle_timeout",
                   proxy_mod.EndReason.CLIENT_ERROR: "proxy_client_error",
                   proxy_mod.EndReason.UPSTREAM_ERROR: "proxy_upstream_error",
                   proxy_mod.EndReason.CANCELLED: "proxy_cancelled"}[result.reason])
        t = decision.target
        self.edge.routelog.write({
            "v": 1,
            "event": "close",
            "time": utc_timestamp(self.edge.clock()),
            "connection_id": c.id,
            "worker": self.edge.worker,
            "router": s.router,
            "acceptor": s.name,
            "mode": s.mode,
            "client_address": c.host,
            "client_port": c.port,
            "user": c.user,
            "container_id": c.container_id,
            "target_name": t.name if t is not None else None,
            "target_node_id": t.node_id if t is not None else None,
            "target_address": f"{t.host}:{t.port}" if t is not None else None,
            "bytes_client_to_broker": result.bytes_up,
            "bytes_broker_to_client": result.bytes_down,
            "duration_ms": round((trio.current_time() - c.started) * 1000, 3),
            "close_reason": result.reason.value,
            "closed_first_by": result.first_eof,
            "spliced": result.spliced,
            "error": result.error,
        })
