"""Running a member of a replicated pair (``[ha] policy = "replication"``; docs/ha.md).

Theory of operation
-------------------
**A primary** serves at once (its own data directory) and accepts one backup
(``broker.ha.replication.ReplicationSource``). With ``vote-on-replication-failure``, losing an
in-sync backup makes it ask the cluster whether it is still in the majority; if not it stops
serving and exits with status 3 (an isolated primary must not keep a node id another side may
take over).

**A backup** (its own data directory) answers its management API at once (``active: false``)
and looks for a primary among the cluster's connectors (``[cluster] static-connectors``, tried
in turn): it dials each as the cluster user and says hello; a primary of another
``group-name``, or one that already has a backup, refuses, and the backup tries the next one
(spare backups keep looking, every ``retry-interval-ms``). Once accepted it copies the primary's
journal (``ReplicationSink``) and follows it. When the connection to an in-sync primary is lost
the backup **votes** (``broker.ha.vote``: the other primaries it learned from the primary's
topology, over their management APIs); if the vote is won it activates — on its own copy of the
journal, with the primary's node id — and serves (and may take a backup of its own); if lost it
looks for the primary again, as Artemis's backup restarts as a backup.

**Under** ``[ha.manager]`` (``broker.ha.quorum``) the coordination service decides instead of
the vote: a primary serves only once it holds the pair's lock with a current activation
sequence (it waits otherwise, phase ``waiting-for-lock``); a backup that lost its in-sync
primary tries the lock ``1 + vote-retries`` times; a primary that loses its in-sync backup moves
the sequence on before answering alone; the node refuses to acknowledge anything past the
lock's lease (``Node.fence``) and the process exits with ISOLATED_EXIT.
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from broker.amqp.peer import PeerConnected, PeerConnection, PeerDisconnected, RetrySettings
from broker.core.departures import Target, target_from_connector
from broker.ha.colocated import ColocatedHost, request_backups
from broker.ha.protocol import ACKS_ADDRESS, FAILBACK, HELLO, RECORDS_ADDRESS, SYNCED, Hello, encode
from broker.ha.replication import DROPPED, ReplicationSink, ReplicationSource
from broker.ha.quorum import (CoordinationUnavailable, SequenceError, Stale, ZooKeeperManager, claim_next,
                               read_local_sequence, try_activate, write_local_sequence)
from broker.ha.status import HaStatus
from broker.ha.vote import ask_backup_vote, ask_primary_vote, vote_with_retries
from broker.lifecycle import SHUTDOWN_GRACE_S, ScaleDown
from broker.role import Role
from broker.store.datadir import open_data_dir
from broker.wire.discovery import DiscoveryGroup
from broker.wire.frames import CLUSTER_MEMBERS
from broker.wire.io.trioutil import Wakeup
from broker.wire.io.udp import listen

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker.ha")

__all__ = ["Replicated", "ISOLATED_EXIT"]

ISOLATED_EXIT = 3


def _write_node_id(path: Path, node_id: str) -> None:
    tmp = path / "node.id.tmp"
    with tmp.open("w", encoding="ascii") as fh:
        fh.write(node_id + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path / "node.id")


DISCOVERY_LISTEN_S = 2.5   # how long a member looking for its pair listens to the discovery group


async def cluster_connectors(cfg: "BrokerConfig") -> list[str]:
    """Where an HA member looks for its pair: ``[cluster] static-connectors``, or the members
    heard on the cluster's discovery group within ``min(initial-wait-timeout-ms,
    DISCOVERY_LISTEN_S)`` (its own node id included: a backup serving it announces it too)."""

    ccfg = cfg.cluster
    urls = list(ccfg.static_connectors)
    d = next((g for g in cfg.discovery_groups if g.name == ccfg.discovery_group), None) \
        if ccfg.discovery_group else None
    if d is not None:
        group = DiscoveryGroup(None, d.refresh_timeout_ms / 1000.0, cluster=ccfg.name, key=ccfg.key)
        try:
            with trio.move_on_after(min(d.initial_wait_timeout_ms / 1000.0, DISCOVERY_LISTEN_S)):
                await listen(d.group_address, d.group_port, group, lambda kind, entry: None,
                             bind_address=d.local_bind_address)
        except OSError as exc:
            log.warning("ha: cannot listen to discovery group %s: %s", d.name, exc)
        scheme = ccfg.connector.split("://", 1)[0]
        for e in group.entries.values():
            cs = e.announcement.connectors
            urls.append(next((c for c in cs if c.startswith(scheme + "://")), cs[0]))
    own = ccfg.connector
    return [u for u in dict.fromkeys(urls) if u != own]


async def find_live_self(cfg: "BrokerConfig", host, node_id: str, stop: trio.Event) -> str | None:
    """check-for-live-server: is another node serving ``node_id`` (a backup that took over while
    we were down)? Each of the cluster's connectors (:func:`cluster_connectors`) is asked once:
    the Open of a cluster node
    names its node id and the live members (``lodestone:cluster-members``). Returns the
    connector serving it, or None."""

    ccfg = cfg.cluster
    for url in await cluster_connectors(cfg):
        if stop.is_set():
            break
        seen: dict = {}
        peer = None

        def on_event(ev) -> None:
            if isinstance(ev, PeerConnected) and peer is not None and peer.engine is not None:
                seen["props"] = peer.engine.remote_properties or {}
                peer.close("amqp:connection:forced", "checked for a live server")

        peer = PeerConnection(host, url, credentials=(ccfg.user, ccfg.password),
                              retry=RetrySettings(initial_connect_attempts=1, reconnect_attempts=0),
                              ca_file=ccfg.ca_file, name=f"check-live-{cfg.name}", on_event=on_event)
        with trio.move_on_after(max(2.0, ccfg.call_timeout_ms / 1000.0)):
            await peer.run()
        props = seen.get("props")
        if not isinstance(props, dict):
            continue
        if props.get("node-id") == node_id:
            return url
        for m in props.get(CLUSTER_MEMBERS) or ():
            if isinstance(m, dict) and m.get("node-id") == node_id and isinstance(m.get("connector"), str):
                return m["connector"]
    return None


def failback_redirect(node, cfg: "BrokerConfig") -> Target | None:
    """Where an activated backup handing its node id back sends clients that follow redirects:
    the failing-back primary's connector (its hello), with this node as its failover when it
    stays the pair's backup (``restart-backup``)."""
    s = node.replication.failback_session if node.replication is not None else None
    if s is None or s.hello is None:
        return None
    own = node.cluster.connector if node.cluster is not None and cfg.ha.restart_backup else None
    return target_from_connector(s.hello.connector, [own] if own else [])


async def primary_quorum_check(node, cfg: "BrokerConfig", status: HaStatus) -> bool:
    """After losing an in-sync backup: may this primary keep serving? (vote-on-replication-failure)"""
    ha, ccfg = cfg.ha, cfg.cluster
    cluster = node.cluster
    voters = [(nid, mgmt) for nid, _c, mgmt in (cluster.live_members() if cluster is not None else ()) if mgmt]
    # the members it knows, connected or not: the quorum is over the cluster, not over who answers
    known = len(cluster.members) + 1 if cluster is not None else 1
    node.replication.max_cluster_size = max(node.replication.max_cluster_size, known)
    n = ha.quorum_size if ha.quorum_size > 0 else node.replication.max_cluster_size
    all_voters = [(nid, m.management_url) for nid, m in (cluster.members.items() if cluster is not None else ())
                  if m.management_url]
    creds = (ccfg.user, ccfg.password)
    result = await vote_with_retries(lambda: ask_primary_vote(node.node_id, all_voters or voters, n, creds),
                                     ha.vote_retries, ha.vote_retry_wait_ms / 1000.0, ha.quorum_vote_wait_s)
    status.votes["won" if result.won else "lost"] += 1
    log.warning("ha: quorum check after losing the backup: %s (%d of %d needed votes; %s)",
                "still in the majority" if result.won else "ISOLATED", result.votes, result.needed,
                ", ".join(result.detail) or "no voter")
    return result.won



class Replicated(Role):
    """A member of a replicated pair (``[ha] policy = "replication"``; see the module doc): a
    role of ``broker.lifecycle.NodeProcess``. It starts as the primary or the backup its config
    says; an activated backup that hands the node id back with ``restart-backup`` is a backup
    again, so both are one component."""

    def __init__(self, cfg: "BrokerConfig") -> None:
        super().__init__(cfg)
        ha = cfg.ha
        self.is_backup = ha.role == "backup"
        self.status = HaStatus(ha.policy, ha.role, str(cfg.data_dir))
        self.exit_code = 0
        #: the backups this node hosts for other primaries ([ha.colocated] max-backups ≥ 1)
        self.colocated: ColocatedHost | None = None
        self._view = None            # the replication view: the primary's stream, or the copy it follows
        self._deactivate: trio.Event | None = None   # per activation: isolated, or handing over
        self._handing_over = False
        self._scaling_down = False
        #: [ha.manager]: the coordination service's lock and activation sequence decide instead
        #: of the vote (broker.ha.quorum)
        self.manager: ZooKeeperManager | None = None
        self._data_path: Path | None = None
        self._claimed = False      # the lock and a fresh activation sequence are held for the next activation
        self._lost_lock: str | None = None
        self._restart_said: str | None = None
        #: a backup started with a copy that served last may serve it when it finds no primary;
        #: not once it handed the node id over (the failing-back primary takes the lock)
        self._may_serve_own_copy = True

    # -- what the node and the management API read -------------------------------------------------
    def describe(self, node) -> dict:
        out = self.status.describe(replication=self._view() if self._view is not None else None,
                                   colocated=self.colocated.describe() if self.colocated is not None else None)
        m = self.manager
        if m is not None:
            out["manager"] = {**m.describe(), "local_activation_sequence": (
                read_local_sequence(self._data_path) if self._data_path is not None else None)}
        return out

    def backups(self) -> tuple[tuple[str, str, bool], ...]:
        return self.replication.backups() if self.replication is not None else ()

    def host_backup(self, body) -> tuple[int, dict] | None:
        return self.colocated.request(body) if self.colocated is not None else None

    def stop(self) -> None:
        super().stop()
        if self.colocated is not None:
            self.colocated.stop()

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self, proc) -> int:
        cfg, ha, status = self.cfg, self.cfg.ha, self.status
        datadir = open_data_dir(cfg.data_dir)
        self._data_path = datadir.path
        try:
            status.node_id = None if self.is_backup else datadir.node_id
            if ha.manager is not None:
                self.manager = ZooKeeperManager(ha.manager, {
                    "name": cfg.name, "connector": cfg.cluster.connector if cfg.cluster else None, "pid": os.getpid()})
                self.manager.coordination_id = ha.coordination_id or (None if self.is_backup else datadir.node_id)
                proc.spawn(self.manager.run, self.stopping)
            co = ha.colocated
            if co is not None and co.max_backups > 0:
                self.colocated = ColocatedHost(cfg, proc.security, datadir.node_id, Replicated)
                proc.spawn(self.colocated.run)
            host = proc.passive(self, status.node_id)   # the EngineHost of the connections it dials
            if self.is_backup or ha.check_for_live_server or ha.manager is not None:
                # a passive member answers at once (active: false); a plain primary opens its
                # management API when it serves (under [ha.manager] it may wait for the lock)
                await proc.open_management()
            while not self.stopping.is_set():
                why = "took over the node id" if self.is_backup else "primary started"
                if self.is_backup:
                    how = await self._follow_primaries(proc, datadir, host)
                    if not how:
                        break
                    if how == "own-copy":
                        why = "restarted with the current activation sequence: serves its own copy"
                elif ha.check_for_live_server:
                    status.change("checking-for-live-server", "is another node serving our node id?")
                    url = await find_live_self(cfg, host, datadir.node_id, self.stopping)
                    if url is not None:
                        log.warning("ha: node %s is served at %s: failing back (copy its journal, then ask "
                                    "for the node id back)", datadir.node_id, url)
                        how = await self._follow_primaries(proc, datadir, host, candidates=[url], failback=True)
                        if not how:
                            break
                        why = ("the node id was handed back" if how == "handover" else
                               "won the vote: the node serving its id went away" if self.manager is None else
                               "took the lock: the node serving its id went away")
                if self.manager is not None and not self._claimed:
                    # a primary serves only with the lock and a current activation sequence (a
                    # failing-back one too: the backup releases the lock as it hands over)
                    took = await self._primary_lock(proc, datadir, host)
                    if took is None:
                        break
                    why = f"{why}; {took}"
                if self.is_backup and ha.scale_down:
                    # Artemis's backup scale-down: move the node id's messages to another live
                    # node instead of serving them, then stop
                    status.change("scaling-down", "took over to move the messages to another node")
                    self._scaling_down = True
                    await proc.serve(self, datadir, scale_down=ScaleDown(cfg))
                    status.change("stopping", "scaled down", active=False)
                    break
                reason = await self._activate(proc, datadir, why)
                if reason == "deactivate" and self._handing_over:
                    status.failbacks += 1
                    if self.manager is not None:
                        await self.manager.unlock()   # the failing-back primary takes it
                    status.change("stopping", "handed the node id back to its primary", active=False)
                    proc.passive(self, status.node_id)
                    if ha.restart_backup:
                        # a backup again, of the primary that just took over: it must not take the
                        # lock back with its own copy in the moment before the primary takes it
                        self._may_serve_own_copy = False
                        continue
                    break
                if reason == "deactivate" and self._lost_lock is not None:
                    status.change("stopping", f"lost the coordination lock: {self._lost_lock}", active=False)
                    break
                status.change("stopping", "isolated from the cluster's majority" if reason == "deactivate"
                              else "stopped", active=False)
                break
        finally:
            datadir.close()
        return self.exit_code

    async def _activate(self, proc, datadir, why: str) -> str:
        """Serve the node id; the reason it stopped serving (``"deactivate"``: isolated, or
        handing the node id back)."""
        status = self.status
        self._deactivate = trio.Event()
        self._handing_over = False
        status.activations += 1
        if self.is_backup:
            status.failovers += 1
        self._claimed = False
        status.change("active", why, active=True)
        try:
            return await proc.serve(self, datadir, deactivate=self._deactivate)
        finally:
            self.replication = None

    # -- each activation ---------------------------------------------------------------------------
    def activated(self, node, nursery: trio.Nursery) -> None:
        """The active member takes a backup and reports replication; an activated backup with
        allow-failback hands over when the node id's primary asks."""
        if self._scaling_down:
            return
        cfg = self.cfg
        src = ReplicationSource(node)
        self.replication = src
        self._view = src.describe
        m = self.manager
        if m is not None:
            # a lost in-sync backup: the activation sequence moves on before any send is answered
            # alone, so that backup can never activate on its copy (broker.ha.quorum)
            src.activation_sequence = read_local_sequence(self._data_path)
            src.quorum_check = lambda: self._advance_sequence(src)
            node.set_fence(m.fenced)
            m.on_lost = self._lock_lost
        elif cfg.ha.vote_on_replication_failure:
            src.quorum_check = lambda: primary_quorum_check(node, cfg, self.status)
        src.on_isolated = self._isolated
        if self.is_backup and cfg.ha.allow_failback:
            src.on_failback = self._failback_asked
        ccfg = cfg.cluster
        nursery.start_soon(src.run, (ccfg.call_timeout_ms if ccfg else 30000) / 1000.0)
        co = cfg.ha.colocated
        if co is not None and co.request_backup:
            nursery.start_soon(request_backups, node, cfg)

    def _isolated(self) -> None:
        self.exit_code = ISOLATED_EXIT
        self._deactivate.set()

    def _lock_lost(self, why: str) -> None:
        """The coordination lock is gone (or its lease ran out): stop serving at once; the
        process exits with ISOLATED_EXIT (a supervisor restarts it: it comes back as a member
        waiting for the lock)."""
        self._lost_lock = why
        if self._deactivate is not None and not self._deactivate.is_set():
            log.error("ha: stops serving node %s: %s", self.status.node_id, why)
            self._isolated()

    async def _advance_sequence(self, src) -> bool:
        """[ha.manager]: the primary lost its in-sync backup; before answering anything alone it
        claims the next activation sequence (False: it could not — it stops)."""
        m = self.manager
        local = read_local_sequence(self._data_path)
        try:
            if local is None or m.fenced() is not None:
                raise SequenceError(m.fenced() or "no local activation sequence")
            new = await claim_next(m, local, lambda v: write_local_sequence(self._data_path, v))
        except Exception as exc:   # SequenceError, CoordinationUnavailable, a ZooKeeper error
            log.error("ha: cannot move the activation sequence on after losing the backup: %s", exc)
            self._lost_lock = f"could not move the activation sequence on: {exc}"
            return False
        src.activation_sequence = new
        log.warning("ha: serving without a backup: activation sequence %d (a copy at %d can no longer activate)",
                    new, local)
        return True

    async def _take_lock(self, datadir, timeout_s: float) -> tuple[bool, str]:
        """Take the coordination lock with a current activation sequence and claim the next
        one (Artemis's tryActivate and ensureSequentialAccessToNodeData): ``(True, how)``, or
        ``(False, why)`` without the lock."""
        m = self.manager
        m.coordination_id = self.cfg.ha.coordination_id or datadir.node_id
        write = lambda v: write_local_sequence(datadir.path, v)   # noqa: E731
        local = read_local_sequence(datadir.path)
        try:
            ok, how = await try_activate(m, local, write, timeout_s)
            if not ok:
                return False, how
            new = await claim_next(m, read_local_sequence(datadir.path), write)
        except (SequenceError, CoordinationUnavailable) as exc:
            await m.unlock()
            return False, str(exc)
        except Exception as exc:   # a ZooKeeper error (no permission on the path, a bad znode): say so
            await m.unlock()
            return False, f"ZooKeeper refused: {type(exc).__name__}: {exc}"
        self._claimed = True
        return True, f"took the lock of {m.coordination_id} at activation sequence {new}"

    async def _primary_lock(self, proc, datadir, host) -> str | None:
        """A primary under [ha.manager] waits for the lock with a current activation sequence;
        meanwhile (check-for-live-server) it looks for a member serving its node id and fails
        back from it first. How it took the lock; None when stopped."""
        cfg, ha, status, stop = self.cfg, self.cfg.ha, self.status, self.stopping
        said = None
        while not stop.is_set():
            ok, why = await self._take_lock(datadir, ha.vote_retry_wait_ms / 1000.0)
            if ok:
                return why
            if why != said:
                log.warning("ha: primary %s does not serve: %s", cfg.name, why)
                said = why
            if status.phase != "waiting-for-lock" or status.last_change != why:
                status.change("waiting-for-lock", why, active=False)
            if ha.check_for_live_server:
                url = await find_live_self(cfg, host, datadir.node_id, stop)
                if url is not None:
                    log.warning("ha: node %s is served at %s: failing back", datadir.node_id, url)
                    how = await self._follow_primaries(proc, datadir, host, candidates=[url], failback=True)
                    if not how:
                        return None
                    if self._claimed:
                        return "took the lock: the node serving its id went away"
                    said = None
                    continue      # handed back: the member that served releases the lock
            with trio.move_on_after(cfg.cluster.retry_interval_ms / 1000.0):
                await stop.wait()
        return None

    def _failback_asked(self) -> None:
        self._handing_over = True
        self._deactivate.set()

    async def deactivating(self, node, reason: str, close_listeners) -> None:
        if reason == "deactivate" and self._handing_over and self.replication is not None:
            # clients first (no send may land after the last record handed over): those that
            # follow redirects to the primary, the rest ended without a Close; then the hand-over
            close_listeners()
            await node.depart_all(failback_redirect(node, self.cfg), "failing back to the primary", SHUTDOWN_GRACE_S)
            await self.replication.hand_over(self.cfg.cluster.call_timeout_ms / 1000.0)

    async def _follow_primaries(self, proc, datadir, host, *, candidates: list[str] | None = None,
                                failback: bool = False):
        """The backup's loop: find a primary, copy and follow it. Returns ``"vote"`` once a won
        vote (or, under [ha.manager], the lock) lets it activate, ``"own-copy"`` once a restarted
        backup that found no primary takes the lock for its own current copy, ``"handover"`` once
        the node handed its id over (a failback), False when stopped. ``candidates``: the connectors to try (default: the cluster's); ``failback``:
        ask the node for our node id back once in sync (the original primary, check-for-live-server)."""

        cfg, status, stop = self.cfg, self.status, self.stopping
        ccfg = cfg.cluster
        own = {ccfg.connector}
        tokens = itertools.count(1)
        while not stop.is_set():
            urls = candidates if candidates is not None else [u for u in await cluster_connectors(cfg) if u not in own]
            status.change("looking-for-primary", f"trying {len(urls)} connector(s)", active=False)
            for url in urls:
                if stop.is_set():
                    return False
                sink, ended = await self._replicate_from(proc, datadir, host, url, tokens, failback)
                lost_in_sync = sink.in_sync and sink.error is None
                handed = sink.handover_seq is not None and sink.synced_seq >= sink.handover_seq
                sink.close()
                if handed and not stop.is_set():
                    log.warning("ha: node %s handed its id over through seq %d", status.node_id, sink.handover_seq)
                    return "handover"
                if stop.is_set():
                    return False
                cond = ended.get("condition")
                if cond == DROPPED and ended.get("remote"):
                    # the primary itself closed the link: it is alive and goes on alone (this
                    # backup was too slow or too far behind). Voting would take its node id
                    # while it serves: in a lone pair nobody else would say no.
                    log.warning("ha: %s dropped this backup (%s); not a failure of the primary: "
                                "syncing again", url, ended.get("description"))
                    status.change("looking-for-primary", f"dropped by {url}: {ended.get('description')}",
                                  active=False)
                    continue
                if not lost_in_sync:
                    if cond is not None:
                        log.info("ha: %s did not take this backup: %s %s", url, cond, ended.get("description"))
                    continue
                if self.manager is not None:
                    if await self._take_over(url, datadir, cond):
                        return "vote"
                elif await self._vote(url, sink, cond):
                    return "vote"
            if self.manager is not None and candidates is None and await self._restart_as_active(datadir):
                return "own-copy"
            with trio.move_on_after(ccfg.retry_interval_ms / 1000.0):
                await stop.wait()
        return False

    async def _restart_as_active(self, datadir) -> bool:
        """[ha.manager], a backup that found no primary to follow: if its own copy holds the
        current activation sequence (it served last: a backup that took over, then stopped), it
        takes the lock and serves that copy, as Artemis's backup does at start (not after it
        handed the node id over to a failing-back primary)."""
        if not self._may_serve_own_copy or not read_local_sequence(self._data_path):
            return False      # (0: it never served; None: its copy is not complete)
        if not await self.manager.wait_connected(0.5):   # not connected: the next round tries again
            return False
        ok, why = await self._take_lock(datadir, 0.0)
        if not ok:
            if why != self._restart_said:
                log.info("ha: backup does not serve its own copy: %s", why)
                self._restart_said = why
            return False
        self.status.node_id = datadir.node_id
        log.warning("ha: no primary to follow and this copy holds the current activation sequence: serving it (%s)",
                    why)
        return True

    async def _replicate_from(self, proc, datadir, host, url: str, tokens, failback: bool):
        """Copy and follow the primary at ``url`` until the connection ends (or this member
        stops); the sink that holds the copy, and how the connection ended (``condition``,
        ``description``)."""
        cfg, status, stop = self.cfg, self.status, self.stopping
        ha, ccfg = cfg.ha, cfg.cluster
        ended: dict = {}

        def set_node_id(node_id: str) -> None:
            _write_node_id(datadir.path, node_id)
            datadir.node_id = node_id
            status.node_id = node_id
            if self.manager is not None and not ha.coordination_id:
                self.manager.coordination_id = node_id   # GET /api/v1/ha shows the pair's lock and sequence
            proc.passive(self, status.node_id)

        def set_sequence(value: int | None) -> None:
            if value is None and sink.start is not None and sink.start.activation_sequence is None and sink.in_sync:
                log.error("ha: primary %s runs without [ha.manager]: this backup's copy can never activate "
                          "under the coordination service", url)
            write_local_sequence(datadir.path, value)

        security = proc.security
        sink = ReplicationSink(datadir, cfg.journal, keep_saved=ha.max_saved_replicated_journals_size,
                               fsync=ha.backup_fsync, on_node_id=set_node_id,
                               on_logins=security.adopt_logins if security is not None else None,
                               on_sequence=set_sequence if ha.manager is not None else None)
        self._view = lambda: {"state": "in-sync" if sink.in_sync else "syncing", "primary": url,
                              "applied_seq": sink.applied_seq, "synced_seq": sink.synced_seq,
                              "records": sink.records_received, "lag_records": None,
                              "logins_adopted": security.logins_adopted if security is not None else 0}

        def on_event(ev) -> None:
            if isinstance(ev, PeerDisconnected):
                ended["condition"], ended["description"], ended["remote"] = ev.condition, ev.description, ev.remote

        peer = PeerConnection(host, url, credentials=(ccfg.user, ccfg.password),
                              retry=RetrySettings(initial_connect_attempts=1, reconnect_attempts=0),
                              ca_file=ccfg.ca_file, name=f"replica-{cfg.name}", on_event=on_event,
                              idle_timeout_s=ccfg.connection_ttl_ms / 1000.0 if ccfg.connection_ttl_ms > 0 else None)
        acks = peer.sender(ACKS_ADDRESS, lambda token, state: None)
        got = Wakeup()

        def on_message(body: bytes) -> str:
            state = sink.on_message(body)
            got.set()
            return state

        peer.receiver(RECORDS_ADDRESS, on_message, credit=64)
        acks.send(encode(HELLO, Hello(ha.group_name, cfg.name, ccfg.connector, proc.management.url or None,
                                      logins=security is not None)), next(tokens))
        status.change("syncing", f"replicating from {url}")
        announced = False
        async with trio.open_nursery() as pn:
            async def run_peer() -> None:
                await peer.run()
                pn.cancel_scope.cancel()

            async def confirm() -> None:
                nonlocal announced
                while True:
                    await got.wait()
                    if sink.error is not None:
                        log.error("ha: replication from %s: %s; starting over", url, sink.error)
                        peer.close("amqp:decode-error", sink.error[:200])
                        return
                    if sink.pending_flush:
                        sink.pending_flush = False
                        seq = await trio.to_thread.run_sync(sink.flush)
                        acks.send(encode(SYNCED, seq), next(tokens))
                        if sink.in_sync and not announced:
                            announced = True
                            status.change("in-sync", f"a copy of {url} (node {status.node_id})")
                            if failback:
                                acks.send(encode(FAILBACK, None), next(tokens))

            async def on_stop() -> None:
                await stop.wait()
                peer.close("amqp:connection:forced", "backup stopping")
                pn.cancel_scope.cancel()

            pn.start_soon(run_peer)
            pn.start_soon(confirm)
            pn.start_soon(on_stop)
        return sink, ended

    async def _take_over(self, url: str, datadir, cond: str | None) -> bool:
        """[ha.manager]: the in-sync primary at ``url`` is gone: take its lock — ``1 +
        vote-retries`` attempts, each waiting up to ``vote-retry-wait-ms`` for it (a dead
        primary's lock goes when its ZooKeeper session expires) — with a current activation
        sequence."""
        ha, status = self.cfg.ha, self.status
        status.change("waiting-for-lock", f"lost the primary at {url} ({cond or 'connection lost'})")
        why = ""
        for attempt in range(1 + ha.vote_retries):
            if self.stopping.is_set():
                return False
            ok, why = await self._take_lock(datadir, ha.vote_retry_wait_ms / 1000.0)
            status.votes["won" if ok else "lost"] += 1
            if ok:
                log.warning("ha: taking over node %s: %s", status.node_id, why)
                return True
            if isinstance(why, Stale):
                break     # waiting longer does not make this copy current
            if attempt == 0:
                log.info("ha: waiting for the lock of node %s: %s", status.node_id, why)
        log.warning("ha: does not take over node %s: %s", status.node_id, why)
        return False

    async def _vote(self, url: str, sink: ReplicationSink, cond: str | None) -> bool:
        """The in-sync primary at ``url`` is gone (or unreachable): ask the other primaries it
        named whether this backup may take its node id over."""
        ha, ccfg, status = self.cfg.ha, self.cfg.cluster, self.status
        primary_id = status.node_id
        topo = sink.topology
        voters = [(nid, mgmt) for nid, mgmt in (topo.members if topo else ()) if nid != primary_id and mgmt]
        n = ha.quorum_size if ha.quorum_size > 0 else sink.max_cluster_size
        status.change("voting", f"lost the primary at {url} ({cond or 'connection lost'})")
        result = await vote_with_retries(
            lambda: ask_backup_vote(primary_id, voters, n, (ccfg.user, ccfg.password)),
            ha.vote_retries, ha.vote_retry_wait_ms / 1000.0, ha.quorum_vote_wait_s)
        status.votes["won" if result.won else "lost"] += 1
        log.warning("ha: vote to take over node %s: %s (%d of %d needed votes from %d primaries; %s)",
                    primary_id, "WON" if result.won else "lost", result.votes, result.needed, result.asked,
                    ", ".join(result.detail) or "no other primary")
        return result.won
