"""RouterService: the trio shell around one configured router's pure core.

Theory of operation
-------------------
``RouterService`` owns a ``router.core.decide.Router`` plus everything with I/O or time:

* **Cache tiers.** The core's ``StickyCache`` is the local tier and the only one on a hit.
  ``backend = "embedded"``: changes and access times are drained every ``FLUSH_INTERVAL_S`` and
  appended to the cache file from a worker thread (``cache_embedded``); the file is replayed at
  construction, wall-clock times converted to this process's monotonic clock, so stickiness and
  expiry survive a restart. ``backend = "redis"``: on a local miss (or a stale local entry) the
  service asks Redis once, under ``redis-timeout-ms``, before the policy runs; decisions are
  written behind in pipelined compare-and-set batches; hits in the local tier refresh the Redis
  TTL in the same batches. Any Redis failure sets ``degraded`` and the service keeps deciding
  from its local tier (no read is attempted while degraded; the writer pings once a second and
  flushes what queued up when Redis is back). A Redis outage never fails a connection. A write
  that loses the compare-and-set adopts the other replica's value, unless that names a node not
  ready here (we moved away from it): then ours is written again over it. A local idle expiry
  never deletes the shared entry (Redis keeps the TTL, refreshed by every replica's hits).
* **Shared tier of a multi-worker router** (``shared=`` a control ``Link``, set by
  ``router.server`` in a worker process of ``workers = N``): the ``memory``/``embedded`` cache of
  every worker is backed by the supervisor's cache (the *owner*, a RouterService in the
  supervisor process, the only one that touches the embedded file). It works like the Redis tier
  — local hit never leaves the process; a local miss asks the owner once (``cache_get``); access
  times are written behind — with one difference: a *new* decision is claimed at the owner before
  the connection gets it (one compare-and-set round trip, ``cache_write``), and a worker that
  loses the claim adopts the owner's value. So a client reconnecting lands on the same target
  whichever worker accepts it. The owner side is ``shared_get`` / ``shared_write``. Such a worker
  runs no health probes: the supervisor's single prober pushes each round
  (``apply_pool_states``; the owner's ``round_listeners`` fire after every probe result).
* **Quorum waits.** A REFUSED_UNAVAILABLE below quorum with ``quorum-timeout > 0`` parks only
  that connection on a ``trio.Event`` that the pool's change listener sets; it re-decides on
  every pool change until the deadline (Artemis blocks a thread and polls; we do neither).
* **Failover waits.** A cached key whose HA pair has no member ready (``explanation.failover``)
  waits the same way, up to ``quorum-timeout``, for a member to become active; when the wait
  expires it is decided once more with ``hold=False`` (the policy re-places it, as for any cached
  node that is not ready). Pair state changes (failing over, served again, split brain) are
  logged by the process that probes.
* **Upstream failures** (``upstream_failed``): the proxy could not connect to a target — it is
  marked not ready at once and its probe task is kicked (``router.health.ProbeKicks``). A worker
  of a multi-worker router marks it locally and tells its supervisor (at most once per target
  per 100 ms), whose prober probes.
* **Background tasks** (``run``): health probes (``router.health``), cache persistence or Redis
  sync, expiry sweep, pins-file reload.

Time: the core gets ``clock()`` (``time.monotonic`` by default); quorum deadlines use trio's clock.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from broker.wire.io.tomlconfig import ConfigError
from router.cache_embedded import EmbeddedCacheStore
from router.cache_tiers import RedisTier, RemoteTier, SharedTier
from router.config import RouterConfig, RouterProcessConfig
from router.core.cache import StickyCache
from router.core.cache import page as cache_page
from router.core.decide import Decision, Outcome, ResolvedKey, Router
from router.core.filters import compile_key_filter, compile_local_filter
from router.core.keys import ConnectionInfo, KeyResolver
from router.core.pins import PinTable, parse_pins
from router.core.policies import create_policy
from router.core.policies.base import Target
from router.core.pool import FollowContext, Pool, create_membership_source
from router.drain import Drain, run_on_broker, run_proxied
from router.errors import CacheBackendError, CacheBackendTimeout, PinFileError
from router.health import REPROBE_MIN_INTERVAL_S, ProbeKicks, run_health_checks
from router.cache_redis import RedisCache

log = logging.getLogger("lodestone.router.service")

FLUSH_INTERVAL_S = 0.2
REDIS_SYNC_INTERVAL_S = 0.05
REDIS_RETRY_S = 1.0
REDIS_MAX_PENDING = 100_000
PERSIST_RETRY_MAX_S = 5.0
SHARED_TIMEOUT_S = 1.0  # a worker's request to the supervisor's cache (same machine)

COUNTERS = ("route_ok", "route_refused_unavailable", "route_refused_use_another", "cache_hit",
            "cache_miss", "cache_stale", "local_match", "pin_hit", "quorum_waits",
            "quorum_wait_timeouts", "redis_hits", "redis_misses", "redis_errors", "redis_writes",
            "redis_conflicts", "redis_writes_dropped", "shared_hits", "shared_misses",
            "shared_errors", "shared_writes", "shared_conflicts", "shared_writes_dropped",
            "persist_writes", "persist_errors", "persist_compactions", "cache_evictions",
            "key_too_long", "redis_reads", "redis_reads_skipped", "redis_read_timeouts",
            "pins_reloads", "pins_errors", "pins_bad_lines", "probe_rounds",
            "management_lookups", "failover_waits", "failover_wait_timeouts",
            "upstream_marked_down", "upstream_reprobes", "pool_holds", "drain_proxied_ended",
            "drain_broker_closed", "drain_errors")

_OUTCOME_COUNTER = {Outcome.OK: "route_ok",
                    Outcome.REFUSED_UNAVAILABLE: "route_refused_unavailable",
                    Outcome.REFUSED_USE_ANOTHER: "route_refused_use_another"}


class RouterService:
    """One configured router: ``await route(conn)``, ``route_for_key(key)``, ``await run()``."""

    def __init__(self, config: RouterConfig, *, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, redis_cache: Any = None,
                 shared: Any = None, source: Any = None, local_managed: bool = False) -> None:
        self.config = config
        self.name = config.name
        self.clock = clock
        self._wall_offset = wall() - clock()
        self.rng = rng if rng is not None else random.Random()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.degraded = False
        self.degraded_reason: str | None = None
        #: I/O components failing right now (``"cache_file"``) → the error; they are retried
        self.io_errors: dict[str, str] = {}
        self.pins_error: str | None = None
        self._pool_changed = trio.Event()
        #: called after every health-probe round (the supervisor pushes the pool to its workers)
        self.round_listeners: list[Callable[[], None]] = []
        #: a worker of a multi-worker router: pool fed by the supervisor, cache shared through it
        self.follower = shared is not None
        self._link = shared
        #: re-probe requests for the health checker (upstream failures)
        self._kicks = ProbeKicks()
        #: a worker: when it last told the supervisor about each target's upstream failure
        self._reported_down: dict[str, float] = {}
        #: what was last logged about each pair: "failing_over" / "serving" / "split_brain"
        self._pair_states: dict[str, tuple] = {}
        #: the embedder sets the local target's readiness (a router inside a broker: the broker
        #: is the local target, ready while it is active); it is never probed
        self.local_managed = local_managed
        self._closed = False
        self._nursery: trio.Nursery | None = None        # run()'s, while it runs
        self._health_scope: trio.CancelScope | None = None
        #: this process's proxied connections by target group: connection id -> how to end it
        self.proxied: dict[str, dict[str, Callable[[], None]]] = {}
        #: drained groups (``router.drain``): their state, and the tasks that move their clients
        self.drains: dict[str, Drain] = {}
        self._drain_scopes: dict[str, trio.CancelScope] = {}
        #: how many processes share the proxied connections (the supervisor sets its workers')
        self.processes = 1
        #: the owner: a group's proxied connections left and ended by its drain, in every process
        self.count_proxied: Callable[[str], Awaitable[tuple[int, int]]] = self._count_own_proxied

        pc = config.pool
        local_t = config.local_target.to_target() if config.local_target else None
        self._holder = Pool(quorum_size=pc.quorum_size if pc else 1, local_target=local_t,
                            local_target_enabled=bool(pc and pc.local_target_enabled),
                            allow_failback=pc.allow_failback if pc else True)
        self._holder.follow_holds = self.follower
        if self.follower:
            self._holder.on_diverted = self._report_diverted
        #: target slot → ready, as last logged (``_log_readiness``)
        self._ready_seen: dict[str, bool] = {}
        #: no automatic failback: the holds last logged and written (``_on_pool_change``)
        self._held_seen: dict[str, str] = {}
        self._readmitting: set[str] = set()
        if pc is not None and not pc.allow_failback and not self.follower:
            self._held_seen = self._load_holds(pc.state_path)
            self._holder.held = dict(self._held_seen)
        self._source = None
        if pc is not None:
            # ``source``: a membership source the embedder built (a broker's own cluster)
            self._source = source if source is not None else create_membership_source(
                pc.source, [t.to_target() for t in pc.targets], pc.source_options)
            self._source.start(self._holder)
        #: a dynamic membership source (cluster): followed by the prober (``run``), pushed by
        #: the supervisor to its workers with the probe results (``pool_states``)
        self.dynamic_membership = bool(getattr(self._source, "dynamic", False))
        self._holder.listeners.append(self._on_pool_change)
        policy = (create_policy(config.policy.name, config.policy.properties, self.rng)
                  if config.policy else None)
        cc = config.cache
        self._store: EmbeddedCacheStore | None = None
        #: the remote tier (``router.cache_tiers``): Redis, or the supervisor's (shared) cache
        self._remote: RemoteTier | None = None
        cache = None
        if cc is not None:
            to_owner = shared is not None and cc.backend != "redis"
            cache = StickyCache(cc.timeout_ms,
                                track_changes=cc.backend in ("embedded", "redis") or to_owner,
                                log_expiry=cc.backend != "redis" and not to_owner,
                                max_entries=cc.max_entries)
            if to_owner:
                self._remote = SharedTier(shared, self.name)
            elif cc.backend == "embedded":
                self._store = EmbeddedCacheStore(cc.path)
                self._load_embedded(cache)
            elif cc.backend == "redis":
                if redis_cache is None:
                    redis_cache = RedisCache(cc.redis_url, router=self.name,
                                             prefix=cc.redis_key_prefix, timeout_ms=cc.timeout_ms,
                                             socket_timeout_s=max(0.25, cc.redis_timeout_ms / 1e3),
                                             connect_timeout_s=cc.redis_connect_timeout_ms / 1e3)
                self._remote = RedisTier(redis_cache, self.name)
        self._redis_seen: dict[str, str] = {}
        self._claiming: dict[str, trio.Event] = {}  # shared tier: keys whose new decision is in flight
        self._pending_puts: dict[str, tuple[str, str]] = {}
        self._pending_touch: set[str] = set()
        self._pending_del: set[str] = set()
        self._last_redis_try = -1e9
        pins = None
        self._pins_mtime: float | None = None
        if config.pins is not None:
            pins = self._read_pins(initial=True)
        resolver = KeyResolver(config.key_type, compile_key_filter(config.key_filter),
                               artemis_keys=config.artemis_keys)
        self.core = Router(self.name, resolver, policy=policy,
                           pool=self._holder if pc is not None else None, cache=cache,
                           local_filter=compile_local_filter(config.local_target_filter,
                                                             from_config=True),
                           local=self._holder.local, pins=pins,
                           root_filter=compile_local_filter(config.root_target_filter, from_config=True),
                           max_key_length=config.max_key_length,
                           fail_back=cc.fail_back if cc is not None else "stay")
        self.core.failover_wait = bool(pc is not None and pc.quorum_timeout_ms)
        self.core.failover_wait_s = pc.quorum_timeout_ms / 1000.0 if pc is not None else 0.0

    # -- public surface -------------------------------------------------------------------------
    @property
    def pool(self) -> Pool:
        """Targets with readiness, node id, connection count, last probe error; quorum state."""
        return self._holder

    @property
    def policy(self):
        return self.core.policy

    @property
    def remote_tier(self) -> str | None:
        """The remote cache tier in use: ``"redis"``, ``"shared"`` (a worker of a multi-worker
        router), or None (local tier only)."""
        return self._remote.name if self._remote is not None else None

    async def route(self, conn: ConnectionInfo) -> Decision:
        """Route one client connection (waits for quorum up to quorum-timeout, alone). The key
        is resolved once: the remote-tier read, the claim and every re-decision of a quorum
        wait use the same key, even if the key filter is replaced meanwhile."""
        rk = self.core.resolve(conn)
        d = await self._decide(rk)
        pc = self.config.pool
        if (pc is not None and pc.quorum_timeout_ms and self._must_wait(d)
                and d.explanation.cache != "skipped"):
            d = await self._wait(rk, d, pc.quorum_timeout_ms / 1000.0)
        self._count(d)
        if d.target is not None and d.outcome is Outcome.OK:
            self._holder.note_routed(d.target)  # a diversion while another group is down
        return d

    async def _decide(self, rk: ResolvedKey, hold: bool = True) -> Decision:
        if self._remote is None:
            return self.core.decide_resolved(rk, self.clock(), hold=hold)
        return await self._decide_with_remote(rk, hold)

    def _must_wait(self, d: Decision) -> bool:
        """A refusal that a pool change may lift: below quorum, or a key whose pair fails over."""
        return d.outcome is Outcome.REFUSED_UNAVAILABLE and (
            d.explanation.failover is not None or not self._holder.quorum_met)

    def upstream_failed(self, slot: str, error: str) -> None:
        """The proxy could not connect to the target in ``slot`` (refused, unreachable, timed
        out, broke the handshake): mark it not ready at once and have it probed again now
        (rate-limited: ``router.health.ProbeKicks``) instead of at its next check-period. A
        worker does the first here and asks its supervisor, whose prober does the rest."""
        pool = self._holder
        if self.local_managed and pool.local is not None and pool.local.target.slot == slot:
            return  # the embedder owns the local target's readiness
        if pool.mark_not_ready(slot, f"upstream connect failed: {error}"):
            self.counters["upstream_marked_down"] += 1
        if self.follower:
            now = self.clock()
            if now - self._reported_down.get(slot, -1e9) < REPROBE_MIN_INTERVAL_S:
                return
            self._reported_down[slot] = now
            try:
                self._link.send({"op": "upstream_failed", "router": self.name, "slot": slot,
                                 "error": error})
            except Exception as exc:  # noqa: BLE001 - ChannelClosed: the supervisor is gone
                log.debug("router %s: cannot report upstream failure of %s: %s", self.name,
                          slot, exc)
            return
        self.counters["upstream_reprobes"] += 1
        self._kicks.kick(slot)
        for cb in list(self.round_listeners):  # the supervisor pushes the mark to its workers
            cb()

    @property
    def live_assignments(self) -> dict[str, int] | None:
        """Bounded load: live assignments per target slot (None for other policies)."""
        p = self.core.policy
        if p is None or not p.tracks_assignments:
            return None
        return dict(sorted(p.loads.items()))

    def connection_closed(self, decision: Decision) -> None:
        """The connection routed by ``decision`` closed (bounded load: its live assignment ends
        when there is no cache to hold it)."""
        self.core.release(decision)

    def route_for_key(self, key: str) -> Decision:
        """Management lookup: skip the key filter, populate the cache (no quorum wait).
        A key over ``max-key-length`` is refused (the management API checks
        :meth:`key_too_long` first and answers 400)."""
        d = self.core.decide_for_key(key, self.clock())
        self.counters["management_lookups"] += 1
        return d

    def key_too_long(self, key: str) -> str | None:
        """Why ``key`` is refused by ``max-key-length``, or None."""
        return self.core.key_too_long(key)

    def set_key_filter(self, pattern: str | None) -> None:
        """Replace the key filter (None/blank clears). Raises FilterError."""
        self.core.set_key_filter(pattern)

    def get_key_filter(self) -> str | None:
        return self.core.get_key_filter()

    def set_local_target_filter(self, pattern: str | None) -> None:
        """Replace the local-target filter (None/blank clears). Raises FilterError; refuses to set
        one when no local target is configured (ValueError)."""
        if pattern is not None and pattern.strip() and self._holder.local is None:
            raise ValueError(f"router {self.name!r} has no local target")
        self.core.set_local_target_filter(pattern)

    def get_local_target_filter(self) -> str | None:
        return self.core.get_local_target_filter()

    def cache_entries(self) -> list[dict[str, Any]]:
        """Live local-tier entries: key, node_id, idle_s, age_s (all of them: tests, embedders;
        the management API pages with :meth:`cache_page`)."""
        cache = self.core.cache
        if cache is None:
            return []
        return [{"key": k, "node_id": ident, "idle_s": idle, "age_s": age}
                for k, ident, idle, age in cache.items(self.clock())]

    def cache_page(self, *, after: str | None, limit: int) -> dict[str, Any]:
        """One page of live local-tier entries in key order: ``{total, entries, next}``."""
        cache = self.core.cache
        if cache is None:
            return {"total": 0, "entries": [], "next": None}
        rows, nxt = cache_page(cache.items(self.clock()), after=after, limit=limit)
        return {"total": len(cache), "max_entries": cache.max_entries,
                "entries": [{"key": k, "node_id": ident, "idle_s": idle, "age_s": age}
                            for k, ident, idle, age in rows], "next": nxt}

    # -- multi-worker: owner side (supervisor) and follower side (worker) ----------------------
    def shared_get(self, key: str) -> str | None:
        """Owner: the identity cached for ``key`` (its access time refreshed), or None."""
        cache = self.core.cache
        if cache is None:
            return None
        e = cache.get(key, self.clock())
        return e[0] if e is not None else None

    def shared_write(self, puts, touches, deletes) -> dict[str, str]:
        """Owner: apply a worker's batch. ``puts`` = (key, identity, replaced identity or "");
        a put wins only if the key is absent, holds the same identity or the one it replaced
        (compare-and-set, as the Redis tier's script). Returns ``{key: identity}`` for lost puts."""
        cache = self.core.cache
        if cache is None:
            return {}
        now = self.clock()
        conflicts: dict[str, str] = {}
        for key, ident, old in puts:
            e = cache.peek(key, now)
            if e is None or e[0] == ident or (old and e[0] == old):
                cache.put(key, ident, now)
            else:
                cache.get(key, now)
                conflicts[key] = e[0]
        for key in touches:
            cache.get(key, now)
        for key in deletes:
            cache.remove(key)
        self.counters["cache_evictions"] = cache.evictions
        return conflicts

    def pool_states(self) -> dict[str, Any]:
        """Owner: the probed targets' results, for ``apply_pool_states`` in the workers; with a
        dynamic membership source also the members (``[name, host, port, tls, management_url,
        node_id, pair, backup]`` in pool order), which the workers adopt first."""
        members = None
        if self.dynamic_membership:
            members = [[t.name, t.host, t.port, t.tls, t.management_url, t.node_id, t.pair,
                        t.backup]
                       for t in (st.target for st in self._holder.members if not st.local)]
        return {"members": members, "root": self._holder.root,
                "states": [[st.target.slot, st.ready, st.target.node_id, st.connection_count,
                            st.last_error] for st in self._holder.all_states() if st.probes],
                "held": dict(self._holder.held),
                "draining": {g: {"rate_per_s": d.rate_per_s, "grace_s": d.grace_s, "started_at": d.started_at,
                                 "processes": self.processes} for g, d in self.drains.items()}}

    def apply_pool_states(self, pushed: dict[str, Any]) -> None:
        """Follower: take the supervisor's membership (dynamic sources) and probe results
        (unknown targets are ignored)."""
        if "root" in pushed:
            self._holder.root = pushed["root"]
        if pushed.get("members") is not None:
            self._holder.sync_members(
                Target(node_id, host, int(port), bool(tls), mgmt, name, pair, bool(backup))
                for name, host, port, tls, mgmt, node_id, pair, backup in pushed["members"])
        if "held" in pushed:  # first: a group that comes back and is held is never offered
            self._holder.set_holds(pushed["held"])
        if "draining" in pushed:
            self._follow_drains(pushed["draining"])
        now = self.clock()
        for slot, ready, node_id, count, error in pushed["states"]:
            self._holder.report_probe(slot, bool(ready), node_id, count, now, error=error)

    def membership_status(self) -> dict[str, Any] | None:
        """A dynamic membership source's state (seeds, members, last read, last error), or None
        (static pool; a worker, which follows its supervisor)."""
        if self._source is None or self.follower or not hasattr(self._source, "status"):
            return None
        return self._source.status()

    def status(self) -> dict[str, Any]:
        """Management summary: pool, counters, degraded state, filters, policy."""
        pool = self._holder.snapshot()
        if self.membership_status() is not None:
            pool["membership"] = self.membership_status()
        return {"name": self.name, "degraded": self.degraded,
                "degraded_reason": self.degraded_reason, "pool": pool,
                "policy": self.core.policy.describe() if self.core.policy else None,
                "key_filter": self.get_key_filter(),
                "local_target_filter": self.get_local_target_filter(),
                "cache_size": len(self.core.cache) if self.core.cache is not None else None,
                "pins": len(self.core.pins) if self.core.pins is not None else None,
                "pins_error": self.pins_error, "io_errors": dict(self.io_errors),
                "counters": dict(self.counters)}

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run probes, persistence / Redis sync, expiry and pin reloads until cancelled.

        ``started()`` is reported after the first probe round, so a freshly started router
        already knows which targets are ready.
        """
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if self.dynamic_membership and not self.follower:
                    await nursery.start(self._follow_membership)
                if self._probes_wanted():
                    await nursery.start(self._health_task)
                if self._store is not None:
                    nursery.start_soon(self._persist_loop)
                if self._remote is not None:
                    nursery.start_soon(self._redis_loop)
                    nursery.start_soon(self._remote.run)
                if self.core.cache is not None:
                    nursery.start_soon(self._expiry_loop)
                nursery.start_soon(self._pins_loop)
                for drain in list(self.drains.values()):   # asked for before the router ran
                    self._start_drain(drain)
                task_status.started()
        finally:
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self.aclose()

    def _probes_wanted(self) -> bool:
        return bool(self._holder.all_states() or self.dynamic_membership) and not self.follower

    # -- reload (router.reload) ----------------------------------------------------------------
    def reconfigure(self, rc: RouterConfig, *, pins: "PinTable | None | object" = None) -> None:
        """Apply a reloaded ``[routers.<name>]`` whose changes ``router.core.reload.plan_reload``
        found live: filters, key length, policy, pins, cache timing and size, the pool's targets
        and settings. Established connections and cached keys keep their targets (a key whose
        target left the pool is re-placed at its next connection). ``pins``: the new pin table
        (read and checked by the caller) when the pins file or its content changed. Raises
        FilterError/PolicyError before changing anything when the new values do not compile."""
        old = self.config
        key_filter = compile_key_filter(rc.key_filter)
        local_filter = compile_local_filter(rc.local_target_filter, from_config=True)
        root_filter = compile_local_filter(rc.root_target_filter, from_config=True)
        policy = (create_policy(rc.policy.name, rc.policy.properties, random.Random(self.rng.getrandbits(64)))
                  if rc.policy else None)
        rc = dataclasses.replace(rc, local_target=old.local_target)   # the embedder's, never the file's
        pc = rc.pool
        if pc is not None and old.pool is not None:   # a pool's source and state file never change live
            pc = dataclasses.replace(pc, source_options=old.pool.source_options, state_path=old.pool.state_path)
            rc = dataclasses.replace(rc, pool=pc)
        self.config = rc
        core = self.core
        core.root_filter = root_filter
        core.resolver.key_filter = key_filter
        core.local_filter = local_filter
        core.max_key_length = rc.max_key_length
        if rc.policy != old.policy:
            core.replace_policy(policy)
        cc = rc.cache
        if core.cache is not None and cc is not None:
            core.cache.timeout_s = cc.timeout_ms / 1000.0
            core.cache.max_entries = cc.max_entries
            core.fail_back = cc.fail_back
            redis = getattr(self._remote, "client", None)
            if isinstance(redis, RedisCache):     # the entries' time to live in Redis
                redis.timeout_ms = cc.timeout_ms
                if redis.reader is not None:
                    redis.reader.timeout_ms = cc.timeout_ms
        if pins is not None or rc.pins != old.pins:
            core.pins = pins if rc.pins is not None else None
            self.pins_error = None
            try:
                self._pins_mtime = os.stat(rc.pins.file).st_mtime_ns if rc.pins is not None else None
            except OSError:
                self._pins_mtime = None
        if pc is not None:
            self._holder.configure(quorum_size=pc.quorum_size, local_target_enabled=pc.local_target_enabled,
                                   allow_failback=pc.allow_failback)
            core.failover_wait = bool(pc.quorum_timeout_ms)
            core.failover_wait_s = pc.quorum_timeout_ms / 1000.0
            if pc.source == "static":     # a worker too: the supervisor pushes probe results only
                before = {t.name: t for t in (old.pool.targets if old.pool is not None else ())}
                for t in pc.targets:      # a target whose configuration changed starts afresh
                    if t.name in before and before[t.name] != t:
                        self._holder.remove_target(t.name)
                self._holder.sync_members([t.to_target() for t in pc.targets])
                for group in self._holder.forget_drains():   # a drained target the file removed
                    self._stop_drain(group)
                    log.warning("router %s: %s left the pool: its drain ends", self.name, group)
            if (old.pool is None or (old.pool.check_period_ms, old.pool.username, old.pool.password,
                                     old.pool.targets) != (pc.check_period_ms, pc.username, pc.password, pc.targets)):
                self._restart_probes()

    def _restart_probes(self) -> None:
        """New probe settings (period, credentials): the health task starts again with them."""
        if self._health_scope is not None:
            self._health_scope.cancel()
        self._health_scope = None
        if self._nursery is not None and self._probes_wanted():
            scope = self._health_scope = trio.CancelScope()    # set now: a second reload cancels it
            self._nursery.start_soon(self._health_task, scope)

    def flush(self) -> None:
        """Write pending cache changes to the embedded file now (sync; used at shutdown)."""
        if self._store is not None and self.core.cache is not None:
            try:
                self._store.write(*self._persist_batch())
            except OSError as exc:
                self.counters["persist_errors"] += 1
                log.error("router %s: cannot write cache file %s at exit: %s", self.name,
                          self._store.path, exc)

    async def aclose(self) -> None:
        """Flush the cache file and release it and the remote tier's client. Idempotent: ``run``
        calls it when it ends, ``router.server`` (every process, supervisor included) at
        shutdown."""
        if self._closed:
            return
        self._closed = True
        if self._source is not None and hasattr(self._source, "close"):
            self._source.close()
        self.flush()
        if self._store is not None:
            self._store.close()
        if self._remote is not None:
            await self._remote.aclose()

    # -- internals: counting, pool changes, quorum -----------------------------------------------
    def _count(self, d: Decision) -> None:
        c = self.counters
        c[_OUTCOME_COUNTER[d.outcome]] += 1
        ex = d.explanation
        cs = ex.cache
        if cs == "hit":
            c["cache_hit"] += 1
        elif cs == "miss":
            c["cache_miss"] += 1
        elif cs == "stale":
            c["cache_miss"] += 1
            c["cache_stale"] += 1
        if ex.local_match:
            c["local_match"] += 1
        if ex.pin is not None and ex.reason.startswith("pinned"):
            c["pin_hit"] += 1
        elif cs == "skipped" and ex.reason.startswith("key too long"):
            c["key_too_long"] += 1
        cache = self.core.cache
        if cache is not None:
            c["cache_evictions"] = cache.evictions

    def _on_pool_change(self, pool: Pool) -> None:
        ev, self._pool_changed = self._pool_changed, trio.Event()
        ev.set()
        if not self.follower:
            self._log_readiness(pool)
        if pool.pair_count and not self.follower:
            self._log_pairs(pool)
        if pool.held != self._held_seen and not self.follower:
            self._holds_changed(pool)

    # -- no automatic failback: holds logged, kept across restarts, changed by the operator -----
    def _holds_changed(self, pool: Pool) -> None:
        before, now = self._held_seen, dict(pool.held)
        for g, why in now.items():
            if g not in before:
                log.warning("router %s: target %s is held out of routing: %s", self.name, g, why)
        for g in before:
            if g not in now:
                ready = any(t.group == g for t in pool.ready_targets())
                log.warning("router %s: target %s takes connections again (%s)", self.name, g,
                            "readmitted" if g in self._readmitting else
                            "released: no other target of the pool is ready" if ready else
                            "no longer held")
        self._readmitting.clear()
        self._held_seen = now
        self.counters["pool_holds"] += sum(1 for g in now if g not in before)
        if self.config.pool is not None and self.config.pool.state_path is not None:
            self._save_holds(self.config.pool.state_path, now)
        for cb in list(self.round_listeners):  # the supervisor pushes the holds to its workers
            cb()

    def _load_holds(self, path: Path | None) -> dict[str, str]:
        """The held targets written before a restart (none if the file does not exist). A file
        that cannot be read is a start error naming it: starting without it could send new
        clients to a site that is held for a reason."""
        if path is None:
            return {}
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
            held = doc["held"]
            if not isinstance(held, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in held.items()):
                raise ValueError("'held' is not an object of strings")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(path, "", f"cannot read the held targets ({exc}); fix or delete "
                                        "the file (deleting it admits every target)") from None
        if held:
            log.warning("router %s: holding %s out of routing as before the restart (%s)",
                        self.name, ", ".join(sorted(held)), path)
        return held

    def _save_holds(self, path: Path, held: dict[str, str]) -> None:
        tmp = Path(f"{path}.tmp")
        try:
            tmp.write_text(json.dumps({"router": self.name, "held": held}, indent=1) + "\n",
                           encoding="utf-8")
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            self.io_errors.pop("pool_state_file", None)
        except OSError as exc:
            self.io_errors["pool_state_file"] = f"{path}: {exc}"
            log.error("router %s: cannot write the held targets to %s: %s", self.name, path, exc)

    def _report_diverted(self, group: str) -> None:
        """A worker routed a connection elsewhere while ``group`` was down: its supervisor's
        pool decides the hold (``Pool.note_diverted``)."""
        try:
            self._link.send({"op": "diverted", "router": self.name, "group": group})
        except Exception as exc:  # noqa: BLE001 - ChannelClosed: the supervisor is gone
            log.debug("router %s: cannot report a diversion from %s: %s", self.name, group, exc)

    def hold_target(self, name: str) -> dict[str, Any]:
        """``POST .../targets/<name>/hold``: a planned switchover (ValueError if refused)."""
        group = self._holder.hold(name, "held by an operator (POST .../hold)")
        return {"target": group, "held": True, "pool": self._holder.snapshot()}

    def readmit_target(self, name: str) -> dict[str, Any]:
        """``POST .../targets/<name>/readmit``: the operator's failback (ValueError if no
        such target)."""
        group = self._holder.group_of(name)
        if group is None:
            raise ValueError(f"no target named {name!r} in the pool")
        self._readmitting.add(group)  # for the log line of ``_holds_changed``
        group, was = self._holder.readmit(name)
        self._readmitting.discard(group)
        return {"target": group, "was_held": was, "pool": self._holder.snapshot()}

    # -- drain (router.drain) ---------------------------------------------------------------------
    def proxy_started(self, group: str, conn_id: str, end: Callable[[], None]) -> None:
        """A proxied connection to ``group`` is established (``end`` ends it, for a drain)."""
        self.proxied.setdefault(group, {})[conn_id] = end

    def proxy_ended(self, group: str, conn_id: str) -> None:
        conns = self.proxied.get(group)
        if conns is not None:
            conns.pop(conn_id, None)
            if not conns:
                del self.proxied[group]

    async def _count_own_proxied(self, group: str) -> tuple[int, int]:
        d = self.drains.get(group)
        return len(self.proxied.get(group, ())), d.proxied_ended if d is not None else 0

    def drain_target(self, name: str, *, rate_per_s: float | None = None,
                     grace_ms: int | None = None) -> dict[str, Any]:
        """``POST .../targets/<name>/drain``: no new connection goes to the target's group, and
        its clients leave at the rate (ValueError if refused: no such target, nothing else
        ready). Draining a drained group again changes nothing."""
        group = self._holder.drain(name)
        pc = self.config.pool
        if group not in self.drains:
            drain = Drain(group, rate_per_s or (pc.drain_rate_per_s if pc else 10.0),
                          (grace_ms if grace_ms is not None else (pc.drain_grace_ms if pc else 0)) / 1000.0)
            self._start_drain(drain)
            log.warning("router %s: draining %s: no new connections; its clients leave at %g/s after %gs",
                        self.name, group, drain.rate_per_s, drain.grace_s)
        return {"target": group, "draining": True, "drain": self.drains[group].view(),
                "pool": self._holder.snapshot()}

    def undrain_target(self, name: str) -> dict[str, Any]:
        """``POST .../targets/<name>/undrain``: the group takes new connections again."""
        group, was = self._holder.undrain(name)
        drain = self._stop_drain(group)
        if was:
            log.warning("router %s: %s undrained: it takes new connections again", self.name, group)
        return {"target": group, "was_draining": was, "drain": drain.view() if drain else None,
                "pool": self._holder.snapshot()}

    def drain_views(self) -> list[dict[str, Any]]:
        return [d.view() for d in self.drains.values()]

    def pool_member(self, group: str) -> Target | None:
        """The member of ``group`` to ask about its clients: a ready one, else the first."""
        members = [st for st in self._holder.members if st.target.group == group and not st.local]
        for st in members:
            if st.ready:
                return st.target
        return members[0].target if members else None

    def _start_drain(self, drain: Drain) -> None:
        self.drains[drain.group] = drain
        if self._nursery is None:
            return                                   # not running: nothing to move
        scope = self._drain_scopes[drain.group] = trio.CancelScope()

        async def run() -> None:
            with scope:
                async with trio.open_nursery() as nursery:
                    if self.follower or self.processes == 1:   # a supervisor proxies nothing
                        nursery.start_soon(run_proxied, self, drain, 1.0 / max(1, self.processes))
                    if not self.follower:
                        nursery.start_soon(run_on_broker, self, drain, self.count_proxied)

        self._nursery.start_soon(run)

    def _stop_drain(self, group: str) -> Drain | None:
        scope = self._drain_scopes.pop(group, None)
        if scope is not None:
            scope.cancel()
        return self.drains.pop(group, None)

    def _follow_drains(self, pushed: dict[str, Any]) -> None:
        """A follower: the drains its prober runs (``pool_states``), with this process's share."""
        self._holder.set_draining(pushed)
        for group in [g for g in self.drains if g not in pushed]:
            self._stop_drain(group)
        for group, d in pushed.items():
            if group not in self.drains:
                self.processes = max(1, int(d.get("processes", 1)))
                self._start_drain(Drain(group, float(d["rate_per_s"]), float(d["grace_s"]),
                                        started_at=float(d.get("started_at", 0.0))))

    def _log_readiness(self, pool: Pool) -> None:
        """Log each target that goes down (with why) or comes back, once per change; a target
        that has never been ready is not "down" (it is starting), and pair members are logged
        per pair (``_log_pairs``: a passive backup is not ready by design)."""
        for st in pool.all_states():
            t = st.target
            if t.pair is not None or st.local:
                continue
            before = self._ready_seen.get(t.slot)
            self._ready_seen[t.slot] = st.ready
            if before is None or before == st.ready:
                if before is None and st.ready:
                    log.info("router %s: target %s is ready (node id %s)", self.name, t.slot, t.node_id)
                continue
            if st.ready:
                log.warning("router %s: target %s is ready again (node id %s)", self.name, t.slot, t.node_id)
            else:
                log.warning("router %s: target %s is not ready: %s; new connections go to the others",
                            self.name, t.slot, st.last_error)

    def _log_pairs(self, pool: Pool) -> None:
        """Log each pair's changes once: failing over (after it was served), served again,
        split brain (ERROR). A pair not served yet since the start is not "failing over"."""
        states: dict[str, tuple] = {}
        for p in pool.pairs():
            name, state, serving = p["name"], p["state"], p["serving"]
            before = self._pair_states.get(name)
            if before is None and state == "failing_over":
                continue  # starting: its members have not answered yet
            cur = states[name] = (state, serving)
            if before == cur:
                continue
            if state == "split_brain":
                log.error("router %s: pair %s (node id %s): %s are active at once (split "
                          "brain); connections go to %s only", self.name, name, p["node_id"],
                          ", ".join(p["active"]), serving)
            elif state == "failing_over":
                log.warning("router %s: pair %s (node id %s) is failing over: no member is "
                            "active; its cached keys wait up to quorum-timeout", self.name, name,
                            p["node_id"])
            elif before is not None:
                log.warning("router %s: pair %s (node id %s) is served by %s", self.name, name,
                            p["node_id"], serving)
        self._pair_states = states

    async def _wait(self, rk: ResolvedKey, d: Decision, timeout_s: float):
        """Park this connection until a pool change lifts its refusal (``_must_wait``) or
        ``timeout_s`` passes; a failover wait that expires is decided once more with
        ``hold=False`` (the key is re-placed)."""
        failover = d.explanation.failover is not None
        self.counters["failover_waits" if failover else "quorum_waits"] += 1
        start = trio.current_time()
        deadline = start + timeout_s
        while True:
            ev = self._pool_changed
            with trio.move_on_at(deadline):
                await ev.wait()
            expired = trio.current_time() >= deadline
            d = await self._decide(rk, hold=not expired)
            if expired:
                if failover:
                    self.counters["failover_wait_timeouts"] += 1
                elif self._must_wait(d):
                    self.counters["quorum_wait_timeouts"] += 1
                break
            if not self._must_wait(d):
                break
            failover = failover or d.explanation.failover is not None
        waited = trio.current_time() - start
        return dataclasses.replace(d, explanation=dataclasses.replace(d.explanation,
                                                                      waited_s=waited))

    # -- internals: membership and health ----------------------------------------------------
    async def _follow_membership(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        pc = self.config.pool

        def on_change() -> None:  # the supervisor pushes the new membership to its workers
            for cb in list(self.round_listeners):
                cb()

        await self._source.follow(self._holder, FollowContext(
            pc.check_period_ms, pc.username, pc.password, self.clock, on_change),
            task_status=task_status)

    async def _health_task(self, scope: trio.CancelScope | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
        if scope is None:
            scope = self._health_scope = trio.CancelScope()
        with scope:
            try:
                await self._health_checks(task_status)
            finally:
                if self._health_scope is scope:
                    self._health_scope = None

    async def _health_checks(self, task_status) -> None:
        pc = self.config.pool

        def on_round() -> None:
            self.counters["probe_rounds"] += 1
            for cb in list(self.round_listeners):
                cb()

        own = [t for t in (pc.targets if pc else ()) if t.username is not None]
        if self.config.local_target is not None and self.config.local_target.username is not None:
            own.append(self.config.local_target)
        await run_health_checks(self._holder, check_period_ms=pc.check_period_ms if pc else 5000,
                                username=pc.username if pc else None,
                                password=pc.password if pc else None, clock=self.clock,
                                on_round=on_round,
                                credentials={t.name: (t.username, t.password) for t in own},
                                probe_local=not self.local_managed, kicks=self._kicks,
                                task_status=task_status)

    # -- internals: embedded persistence --------------------------------------------------------
    def _load_embedded(self, cache: StickyCache) -> None:
        entries = self._store.load()
        now_wall = self.clock() + self._wall_offset
        timeout = cache.timeout_s
        max_len = self.config.max_key_length
        # least recently used first, so over max-entries the oldest are the ones evicted
        for key, (ident, last_wall, stored_wall) in sorted(entries.items(),
                                                           key=lambda kv: kv[1][1]):
            if (timeout and now_wall - last_wall >= timeout) or len(key) > max_len:
                cache.changes[key] = None  # expired while we were down / over the key limit
                continue
            cache.restore(key, ident, last_wall - self._wall_offset,
                          stored_wall - self._wall_offset)
        self.counters["cache_evictions"] = cache.evictions
        if self._store.skipped:
            log.warning("router %s: skipped %d damaged record(s) in %s", self.name,
                        self._store.skipped, self._store.path)

    def _persist_batch(self):
        cache = self.core.cache
        changes, touched = cache.drain()
        off = self._wall_offset
        puts, deletes = [], []
        for key, ident in changes.items():
            e = cache.entries.get(key)
            if ident is None or e is None:
                deletes.append(key)
            else:
                puts.append((key, e[0], e[1] + off, e[2] + off))
        touches = [(k, cache.entries[k][1] + off) for k in touched
                   if k in cache.entries and k not in changes]
        return puts, touches, deletes

    async def _persist_loop(self) -> None:
        """Append the drained changes every FLUSH_INTERVAL_S; compact when the file holds
        many more records than live entries. A failed write (ENOSPC, EMFILE, EIO…) never stops
        the router: the batch goes back into the pending changes (newer changes win), the
        failure is counted and reported (``io_errors["cache_file"]``, /health), and the next
        flush retries — after a back-off that doubles up to PERSIST_RETRY_MAX_S."""
        store = self._store
        cache = self.core.cache
        backoff = 0.0
        while True:
            await trio.sleep(FLUSH_INTERVAL_S + backoff)
            puts, touches, deletes = self._persist_batch()
            try:
                if puts or touches or deletes:
                    await trio.to_thread.run_sync(store.write, puts, touches, deletes)
                    self.counters["persist_writes"] += 1
                if store.needs_compaction(len(cache)):
                    off = self._wall_offset
                    snap = [(k, e[0], e[1] + off, e[2] + off) for k, e in cache.entries.items()]
                    await trio.to_thread.run_sync(store.compact, snap)
                    self.counters["persist_compactions"] += 1
            except OSError as exc:
                self.counters["persist_errors"] += 1
                for key, *_ in puts:
                    cache.changes.setdefault(key, cache.entries[key][0]
                                             if key in cache.entries else None)
                for key in deletes:
                    cache.changes.setdefault(key, None)
                cache.touched.update(k for k, _ in touches)
                backoff = min(PERSIST_RETRY_MAX_S, max(FLUSH_INTERVAL_S, backoff * 2))
                text = f"{store.path}: {exc.strerror or exc}"
                if "cache_file" not in self.io_errors:
                    log.error("router %s: cannot write cache file %s; retrying", self.name, text)
                self.io_errors["cache_file"] = text
                continue
            backoff = 0.0
            if self.io_errors.pop("cache_file", None) is not None:
                log.warning("router %s: cache file %s writable again", self.name, store.path)

    async def _expiry_loop(self) -> None:
        cache = self.core.cache
        while True:
            # the timeout may change (a reload): 0 = entries never expire, nothing to scan
            await trio.sleep(min(max(cache.timeout_s / 4, 0.05), 5.0) if cache.timeout_s else 5.0)
            if cache.timeout_s:
                for key in cache.expire(self.clock()):
                    self._redis_seen.pop(key, None)

    # -- internals: the remote tier (Redis or shared; router.cache_tiers) -----------------------
    def _set_degraded(self, exc: BaseException) -> None:
        tier = self._remote.name
        self.counters[f"{tier}_errors"] += 1
        if not self.degraded:
            log.warning("router %s: %s cache tier unavailable, deciding from the local tier: %s",
                        self.name, tier, exc)
        self.degraded = True
        self.degraded_reason = str(exc)
        self.io_errors[tier] = f"{tier} cache tier unavailable (deciding from the local tier): {exc}"
        self._last_redis_try = trio.current_time()

    async def _decide_with_remote(self, rk: ResolvedKey, hold: bool = True) -> Decision:
        core = self.core
        d, key = core.lookup_resolved(rk, self.clock(), hold=hold)
        if d is not None:
            if self._claiming and key in self._claiming:
                # a hit on a decision another connection is still claiming: wait for the owner
                await self._claiming[key].wait()
                return core.decide_resolved(rk, self.clock(), hold=hold)
            return d
        from_remote = False
        remote = self._remote
        tier = remote.name
        if self.degraded:
            if tier == "redis":
                self.counters["redis_reads_skipped"] += 1
        else:
            if tier == "redis":
                self.counters["redis_reads"] += 1
            try:
                value = await remote.get(key, self._read_timeout_s())
            except CacheBackendError as exc:
                value = None
                if isinstance(exc, CacheBackendTimeout) and tier == "redis":
                    # A late answer is not an outage: reads stop (degraded) only when the tier
                    # says Redis answered nothing at all while this read waited (``silent``).
                    self.counters["redis_read_timeouts"] += 1
                    if getattr(exc, "silent", True):
                        self._set_degraded(exc)
                    else:
                        self.counters["redis_errors"] += 1
                else:
                    self._set_degraded(exc)
            else:
                if value is None:
                    self.counters[f"{tier}_misses"] += 1
                else:
                    self.counters[f"{tier}_hits"] += 1
                    self._redis_seen[key] = value
                    if (self._holder.ready_target(value) is not None
                            or self.config.cache.fail_back == "return"
                            or self._holder.failing_over(value) is not None):
                        # fail-back = return: a not-ready entry is restored too, so the core
                        # sees it stale and keeps it instead of replacing it; an entry on a
                        # pair that fails over too, so the key waits for the pair
                        now = self.clock()
                        core.cache.restore(key, value, now, now)
                        from_remote = True
        if self._claiming and key in self._claiming:
            await self._claiming[key].wait()
        d = core.decide_resolved(rk, self.clock(), hold=hold)
        if from_remote and d.explanation.cache == "hit":
            d = dataclasses.replace(d, explanation=dataclasses.replace(d.explanation,
                                                                       cache_tier=tier))
        elif (remote.claims and not self.degraded and d.outcome is Outcome.OK
              and d.explanation.cache in ("miss", "stale")):
            d = await self._claim(rk, d, key)
        return d

    def _read_timeout_s(self) -> float:
        if self._remote.name == "shared":
            return SHARED_TIMEOUT_S
        return self.config.cache.redis_timeout_ms / 1e3

    async def _claim(self, rk: ResolvedKey, d: Decision, key: str) -> Decision:
        """Shared tier: make a new decision the owner's before the client gets it (one CAS)."""
        cache = self.core.cache
        ident = cache.changes.pop(key, None)
        if ident is None:  # nothing was stored (decided before the cache)
            return d
        old = self._redis_seen.pop(key, "")
        ev = self._claiming[key] = trio.Event()
        try:
            conflicts = await self._remote.write([(key, ident, old)], [], [], SHARED_TIMEOUT_S)
        except CacheBackendError as exc:
            self._set_degraded(exc)
            self._pending_puts[key] = (ident, old)  # written behind once the owner answers
            return d
        finally:
            if self._claiming.get(key) is ev:
                del self._claiming[key]
            ev.set()
        self.counters["shared_writes"] += 1
        cur = conflicts.get(key)
        if cur is None:
            return d
        if self._holder.ready_target(cur) is None:
            # the owner names a node that is not ready here: ours replaces it (as a stale entry)
            self._pending_puts[key] = (ident, cur)
            return d
        self.counters["shared_conflicts"] += 1  # another worker decided first: adopt its choice
        now = self.clock()
        cache.restore(key, cur, now, now)
        d = self.core.decide_resolved(rk, now)
        return dataclasses.replace(d, explanation=dataclasses.replace(d.explanation,
                                                                      cache_tier=self._remote.name))

    def _collect_redis_changes(self) -> None:
        cache = self.core.cache
        changes, touched = cache.drain()
        for key, ident in changes.items():
            if ident is None:
                self._pending_puts.pop(key, None)
                self._pending_del.add(key)
            else:
                self._pending_del.discard(key)
                self._pending_puts[key] = (ident, self._redis_seen.pop(key, ""))
        self._pending_touch |= touched
        over = len(self._pending_puts) + len(self._pending_touch) - REDIS_MAX_PENDING
        if over > 0:
            self.counters[f"{self._remote.name}_writes_dropped"] += over
            for k in list(self._pending_touch)[:over]:
                self._pending_touch.discard(k)
            over = len(self._pending_puts) - REDIS_MAX_PENDING
            for k in list(self._pending_puts)[:max(over, 0)]:
                del self._pending_puts[k]

    async def _redis_loop(self) -> None:
        while True:
            await trio.sleep(REDIS_SYNC_INTERVAL_S)
            self._collect_redis_changes()
            if self.degraded:
                if trio.current_time() - self._last_redis_try < REDIS_RETRY_S:
                    continue
                try:
                    await self._remote.ping(REDIS_RETRY_S)
                except CacheBackendError as exc:
                    self._set_degraded(exc)
                    continue
                log.warning("router %s: %s cache tier is back", self.name, self._remote.name)
                self.degraded = False
                self.degraded_reason = None
                self.io_errors.pop(self._remote.name, None)
            if not (self._pending_puts or self._pending_touch or self._pending_del):
                continue
            puts = [(k, ident, old) for k, (ident, old) in self._pending_puts.items()]
            touches = list(self._pending_touch - set(self._pending_puts))
            deletes = list(self._pending_del)
            self._pending_puts, self._pending_touch, self._pending_del = {}, set(), set()
            try:
                conflicts = await self._remote.write(puts, touches, deletes, REDIS_RETRY_S)
            except CacheBackendError as exc:
                self._set_degraded(exc)
                for k, ident, old in puts:  # keep them (newer changes win) for the retry
                    self._pending_puts.setdefault(k, (ident, old))
                self._pending_touch |= set(touches)
                self._pending_del |= set(deletes) - set(self._pending_puts)
                continue
            self.counters[f"{self._remote.name}_writes"] += len(puts) + len(touches) + len(deletes)
            now = self.clock()
            mine = {k: ident for k, ident, _ in puts} if conflicts else {}
            for key, ident in conflicts.items():  # another replica decided first: adopt it...
                if self._holder.ready_target(ident) is None:
                    # ...unless it names a node that is not ready here (we re-decided away from
                    # it, perhaps while Redis was down): ours replaces it, as a stale entry is.
                    self._pending_puts.setdefault(key, (mine[key], ident))
                    continue
                self.counters[f"{self._remote.name}_conflicts"] += 1
                e = self.core.cache.entries.get(key)
                self.core.cache.restore(key, ident, now, e[2] if e else now)

    # -- internals: pins ------------------------------------------------------------------------
    def _read_pins(self, initial: bool = False) -> PinTable | None:
        path = self.config.pins.file
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if not initial and mtime == self._pins_mtime:
            return None
        bad: list[str] = []
        try:
            table = load_pins(path, bad_lines=bad)
            if bad and not table:
                raise PinFileError(f"no valid pin: {'; '.join(bad[:3])}")
        except PinFileError as exc:
            self.counters["pins_errors"] += 1
            self.counters["pins_bad_lines"] += len(bad)
            self.pins_error = str(exc)
            log.error("router %s: keeping previous pins: %s", self.name, exc)
            self._pins_mtime = mtime
            if initial:
                return PinTable(source=str(path))
            return None
        self._pins_mtime = mtime
        self.pins_error = None
        if bad:  # a bad line loses only itself
            self.counters["pins_bad_lines"] += len(bad)
            more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
            self.pins_error = f"skipped {len(bad)} bad line(s): {'; '.join(bad[:3])}{more}"
            log.warning("router %s: pins loaded, %s", self.name, self.pins_error)
        self.counters["pins_reloads"] += 1
        return table

    async def _pins_loop(self) -> None:
        """Re-read the pins file when it changes (checked every check-period; a reload may add,
        move or remove the file)."""
        while True:
            pc = self.config.pool
            await trio.sleep((pc.check_period_ms if pc else 5000) / 1000.0)
            if self.config.pins is None:
                continue
            table = self._read_pins()
            if table is not None:
                self.core.pins = table


def build_router(rc: RouterConfig, *, rng: random.Random | None = None, shared: Any = None, source: Any = None,
                 local_managed: bool = False) -> RouterService:
    """The one way a router is built from its ``[routers.<name>]``: by the single process, each
    worker (``shared``: its control link), the supervisor of workers, a reload (for the routers a
    new file adds) and the router inside a broker acceptor (``source``: the broker's own cluster,
    ``local_managed``: the broker is its local target; ``router.embed``)."""
    return RouterService(rc, rng=rng, shared=shared, source=source, local_managed=local_managed)


def build_services(config: RouterProcessConfig, *, rng: random.Random | None = None,
                   **kwargs: Any) -> dict[str, RouterService]:
    """One router (``build_router``) per ``[routers.<name>]`` of a loaded router process config."""
    base = rng if rng is not None else random.Random()
    return {name: build_router(rc, rng=random.Random(base.getrandbits(64)), **kwargs)
            for name, rc in config.routers.items()}


def load_pins(path: str | Path, *, bad_lines: list[str] | None = None) -> PinTable:
    """Read and parse a pins file: the shell side of ``router.core.pins`` (``PinFileError`` if
    unreadable, or malformed when strict).

    ``bad_lines``: skip malformed lines and collect their messages (see ``parse_pins``).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return PinTable(source=str(p))  # no pins written yet: an empty table
    except (OSError, UnicodeDecodeError) as exc:
        raise PinFileError(f"{p}: cannot read: {exc}") from None
    return parse_pins(text, str(p), bad_lines=bad_lines)
