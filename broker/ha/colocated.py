"""Colocated backups (seed 001 "Colocated Backup Servers"; Artemis ``<colocated>``; docs/ha.md):
a primary asks another node of the cluster to host a backup for it, in that node's process, on
ports offset by ``backup-port-offset``.

Theory of operation
-------------------
**Asking** (``[ha.colocated] request-backup = true``, :func:`request_backups`): while it is
active and has no backup, a primary asks the cluster's live members in turn, every
``backup-request-retry-interval-ms`` (at most ``backup-request-retries`` times; -1 = until one
accepts): ``POST <member management URL>/api/v1/ha/colocated`` with the cluster credential and
``{"node_id", "connector", "group", "name"}``. It stops asking once a backup is connected.

**Hosting** (``max-backups`` ≥ 1, :class:`ColocatedHost`): a node accepts a request from
another node id while it hosts fewer than ``max-backups``; it then runs, in its own process, a
replication backup (``broker.ha.replicated.Replicated``, in a ``NodeProcess`` of its own) of a configuration derived from its
own (:func:`derive_config`): named ``<name>-colocated-<n>`` (Artemis's ``colocated_backup_n``),
data directory ``<data-dir>/colocated/<node id>``, every acceptor port, the management port and
the cluster connector's port increased by ``backup-port-offset`` (acceptors named in
``excludes`` keep theirs; port 0 stays 0), the requester's connector first among its cluster
connectors and the requester's ``group-name``. It follows the requester as any backup does,
votes when it loses it and, if it wins, serves the requester's node id on the offset ports. Its
listeners are printed as ``listening colocated-<n>-<what> <url>``.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
from typing import TYPE_CHECKING, Any, Callable
from urllib.parse import urlsplit

import trio

from broker.cluster.settings import HaConfig, parse_connector
from broker.lifecycle import NodeProcess
from broker.role import Role
from broker.wire.io.http import http_request

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker.ha")

__all__ = ["ColocatedHost", "derive_config", "request_backups"]


def _offset_url(url: str, offset: int) -> str:
    scheme, rest = url.split("://", 1)
    host, _, port = rest.rpartition(":")
    p = int(port)
    return f"{scheme}://{host}:{p + offset if p else 0}"


def derive_config(cfg: "BrokerConfig", n: int, requester_connector: str, group: str | None) -> "BrokerConfig":
    """The configuration of this node's ``n``-th colocated backup (see the module doc)."""

    co = cfg.ha.colocated
    off = co.backup_port_offset
    acceptors = tuple(a if (a.name in co.excludes or a.port == 0) else dataclasses.replace(a, port=a.port + off)
                      for a in cfg.acceptors)
    mgmt = cfg.management
    if mgmt.port:
        mgmt = dataclasses.replace(mgmt, port=mgmt.port + off)
    ccfg = cfg.cluster
    connector = _offset_url(ccfg.connector, off)
    statics = tuple(dict.fromkeys((requester_connector,) + tuple(u for u in ccfg.static_connectors if u != connector)))
    cluster = dataclasses.replace(ccfg, connector=connector, static_connectors=statics)
    ha = HaConfig(policy="replication", role="backup", group_name=group, allow_failback=cfg.ha.allow_failback,
                  restart_backup=cfg.ha.restart_backup, vote_retries=cfg.ha.vote_retries,
                  vote_retry_wait_ms=cfg.ha.vote_retry_wait_ms, quorum_vote_wait_s=cfg.ha.quorum_vote_wait_s,
                  quorum_size=cfg.ha.quorum_size,
                  max_saved_replicated_journals_size=cfg.ha.max_saved_replicated_journals_size,
                  backup_fsync=cfg.ha.backup_fsync)
    return dataclasses.replace(cfg, name=f"{cfg.name}-colocated-{n}", data_dir=cfg.data_dir / "colocated" / f"{n}",
                               acceptors=acceptors, management=mgmt, cluster=cluster, ha=ha, routers={},
                               broadcast_groups=(), activity=dataclasses.replace(cfg.activity, path=None))


class ColocatedHost:
    """The backups this node hosts for other primaries (``[ha.colocated] max-backups``): a
    component of the node's role (``broker.ha.replicated.Replicated``), run in the process's
    nursery; each hosted backup is one more ``broker.lifecycle.NodeProcess`` in this process."""

    def __init__(self, cfg: "BrokerConfig", security, own_node_id: str,
                 make_role: Callable[["BrokerConfig"], Role]) -> None:
        """``make_role(derived config)``: the role of a hosted backup (``Replicated``, handed in
        by the role that hosts: importing it here would close a circle)."""
        self.make_role = make_role
        self.cfg = cfg
        self.security = security
        self.own_node_id = own_node_id
        self.backups: dict[str, dict[str, Any]] = {}   # requester node id -> {n, name, role, ...}
        self._to_start, self._starts = trio.open_memory_channel(math.inf)
        self.stopped = False

    async def run(self) -> None:
        """Run every hosted backup as it is accepted, until stopped."""
        async with trio.open_nursery() as nursery:
            async for derived, entry in self._starts:
                nursery.start_soon(self._run, derived, entry)

    def stop(self) -> None:
        """Stop every hosted backup (its host is stopping) and take no more."""
        self.stopped = True
        for e in self.backups.values():
            e["role"].stop()
        self._to_start.close()

    def request(self, body: Any) -> tuple[int, dict]:
        """``POST /api/v1/ha/colocated``: host a backup for the node in ``body``."""

        if not isinstance(body, dict):
            return 400, {"error": "body must be a JSON object"}
        node_id, connector, group = body.get("node_id"), body.get("connector"), body.get("group")
        if not isinstance(node_id, str) or not node_id or len(node_id) > 64:
            return 400, {"error": "node_id must be a string"}
        if not isinstance(connector, str):
            return 400, {"error": "connector must be a string"}
        try:
            parse_connector(connector)
        except ValueError as exc:
            return 400, {"error": f"connector: {exc}"}
        if group is not None and (not isinstance(group, str) or not group):
            return 400, {"error": "group must be a non-empty string or null"}
        if self.stopped:
            return 503, {"error": "this node is stopping"}
        if node_id == self.own_node_id:
            return 409, {"error": "a node cannot host its own backup"}
        if node_id in self.backups:
            return 200, {"name": self.backups[node_id]["name"], "already": True}
        co = self.cfg.ha.colocated
        if len(self.backups) >= co.max_backups:
            return 409, {"error": f"this node already hosts {len(self.backups)} backup(s) (max-backups = "
                                  f"{co.max_backups})"}
        n = len(self.backups) + 1
        derived = derive_config(self.cfg, n, connector, group)
        entry = {"n": n, "name": derived.name, "node_id": node_id, "connector": connector,
                 "role": self.make_role(derived),
                 "management_port": derived.management.port, "amqp_ports": [a.port for a in derived.acceptors]}
        self.backups[node_id] = entry
        self._to_start.send_nowait((derived, entry))
        log.warning("ha: hosting colocated backup %s for node %s (%s)", derived.name, node_id, connector)
        return 202, {"name": derived.name, "amqp_ports": entry["amqp_ports"],
                     "management_port": entry["management_port"]}

    async def _run(self, derived: "BrokerConfig", entry: dict) -> None:

        proc = NodeProcess(derived, self.security, label=f"colocated-{entry['n']}", signals=False)
        try:
            await proc.run(entry["role"])
        except Exception as exc:   # noqa: BLE001 - one hosted backup failing must not stop the node
            log.error("ha: colocated backup %s stopped: %r", derived.name, exc)
            entry["error"] = repr(exc)

    def describe(self) -> list[dict]:
        out = []
        for e in self.backups.values():
            st = e["role"].status
            out.append({"name": e["name"], "for_node_id": e["node_id"], "connector": e["connector"],
                        "phase": st.phase, "active": st.active, "error": e.get("error")})
        return out


async def request_backups(node, cfg: "BrokerConfig") -> None:
    """``request-backup``: while this primary has no backup, ask the cluster's members to host one."""
    co = cfg.ha.colocated
    ccfg = cfg.cluster
    token = base64.b64encode(f"{ccfg.user}:{ccfg.password}".encode()).decode()
    body = json.dumps({"node_id": node.node_id, "connector": node.cluster.connector if node.cluster else ccfg.connector,
                       "group": cfg.ha.group_name, "name": cfg.name}).encode()
    attempts = 0
    turn = 0
    while co.backup_request_retries < 0 or attempts <= co.backup_request_retries:
        await trio.sleep(co.backup_request_retry_interval_ms / 1000.0)
        repl = node.replication
        if not node.active or repl is None or repl.session is not None or node.cluster is None:
            continue            # not serving yet, or a backup is connected (or syncing): nothing to ask
        members = [(nid, mgmt) for nid, _c, mgmt in node.cluster.live_members() if mgmt]
        if not members:
            continue
        nid, mgmt = members[turn % len(members)]
        turn += 1
        attempts += 1
        parts = urlsplit(mgmt)
        try:
            status, answer = await http_request(
                parts.hostname, parts.port or 80, "POST", "/api/v1/ha/colocated",
                headers=[("Host", parts.netloc), ("Connection", "close"), ("Authorization", "Basic " + token),
                         ("Content-Type", "application/json")], body=body, timeout_s=5.0)
        except (OSError, trio.TooSlowError) as exc:
            log.info("ha: backup request to %s failed: %r", nid[:8], exc)
            continue
        log.log(logging.WARNING if status in (200, 202) else logging.INFO,
                "ha: asked node %s to host a colocated backup: HTTP %d %s", nid[:8], status,
                answer[:200].decode(errors="replace"))
    log.warning("ha: no node accepted to host a colocated backup after %d requests", attempts)
