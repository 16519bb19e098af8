"""Drain a pool target: move its clients to the other targets at a bounded rate (docs/router.md, "Drain").

Theory of operation
-------------------
``POST /api/v1/routers/<r>/targets/<t>/drain`` (or ``lodestone-router drain CONFIG <t>``) takes
the target's group out of routing at once (``router.core.pool.Pool.drain``: new connections and
cached keys go elsewhere; if no other target is ready, the drained one serves rather than
nothing). Its established clients then leave at ``drain-rate-per-s`` after ``drain-grace-ms``,
in two phases:

1. **Proxied clients** (this router's own connections to the target, every process): each
   process ends its proxied connections to the target at its share of the rate (the rate divided
   by the number of processes) by ending the broker side of the proxy. The client sees its
   connection end (the broker's end of stream, relayed) and reconnects through the router,
   which places it on another target. Counted ``proxy_drained``.
2. **Clients on the broker** (redirected there by the router, or connected to it directly):
   once no proxied connection is left, the process that probes (the router, or the supervisor
   of its workers) lists the broker's client connections (``GET /api/v1/connections``) and asks
   the broker to close each (``POST /api/v1/connections/close`` with ``{"id": …}``), one every
   ``1/rate`` s, with the target the router now computes for that client's key as ``redirect``:
   a client that follows redirects (``lodestone:follows-redirect``) goes straight there, any
   other has its connection ended (the broker's default, ``end-of-stream``: every client
   reconnects from that at once) and comes back through its configured address. The broker is
   listed again while the drain lasts, so a client that arrives later leaves too.

Why not ``amqp:connection:forced`` for unmodified clients (what the issue that asked for drains
suggested): an unmodified python-qpid-proton client reconnects from it only at its next
heartbeat, up to half the idle timeout later (docs/ha.md, "Telling clients where to go"); an end
of stream moves it at once. A drain ends with ``POST …/undrain`` (the target takes new
connections again); while it lasts, the pool's view shows ``draining`` and what is left.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import h11
import trio

from broker.wire.io.http import call_json_url
from router.core.keys import KeyType
from router.core.membership import host_port

if TYPE_CHECKING:
    from router.service import RouterService

log = logging.getLogger("router.drain")

#: how often the broker is listed again while a drain lasts, once its list is done
RELIST_S = 1.0
#: how often a process with nothing left to end looks again
IDLE_S = 0.2
HTTP_TIMEOUT_S = 5.0


@dataclass
class Drain:
    """One drained group: the settings it runs with and what it did."""

    group: str
    rate_per_s: float
    grace_s: float
    started_at: float = field(default_factory=time.time)
    proxied_ended: int = 0          # this process's proxied connections ended
    proxied_left: int = 0           # every process's, as last counted
    broker_closed: int = 0          # closes the broker accepted
    broker_left: int | None = None  # client connections in the broker's last list, not yet closed
    last_error: str | None = None
    #: ``grace``, ``proxied`` (ending proxied connections), ``broker`` (closing the broker's
    #: clients), ``drained`` (nothing left; the broker is still watched while the drain lasts),
    #: ``proxied-only`` (no proxied connection left and no management-url to ask the broker)
    phase: str = "grace"

    def view(self) -> dict[str, Any]:
        left = self.proxied_left + (self.broker_left or 0)
        return {"target": self.group, "phase": self.phase, "rate_per_s": self.rate_per_s,
                "grace_ms": round(self.grace_s * 1000), "started_at": self.started_at, "left": left, "proxied_left": self.proxied_left,
                "on_broker_left": self.broker_left, "proxied_ended": self.proxied_ended,
                "broker_closed": self.broker_closed, "last_error": self.last_error}


def end_proxied(c) -> None:
    """End a proxied connection from outside its task: shut the broker side down, so the relay
    or pump sees the broker's end of stream and ends the client's side as it always does."""
    c.drained = True
    sock = getattr(c.upstream, "socket", None)
    if sock is None:
        return
    try:
        if isinstance(sock, socket.socket):     # an SSLSocket too: its plain socket, its TLS state kept
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass                                     # already gone


async def run_proxied(service: "RouterService", drain: Drain, share: float) -> None:
    """Phase 1 in this process: end its proxied connections to ``drain.group``, one every
    ``1 / (rate × share)`` s after the grace, until the drain is cancelled; paused while the
    drained target serves for lack of another (``drain_fallback``)."""
    await trio.sleep(drain.grace_s)
    interval = 1.0 / max(drain.rate_per_s * share, 1e-6)
    while True:
        conns = service.proxied.get(drain.group)
        if not conns or service.pool.drain_fallback:
            await trio.sleep(IDLE_S)
            continue
        cid, end = next(iter(conns.items()))
        conns.pop(cid, None)         # never picked twice (its release finds it gone)
        try:
            end()
        except Exception:            # noqa: BLE001 - one connection's bug; the drain goes on
            log.exception("router %s: drain of %s: ending connection %s failed", service.name, drain.group, cid)
            service.counters["drain_errors"] += 1
        drain.proxied_ended += 1
        service.counters["drain_proxied_ended"] += 1
        await trio.sleep(interval)


def key_of(key_type: KeyType, conn: dict) -> str | None:
    """A broker connection's routing key, from what ``GET /api/v1/connections`` shows; None
    when the listing does not carry it (SNI host, role)."""
    if key_type is KeyType.CLIENT_ID:
        return conn.get("container_id")
    if key_type is KeyType.USER_NAME:
        return conn.get("user")
    if key_type is KeyType.SOURCE_IP:
        src = conn.get("source") or ""
        if src.startswith("["):
            return src[1:src.find("]")] or None
        return src.rsplit(":", 1)[0] or None
    return None


#: what a management call can raise (as the health probes see them): the drain retries
HTTP_ERRORS = (OSError, ValueError, trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError)


async def run_on_broker(service: "RouterService", drain: Drain, count_proxied) -> None:
    """Phase 2, in the process that probes: once no proxied connection to the group is left
    anywhere (``count_proxied(group)``: ``(left, ended)`` over every process), close the
    broker's client connections one every ``1/rate`` s, each redirected to its key's new
    target; list again while the drain lasts. Paused while the drained target serves for lack of
    another (``drain_fallback``). Nothing here ends the router: a failure is counted, logged
    and retried."""
    await trio.sleep(drain.grace_s)
    asked: set[str] = set()     # closes the broker accepted: not asked again while they finish
    while True:
        try:
            pause = await _broker_round(service, drain, count_proxied, asked)
        except HTTP_ERRORS as exc:
            _failed(service, drain, f"{type(exc).__name__}: {exc or 'timeout'}")
            pause = RELIST_S
        except Exception as exc:     # noqa: BLE001 - a bug: logged, counted, the drain goes on
            log.exception("router %s: drain of %s failed", service.name, drain.group)
            _failed(service, drain, f"internal error: {exc!r}")
            pause = RELIST_S
        await trio.sleep(pause)


async def _broker_round(service: "RouterService", drain: Drain, count_proxied, asked: set[str]) -> float:
    """One round of phase 2; returns how long to wait before the next."""
    drain.proxied_left, ended = await count_proxied(drain.group)
    drain.proxied_ended = max(drain.proxied_ended, ended)
    if drain.proxied_left:
        drain.phase = "proxied"
        return IDLE_S
    if service.pool.drain_fallback:
        return IDLE_S
    target = service.pool_member(drain.group)
    if target is None or not target.management_url:
        drain.broker_left = None     # nothing to ask: only proxied clients can be moved
        drain.phase = "proxied-only"
        return IDLE_S
    listed = await _list(service, target.management_url)
    asked &= {c["id"] for c in listed}      # those gone are forgotten
    todo = [c for c in listed if c["id"] not in asked]
    drain.broker_left = len(listed)         # a close asked for counts until the client is gone
    drain.phase = "broker" if listed else "drained"
    interval = 1.0 / drain.rate_per_s
    for conn in todo:
        if service.pool.drain_fallback:
            break
        redirect = None
        key = key_of(service.config.key_type, conn)
        if key is not None:
            d = service.route_for_key(key)
            if d.target is not None and d.target.group != drain.group:
                redirect = host_port(d.target.host, d.target.port)
        try:
            await _close(service, target.management_url, conn["id"], redirect)
            asked.add(conn["id"])
            drain.broker_closed += 1
            service.counters["drain_broker_closed"] += 1
        except HTTP_ERRORS as exc:
            _failed(service, drain, f"closing connection {conn['id']} on {target.name}: "
                                    f"{type(exc).__name__}: {exc or 'timeout'}")
        await trio.sleep(interval)
    return RELIST_S if not todo else 0.2


def _failed(service: "RouterService", drain: Drain, error: str) -> None:
    if drain.last_error != error:
        log.warning("router %s: drain of %s: %s", service.name, drain.group, error)
    drain.last_error = error
    service.counters["drain_errors"] += 1


async def _call(service: "RouterService", url: str, method: str, path: str, body: bytes = b"") -> Any:
    pc = service.config.pool
    auth = (pc.username, pc.password or "") if pc is not None and pc.username is not None else None
    status, answer = await call_json_url(url.rstrip("/") + path, method, body=body, auth=auth,
                                         timeout_s=HTTP_TIMEOUT_S, max_body_bytes=16 << 20)
    if status // 100 != 2:
        raise ValueError(f"{method} {path}: HTTP {status}: {answer[:200].decode('utf-8', 'replace')}")
    return json.loads(answer) if answer else None


async def _list(service: "RouterService", url: str) -> list[dict]:
    conns = await _call(service, url, "GET", "/api/v1/connections")
    if not isinstance(conns, list):
        raise ValueError("GET /api/v1/connections: not a list")
    return [c for c in conns if isinstance(c, dict) and isinstance(c.get("id"), str) and not c.get("internal")]


async def _close(service: "RouterService", url: str, conn_id: str, redirect: str | None) -> None:
    body: dict[str, Any] = {"id": conn_id}
    if redirect is not None:
        body["redirect"] = redirect
    await _call(service, url, "POST", "/api/v1/connections/close", json.dumps(body).encode())

