"""One client connection at the router's edge, from accept to close.

Theory of operation
-------------------
``Acceptor.handle(sock, peer)`` is the whole life of one connection and the one place that owns
its deadlines. The socket comes straight from ``accept`` (``router.net.listener``) and is wrapped
in the lean streams of ``router.net.fastio`` (no trio stream layers on the hot path). One cancel
scope carries the deadline of each phase in turn (``_Conn.phase`` tells which one fired):

1. **TLS** (TLS acceptors only): ``FastTLSStream.do_handshake`` within ``tls_handshake_timeout_s``.
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
   target says so), replay the client's SASL header + sasl-init (the client's own credentials)
   pipelined with its AMQP header + Open (+ anything pipelined) in one write, parse the broker's
   SASL outcome from its first bytes (a byte-exact memo of known ok-answers, else
   ``SaslClientReplay``; replay phase, again ``upstream_connect_timeout_s``), pass what follows
   the outcome to the client, then ``router.net.proxy.pump`` with ``idle_timeout_s``. From
   here on the broker speaks for itself: its Open, and its Close with its error, reach the client
   byte for byte. SASL EXTERNAL cannot be replayed (the router holds no client key), so in proxy
   mode an EXTERNAL client is refused with ``amqp:not-implemented`` after its Open.

Whatever happens, ``finally`` closes every stream (TLS streams with a close_notify, bounded).
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import logging
import os
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import trio

from broker.amqp.frames import (artemis_not_ready_description, artemis_redirect_description,
                                 artemis_rejected_description, redirect_frames, refuse_frames)
from broker.amqp.sasl import SaslClientReplay, UpstreamAuthFailed, UpstreamAuthOk, parse_plain
from broker.auth import LoginGate
from broker.core.limits import Admission, OncePer, SourceLimiter, SourceLimits, source_key
from broker.core.security import SecurityConfig
from broker.errors import DecodeError, NotThisProtocol, RemoteProtocolError
from broker.proxyproto import build_header as build_proxy_header
from router.core.decide import Decision, Outcome
from router.core.keys import ConnectionInfo
from router.net import fastio
from router.net import proxy as proxy_mod
from router.net.stats import COUNTER_NAMES, EdgeStats
from router.net.tls import peer_common_name, sni_of
from router.routelog import (
    RouteLog,
    json_bool,
    json_float,
    json_int,
    json_str,
    json_str_bounded,
    json_str_list,
    utc_timestamp,
)
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

    def cached(self, user: str, password: str, source_ip: str) -> Principal | None: ...

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
    upstream_proxy_protocol: bool = False       # PROXY v2 header (the client's address) first upstream
    use_splice: bool = True
    chunk_bytes: int = proxy_mod.DEFAULT_CHUNK_BYTES
    limits: SourceLimits = SourceLimits()       # per-source limits (broker.core.limits)
    max_connections: int = 0                    # the acceptor's limit (enforced by the listener)


@dataclass
class EdgeContext:
    """Process-wide pieces every acceptor shares."""

    stats: EdgeStats
    routelog: RouteLog
    authenticator: Authenticator | None
    worker: int = 0
    login_gate: Any = None                      # broker.auth.LoginGate over the authenticator
    clock: Callable[[], float] = time.time
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    _prefix: str = field(default_factory=lambda: os.urandom(4).hex())

    def __post_init__(self) -> None:
        if self.login_gate is None and isinstance(self.authenticator, SecurityConfig):
            self.login_gate = LoginGate(self.authenticator, name="router")
        self.log_once = OncePer(self.login_gate.settings.log_interval_s if self.login_gate else 60.0)

    def next_connection_id(self) -> str:
        return f"{self._prefix}-{self.worker}-{next(self._ids)}"


def format_source(sockaddr) -> tuple[str, str, int]:
    """("host:port" as in ConnectionInfo.source, host, port) for a peer sockaddr."""
    host, port = sockaddr[0], sockaddr[1]
    text = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return text, host, port


_TLS_CLOSE_S = 1.0
_REFUSAL_TIMEOUT_S = 2.0   # a client over a per-source limit gets this long to hear its refusal
_MAX_REFUSING = 256        # acceptor-wide refusals in flight (over max-connections); more: closed
_OVER_LIMIT_REFUSAL_S = 0.25   # ... and how long each may take (a silent client is simply closed)
_LIMIT_TEXT = {
    "source_connections": "Connection router {r}: {src} has {lim.max_connections_per_source} connections "
                          "open (max-connections-per-source)",
    "source_unauthenticated": "Connection router {r}: {src} has {lim.max_unauthenticated_per_source} "
                              "connections still authenticating (max-unauthenticated-per-source)",
    "source_rate": "Connection router {r}: {src} opens connections faster than "
                   "{lim.max_connection_rate_per_source:g} per second (max-connection-rate-per-source)",
}
_INF = float("inf")

# Phases of one connection: which deadline the connection's single cancel scope enforces.
_PH_TLS, _PH_HANDSHAKE, _PH_ROUTE, _PH_CONNECT, _PH_REPLAY, _PH_PROXY, _PH_LINGER = range(7)

# Upstream SASL replies that ended in outcome ok, byte for byte (SASL header + mechanisms +
# outcome): a broker answers every replay with the same bytes, so a reply that starts with a
# known prefix is an UpstreamAuthOk whose leftover is the rest (the parse is a pure function of
# the bytes; anything else goes through SaslClientReplay).
_UPSTREAM_OK_PREFIXES: dict[bytes, None] = {}
_MAX_OK_PREFIXES = 32

_ADDR_CACHE: dict[tuple[str, int], tuple[int, tuple] | None] = {}


def _ip_address_for(host: str, port: int) -> tuple[int, tuple] | None:
    """(family, sockaddr) when ``host`` is an IP literal, None for a name (memoized)."""
    key = (host, port)
    try:
        return _ADDR_CACHE[key]
    except KeyError:
        pass
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        r = None
    else:
        r = (socket.AF_INET6, (host, port, 0, 0)) if ip.version == 6 else (socket.AF_INET, (host, port))
    if len(_ADDR_CACHE) < 4096:
        _ADDR_CACHE[key] = r
    return r


async def _connect_tcp(host: str, port: int) -> socket.socket:
    """TCP connect (a non-blocking stdlib socket). An IP literal skips the resolver; a name is
    resolved by trio and its addresses are tried in order."""
    addr = _ip_address_for(host, port)
    if addr is not None:
        return await fastio.connect_tcp(*addr)
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError = OSError(f"{host} has no address")
    for family, _type, _proto, _canon, sockaddr in infos:
        try:
            return await fastio.connect_tcp(family, sockaddr)
        except OSError as exc:
            last = exc
    raise last


def _close_now(stream) -> bool:
    """Close a stream without waiting when possible (plain sockets; TLS whose close_notify goes
    out at once). False: a TLS close_notify is still to be written (then use :func:`_close`)."""
    if type(stream) is fastio.FastTLSStream and not stream.send_close_notify():
        return False
    stream.close()
    return True


async def _close(stream) -> None:
    """Close a stream; a TLS stream gets its close_notify (bounded by _TLS_CLOSE_S, shielded so
    it also happens when the connection is being cancelled), so TLS peers see a clean end."""
    if _close_now(stream):
        return
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + _TLS_CLOSE_S
        try:
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    stream.close()


@dataclass
class _Conn:
    """Per-connection facts gathered along the way (for the routing log), and its streams."""

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
    phase: int = _PH_TLS
    refusal: str | None = None  # over a per-source limit: the refusal text (no auth is checked)
    authenticated: bool = False
    refusal_timeout_s: float = _REFUSAL_TIMEOUT_S  # how long a refused client gets to hear why
    client: Any = None          # FastSocketStream | FastTLSStream once wrapped
    upstream: Any = None
    decision: Decision | None = None
    decision_us: int = 0
    leftover: bytes = b""       # broker bytes after its sasl-outcome, for the client


_ROUTE_COUNTER = {Outcome.OK: "route_ok", Outcome.REFUSED_UNAVAILABLE: "route_refused_unavailable",
                  Outcome.REFUSED_USE_ANOTHER: "route_refused_use_another"}
_END_COUNTER = {proxy_mod.EndReason.CLOSED: "proxy_closed",
                proxy_mod.EndReason.IDLE_TIMEOUT: "proxy_idle_timeout",
                proxy_mod.EndReason.CLIENT_ERROR: "proxy_client_error",
                proxy_mod.EndReason.UPSTREAM_ERROR: "proxy_upstream_error",
                proxy_mod.EndReason.CANCELLED: "proxy_cancelled"}


class Acceptor:
    """One configured acceptor: ``handle`` is called for each accepted TCP socket."""

    def __init__(self, settings: AcceptorSettings, service, edge: EdgeContext):
        self.settings = settings
        self.service = service
        self.edge = edge
        self._counters = edge.stats.counters
        self._keys = {name: (settings.name, name) for name in COUNTER_NAMES}
        self._upstream_ctx = settings.upstream_ssl_context
        self.limiter = SourceLimiter(settings.limits)
        self._refusing = 0          # refusals in flight for the acceptor-wide limit

    def _inc(self, name: str, n: int = 1) -> None:
        self._counters[self._keys[name]] += n

    # -- the one place that owns every deadline ------------------------------------------------
    async def handle(self, sock: socket.socket, peer) -> None:
        """Serve one accepted client socket to the end (``peer``: its address from ``accept``).
        Owns and closes the socket; never raises for peer behaviour.

        One cancel scope carries each phase's deadline in turn (``c.phase`` says which), so a
        timeout is told apart after the scope by the phase it hit."""
        s = self.settings
        active = self.edge.stats.active
        active[s.name] += 1
        self._counters[self._keys["accepted"]] += 1
        host, port = peer[0], peer[1]
        now = trio.current_time()
        c = _Conn(self.edge.next_connection_id(), f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                  host, port, now, self.edge.clock())
        key = source_key(host)
        verdict, reason = self.limiter.admit(key, now)
        if verdict is not Admission.ADMIT:
            self._inc(f"refused_{reason}")
            lim = s.limits
            c.refusal = _LIMIT_TEXT[reason].format(r=s.router, src=key, lim=lim)
            if self.edge.log_once(f"{s.name}/{key}/{reason}", now):
                log.warning("%s: %s; refusing (logged once per source per interval)", s.name, c.refusal)
            if verdict is Admission.DROP:
                self._inc("refused_dropped")
                active[s.name] -= 1
                sock.close()
                return
        try:
            with trio.CancelScope() as scope:
                proxy = await self._serve(sock, c, scope)
            if scope.cancelled_caught:
                await self._timed_out(c)
            elif proxy:
                await self._proxy(c)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # the client vanished in the middle of one of our writes; nothing to tell anybody
            pass
        except BaseExceptionGroup as group:
            # From the pump's nursery (trio wraps its tasks' exceptions, strict groups): a
            # cancellation (drain deadline, shutdown) goes on up; anything else is a bug in this
            # connection only — counted and logged, never allowed to reach the handlers nursery.
            cancelled, rest = group.split(trio.Cancelled)
            if rest is not None:
                self._inc("internal_error")
                log.error("%s: connection %s failed", s.name, c.id, exc_info=rest)
            if cancelled is not None:
                raise cancelled
        except Exception:
            self._inc("internal_error")
            log.exception("%s: connection %s failed", s.name, c.id)
        finally:
            active[s.name] -= 1
            if c.decision is not None:
                self.service.connection_closed(c.decision)
            if c.refusal is not None:
                self.limiter.release_refusal(key)
            else:
                self.limiter.release(key, authenticated=c.authenticated)
            if c.upstream is not None and not _close_now(c.upstream):
                await _close(c.upstream)
            if c.client is None:
                sock.close()
            elif not _close_now(c.client):
                await _close(c.client)

    async def refuse_over_limit(self, sock: socket.socket, peer) -> None:
        """The acceptor is at ``max-connections`` (counted by the listener as
        ``connection_limit_rejected``): answer ``amqp:resource-limit-exceeded`` without checking
        credentials, within 2 s — or close at once when the client's address already has
        ``max-refusing-per-source`` refusals in flight, or the acceptor ``_MAX_REFUSING``."""
        s = self.settings
        host, port = peer[0], peer[1]
        key = source_key(host)
        if self._refusing >= _MAX_REFUSING or \
                self.limiter.refuse(key, trio.current_time()) is Admission.DROP:
            self._inc("refused_dropped")
            sock.close()
            return
        self._refusing += 1
        c = _Conn(self.edge.next_connection_id(), f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                  host, port, trio.current_time(), self.edge.clock())
        c.refusal = (f"Connection router {s.router}: acceptor {s.name} is at its limit of "
                     f"{s.max_connections} connections (max-connections)")
        # at capacity: hold nothing for long — a client that is not already speaking is closed
        c.refusal_timeout_s = _OVER_LIMIT_REFUSAL_S
        try:
            with trio.CancelScope() as scope:
                await self._serve(sock, c, scope)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            self._inc("internal_error")
            log.exception("%s: refusing connection %s failed", s.name, c.id)
        finally:
            self._refusing -= 1
            self.limiter.release_refusal(key)
            if c.client is None:
                sock.close()
            elif not _close_now(c.client):
                await _close(c.client)

    async def _serve(self, sock: socket.socket, c: _Conn, scope: trio.CancelScope) -> bool:
        """Phases 1-4 and the upstream connect + replay of phase 5, under ``scope``. True when
        the connection is ready to be pumped (``c.client``/``c.upstream`` set)."""
        s = self.settings
        try:
            fastio.prepare_socket(sock)
        except OSError:
            self._inc("handshake_eof")  # the client is already gone
            return False
        # 1. TLS
        refusing = c.refusal is not None
        if s.ssl_context is not None:
            scope.deadline = trio.current_time() + (c.refusal_timeout_s if refusing else s.tls_handshake_timeout_s)
            try:
                client = c.client = fastio.FastTLSStream(sock, s.ssl_context, server_side=True)
            except OSError as exc:  # the socket broke before the handshake began
                self._inc("tls_handshake_failed")
                log.debug("%s: TLS setup failed: %s", c.source, exc)
                return False
            try:
                await client.do_handshake()
            except trio.BrokenResourceError as exc:
                self._inc("tls_handshake_failed")
                log.debug("%s: TLS handshake failed: %s", c.source, exc.__cause__ or exc)
                return False
            self._inc("tls_handshake_ok")
            ssl_object = client.ssl_object
            c.sni = sni_of(ssl_object)
            c.cert_cn = peer_common_name(ssl_object)
        else:
            client = c.client = fastio.FastSocketStream(sock)

        # 2. SASL + Open
        c.phase = _PH_HANDSHAKE
        scope.deadline = trio.current_time() + (c.refusal_timeout_s if refusing else s.handshake_timeout_s)
        detected = await self._sniff(client, c)
        if detected is None:
            return False
        if refusing:
            await self._refuse(client, c.refusal, None, condition="amqp:resource-limit-exceeded",
                               c=c, scope=scope)
            return False

        # 3. Route (the service bounds its own quorum wait)
        c.phase = _PH_ROUTE
        scope.deadline = _INF
        info = ConnectionInfo(source=c.source, sni_host=c.sni, container_id=c.container_id,
                              user=c.user, roles=c.roles, acceptor=s.name)
        t0 = time.perf_counter_ns()
        decision: Decision = await self.service.route(info)
        decision_us = c.decision_us = (time.perf_counter_ns() - t0) // 1000
        c.decision = decision
        self._inc(_ROUTE_COUNTER[decision.outcome])

        target = decision.target if decision.outcome is Outcome.OK else None
        if target is None:
            self._log_decision(c, decision, decision_us, "refused")
            await self._refuse(client, self._refusal_text(decision), "refused", c=c, scope=scope)
            return False
        if s.mode == "redirect":
            self._log_decision(c, decision, decision_us, "redirected")
            text = artemis_redirect_description(s.router, target.host, target.port)
            self._inc("redirected")  # before the linger, whose deadline may end this scope
            await self._send_and_linger(client, redirect_frames(target.host, target.port, text), c=c, scope=scope)
            return False

        # 5. Proxy
        if detected.mechanism == "EXTERNAL":
            self._inc("proxy_external_refused")
            self._log_decision(c, decision, decision_us, "refused_external")
            await self._refuse(client, f"Connection router {s.router} cannot proxy SASL EXTERNAL "
                                       "(the client certificate cannot be replayed to a broker); "
                                       "use PLAIN or a redirect acceptor",
                               None, condition="amqp:not-implemented", c=c, scope=scope)
            return False
        if not await self._open_upstream(client, c, target, detected, scope):
            return False  # logged ("upstream_failed") and answered by _open_upstream
        c.phase = _PH_PROXY  # the pump runs after this scope, with its own idle deadline
        return True

    async def _timed_out(self, c: _Conn) -> None:
        """The connection's cancel scope fired: count the phase's timeout, answer the client."""
        ph = c.phase
        if ph == _PH_TLS:
            self._inc("tls_handshake_timeout")
        elif ph == _PH_HANDSHAKE:
            self._inc("handshake_timeout")
        elif ph in (_PH_CONNECT, _PH_REPLAY):
            r = self.settings.router
            target = c.decision.target
            where = f"{target.name}:{target.port}" if target.name else f"{target.host}:{target.port}"
            if c.upstream is not None:
                c.upstream.close()
                c.upstream = None
            self._inc("upstream_connect_timeout")
            text = (f"Connection router {r} timed out connecting to broker {where}" if ph == _PH_CONNECT
                    else f"Connection router {r} timed out replaying the handshake to {where}")
            await self._refuse(c.client, text, None)
            self._log_decision(c, c.decision, c.decision_us, "upstream_failed")
        # _PH_LINGER: the client did not close within close_linger_s; nothing to count

    async def _proxy(self, c: _Conn) -> None:
        s = self.settings
        decision = c.decision
        self._log_decision(c, decision, c.decision_us, "proxied")
        self._inc("proxied")
        result = proxy_mod.PumpStats()
        try:
            if c.leftover:
                # the broker's bytes after its sasl-outcome (its AMQP header + Open, usually)
                try:
                    await c.client.send_all(c.leftover)
                except trio.BrokenResourceError as exc:
                    result.reason = proxy_mod.EndReason.CLIENT_ERROR
                    result.error = f"client: send {exc}"
                    self._proxy_closed(c, decision, result)
                    return
                result.bytes_down = len(c.leftover)
            await proxy_mod.pump(c.client, c.upstream, idle_timeout_s=s.idle_timeout_s,
                                 chunk_bytes=s.chunk_bytes, use_splice=s.use_splice, stats=result)
        except BaseException as exc:
            # drain deadline / shutdown: a bare Cancelled from the one-task pump, or a group of
            # them from the two-task pump's nursery (trio's strict exception groups)
            if isinstance(exc, trio.Cancelled) or (isinstance(exc, BaseExceptionGroup)
                                                   and exc.split(trio.Cancelled)[1] is None):
                result.reason = proxy_mod.EndReason.CANCELLED
                self._proxy_closed(c, decision, result)
            raise
        self._proxy_closed(c, decision, result)

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
                    data = await client.receive_some(_RECEIVE_BYTES)
                    if not data:
                        self._inc("handshake_eof")
                        return None
                    sniffer.receive_data(data)
                elif isinstance(ev, AuthRequested) and c.refusal is not None:
                    sniffer.accept(None)  # over a limit: no credentials checked, only the refusal follows
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
                        c.authenticated = True
                        self.limiter.authenticated(source_key(c.host))
                elif isinstance(ev, AuthFailed):
                    self._inc("auth_failed")
                    await self._send_quietly(client, sniffer.data_to_send())
                    return None
                elif isinstance(ev, Detected):
                    out = sniffer.data_to_send()
                    if out:
                        await client.send_all(out)
                    if ev.sasl_init_bytes is None and c.refusal is None:
                        # No SASL at all: anonymous (allowed only when the users file allows it)
                        principal = self._anonymous()
                        if principal is None:  # pragma: no cover - the sniffer refuses first
                            return None
                        c.user, c.roles, c.mechanism = None, tuple(principal.roles), None
                        c.authenticated = True
                        self.limiter.authenticated(source_key(c.host))
                    c.container_id = ev.open.container_id
                    c.open_hostname = ev.open.hostname
                    return ev
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The client left (reset, or TLS broken) while we read or wrote its handshake: our
            # SASL header/mechanisms/outcome may meet a reset as well as our next read does.
            self._inc("handshake_eof")
            return None
        except NotThisProtocol as exc:
            self._inc("protocol_header_rejected")
            await self._send_quietly(client, sniffer.data_to_send() + (exc.reply or b""))
            return None
        except RemoteProtocolError as exc:
            self._inc("handshake_oversized" if sniffer._received > s.max_handshake_bytes else
                      "handshake_decode_error" if isinstance(exc, DecodeError) else "protocol_error")
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
                gate = self.edge.login_gate
                if gate is None:  # pragma: no cover - an Authenticator that is not a users file
                    principal = auth.cached(user, password, c.host)
                    if principal is None:
                        principal = await trio.to_thread.run_sync(auth.authenticate, user, password, c.host)
                    return principal
                # a known login at once; else throttled, fair, on the gate's own threads, and a
                # refusal only after its delay (broker.auth)
                return (await gate.login(user, password, c.host)).principal
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
            reason = decision.explanation.reason
            if reason.startswith("key too long"):  # max-key-length: tell the client why
                return f"{artemis_rejected_description(r)} ({reason})"
            return artemis_rejected_description(r)
        return artemis_not_ready_description(r)

    async def _refuse(self, client: trio.abc.Stream, description: str, counter: str | None,
                      condition: str = "amqp:connection:forced", *, c: _Conn | None = None,
                      scope: trio.CancelScope | None = None) -> None:
        if counter:
            self._inc(counter)
        await self._send_and_linger(client, refuse_frames(condition, description), c=c, scope=scope)

    async def _send_and_linger(self, client: trio.abc.Stream, data: bytes, *, c: _Conn | None = None,
                               scope: trio.CancelScope | None = None) -> None:
        """Write our last frames, half-close, and give the client ``close_linger_s`` to answer
        with its Close and EOF (closing at once could reset the connection before it read them).
        Inside the connection's scope (``c``, ``scope``) the linger is that scope's deadline
        (phase LINGER); elsewhere it gets a scope of its own."""
        try:
            await client.send_all(data)
            if isinstance(client, trio.abc.HalfCloseableStream):
                await client.send_eof()
            if scope is not None and c is not None:
                c.phase = _PH_LINGER
                scope.deadline = trio.current_time() + self.settings.close_linger_s
                while await client.receive_some(_RECEIVE_BYTES):
                    pass
            else:
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
    async def _open_upstream(self, client: trio.abc.Stream, c: _Conn, target, detected: Detected,
                             scope: trio.CancelScope) -> bool:
        """Connect and replay the handshake (``c.upstream``, ``c.leftover``), under ``scope``
        with the connect deadline. False after telling the client why not.

        The replay is pipelined (AMQP §5.3.2 lets a client send its SASL header, sasl-init,
        AMQP header and Open without waiting): the client's SASL bytes and its AMQP header +
        Open go out in one write, and the broker's SASL outcome is parsed from the first bytes
        it answers with; whatever follows the outcome (its AMQP header, Open) is for the client.
        A broker that refuses the credentials never reads the pipelined Open."""
        s = self.settings
        r = s.router
        where = f"{target.name}:{target.port}" if target.name else f"{target.host}:{target.port}"
        c.phase = _PH_CONNECT
        scope.deadline = trio.current_time() + s.upstream_connect_timeout_s
        usock = None
        try:
            usock = await _connect_tcp(target.host, target.port)
            if s.upstream_proxy_protocol:
                # before TLS and SASL: the broker trusts this header from the router's address only
                # (its acceptor's proxy-protocol-from) and uses the client's address from then on
                await fastio.FastSocketStream(usock).send_all(build_proxy_header((c.host, c.port)))
            if target.tls or s.upstream_tls:
                ctx = self._upstream_ctx
                if ctx is None:
                    ctx = self._upstream_ctx = ssl.create_default_context()
                upstream = c.upstream = fastio.FastTLSStream(usock, ctx, server_side=False,
                                                             server_hostname=target.host)
                await upstream.do_handshake()
            else:
                upstream = c.upstream = fastio.FastSocketStream(usock)
        except (OSError, trio.BrokenResourceError) as exc:
            if c.upstream is not None:
                c.upstream.close()
                c.upstream = None
            elif usock is not None:
                usock.close()
            self._log_decision(c, c.decision, c.decision_us, "upstream_failed")
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                # out of descriptors: this client is refused, established ones are unaffected
                self._inc("upstream_fd_exhausted")
                await self._refuse(client, f"Connection router {r} is out of file descriptors and cannot "
                                           f"connect to broker {where}", None, c=c, scope=scope)
                return False
            self._inc("upstream_connect_failed")
            log.info("%s: cannot reach %s: %s", s.name, where, exc)
            await self._refuse(client, f"Connection router {r} could not reach broker {where}", None,
                               c=c, scope=scope)
            return False

        c.phase = _PH_REPLAY
        scope.deadline = trio.current_time() + s.upstream_connect_timeout_s
        failed: str | None = None
        try:
            if detected.sasl_init_bytes is None:
                await upstream.send_all(detected.client_bytes)
            else:
                await upstream.send_all(detected.sasl_init_bytes + detected.client_bytes)
                data = await upstream.receive_some(_RECEIVE_BYTES)
                for prefix in _UPSTREAM_OK_PREFIXES:
                    if data.startswith(prefix):
                        c.leftover = data[len(prefix):]
                        break
                else:
                    failed = await self._replay_slow(upstream, c, detected, data)
        except (RemoteProtocolError, trio.BrokenResourceError) as exc:
            self._inc("upstream_protocol_error")
            log.info("%s: broker %s broke the handshake replay: %s", s.name, where, exc)
            failed = f"Connection router {r}: broker {where} failed the handshake"
            condition = "amqp:connection:forced"
        else:
            condition = "amqp:unauthorized-access"
        if failed is not None:
            c.upstream.close()
            c.upstream = None
            self._log_decision(c, c.decision, c.decision_us, "upstream_failed")
            await self._refuse(client, failed, None, condition=condition, c=c, scope=scope)
            return False
        return True

    async def _replay_slow(self, upstream, c: _Conn, detected: Detected, data: bytes) -> str | None:
        """Parse the broker's SASL answer with ``SaslClientReplay`` (first time, split reads,
        refusals). Sets ``c.leftover``; returns the client's error text if the broker refused
        the credentials. Raises RemoteProtocolError / BrokenResourceError."""
        replay = SaslClientReplay(detected.sasl_init_bytes, max_frame_bytes=self.settings.max_handshake_bytes)
        replay.data_to_send()  # already sent, pipelined
        received = bytearray()
        while True:
            if not data:
                raise RemoteProtocolError("broker closed during SASL")
            received += data
            replay.receive_data(data)
            ev = replay.next_event()
            if ev is not NEED_DATA:
                break
            data = await upstream.receive_some(_RECEIVE_BYTES)
        if isinstance(ev, UpstreamAuthFailed):
            self._inc("upstream_auth_failed")
            target = c.decision.target
            where = f"{target.name}:{target.port}" if target.name else f"{target.host}:{target.port}"
            return f"broker {where} refused the credentials (sasl-outcome {ev.code})"
        assert isinstance(ev, UpstreamAuthOk)
        c.leftover = ev.leftover
        prefix = bytes(received[:len(received) - len(ev.leftover)])
        if len(_UPSTREAM_OK_PREFIXES) < _MAX_OK_PREFIXES:
            _UPSTREAM_OK_PREFIXES[prefix] = None
        return None

    # -- routing log (schema: docs/router.md; lines formatted directly, see router.routelog) ---
    def _log_decision(self, c: _Conn, decision: Decision, decision_us: int, action: str) -> None:
        routelog = self.edge.routelog
        if routelog.path is None:
            return
        s = self.settings
        e = decision.explanation
        tname, tnode, taddr = _target_json(decision.target)
        lim = routelog.max_field_chars  # client-supplied strings are bounded (router.routelog)
        routelog.write_line(
            f'{{"v":1,"event":"route","time":"{utc_timestamp(self.edge.clock())}",'
            f'"connection_id":{json_str(c.id)},"worker":{json_int(self.edge.worker)},'
            f'"router":{json_str(s.router)},"acceptor":{json_str(s.name)},"mode":{json_str(s.mode)},'
            f'"key_type":{json_str(e.key_type)},"key_raw":{json_str_bounded(e.raw_key, lim)},'
            f'"key_filtered":{json_str_bounded(e.filtered_key, lim)},'
            f'"key_transformed":{json_str_bounded(e.key, lim)},'
            f'"client_address":{json_str(c.host)},"client_port":{json_int(c.port)},'
            f'"sni":{json_str_bounded(c.sni, lim)},'
            f'"user":{json_str_bounded(c.user, lim)},"roles":{json_str_list(c.roles)},'
            f'"sasl_mechanism":{json_str(c.mechanism)},"container_id":{json_str_bounded(c.container_id, lim)},'
            f'"open_hostname":{json_str_bounded(c.open_hostname, lim)},"target_name":{tname},"target_node_id":{tnode},'
            f'"target_address":{taddr},"local":{json_bool(decision.local)},"policy":{json_str(e.policy)},'
            f'"cache":{json_str(e.cache)},"cache_hit":{json_bool(e.cache == "hit")},'
            f'"cache_tier":{json_str(e.cache_tier)},"pin":{json_str(e.pin)},'
            f'"quorum_met":{json_bool(e.quorum_met)},"ready_targets":{json_int(e.ready_targets)},'
            f'"outcome":{json_str(decision.outcome.value)},"action":{json_str(action)},'
            f'"reason":{json_str(e.reason)},"decision_us":{json_int(int(decision_us))}}}')

    def _proxy_closed(self, c: _Conn, decision: Decision, result: proxy_mod.PumpStats) -> None:
        s = self.settings
        stats = self.edge.stats
        stats.bytes_up[s.name] += result.bytes_up
        stats.bytes_down[s.name] += result.bytes_down
        self._inc(_END_COUNTER[result.reason])
        routelog = self.edge.routelog
        if routelog.path is None:
            return
        tname, tnode, taddr = _target_json(decision.target)
        lim = routelog.max_field_chars
        routelog.write_line(
            f'{{"v":1,"event":"close","time":"{utc_timestamp(self.edge.clock())}",'
            f'"connection_id":{json_str(c.id)},"worker":{json_int(self.edge.worker)},'
            f'"router":{json_str(s.router)},"acceptor":{json_str(s.name)},"mode":{json_str(s.mode)},'
            f'"client_address":{json_str(c.host)},"client_port":{json_int(c.port)},'
            f'"user":{json_str_bounded(c.user, lim)},'
            f'"container_id":{json_str_bounded(c.container_id, lim)},"target_name":{tname},"target_node_id":{tnode},'
            f'"target_address":{taddr},"bytes_client_to_broker":{json_int(result.bytes_up)},'
            f'"bytes_broker_to_client":{json_int(result.bytes_down)},'
            f'"duration_ms":{json_float(round((trio.current_time() - c.started) * 1000, 3))},'
            f'"close_reason":{json_str(result.reason.value)},"closed_first_by":{json_str(result.first_eof)},'
            f'"spliced":{json_bool(result.spliced)},"error":{json_str_bounded(result.error, lim)}}}')


def _target_json(t) -> tuple[str, str, str]:
    """The routing log's target_name, target_node_id and target_address, as JSON text."""
    if t is None:
        return "null", "null", "null"
    return json_str(t.name), json_str(t.node_id), json_str(f"{t.host}:{t.port}")
