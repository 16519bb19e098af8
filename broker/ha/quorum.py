"""The pluggable quorum: a replicated pair coordinated by Apache ZooKeeper (``[ha.manager]``;
seed 001 "Pluggable Quorum Vote Replication"; docs/ha.md "A pair coordinated by ZooKeeper").

Theory of operation
-------------------
Two things kept in ZooKeeper decide who serves a **coordination id** (``[ha] coordination-id``,
by default the node id the pair serves):

* **the lock**, an ephemeral znode ``<root>/<coordination-id>/lock`` holding who took it: only
  its holder may serve. It lives as long as the holder's ZooKeeper session: a holder that dies
  loses it when the session expires (``session-ms`` after ZooKeeper last heard from it); one
  that stops cleanly closes the session and loses it at once;
* **the activation sequence**, a persistent znode ``<root>/<coordination-id>/activation-sequence``
  (a decimal integer, 0 when absent). Each member keeps its own copy beside its journal
  (``<data-dir>/activation.seq``). The number grows each time a member starts serving without
  an in-sync copy elsewhere (as it activates, and when a serving primary loses its in-sync
  backup), so a member whose copy is behind holds older data and never activates.

:func:`try_activate` is Artemis's ``tryActivate``: take the lock, then compare. Equal: the data
is current. A negative coordinated value is a claim in progress (see below): ``-(n)`` with
``n`` equal to the local value means this member claimed and wrote locally, then stopped
before committing; ``n = local + 1`` means a claim whose local write may not have happened —
both are repaired and committed. Anything else: the lock is released and the reason returned.

:func:`claim_next` is Artemis's ``ensureSequentialAccessToNodeData``, in two steps so a crash in
between is recoverable: compare-and-set ``local → -(local+1)`` (claimed), write ``local+1`` to
the local file (fsync), compare-and-set ``-(local+1) → local+1`` (committed).

**The lease.** ZooKeeper expires a session ``session-ms`` after it last heard from the client,
so a holder that has had no answer from ZooKeeper for a while cannot know whether its lock
still exists. :class:`ZooKeeperManager` confirms the session with a round trip several times
per session (a heartbeat) and counts the lease from when the last confirmed request was *sent*:
the holder must stop acknowledging anything once ``session-ms × (100 − session-percent) / 100``
passed without a confirmation (the holder's heartbeat is a write to its lock's znode, which
only an ensemble with a quorum commits) — ``session-percent`` of the session is the margin left before
ZooKeeper could let another member take the lock. ``fenced()`` is checked where the node
acknowledges sends, so a process resumed after a freeze (SIGSTOP, a long pause) stops before it
acknowledges anything, whatever ran first when it woke.

The kazoo client runs its own threads; every call here is a blocking kazoo call run in a trio
worker thread, and its watch and state callbacks only set flags.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import trio
from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, ConnectionLoss, NodeExistsError, NoNodeError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry

from broker.cluster.settings import ManagerConfig

log = logging.getLogger("lodestone.broker.ha")

__all__ = ["ManagerConfig", "ZooKeeperManager", "read_local_sequence", "write_local_sequence",
           "try_activate", "claim_next", "SequenceError", "CoordinationUnavailable", "Stale"]

#: kazoo's own log: every connection attempt is a line; this module says what matters once
_KAZOO_LOG = logging.getLogger("lodestone.broker.ha.kazoo")
_KAZOO_LOG.setLevel(logging.ERROR)

SEQUENCE_FILE = "activation.seq"
#: what the local file says while a backup's copy is not (yet) in sync: it never activates
NO_SEQUENCE = "none"


class Stale(str):
    """Why a copy may not serve however long it waits (out of date, never in sync, ahead): the
    reason :func:`try_activate` gives, as a ``str`` that says it is final."""


class SequenceError(Exception):
    """The coordinated activation sequence moved under this member (it must not serve)."""


class CoordinationUnavailable(Exception):
    """ZooKeeper did not answer (not connected, session lost, a request timed out)."""


# -- the local copy -----------------------------------------------------------------------------

def read_local_sequence(data_dir: Path) -> int | None:
    """This member's activation sequence (0 if it never had one: a fresh or pre-quorum data
    directory); None while it holds no usable copy (a backup mid-sync)."""
    try:
        text = (Path(data_dir) / SEQUENCE_FILE).read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return 0
    if text == NO_SEQUENCE:
        return None
    try:
        value = int(text)
    except ValueError:
        log.error("ha: %s holds %r, not an activation sequence: treated as out of date",
                  Path(data_dir) / SEQUENCE_FILE, text[:40])
        return None
    return value if value >= 0 else None


def write_local_sequence(data_dir: Path, value: int | None) -> None:
    """Write (fsync, rename, fsync the directory) this member's activation sequence."""
    d = Path(data_dir)
    tmp = d / (SEQUENCE_FILE + ".tmp")
    with tmp.open("w", encoding="ascii") as fh:
        fh.write((NO_SEQUENCE if value is None else str(value)) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, d / SEQUENCE_FILE)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# -- the rules (over any coordinator: ZooKeeperManager, or a fake in the unit tests) ------------------

async def try_activate(coord, local: int | None, write_local: Callable[[int], None],
                       timeout_s: float) -> tuple[bool, str]:
    """Take the lock (waiting up to ``timeout_s``) and check the activation sequence. Returns
    ``(True, how)`` holding the lock, or ``(False, why)`` without it."""
    if local is None:
        return False, Stale("this member's copy was never in sync (no activation sequence)")
    current = await coord.get_sequence()
    if current > local:   # committed past this copy: no need to take the lock to know
        return False, _behind(local, current)
    if not await coord.try_lock(timeout_s):
        holder = await coord.holder()
        return False, f"the lock is held by {holder or 'another member'}"
    try:
        current = await coord.get_sequence()
        if current == local:
            return True, f"activation sequence {local} is current"
        if current < 0:   # a claim that was not committed
            claimed = -current
            if claimed == local or claimed == local + 1:
                if claimed != local:
                    await trio.to_thread.run_sync(write_local, claimed)
                if await coord.cas_sequence(current, claimed):
                    log.warning("ha: repaired an uncommitted claim of activation sequence %d", claimed)
                    return True, f"repaired the uncommitted claim of activation sequence {claimed}"
            why = Stale(f"the coordinated activation sequence is claimed at {claimed} and this copy is at "
                        f"{local}: out of date")
        elif current > local:
            why = _behind(local, current)
        else:
            why = Stale(f"this copy's activation sequence {local} is ahead of the coordinated {current}: "
                        "the coordination service lost its state, or this data directory belongs elsewhere")
    except BaseException:
        await coord.unlock()
        raise
    await coord.unlock()
    return False, why


def _behind(local: int, current: int) -> Stale:
    return Stale(f"this copy is out of date: its activation sequence is {local}, the coordinated one "
            f"{current} (another member served since)")


async def claim_next(coord, local: int, write_local: Callable[[int], None]) -> int:
    """Artemis's two-step increment, holding the lock: ``local → -(local+1)``, the local write,
    ``-(local+1) → local+1``. Raises SequenceError if the coordinated value moved."""
    nxt = local + 1
    if not await coord.cas_sequence(local, -nxt):
        raise SequenceError(f"cannot claim activation sequence {nxt}: the coordinated value is not {local}")
    await trio.to_thread.run_sync(write_local, nxt)
    if not await coord.cas_sequence(-nxt, nxt):
        raise SequenceError(f"cannot commit activation sequence {nxt}: the claim was overwritten")
    return nxt


# -- ZooKeeper ----------------------------------------------------------------------------------------

class ZooKeeperManager:
    """The lock and the activation sequence of one coordination id in ZooKeeper (kazoo), with
    the holder's lease (see the module doc)."""

    def __init__(self, cfg: ManagerConfig, identity: dict) -> None:
        self.cfg = cfg
        self.identity = identity
        self.coordination_id: str | None = None
        self.client = None
        self.state = "not-started"     # not-started | connecting | connected | suspended | lost | stopped
        self.session_id: int | None = None
        self.negotiated_session_ms: int | None = None
        self.holding = False
        self.last_confirmed: float | None = None   # monotonic time a confirmed request was sent
        self.counters = {"lock_acquired": 0, "lock_released": 0, "lock_lost": 0, "session_lost": 0,
                         "sequence_claims": 0, "connect_failures": 0}
        self.on_lost: Callable[[str], None] | None = None   # called in the trio thread
        self._token: trio.lowlevel.TrioToken | None = None
        self._lost_reason: str | None = None
        self._connected = trio.Event()
        self.last_error: str | None = None
        self.coordinated_seq: int | None = None   # as last read or written
        self.holder_seen: str | None = None       # the lock's holder as last read

    # -- paths --------------------------------------------------------------------------------
    def _base(self) -> str:
        ns = (self.cfg.namespace or "").strip("/")
        return ("/" + ns if ns else "") + "/lodestone/" + (self.coordination_id or "unknown")

    @property
    def lock_path(self) -> str:
        return self._base() + "/lock"

    @property
    def sequence_path(self) -> str:
        return self._base() + "/activation-sequence"

    # -- the session --------------------------------------------------------------------------
    @property
    def session_s(self) -> float:
        return (self.negotiated_session_ms or self.cfg.session_ms) / 1000.0

    @property
    def lease_s(self) -> float:
        return self.session_s * (100 - self.cfg.session_percent) / 100.0

    @property
    def heartbeat_s(self) -> float:
        return max(0.05, self.session_s / 6.0)

    async def run(self, stop: trio.Event) -> None:
        """Connect (retrying, one log line per new reason), then confirm the session every
        ``heartbeat_s``, until ``stop``."""

        self._token = trio.lowlevel.current_trio_token()
        cfg = self.cfg
        said = None
        self.state = "connecting"
        try:
            while not stop.is_set():
                client = KazooClient(hosts=cfg.connect_string, timeout=cfg.session_ms / 1000.0,
                                     connection_retry=KazooRetry(max_tries=-1, delay=cfg.retries_ms / 1000.0,
                                                                 backoff=1, max_delay=cfg.retries_ms / 1000.0),
                                     logger=_KAZOO_LOG)
                client.add_listener(self._state_listener)
                self.client = client
                try:
                    await trio.to_thread.run_sync(lambda: client.start(timeout=cfg.connection_ms / 1000.0),
                                                  abandon_on_cancel=True)
                    break
                except Exception as exc:   # kazoo's timeout, a bad connect string
                    self.client = None
                    self.counters["connect_failures"] += 1
                    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                    self.last_error = f"cannot reach ZooKeeper at {cfg.connect_string}: {why}"
                    if why != said:
                        log.error("ha: cannot reach ZooKeeper at %s (%s); retrying every %d ms until it answers",
                                  cfg.connect_string, why, cfg.retries_ms)
                        said = why
                    with trio.move_on_after(cfg.retries_ms / 1000.0):
                        await stop.wait()
            if stop.is_set():
                return
            self._session_started()
            log.warning("ha: connected to ZooKeeper at %s (session %s, %d ms negotiated)", cfg.connect_string,
                        self._session_hex(), self.negotiated_session_ms or cfg.session_ms)
            async with trio.open_nursery() as n:
                n.start_soon(self._watchdog)
                while not stop.is_set():
                    await self._heartbeat()
                    with trio.move_on_after(self.heartbeat_s):
                        await stop.wait()
                n.cancel_scope.cancel()
        finally:
            await self.close()

    async def _watchdog(self) -> None:
        """An idle holder past its lease stops too, not only at its next send."""
        while True:
            if self.holding:
                self.fenced()
            await trio.sleep(min(0.1, self.heartbeat_s / 2))

    def _session_hex(self) -> str:
        return f"0x{self.session_id:x}" if self.session_id else "-"

    def _session_started(self) -> None:
        cid = self.client.client_id
        self.session_id = cid[0] if cid else None
        neg = getattr(self.client, "_session_timeout", None)
        self.negotiated_session_ms = int(neg) if neg else None
        self.state = "connected"
        self._connected.set()

    def _state_listener(self, state) -> None:
        """kazoo's thread: LOST (the session expired), SUSPENDED (the connection dropped),
        CONNECTED (again)."""
        name = str(state).lower()
        if self._token is None:
            return
        try:
            self._token.run_sync_soon(self._state_changed, name)
        except trio.RunFinishedError:
            pass

    def _state_changed(self, name: str) -> None:
        if self.state == "stopped":
            return
        if name == "lost":
            self.state = "lost"
            self.counters["session_lost"] += 1
            self._connected = trio.Event()
            log.error("ha: the ZooKeeper session %s expired", self._session_hex())
            if self.holding:
                self._lose("the ZooKeeper session expired")
        elif name == "suspended":
            self.state = "suspended"
            self._connected = trio.Event()
            log.warning("ha: lost the connection to ZooKeeper (session %s kept until it expires)", self._session_hex())
        elif name == "connected":
            if self.client is None:
                return
            cid = self.client.client_id
            if cid and self.session_id is not None and cid[0] != self.session_id and self.holding:
                self._lose("ZooKeeper gave this member a new session")
            was = self.state
            self._session_started()
            if was in ("suspended", "lost"):
                log.warning("ha: connected to ZooKeeper again (session %s)", self._session_hex())

    def _lose(self, why: str) -> None:
        if not self.holding:
            return
        self.holding = False
        self.counters["lock_lost"] += 1
        self._lost_reason = why
        log.error("ha: lost the lock of %s: %s", self.coordination_id, why)
        if self.on_lost is not None:
            self.on_lost(why)

    async def _call(self, fn, timeout_s: float | None = None) -> Any:
        """A blocking kazoo call in a worker thread; CoordinationUnavailable when ZooKeeper
        does not answer."""

        if self.client is None or self.state not in ("connected",):
            raise CoordinationUnavailable(f"not connected to ZooKeeper ({self.state})")
        timeout_s = timeout_s if timeout_s is not None else self.session_s
        try:
            return await trio.to_thread.run_sync(lambda: fn(self.client, timeout_s), abandon_on_cancel=True)
        except (ConnectionLoss, SessionExpiredError, KazooTimeoutError, TimeoutError) as exc:
            raise CoordinationUnavailable(f"ZooKeeper did not answer: {type(exc).__name__}") from None

    async def _heartbeat(self) -> None:
        if self.state != "connected":
            return
        sent = time.monotonic()
        if self.holding:
            # a write to the lock's own znode: only an ensemble with a quorum commits it (a lone
            # server that lost its peers still answers reads until it notices), and it fails if
            # the znode is gone
            data = json.dumps(self.identity).encode()
            try:
                stat = await self._call(lambda c, t: c.set_async(self.lock_path, data).get(timeout=t), self.lease_s)
            except NoNodeError:
                self._lose("the lock's znode is gone")
                return
            except CoordinationUnavailable:
                return
            if stat.ephemeralOwner != self.session_id:
                self._lose("the lock's znode belongs to another session")
                return
        else:
            try:
                await self._call(lambda c, t: c.exists_async("/").get(timeout=t), self.lease_s)
            except CoordinationUnavailable:
                return
        self.last_confirmed = max(self.last_confirmed or 0.0, sent)
        if self.coordination_id is None:
            return
        try:   # the holder (the write above showed a holder its own) and the sequence, for GET /api/v1/ha
            holder, seq = await self._call(lambda c, t: (None if self.holding else _get_or_none(c, self.lock_path, t)[0],
                                                         _get_or_none(c, self.sequence_path, t)[0]),
                                           self.lease_s)
        except CoordinationUnavailable:
            return
        self.holder_seen = _holder_text(json.dumps(self.identity).encode() if self.holding else holder)
        if seq is not None:
            try:
                self.coordinated_seq = int(seq.decode("ascii"))
            except ValueError:
                pass

    def fenced(self) -> str | None:
        """Why this member must not acknowledge anything now (None: it may). Checked where the
        node answers sends; trips the loss once."""
        if not self.holding:
            return self._lost_reason or "this member does not hold the lock"
        last = self.last_confirmed
        if last is None or time.monotonic() - last > self.lease_s:
            self._lose(f"no answer from ZooKeeper for {self.lease_s:g} s (the lease: session-ms less "
                       f"session-percent)")
            return self._lost_reason
        return None

    async def wait_connected(self, timeout_s: float) -> bool:
        with trio.move_on_after(timeout_s):
            await self._connected.wait()
            return True
        return False

    # -- the coordinator interface (try_activate / claim_next) -------------------------------
    async def try_lock(self, timeout_s: float) -> bool:
        """Create the lock's ephemeral znode, waiting up to ``timeout_s`` for its holder to go."""
        deadline = trio.current_time() + timeout_s
        data = json.dumps(self.identity).encode()
        while True:
            if self.state != "connected" and not await self.wait_connected(max(0.0, deadline - trio.current_time())):
                return False
            gone = threading.Event()

            def attempt(c, t):
                try:
                    c.create(self.lock_path, data, ephemeral=True, makepath=True)
                    return True
                except NodeExistsError:
                    stat = c.exists(self.lock_path, watch=lambda _ev: gone.set())
                    if stat is None:
                        return None          # gone meanwhile: try again
                    return stat.ephemeralOwner == c.client_id[0]   # a retried create of ours
            sent = time.monotonic()
            try:
                got = await self._call(attempt)
            except CoordinationUnavailable:
                got = False
                if trio.current_time() >= deadline:
                    return False
                await trio.sleep(min(0.1, max(0.0, deadline - trio.current_time())))
                continue
            if got:
                self.holding = True
                self._lost_reason = None
                self.last_confirmed = max(self.last_confirmed or 0.0, sent)
                self.counters["lock_acquired"] += 1
                log.info("ha: took the lock of %s (ZooKeeper session %s)", self.coordination_id,
                         self._session_hex())
                return True
            if got is None:
                continue
            left = deadline - trio.current_time()
            if left <= 0:
                return False
            await trio.to_thread.run_sync(lambda: gone.wait(min(left, 0.5)), abandon_on_cancel=True)

    async def unlock(self) -> None:
        """Delete the lock's znode if it is ours."""
        if not self.holding:
            return
        self.holding = False
        self.counters["lock_released"] += 1
        try:
            def release(c, t):
                stat = c.exists(self.lock_path)
                if stat is not None and stat.ephemeralOwner == c.client_id[0]:
                    c.delete(self.lock_path, version=stat.version)
            await self._call(release)
            log.info("ha: released the lock of %s", self.coordination_id)
        except Exception as exc:   # it goes with the session anyway
            log.warning("ha: could not release the lock of %s (%s); it goes when the session ends",
                        self.coordination_id, exc)

    async def holder(self) -> str | None:
        """Who holds the lock (its name and connector), None if nobody does."""
        def read(c, t):
            try:
                data, _stat = c.get(self.lock_path)
            except NoNodeError:
                return None
            return data
        try:
            data = await self._call(read)
        except CoordinationUnavailable:
            return None
        self.holder_seen = _holder_text(data)
        return self.holder_seen

    async def get_sequence(self) -> int:
        def read(c, t):
            try:
                data, _stat = c.get(self.sequence_path)
            except NoNodeError:
                return 0
            return int(data.decode("ascii"))
        self.coordinated_seq = await self._call(read)
        return self.coordinated_seq

    async def cas_sequence(self, expect: int, new: int) -> bool:
        """Compare-and-set the coordinated activation sequence (absent counts as 0)."""
        def cas(c, t):
            try:
                data, stat = c.get(self.sequence_path)
            except NoNodeError:
                if expect != 0:
                    return False
                try:
                    c.create(self.sequence_path, str(new).encode(), makepath=True)
                    return True
                except NodeExistsError:
                    return False
            if int(data.decode("ascii")) != expect:
                return False
            try:
                c.set(self.sequence_path, str(new).encode(), version=stat.version)
                return True
            except (BadVersionError, NoNodeError):
                return False
        ok = await self._call(cas)
        if ok:
            self.counters["sequence_claims"] += 1
            self.coordinated_seq = new
        return ok

    async def close(self) -> None:
        """End the session: a held lock goes at once."""
        client, self.client = self.client, None
        self.state = "stopped"
        self.holding = False
        if client is None:
            return
        def stop():
            try:
                client.stop()
                client.close()
            except Exception:
                pass
        with trio.CancelScope(shield=True):
            with trio.move_on_after(5.0):
                await trio.to_thread.run_sync(stop, abandon_on_cancel=True)

    def describe(self) -> dict:
        last = self.last_confirmed
        return {"type": self.cfg.type, "connect_string": self.cfg.connect_string,
                "namespace": self.cfg.namespace, "coordination_id": self.coordination_id,
                "session": {"state": self.state, "id": self._session_hex() if self.session_id else None,
                            "timeout_ms": self.negotiated_session_ms or self.cfg.session_ms,
                            "lease_ms": round(self.lease_s * 1000),
                            "last_confirmed_ms_ago": None if last is None else round((time.monotonic() - last) * 1000)},
                "holding_lock": self.holding, "lock_holder": self.holder_seen,
                "coordinated_activation_sequence": self.coordinated_seq,
                "last_error": self.last_error, "counters": dict(self.counters)}


def _get_or_none(c, path: str, timeout_s: float):
    """``(data, stat)`` of a znode, ``(None, None)`` if it does not exist (kazoo, blocking)."""
    try:
        return c.get_async(path).get(timeout=timeout_s)
    except NoNodeError:
        return None, None


def _holder_text(data: bytes | None) -> str | None:
    if data is None:
        return None
    try:
        who = json.loads(data)
        return f"{who.get('name')} ({who.get('connector') or 'no connector'})"
    except (ValueError, AttributeError):
        return data[:80].decode("utf-8", "replace")
