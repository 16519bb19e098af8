"""Small log sets for the data-gravity job, written line by line in the documented formats
(docs/router.md "Routing log", docs/broker.md "Activity log schema"), with the answers worked
out by hand in ``HAND``.

The scenario (router ``main``, key type CLIENT_ID, brokers n1, n2, n3; times are seconds after
2026-01-02T00:00:00Z):

* address ``x``: producer key ``xp`` on n1 (700 bytes; a second connection at t=60, no traffic,
  which the proxy first tried on n3 — an ``upstream_retried`` line: no connection of n3's),
  consumer ``xc`` on n2 (500 bytes): n1 forwards 500 bytes to n2, 200 stay on n1 (backlog).
* address ``y``: producer ``yp`` on n2 (300 bytes, two windows of 150), consumer ``yc`` first on
  n3 (t=4; 100 bytes, forwarded n2 → n3) and then — the key that moved broker mid-log — on n2
  (t=50; 200 bytes).
* address ``z``: ``zp`` and ``zc`` both on n3 (100 bytes each).
* a refused decision for a key that never reached a broker (``ghost``).

Files: ``router/routing.log.1`` (the rotated, older file: t=1…6), ``router/routing.log``
(t=50, 60, ghost), ``n1/activity.jsonl``, ``n2/…``, ``n3/…``; malformed lines in each of them.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

BASE = dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)
N1, N2, N3 = "n1", "n2", "n3"


def ts(sec: float, micro: bool = True) -> str:
    t = BASE + dt.timedelta(seconds=sec)
    if micro:
        return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def route(sec: float, key: str, node: str | None, *, cid: str | None = None, user: str = "app",
          host: str = "127.0.0.1", key_type: str = "CLIENT_ID", router: str = "main", v: int = 1,
          outcome: str = "OK", conn: str | None = None, drop: tuple[str, ...] = (), action: str | None = None) -> str:
    """One ``event = "route"`` line, every field in the documented order."""
    rec = {"v": v, "event": "route", "time": ts(sec), "connection_id": conn or f"tok-0-{key}-{sec}", "worker": 0,
           "router": router, "acceptor": "proxy", "mode": "proxy", "key_type": key_type,
           "key_raw": cid if cid is not None else key, "key_filtered": key, "key_transformed": key,
           "client_address": host, "client_port": 40000 + int(sec), "sni": None, "user": user, "roles": ["app"],
           "sasl_mechanism": "PLAIN", "container_id": cid if cid is not None else key, "open_hostname": None,
           "target_name": node, "target_node_id": node,
           "target_address": "127.0.0.1:15672" if node else None, "local": False, "policy": "CONSISTENT_HASH",
           "cache": "miss", "cache_hit": False, "cache_tier": None, "pin": None, "quorum_met": True,
           "ready_targets": 3, "outcome": outcome, "action": action or ("proxied" if outcome == "OK" else "refused"),
           "reason": "selected by CONSISTENT_HASH", "decision_us": 42}
    for d in drop:
        rec.pop(d)
    return json.dumps(rec, separators=(",", ":"))


def close(sec: float, key: str, node: str, conn: str) -> str:
    return json.dumps({"v": 1, "event": "close", "time": ts(sec), "connection_id": conn, "worker": 0,
                       "router": "main", "acceptor": "proxy", "mode": "proxy", "client_address": "127.0.0.1",
                       "client_port": 40001, "user": "app", "container_id": key, "target_name": node,
                       "target_node_id": node, "target_address": "127.0.0.1:15672",
                       "bytes_client_to_broker": 900, "bytes_broker_to_client": 300, "duration_ms": 12.5,
                       "close_reason": "closed", "closed_first_by": "client", "spliced": False, "error": None},
                      separators=(",", ":"))


def act(node: str, key: str | None, address: str, direction: str, nbytes, start: float, end: float, *,
        conn: str = "c-1", peer: str | None = None, user: str | None = "app", source: str | None = None,
        messages: int = 1) -> str:
    """One activity record (client or, with ``peer``, cluster)."""
    cluster = peer is not None
    rec = {"ts": ts(end, micro=False), "node_id": node, "node": f"broker-{node[1:]}",
           "connection_id": f"cluster:{peer}" if cluster else f"{node}-{conn}",
           "container_id": None if cluster else key, "user": None if cluster else user,
           "source": None if cluster else (source or "127.0.0.1:50000"), "address": address,
           "direction": direction, "messages": messages, "bytes": nbytes,
           "window_start": ts(start, micro=False), "window_end": ts(end, micro=False), "final": False}
    if cluster:
        rec["peer_node_id"] = peer
    return json.dumps(rec, separators=(",", ":"))


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def write_hand_case(root: Path) -> Path:
    """The scenario of the module docstring under ``root``; returns ``root``."""
    write(root / "router" / "routing.log.1", [
        route(1, "xp", N1), route(2, "xc", N2), route(3, "yp", N2),
        "{this is not json",                                          # malformed: invalid JSON
        route(4, "yc", N3), route(5, "zp", N3),
        route(5.5, "zz", N1, v=2),                                    # unknown version: set aside
        route(6, "zc", N3),
    ])
    write(root / "router" / "routing.log", [
        route(50, "yc", N2),                                          # yc moved: n3 → n2
        close(55, "yc", N2, "tok-0-yc-50"),
        "",                                                           # blank: neither read nor bad
        route(59.9, "xp", N3, conn="tok-0-xp-60", action="upstream_retried"),  # n3 failed it: not a connection
        route(60, "xp", N1),                                          # xp again, same broker
        route(61, "qq", N2, drop=("key_transformed",)),               # malformed: missing field
        route(62, "ghost", None, outcome="REFUSED_UNAVAILABLE"),      # refused: no broker
    ])
    write(root / "brokers" / "n1" / "activity.jsonl", [
        act(N1, "xp", "x", "produce", 700, 10, 20),
        act(N1, None, "x", "forward", 500, 10, 20, peer=N2),
        act(N1, "xp", "x", "produce", "lots", 20, 30),                # malformed: mistyped bytes
    ])
    write(root / "brokers" / "n2" / "activity.jsonl", [
        act(N2, None, "x", "forward-in", 500, 10, 20, peer=N1),
        act(N2, "xc", "x", "consume", 500, 10, 20),
        act(N2, "yp", "y", "produce", 150, 10, 20, conn="c-2"),
        act(N2, "yp", "y", "produce", 150, 20, 30, conn="c-2"),
        act(N2, None, "y", "forward", 100, 10, 20, peer=N3),
        act(N2, "yc", "y", "consume", 200, 60, 70, conn="c-3"),
        act(N2, "yc", "y", "teleport", 1, 60, 70, conn="c-3"),        # malformed: unknown direction
    ])
    write(root / "brokers" / "n3" / "activity.jsonl", [
        act(N3, None, "y", "forward-in", 100, 10, 20, peer=N2),
        act(N3, "yc", "y", "consume", 100, 10, 20),
        act(N3, "zp", "z", "produce", 100, 10, 20, conn="c-2"),
        act(N3, "zc", "z", "consume", 100, 10, 20, conn="c-3"),
        act(N3, "zc", "z", "consume", 5, 20, 30, conn="c-3").replace(ts(20, micro=False), "yesterday"),  # bad time
    ])
    return root


#: the answers, worked out by hand in the module docstring's scenario (see tests/spark/README)
HAND = {
    "lines_read": 29,        # routing.log.1 8, routing.log 6 (blank not counted), n1 3, n2 7, n3 5
    "lines_malformed": 6,    # invalid JSON, v=2, missing key_transformed, bytes "lots", "teleport", a bad time
    "lines_unknown_version": 1,
    "per_file": {"routing.log.1": (8, 2), "routing.log": (6, 1), "n1/activity.jsonl": (3, 1),
                 "n2/activity.jsonl": (7, 1), "n3/activity.jsonl": (5, 1)},
    "homes": {"x": N1, "y": N2, "z": N3},
    "gravity": {"xp": 1.0, "xc": 0.0, "yp": 1.0, "yc": 200 / 300, "zp": 1.0, "zc": 1.0},
    "bytes": {"xp": 700, "xc": 500, "yp": 300, "yc": 300, "zp": 100, "zc": 100},
    "current": {"xp": N1, "xc": N2, "yp": N2, "yc": N2, "zp": N3, "zc": N3},
    "connections": {"xp": 2, "xc": 1, "yp": 1, "yc": 2, "zp": 1, "zc": 1},
    "moves": {"xp": 0, "xc": 0, "yp": 0, "yc": 1, "zp": 0, "zc": 0},
    "cross_broker_bytes": 600,           # forward n1→n2 500 + n2→n3 100
    "matrix": {(N1, N2): 500, (N2, N3): 100},
    # x: 700 (no consumer on n1; n2 the only consuming broker: nothing to redistribute);
    # y: 300 − 300/2 forwarded (consumers on n2, n3), + 50: n3 receives 150 and its consumer takes
    # 100, n2's takes 200 of its 150 → the 50 are redistributed
    "modelled_cross_broker_bytes": 900,
    "skew": {"connections": 3 / (8 / 3) - 1, "bytes": 1000 / (2000 / 3) - 1},
    # --max-skew 0.3: x (1,200 bytes) exceeds a broker's 866.7 and is split; only xc moves
    "tight": {"max_skew": 0.3, "assignment": {"xp": N1, "xc": N3, "yp": N2, "yc": N2, "zp": N3, "zc": N3},
              "cross": 700, "skew": {"connections": 0.125, "bytes": 700 / (2000 / 3) - 1}, "moved": ["xc"]},
    # --max-skew 1.0: every group whole on its own broker; only xc moves
    "loose": {"max_skew": 1.0, "assignment": {"xp": N1, "xc": N1, "yp": N2, "yc": N2, "zp": N3, "zc": N3},
              "cross": 0, "skew": {"connections": 0.125, "bytes": 1200 / (2000 / 3) - 1}, "moved": ["xc"]},
}
