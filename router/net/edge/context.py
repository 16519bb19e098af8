"""What every phase of an edge connection shares: acceptor settings, the process-wide edge
context, the per-connection record, and closing streams."""

from __future__ import annotations

import collections
import itertools
import os
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import trio

from broker.wire.io.login import LoginGate
from broker.wire.limits import OncePer, SourceLimits
from broker.wire.io.users import SecurityConfig
from router.core.decide import Decision
from router.net import fastio
from router.net import proxy as proxy_mod
from router.net.stats import EdgeStats
from router.routelog import RouteLog

RECEIVE_BYTES = 65536
TLS_CLOSE_S = 1.0


class Principal(Protocol):
    """What the users file gives back for an authenticated client (``broker.wire.io.users``)."""

    user: str
    roles: tuple[str, ...]


class Authenticator(Protocol):
    """The users/roles file (``broker.wire.io.users.SecurityConfig``), as the edge uses it."""

    def cached(self, user: str, password: str, source_ip: str) -> Principal | None: ...

    def authenticate(self, user: str, password: str, source_ip: str) -> Principal | None: ...

    def principal_for_certificate(self, cn: str, source_ip: str) -> Principal | None: ...

    def anonymous_principal(self) -> Principal | None: ...


@dataclass
class AcceptorSettings:
    """Everything one acceptor needs at run time (built from ``[[acceptors]]`` by the server)."""

    name: str
    mode: str                                   # "redirect" | "proxy" | "auto"
    router: str                                 # the router (service) name
    ssl_context: ssl.SSLContext | None = None
    mechanisms: tuple[str, ...] = ("PLAIN",)
    tls_handshake_timeout_s: float = 10.0
    handshake_timeout_s: float = 10.0
    upstream_connect_timeout_s: float = 5.0
    tcp_user_timeout_ms: int = 0                # TCP_USER_TIMEOUT on the client's and the broker's socket
    connect_retries: int = 0                    # brokers tried after the first fails (connect-retries)
    idle_timeout_s: float | None = 300.0
    upstream_close_grace_s: float = proxy_mod.DEFAULT_UPSTREAM_CLOSE_GRACE_S  # upstream-close-grace-ms
    close_linger_s: float = 1.0
    max_handshake_bytes: int = 65536
    upstream_ssl_context: ssl.SSLContext | None = None
    upstream_tls: bool = False                  # TLS to every target (else only targets with tls = true)
    upstream_proxy_protocol: bool = False       # PROXY v2 header (the client's address) first upstream
    use_splice: bool = True
    chunk_bytes: int = proxy_mod.DEFAULT_CHUNK_BYTES
    limits: SourceLimits = SourceLimits()       # per-source limits (broker.wire.limits)
    max_connections: int = 0                    # the acceptor's limit (enforced by the listener)


#: how many decisions each process keeps for the dashboard's "last decisions"
RECENT_DECISIONS = 50


@dataclass
class EdgeContext:
    """Process-wide pieces every acceptor shares."""

    stats: EdgeStats
    routelog: RouteLog
    authenticator: Authenticator | None
    worker: int = 0
    login_gate: Any = None                      # broker.wire.io.login.LoginGate over the authenticator
    clock: Callable[[], float] = time.time
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    #: the last routing decisions of this process, newest last (``router.dashboard``): tuples
    #: ``(wall, router, acceptor, mode, connection id, client host, user, container id, Decision,
    #: decision_us, action)``
    recent: Any = field(default_factory=lambda: collections.deque(maxlen=RECENT_DECISIONS))
    _prefix: str = field(default_factory=lambda: os.urandom(4).hex())

    def __post_init__(self) -> None:
        if self.login_gate is None and isinstance(self.authenticator, SecurityConfig):
            self.login_gate = LoginGate(self.authenticator, name="router")
        self.log_once = OncePer(self.login_gate.settings.log_interval_s if self.login_gate else 60.0)

    def next_connection_id(self) -> str:
        return f"{self._prefix}-{self.worker}-{next(self._ids)}"


# Phases of one connection: which deadline the connection's single cancel scope enforces.
PH_TLS, PH_HANDSHAKE, PH_ROUTE, PH_CONNECT, PH_REPLAY, PH_PROXY, PH_LINGER = range(7)


@dataclass(slots=True)
class ConnState:
    """Per-connection facts gathered along the way (for the routing log), and its streams."""

    id: str
    source: str
    host: str
    port: int
    started: float
    sni: str | None = None
    cert_cn: str | None = None
    user: str | None = None
    roles: tuple[str, ...] = ()
    mechanism: str | None = None
    container_id: str | None = None
    open_hostname: str | None = None
    phase: int = PH_TLS
    refusal: str | None = None  # over a per-source limit: the refusal text (no auth is checked)
    refusal_timeout_s: float = 2.0  # how long a refused client gets to hear why (limits.py)
    authenticated: bool = False
    client: Any = None          # FastSocketStream | FastTLSStream once wrapped
    upstream: Any = None
    decision: Decision | None = None
    decision_us: int = 0
    leftover: bytes = b""       # broker bytes after its sasl-outcome, for the client
    service: Any = None         # the router it is routed by (a reload may give the acceptor another)
    drained: bool = False       # ended by a drain (router.drain): counted proxy_drained


def reset_on_close(stream) -> None:
    """A plain client that did not end its side in time is closed with a TCP reset: a proton
    client waiting for its transport to close (after ``amqp:connection:forced``, which it does
    not answer) then fails its next write, where after a FIN it would need two (its first,
    a heartbeat half the Open's idle-time-out later, only draws the reset)."""
    if type(stream) is fastio.FastSocketStream and not stream._closed:
        try:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, proxy_mod.LINGER_RESET)
        except OSError:
            pass


def close_now(stream) -> bool:
    """Close a stream without waiting when possible (plain sockets; TLS whose close_notify goes
    out at once). False: a TLS close_notify is still to be written (then use :func:`close`)."""
    if type(stream) is fastio.FastTLSStream and not stream.send_close_notify():
        return False
    stream.close()
    return True


async def close(stream) -> None:
    """Close a stream; a TLS stream gets its close_notify (bounded by TLS_CLOSE_S, shielded so
    it also happens when the connection is being cancelled), so TLS peers see a clean end."""
    if close_now(stream):
        return
    with trio.CancelScope(shield=True) as scope:
        scope.deadline = trio.current_time() + TLS_CLOSE_S
        try:
            await stream.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    stream.close()
