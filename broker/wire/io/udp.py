"""The UDP shells of discovery: a broadcast group's sender and a discovery group's listener (trio).

Theory of operation
-------------------
:func:`broadcast` sends this node's announcement (:mod:`broker.wire.discovery`) to the group
address every ``broadcast-period-ms`` from a socket bound to ``local-bind-address``/``-port``;
the multicast interface is the bind address when one is given, and multicast loop is on, so nodes
on one host hear each other. A send that fails (no route to the group yet, say) is counted and
logged once per kind of error; the next period tries again.

:func:`listen` joins the group on ``local-bind-address`` (0.0.0.0: the kernel's choice), binds the
group address and port with ``SO_REUSEADDR``/``SO_REUSEPORT`` (several nodes of one host share the
port), feeds every datagram to a :class:`~broker.wire.discovery.DiscoveryGroup` and tells the
owner what changed: ``on_change(kind, entry)`` with kind ``added``, ``changed`` or ``removed`` (an
entry not refreshed within the refresh timeout). Garbage is counted by the group and dropped.
IPv4 only.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import struct
import time
from typing import Callable

import trio

from broker.wire.discovery import MAX_PACKET, Announcement, DiscoveryGroup, encode_announcement

log = logging.getLogger("lodestone.broker.discovery")

__all__ = ["broadcast", "listen", "open_listener_socket"]


async def broadcast(group_address: str, group_port: int, announce: Callable[[int], Announcement], *,
                    period_s: float, bind_address: str = "0.0.0.0", bind_port: int = -1, key: str | None = None,
                    counters: dict | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Announce ``announce(sequence)`` to the group every ``period_s`` seconds, forever."""
    counters = counters if counters is not None else {}
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM, trio.socket.IPPROTO_UDP)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind((bind_address, bind_port if bind_port >= 0 else 0))
        if bind_address != "0.0.0.0":
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(bind_address))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        task_status.started(sock.getsockname())
        base = int(time.time() * 1000) << 16   # grows across restarts (discovery.py)
        n = 0
        logged: set = set()
        while True:
            n += 1
            try:
                a = announce(base + n)
                try:
                    data = encode_announcement(a, key)
                except ValueError as exc:   # over MAX_PACKET, or a backup URL listeners would refuse:
                    # the backups go, never the node
                    if a.backups:
                        data = encode_announcement(dataclasses.replace(a, backups=()), key)
                    else:
                        raise
                    counters["backups_left_out"] = counters.get("backups_left_out", 0) + 1
                    if "too-big" not in logged:
                        logged.add("too-big")
                        log.warning("announcement with its backups cannot be sent (%s): "
                                    "announcing the node without them (logged once)", exc)
                await sock.sendto(data, (group_address, group_port))
                counters["sent"] = counters.get("sent", 0) + 1
            except OSError as exc:
                counters["send_failed"] = counters.get("send_failed", 0) + 1
                if exc.errno not in logged:
                    logged.add(exc.errno)
                    log.warning("broadcast to %s:%d failed (retrying every period; logged once): %s",
                                group_address, group_port, exc)
            await trio.sleep(period_s)


def open_listener_socket(group_address: str, group_port: int, bind_address: str = "0.0.0.0"):
    """A UDP socket that receives the group's datagrams (several may share the port on one host)."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_DGRAM, trio.socket.IPPROTO_UDP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        mreq = struct.pack("4s4s", socket.inet_aton(group_address), socket.inet_aton(bind_address))
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    except OSError:
        sock.close()
        raise
    return sock


async def listen(group_address: str, group_port: int, group: DiscoveryGroup,
                 on_change: Callable[[str, object], None], *, bind_address: str = "0.0.0.0",
                 task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Keep ``group`` up to date from the datagrams heard, forever (see the module doc)."""
    sock = open_listener_socket(group_address, group_port, bind_address)
    with sock:
        await sock.bind((group_address, group_port))
        task_status.started(sock.getsockname())
        while True:
            now = time.monotonic()
            wait = group.next_expiry(now)
            with trio.move_on_after(min(wait, 1.0) if wait is not None else 1.0):
                data, _addr = await sock.recvfrom(MAX_PACKET + 1)
                ev = group.receive(data, time.monotonic())
                if ev is not None and ev[0] != "refreshed":
                    on_change(*ev)
            for e in group.expire(time.monotonic()):
                on_change("removed", e)
