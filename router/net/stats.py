"""Edge counters and gauges, named per outcome (Envoy tls_inspector style).

One :class:`EdgeStats` per process, shared by every acceptor. Counters are keyed by
``(acceptor, name)``; the management API sums them or shows them per acceptor, and ``/metrics``
exports ``lodestone_router_edge_events_total{acceptor=..., event=...}``.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

#: Every counter name the edge increments, with its meaning (documented in docs/router.md).
COUNTER_NAMES: dict[str, str] = {
    "accepted": "TCP connections accepted",
    "connection_limit_rejected": "connections closed at once because the acceptor was at its limit",
    "fd_limit_rejected": "connections accepted and closed at once because the process was out of file descriptors",
    "tls_handshake_ok": "TLS handshakes completed",
    "tls_handshake_timeout": "TLS handshakes that missed tls-handshake-timeout",
    "tls_handshake_failed": "TLS handshakes that failed (bad ClientHello, certificate, reset)",
    "handshake_timeout": "clients that did not finish SASL + Open within handshake-timeout",
    "handshake_eof": "clients that closed before finishing SASL + Open",
    "handshake_oversized": "handshakes larger than max-handshake-bytes",
    "protocol_header_rejected": "garbage or a wrong AMQP protocol header",
    "protocol_error": "malformed SASL or Open frames",
    "handshake_decode_error": "Opens with an undecodable field (e.g. a container-id not valid UTF-8): amqp:decode-error",
    "auth_ok": "SASL authentications accepted",
    "auth_failed": "SASL authentications refused (bad credentials, source not allowed, no certificate)",
    "route_ok": "routing decisions with a target",
    "route_refused_unavailable": "routing decisions refused: not ready (no quorum / no target)",
    "route_refused_use_another": "routing decisions refused: rejected here (no policy/pool)",
    "cache_hit": "routing decisions answered by the sticky cache (any tier)",
    "cache_miss": "routing decisions the sticky cache could not answer (no entry, or its target not ready)",
    "redirected": "clients sent an amqp:connection:redirect",
    "refused": "clients sent amqp:connection:forced (after a refusing decision)",
    "proxied": "clients whose handshake was replayed to a broker",
    "proxy_external_refused": "proxy-mode clients using SASL EXTERNAL (cannot be replayed upstream)",
    "upstream_connect_failed": "proxy-mode upstream connections refused/unreachable",
    "upstream_connect_timeout": "proxy-mode upstream connections that missed upstream-connect-timeout",
    "upstream_retried": "proxy-mode clients routed again after their broker failed before answering (connect-retries)",
    "upstream_fd_exhausted": "proxy-mode clients refused because no descriptor was left to connect to the broker",
    "upstream_auth_failed": "brokers that refused the replayed SASL credentials",
    "upstream_protocol_error": "brokers that answered the replay with something unexpected",
    "proxy_closed": "proxied connections that ended normally",
    "proxy_idle_timeout": "proxied connections closed after idle-timeout without traffic",
    "proxy_client_error": "proxied connections the client broke (reset)",
    "proxy_upstream_error": "proxied connections the broker broke (reset)",
    "proxy_upstream_closed": "proxied connections the broker ended first whose client did not close within "
                             "upstream-close-grace-ms (closed by the router)",
    "proxy_cancelled": "proxied connections cut at the drain deadline or shutdown",
    "proxy_drained": "proxied connections ended by a drain of their target (also counted by how they ended)",
    "internal_error": "connections closed because of a bug (logged with a traceback)",
    "refused_source_connections": "clients refused (amqp:resource-limit-exceeded): their address "
                                  "had max-connections-per-source connections open",
    "refused_source_unauthenticated": "clients refused: their address had "
                                      "max-unauthenticated-per-source connections still authenticating",
    "refused_source_rate": "clients refused: their address exceeded max-connection-rate-per-source",
    "refused_dropped": "clients over a per-source limit closed at once (their address already had "
                       "max-refusing-per-source refusals in flight)",
}


class EdgeStats:
    """Counters per (acceptor, name), gauges for active connections, byte totals."""

    def __init__(self) -> None:
        self.counters: Counter[tuple[str, str]] = Counter()
        self.active: Counter[str] = Counter()
        self.bytes_up: Counter[str] = Counter()
        self.bytes_down: Counter[str] = Counter()

    def inc(self, acceptor: str, name: str, n: int = 1) -> None:
        """Count one event (``name`` must be in COUNTER_NAMES)."""
        self.counters[(acceptor, name)] += n

    def get(self, name: str, acceptor: str | None = None) -> int:
        """One counter, for one acceptor or summed over all."""
        if acceptor is not None:
            return self.counters[(acceptor, name)]
        return sum(v for (a, n), v in self.counters.items() if n == name)

    def totals(self) -> dict[str, int]:
        """Every counter summed over acceptors (zeros included, so the shape is stable)."""
        out = {name: 0 for name in COUNTER_NAMES}
        for (_a, name), v in self.counters.items():
            out[name] = out.get(name, 0) + v
        return out

    def by_acceptor(self, acceptors: Iterable[str]) -> dict[str, dict]:
        """Per-acceptor counters, active connections and bytes."""
        out = {}
        for a in acceptors:
            counts = {name: self.counters[(a, name)] for name in COUNTER_NAMES}
            out[a] = {"counters": counts, "active_connections": self.active[a],
                      "bytes_client_to_broker": self.bytes_up[a], "bytes_broker_to_client": self.bytes_down[a]}
        return out
