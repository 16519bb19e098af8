"""Shared-store high availability: a primary and its backups on one data directory (seed 001,
Artemis ``<ha-policy><shared-store>``; docs/ha.md).

Theory of operation
-------------------
Every member of a pair names the same ``[node] data-dir`` (a shared file system). Three files
in it decide who serves, as Artemis's ``FileLockNodeManager`` does with ``server.lock``:

* ``lock`` — the **live lock**: the data directory's own ``flock`` (``broker.store.datadir``).
  Whoever holds it serves, with the node id in ``node.id``. The kernel frees it when its holder
  dies, even by SIGKILL, so a crashed primary's lock frees with its process.
* ``backup.lock`` — the **backup lock**: one backup at a time waits for the live lock; further
  backups wait for this one (spares).
* ``ha.state`` — one byte, what the last live node said about itself: ``L`` live (still true
  after a crash: the lock was freed without a word), ``P`` paused (stopped cleanly without
  ``failover-on-shutdown``), ``F`` a primary is failing back, ``N`` (or no file) never started.

**A backup** takes the backup lock, then polls (every :data:`POLL_S`) for the live lock. When
it gets it, the state says why it was free: ``L`` — the live node crashed (or failed over on
shutdown): activate; ``P`` or ``F`` — give the lock back and keep waiting (a clean stop is not a
failure; a primary coming back must get it). It activates with the pair's node id and journal
(recovered from the shared files) and releases the backup lock for the next spare.

**A primary** writes ``F`` (asking an active backup with ``allow-failback`` to hand over), then
polls for the live lock, writes ``L`` and activates. An active backup with ``allow-failback``
watches ``ha.state``; on ``F`` it closes every client (``amqp:connection:redirect`` to the primary's connector, which it wrote to
``primary.json`` before ``F``, for clients that follow redirects; the others' connections
ended without a Close: docs/ha.md "Telling clients where to go"), flushes and
closes the journal, releases the live lock and — with ``restart-backup`` — waits again as a
backup. Without ``allow-failback`` the restarted primary waits (it is then the spare).

**Topology.** The backup that holds the backup lock writes where it will serve to
``backup.json`` (its ``[cluster] connector``, else its first acceptor with a fixed port, and its
management URL). The active node reads it every :data:`BACKUP_CHECK_S` and, while the backup lock
is held, lists that backup as its own (``Node.backups``: ``GET /api/v1/cluster`` role
``backup``, the ``backups`` notification to the cluster's members, broadcast announcements,
Artemis's ``failover-server-list`` in its Open), as an Artemis shared-store backup announces
itself to its live node. A stale file (its writer gone, the lock free) is ignored.

**Scale-down** (``[ha] scale-down`` on a backup, Artemis's ``<slave><scale-down>``): a backup
that takes the live lock activates without any AMQP listener, moves every message of the node
id to another live node over the cluster's bridges, writes ``P`` (so no spare takes the emptied
node id over; its primary may come back) and stops.

**A clean stop** (SIGTERM/SIGINT) of the active node writes ``P`` unless ``failover-on-shutdown``
(then ``L`` stays and a backup activates). A passive node's stop just releases its locks.

The management API listens for the whole life of the process (a passive backup answers
``active: false``, which keeps routers away; ``GET /api/v1/ha`` shows the role); a primary with
``wait-for-activation`` (the default) opens it only once active. AMQP acceptors listen only while
active: their ``listening`` lines are printed at each activation.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from broker.core.departures import target_from_connector
from broker.ha.status import HaStatus
from broker.lifecycle import SHUTDOWN_GRACE_S, ScaleDown
from broker.role import Role
from broker.store.datadir import open_data_dir
from broker.store.errors import DataDirLocked

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker.ha")

__all__ = ["SharedStore", "SharedStoreMember", "POLL_S"]

POLL_S = 0.05            # how often a waiting node tries the live lock
FAILBACK_CHECK_S = 0.2   # how often an active backup reads ha.state for a failing-back primary
BACKUP_CHECK_S = 1.0     # how often the active node reads backup.json (its waiting backup, for the topology)

LIVE, PAUSED, FAILING_BACK, NOT_STARTED = "L", "P", "F", "N"
STATE_NAMES = {LIVE: "live", PAUSED: "paused", FAILING_BACK: "failing-back", NOT_STARTED: "not-started"}


class SharedStore:
    """The pair's files in the shared data directory (sync; see the module doc)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = Path(data_dir)
        self.path.mkdir(parents=True, exist_ok=True)
        self._backup_fd: int | None = None

    # -- ha.state ------------------------------------------------------------------------------
    def state(self) -> str:
        try:
            with open(self.path / "ha.state", "rb") as fh:
                b = fh.read(1)
        except FileNotFoundError:
            return NOT_STARTED
        s = b.decode("ascii", "replace")
        return s if s in STATE_NAMES else NOT_STARTED

    def set_state(self, s: str) -> None:
        """Write the state byte durably (in place, fsync'd)."""
        fd = os.open(self.path / "ha.state", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, s.encode("ascii"), 0)
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- backup.lock ---------------------------------------------------------------------------
    def try_backup_lock(self) -> bool:
        if self._backup_fd is not None:
            return True
        fd = os.open(self.path / "backup.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._backup_fd = fd
        return True

    def release_backup_lock(self) -> None:
        if self._backup_fd is not None:
            os.close(self._backup_fd)
            self._backup_fd = None

    def backup_lock_held(self) -> bool:
        """Does some process hold the backup lock (a backup waiting for the live lock)? Tried
        shared and non-blocking, released at once; a backup that tries in that instant tries again."""
        if self._backup_fd is not None:
            return True
        try:
            fd = os.open(self.path / "backup.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)   # closing the descriptor drops a lock it got
        return False

    def write_backup_info(self, connector: str, management_url: str) -> None:
        """Where the waiting backup will serve (written by the holder of the backup lock)."""
        tmp = self.path / "backup.json.tmp"
        tmp.write_text(json.dumps({"connector": connector, "management_url": management_url, "pid": os.getpid()}))
        os.replace(tmp, self.path / "backup.json")

    def clear_backup_info(self) -> None:
        """The backup lock's holder is done waiting (it activates) or announces nothing."""
        try:
            (self.path / "backup.json").unlink()
        except FileNotFoundError:
            pass

    def waiting_backup(self, own_connector: str | None = None) -> tuple[str, str, bool] | None:
        """``(connector, management URL, True)`` of the backup waiting on these files, or None
        (no backup lock held, no readable ``backup.json``, or one naming ``own_connector``: a
        file the active node itself left when it was the waiting backup)."""
        if not self.backup_lock_held():
            return None
        try:
            info = json.loads((self.path / "backup.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        connector = info.get("connector") if isinstance(info, dict) else None
        mgmt = info.get("management_url") if isinstance(info, dict) else None
        if not isinstance(connector, str) or not connector or connector == own_connector:
            return None
        return (connector, mgmt if isinstance(mgmt, str) else "", True)

    def write_primary_info(self, connector: str | None) -> None:
        """Where the primary will serve (written before it asks for failback): an active backup
        handing over redirects its clients there. No connector: the file is removed."""
        if not connector:
            try:
                (self.path / "primary.json").unlink()
            except FileNotFoundError:
                pass
            return
        tmp = self.path / "primary.json.tmp"
        tmp.write_text(json.dumps({"connector": connector, "pid": os.getpid()}))
        os.replace(tmp, self.path / "primary.json")

    def primary_connector(self) -> str | None:
        """The connector of ``primary.json`` (None: none, unreadable)."""
        try:
            info = json.loads((self.path / "primary.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        c = info.get("connector") if isinstance(info, dict) else None
        return c if isinstance(c, str) and c else None

    def node_id(self) -> str | None:
        """The pair's node id, if the primary has ever started (read without a lock)."""
        try:
            text = (self.path / "node.id").read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            return None
        return text or None


async def _acquire_live(store: SharedStore, path: Path, *, backup: bool, status: HaStatus):
    """Poll for the live lock; a backup takes it only when the state says the live node is gone
    (``L``). Returns the open, locked ``DataDir``."""

    while True:
        if backup and store.state() == NOT_STARTED:
            await trio.sleep(POLL_S)   # the primary never started: nothing to take over yet
            continue
        try:
            dd = open_data_dir(path)
        except DataDirLocked:
            await trio.sleep(POLL_S)
            continue
        if not backup:
            return dd
        s = store.state()
        if s == LIVE:
            return dd
        dd.close()    # paused (a clean stop) or a primary failing back: not ours to take
        await trio.sleep(POLL_S)


async def _watch_failback(store: SharedStore, deactivate: trio.Event) -> None:
    while store.state() != FAILING_BACK:
        await trio.sleep(FAILBACK_CHECK_S)
    deactivate.set()


def backup_connector(cfg: "BrokerConfig") -> str | None:
    """Where this member will serve once active, for the topology: its ``[cluster] connector``
    (unless on port 0), else its first acceptor on a fixed port and a specific host."""
    c = cfg.cluster
    if c is not None and c.connector and not c.connector.endswith(":0"):
        return c.connector
    for acc in cfg.acceptors:
        if acc.port and acc.host not in ("0.0.0.0", "::", ""):
            host = f"[{acc.host}]" if ":" in acc.host else acc.host
            return f"{acc.scheme}://{host}:{acc.port}"
    return None


class SharedStoreMember(Role):
    """A primary or backup of a shared-store pair (``[ha] policy = "shared-store"``; see the
    module doc): a role of ``broker.lifecycle.NodeProcess``."""

    def __init__(self, cfg: "BrokerConfig") -> None:
        super().__init__(cfg)
        ha = cfg.ha
        self.store = SharedStore(cfg.data_dir)
        self.is_backup = ha.role == "backup"
        self.status = HaStatus(ha.policy, ha.role, str(cfg.data_dir), node_id=self.store.node_id())
        #: while active: the backup waiting on our files, ``(connector, management URL, True)``
        self.waiting_backup: tuple[str, str, bool] | None = None
        self._failing_back: trio.Event | None = None   # per activation: the primary asks for the lock

    # -- what the node and the management API read -------------------------------------------------
    def describe(self, node) -> dict:
        state = self.store.state()
        return self.status.describe(pair_state=STATE_NAMES.get(state) if state else None)

    def backups(self) -> tuple[tuple[str, str, bool], ...]:
        return (self.waiting_backup,) if self.waiting_backup is not None else ()

    # -- the loop ----------------------------------------------------------------------------------
    async def run(self, proc) -> int:
        ha, store, status = self.cfg.ha, self.store, self.status
        proc.passive(self, status.node_id)
        if self.is_backup or not ha.wait_for_activation:
            await proc.open_management()
        if not self.is_backup:
            store.write_primary_info(backup_connector(self.cfg))   # where the backup sends its clients
            store.set_state(FAILING_BACK)   # an active backup with allow-failback hands over
        try:
            while not self.stopping.is_set():
                dd = await self._wait_for_live_lock(proc)
                if dd is None:   # stopped while waiting
                    break
                try:
                    reason = await self._activate(proc, dd)
                finally:
                    dd.close()    # the live lock frees: a backup or the returning primary takes it
                    self.waiting_backup = None
                proc.passive(self, status.node_id)
                status.active = False
                if reason != "deactivate" or not (self.is_backup and ha.restart_backup):
                    break
        finally:
            store.release_backup_lock()
        return 0

    async def _wait_for_live_lock(self, proc):
        """A backup takes the backup lock (and says where it will serve), then both wait for the
        live lock; the open, locked ``DataDir``, or None when stopped first."""
        store, status = self.store, self.status
        with trio.CancelScope() as waiting:
            async def cancel_on_stop() -> None:
                await self.stopping.wait()
                waiting.cancel()
            async with trio.open_nursery() as wn:
                wn.start_soon(cancel_on_stop)
                if self.is_backup:
                    status.change("waiting-for-backup-lock", "backup started", active=False)
                    while not store.try_backup_lock():
                        await trio.sleep(POLL_S)
                    connector = backup_connector(self.cfg)
                    if connector and not self.cfg.ha.scale_down:   # the active node lists us (topology)
                        store.write_backup_info(connector, proc.management.url or "")
                    else:   # a scale-down backup never serves: nobody's failover target
                        store.clear_backup_info()
                    status.change("waiting-for-live-lock", "this node is the pair's waiting backup")
                else:
                    status.change("waiting-for-live-lock", "primary started", active=False)
                dd = await _acquire_live(store, self.cfg.data_dir, backup=self.is_backup, status=status)
                wn.cancel_scope.cancel()
                return dd
        return None

    async def _activate(self, proc, dd) -> str:
        """Serve the pair's node id on the live lock; the reason it stopped serving."""
        ha, store, status = self.cfg.ha, self.store, self.status
        store.set_state(LIVE)
        if self.is_backup:
            store.clear_backup_info()     # no longer waiting: the next spare writes its own
        store.release_backup_lock()   # the next spare backup may wait now
        status.node_id = dd.node_id
        if self.is_backup and ha.scale_down:
            # Artemis's shared-store backup scale-down: move the node id's messages to another
            # live node instead of serving them, then stop; the pair is left paused (no spare
            # takes the emptied node id over; its primary may return)
            status.change("scaling-down", "took over to move the messages to another node")
            self._failing_back = None
            await proc.open_management()
            reason = await proc.serve(self, dd, scale_down=ScaleDown(self.cfg))
            store.set_state(PAUSED)
            status.change("stopping", "scaled down", active=False)
            return reason
        status.activations += 1
        if self.is_backup:
            status.failovers += 1
        status.change("active", "took over a failed live node" if self.is_backup else "primary activated",
                      active=True)
        await proc.open_management()
        self._failing_back = trio.Event()
        reason = await proc.serve(self, dd, deactivate=self._failing_back)
        if reason == "deactivate":
            status.failbacks += 1
            status.change("stopping", "the primary is failing back: handing over", active=False)
        elif not ha.failover_on_shutdown:
            store.set_state(PAUSED)     # a clean stop: the backup stays passive
        else:
            log.warning("ha: stopping with failover-on-shutdown: the backup takes over")
        return reason

    # -- each activation ---------------------------------------------------------------------------
    def activated(self, node, nursery: trio.Nursery) -> None:
        if self.is_backup and self.cfg.ha.allow_failback and self._failing_back is not None:
            nursery.start_soon(_watch_failback, self.store, self._failing_back)
        nursery.start_soon(self._watch_backup, node)

    async def _watch_backup(self, node) -> None:
        """The active node follows its waiting backup (``backup.json`` + the backup lock); the
        cluster's members are told when it changes."""
        while not node.active:   # listening, in the cluster (a scaling-down node never is)
            await trio.sleep(POLL_S)
        while True:
            own = node.cluster.connector if node.cluster is not None else None
            now = await trio.to_thread.run_sync(self.store.waiting_backup, own)
            if now != self.waiting_backup:
                self.waiting_backup = now
                log.info("ha: %s", f"a backup waits on the shared store: {now[0]}" if now else "no backup waits any more")
                if node.cluster is not None:
                    node.cluster.backups_changed()
            await trio.sleep(BACKUP_CHECK_S)

    async def deactivating(self, node, reason: str, close_listeners) -> None:
        if reason != "deactivate":
            return
        # the primary is failing back: clients that follow redirects go to it (primary.json), the
        # rest have their connections ended without a Close
        close_listeners()
        ha = self.cfg.ha
        own = node.cluster.connector if node.cluster is not None else backup_connector(self.cfg)
        target = target_from_connector(self.store.primary_connector(), [own] if own and ha.restart_backup else [])
        await node.depart_all(target, "failing back to the primary", SHUTDOWN_GRACE_S)
