"""Telling clients where to go: which condition each connection gets when the broker closes it
on purpose (failback, scale-down, ``POST /api/v1/connections/close``; docs/ha.md "Telling
clients where to go").

Theory of operation
-------------------
Pure decisions, no I/O and no clock: the shell (:meth:`broker.node.Node.plan_departures` and ``depart``) passes
what it knows of each open connection as a :class:`ConnectionFacts` and gets back one
:class:`Departure` per connection to close, then closes them at the times :func:`close_offsets`
gives.

* A client whose Open desired ``lodestone:follows-redirect`` (``frames.FOLLOWS_REDIRECT``:
  ``router.client``, ``clients/node/lodestone-redirect.js``) gets ``amqp:connection:redirect``
  naming the node that now serves the data (§2.8.17; the info map of
  ``frames.redirect_info``: ``network-host``, ``port``, and ``failover-server-list`` when that
  node has backups) — when there is such a node.
* Every other client has its connection ended without an AMQP Close (:data:`END_OF_STREAM`: the
  broker stops writing and closes the socket), which every client library treats as a lost
  connection and reconnects from at once. Not ``amqp:connection:forced``, although an unmodified
  proton client reconnects transparently on ``forced`` only (any other condition, a redirect
  included, stops it for good): after a Close proton stops reading, and on ``forced``, which it
  does not answer, it learns that the socket is gone only when a write fails — its next
  heartbeat, half the broker's idle-time-out later (30 s at the default 60 s; measured: 59.5 s
  for a direct consumer, 30 s behind the router). An end of stream it reads at once. The
  management call can ask for ``forced`` instead (``unmodified = "forced"``).
* The cluster's own connections (bridges, replication, check-for-live-server: logged in as the
  cluster user) and connections this node dialled are never selected: they end with the node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable
from urllib.parse import urlsplit

from broker.wire.frames import REDIRECT, redirect_info

__all__ = ["ConnectionFacts", "Target", "Selector", "CloseRequest", "Departure", "CloseRequestError",
           "FORCED", "END_OF_STREAM", "UNMODIFIED", "ALL", "plan_departures", "target_from_connector", "close_offsets", "parse_close_request", "parse_target", "SELECTORS"]

FORCED = "amqp:connection:forced"
#: the "condition" of a departure without an AMQP Close: the broker ends the stream
END_OF_STREAM = "end-of-stream"
UNMODIFIED = (END_OF_STREAM, FORCED)   # what clients that do not follow redirects may get
SELECTORS = ("container-id", "user", "id", "all")
MAX_RATE_PER_SECOND = 100000.0
MIN_RATE_PER_SECOND = 0.01   # one close every 100 s: slower would outlive any drain


@dataclass(frozen=True)
class ConnectionFacts:
    """What the decision needs of one open connection."""

    conn_id: str
    container_id: str | None
    user: str | None
    follows_redirect: bool
    internal: bool   # the cluster user's, or dialled by this node: never closed by a departure


@dataclass(frozen=True)
class Target:
    """The node that now serves the data: its client acceptor, and its backups' connectors."""

    host: str
    port: int
    failover: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Selector:
    """Which client connections: ``kind`` one of :data:`SELECTORS`; ``value`` but for ``all``
    (``id``: one connection, as ``GET /api/v1/connections`` names it: a router's drain)."""

    kind: str
    value: str | None = None

    def matches(self, c: ConnectionFacts) -> bool:
        if c.internal:
            return False
        if self.kind == "all":
            return True
        if self.kind == "container-id":
            return c.container_id == self.value
        if self.kind == "id":
            return c.conn_id == self.value
        return c.user == self.value


ALL = Selector("all")


@dataclass(frozen=True)
class Departure:
    """Close ``conn_id`` with ``condition``, ``description`` and ``info`` (codec types, or None);
    ``condition`` :data:`END_OF_STREAM`: end it without a Close."""

    conn_id: str
    condition: str
    description: str
    info: dict | None = None


@dataclass(frozen=True)
class CloseRequest:
    """A parsed ``POST /api/v1/connections/close`` body."""

    selector: Selector
    target: Target | None = None
    rate_per_second: float | None = None
    unmodified: str = END_OF_STREAM


class CloseRequestError(ValueError):
    """A bad request body; ``field`` names the offending field (the API answers 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def plan_departures(conns: Iterable[ConnectionFacts], selector: Selector, target: Target | None,
                    why: str, unmodified: str = END_OF_STREAM) -> list[Departure]:
    """One departure per selected connection, in the order given (see the module doc);
    ``unmodified``: what the clients get that cannot be redirected (:data:`UNMODIFIED`)."""
    if unmodified not in UNMODIFIED:
        raise ValueError(f"unmodified must be one of {UNMODIFIED}, not {unmodified!r}")
    out = []
    for c in conns:
        if not selector.matches(c):
            continue
        if target is not None and c.follows_redirect:
            out.append(Departure(c.conn_id, REDIRECT, f"{why}: reconnect to {target}",
                                 redirect_info(target.host, target.port, failover=target.failover)))
        else:
            out.append(Departure(c.conn_id, unmodified, f"{why}: reconnect"))
    return out


def close_offsets(n: int, rate_per_second: float | None) -> list[float]:
    """Seconds after the start at which each of ``n`` closes happens: all at once without a rate,
    else one every ``1 / rate`` seconds, the first at once (``n`` closes span ``(n - 1) / rate``)."""
    if not rate_per_second:
        return [0.0] * n
    return [i / rate_per_second for i in range(n)]


def target_from_connector(connector: str | None, failover: Iterable[str] = ()) -> Target | None:
    """The :class:`Target` of a node's connector ``amqp[s]://host:port`` (None without a host or
    a fixed port); ``failover``: its backups' connectors."""
    if not connector:
        return None
    parts = urlsplit(connector)
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname or not port:
        return None
    return Target(parts.hostname, port, tuple(c for c in failover if c))


def parse_target(text: str, field: str = "redirect") -> Target:
    """``host:port`` (``[v6]:port`` for IPv6) → :class:`Target`."""
    if not isinstance(text, str) or not text:
        raise CloseRequestError(field, f"{text!r} must be a string host:port")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise CloseRequestError(field, f"{text!r} must be host:port ([v6-address]:port for IPv6)")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or ":" in host:
            raise CloseRequestError(field, f"{text!r} must be host:port ([v6-address]:port for IPv6)")
    if not host or any(ch.isspace() or ch in "/@?#" for ch in host):
        raise CloseRequestError(field, f"{text!r} has no valid host")
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise CloseRequestError(field, f"{text!r}: port must be 1-65535")
    return Target(host, int(port_text))


def parse_close_request(body) -> CloseRequest:
    """Check a ``POST /api/v1/connections/close`` body: exactly one selector (``container-id``,
    ``user`` or ``id``, a non-empty string, or ``all``: true), an optional ``redirect`` ``host:port``,
    an optional ``rate-per-second`` (a number from 0.01 to 100000) and an optional ``unmodified``
    (:data:`UNMODIFIED`). Raises :class:`CloseRequestError`."""
    if not isinstance(body, dict):
        raise CloseRequestError("body", "expected a JSON object with one of container-id, user, id, all")
    known = set(SELECTORS) | {"redirect", "rate-per-second", "unmodified"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise CloseRequestError(unknown[0], f"unknown field (expected {', '.join(sorted(known))})")
    given = [k for k in SELECTORS if k in body]
    if len(given) != 1:
        raise CloseRequestError("selector", f"exactly one of {', '.join(SELECTORS)} is required"
                                            + (f", got {', '.join(given)}" if given else ""))
    kind = given[0]
    value = body[kind]
    if kind == "all":
        if value is not True:
            raise CloseRequestError("all", f"must be true, not {value!r}")
        selector = ALL
    else:
        if not isinstance(value, str) or not value:
            raise CloseRequestError(kind, f"must be a non-empty string, not {value!r}")
        selector = Selector(kind, value)
    target = parse_target(body["redirect"]) if body.get("redirect") is not None else None
    rate = body.get("rate-per-second")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) \
                or not MIN_RATE_PER_SECOND <= rate <= MAX_RATE_PER_SECOND:
            raise CloseRequestError("rate-per-second", f"{rate!r} must be a number from {MIN_RATE_PER_SECOND:g} "
                                                       f"to {MAX_RATE_PER_SECOND:g}")
        rate = float(rate)
    unmodified = body.get("unmodified", END_OF_STREAM)
    if unmodified not in UNMODIFIED:
        raise CloseRequestError("unmodified", f"{unmodified!r} must be one of {', '.join(UNMODIFIED)}")
    return CloseRequest(selector, target, rate, unmodified)
