"""The routing decision (Artemis ``ConnectionRouter.getTarget``, spec §0 step 3-4) as pure logic.

Theory of operation
-------------------
``Router.decide(conn, now)`` runs, in order:

1. (Artemis keys only) a container-id with the Artemis internal router prefix → local target.
2. key = resolve(conn) → (raw, filtered) with the key-filter; ``NULL`` when missing.
3. key = policy.transform_key(key) unless it is ``NULL`` (only CONSISTENT_HASH_MODULO changes it).
4. local-target-filter full match → the local target (REFUSED_UNAVAILABLE if its probe fails —
   unlike Artemis, whose local target is the broker itself and always ready).
5. pinned routes (exact key, then patterns) → that node, if ready.
6. no policy or no pool → REFUSED_USE_ANOTHER.
7. cache hit whose node is ready (quorum ignored, as Artemis) → it; the cache is not re-put.
   A hit on an HA pair with no member ready (failing over, ``Pool.failing_over``) is
   REFUSED_UNAVAILABLE with ``explanation.failover`` = the pair, so the shell lets the
   connection wait (up to quorum-timeout) for a member to become active; ``hold=False`` (the
   wait is over) or ``failover_wait = False`` (quorum-timeout 0) goes on to step 8 as for any
   cached node that is not ready (Artemis).
8. policy.select_target(pool.targets(), key) — ``()`` below quorum; a target is cached and OK,
   ``None`` is REFUSED_UNAVAILABLE.

Before step 2's filter runs, a raw key longer than ``max_key_length`` characters (0 = no limit)
is refused (REFUSED_USE_ANOTHER, reason ``key too long (…)``): never hashed or truncated, which
would break Artemis-identical placement and joins on the routing log; nothing about it is
cached. ``key_too_long(key)`` gives the same verdict to the management lookup.

``decide_for_key(key, now)`` (management) starts at step 3 with the raw key: no key filter.
``lookup(conn, now)`` runs steps 1-7 only and returns ``None`` where the policy would be asked,
so the shell can consult a remote cache tier (Redis) first without side effects.

Steps 1-2 are ``resolve(conn) -> ResolvedKey``; ``decide_resolved``/``lookup_resolved`` run the
rest from it. A shell that looks up, waits (a remote tier, a claim, a quorum wait) and decides
again resolves once per connection, so a key filter replaced meanwhile cannot split one
connection's lookup, cache entry and pin check across two keys.
Every Decision carries an ``Explanation`` (what the routing log and management API print).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from .cache import StickyCache
from .filters import Filter, compile_key_filter, compile_local_filter
from .keys import ARTEMIS_INTERNAL_CLIENT_PREFIX, ConnectionInfo, KeyResolver
from .pins import PinTable
from .policies.base import NULL_KEY, Policy, Target
from .pool import Pool, TargetState


class Outcome(enum.Enum):
    """Artemis ``TargetResult.Status``."""

    OK = "OK"
    REFUSED_UNAVAILABLE = "REFUSED_UNAVAILABLE"   # not ready yet (no quorum / no target): transient
    REFUSED_USE_ANOTHER = "REFUSED_USE_ANOTHER"   # rejected here: go elsewhere, not transient


@dataclass(frozen=True)
class Explanation:
    """Why a decision came out as it did. ``to_dict()`` is what logs and the management API print.

    ``cache`` is one of ``off`` (no cache), ``hit``, ``miss``, ``stale`` (cached node not ready),
    ``skipped`` (decided before the cache); ``cache_tier`` is ``local``, ``redis`` or ``shared``
    (a multi-worker router's supervisor) on a hit.
    """

    router: str
    key_type: str
    raw_key: str | None
    filtered_key: str
    key: str
    key_filter: str | None
    local_filter: str | None
    local_match: bool
    pin: str | None
    cache: str
    cache_tier: str | None
    cache_age_s: float | None
    policy: str | None
    ready_targets: int
    total_targets: int
    quorum_size: int
    quorum_met: bool
    reason: str
    waited_s: float = 0.0
    #: the HA pair this decision waits for (a cached key whose pair is failing over), else None
    failover: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Decision:
    """The outcome of routing one connection (or one management key lookup)."""

    outcome: Outcome
    target: Target | None
    local: bool
    explanation: Explanation
    #: a live assignment this connection holds (bounded load, no cache): (the policy that
    #: made it, its target slot); ``Router.release(decision)`` ends it when the connection closes
    #: (on that policy, also after a reload replaced it)
    hold: tuple[Any, str] | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def node_id(self) -> str | None:
        return self.target.node_id if self.target is not None else None

    def to_dict(self) -> dict[str, Any]:
        t = self.target
        return {"outcome": self.outcome.value, "local": self.local,
                "target": None if t is None else {
                    "name": t.name, "node_id": t.node_id, "host": t.host, "port": t.port,
                    "tls": t.tls},
                "explanation": self.explanation.to_dict()}


_OK, _UNAVAIL, _ANOTHER = Outcome.OK, Outcome.REFUSED_UNAVAILABLE, Outcome.REFUSED_USE_ANOTHER

# Hot path: a frozen dataclass __init__ costs one object.__setattr__ per field (~4 us for an
# Explanation here). Both classes are plain (non-slots) frozen dataclasses, so we build them by
# installing a ready __dict__ in one call; the result is identical to calling the constructor.
_new = object.__new__
_setattr = object.__setattr__


def _decision(outcome: Outcome, target: Target | None, local: bool, ex: dict) -> Decision:
    e = _new(Explanation)
    _setattr(e, "__dict__", ex)
    d = _new(Decision)
    _setattr(d, "__dict__", {"outcome": outcome, "target": target, "local": local,
                             "explanation": e, "hold": None})
    return d


_INTERNAL, _TOO_LONG = "internal", "too long"


class ResolvedKey(NamedTuple):
    """A connection's key after steps 1-2 (``Router.resolve``), resolved once per connection."""

    raw: str | None
    filtered: str
    #: None, or "internal" (step 1: an Artemis internal client id) / "too long" (max-key-length)
    special: str | None = None


class Router:
    """One connection router: key resolver, filters, policy, pool, cache and pins.

    ``local`` is the local target's state (``pool.local`` when there is a pool). All methods are
    pure: they take ``now`` and never block; the shell (``router.service``) does I/O and waiting.
    """

    def __init__(self, name: str, resolver: KeyResolver, *, policy: Policy | None = None,
                 pool: Pool | None = None, cache: StickyCache | None = None,
                 local_filter: Filter | None = None, local: TargetState | None = None,
                 pins: PinTable | None = None, max_key_length: int = 0,
                 fail_back: str = "stay", root_filter: Filter | None = None) -> None:
        self.name = name
        #: keys (full match) that go to the pool's root (``Pool.root``, OpenAMQ's model), never cached
        self.root_filter = root_filter
        #: what a key whose cached target is not ready does once that target returns (see
        #: ``_keep_stale``): ``stay`` where the policy sent it meanwhile (Artemis: the new choice
        #: overwrites the entry), or ``return`` to the cached target
        self.fail_back = fail_back
        self.max_key_length = max_key_length
        #: a cached key whose HA pair is failing over waits for it (the shell bounds the wait by
        #: quorum-timeout; False when that is 0: the key is re-placed at once, as in Artemis)
        self.failover_wait = True
        #: how long after a pair lost its last active member a new connection that follows pool
        #: order still waits for it (the shell sets quorum-timeout)
        self.failover_wait_s = 3.0
        self.resolver = resolver
        self.policy = policy  # property: also picks the transform step (None = identity)
        self.pool = pool
        self.cache = cache
        self.local_filter = local_filter
        self.local = local if local is not None else (pool.local if pool is not None else None)
        self.pins = pins
        if pool is not None and policy is not None:
            pool.observers.append(policy.observe)
            if policy.needs_connection_count:
                pool.require_connection_count = True
        #: bounded load with a cache: key → slot of the live assignment its cache entry holds
        self.assigned: dict[str, str] = {}
        if cache is not None and policy is not None and policy.tracks_assignments:
            cache.on_drop = self._cache_dropped

    def replace_policy(self, policy: Policy | None) -> None:
        """A reloaded policy: it observes the pool's probes from now on and counts its own live
        assignments (bounded load) from zero; a connection the old one placed releases on the old
        one when it closes."""
        old = self._policy
        pool = self.pool
        if pool is not None:
            if old is not None and old.observe in pool.observers:
                pool.observers.remove(old.observe)
            pool.require_connection_count = policy is not None and policy.needs_connection_count
            if policy is not None:
                pool.observers.append(policy.observe)
                for st in pool.all_states():     # what the new policy needs to know already
                    if st.ready:
                        policy.observe(st.target, st.connection_count)
        self.policy = policy
        self.assigned.clear()
        if self.cache is not None:
            self.cache.on_drop = (self._cache_dropped if policy is not None and policy.tracks_assignments
                                  else None)

    # -- bounded load: live assignments ---------------------------------------------------------
    def _cache_dropped(self, key: str) -> None:
        slot = self.assigned.pop(key, None)
        if slot is not None:
            self._policy.release(slot)

    def release(self, decision: Decision) -> None:
        """The connection that got ``decision`` closed: end the assignment it holds (bounded
        load without a cache; with a cache the entry holds it until it goes). Idempotent."""
        held = decision.__dict__.get("hold")
        if held is not None:
            decision.__dict__["hold"] = None
            policy, slot = held
            policy.release(slot)

    @property
    def policy(self) -> Policy | None:
        return self._policy

    @policy.setter
    def policy(self, policy: Policy | None) -> None:
        self._policy = policy
        # Hot path: most policies keep the base (identity) transform_key; skip the call then.
        self._transform = (policy.transform_key if policy is not None
                           and type(policy).transform_key is not Policy.transform_key else None)

    # -- management setters (Artemis ConnectionRouterControl) ----------------------------------
    def set_key_filter(self, pattern: str | None) -> None:
        """Replace the key filter; ``None`` or blank clears it. Raises FilterError."""
        self.resolver.key_filter = compile_key_filter(pattern)

    def get_key_filter(self) -> str | None:
        f = self.resolver.key_filter
        return f.pattern if f is not None else None

    def set_local_target_filter(self, pattern: str | None) -> None:
        """Replace the local-target filter; ``None`` or blank clears it. Raises FilterError."""
        self.local_filter = compile_local_filter(pattern)

    def get_local_target_filter(self) -> str | None:
        f = self.local_filter
        return f.pattern if f is not None else None

    # -- decisions ----------------------------------------------------------------------------
    def key_too_long(self, key: str | None) -> str | None:
        """The refusal reason when ``key`` is over ``max_key_length``, else None."""
        m = self.max_key_length
        if m and key is not None and len(key) > m:
            return f"key too long ({len(key)} characters; max-key-length is {m})"
        return None

    def _too_long(self, raw: str, reason: str) -> Decision:
        # filtered/transformed keys are NULL: nothing downstream (cache, policy) sees the key;
        # raw_key is the client's own string (the routing log truncates it)
        return _decision(_ANOTHER, None, False,
                         self._expl(raw, NULL_KEY, NULL_KEY, False, None, "skipped", None, None,
                                    reason))

    def resolve(self, conn: ConnectionInfo) -> ResolvedKey:
        """Steps 1-2: the connection's raw and filtered key (and whether it is special)."""
        if self.resolver.artemis_keys and self.local is not None:
            cid = conn.container_id
            if cid is not None and cid.startswith(ARTEMIS_INTERNAL_CLIENT_PREFIX):
                if self.max_key_length and len(cid) > self.max_key_length:
                    return ResolvedKey(cid, NULL_KEY, _TOO_LONG)
                return ResolvedKey(cid, cid, _INTERNAL)
        raw, filtered = self.resolver.resolve(conn)
        if self.max_key_length and raw is not None and len(raw) > self.max_key_length:
            return ResolvedKey(raw, NULL_KEY, _TOO_LONG)
        return ResolvedKey(raw, filtered)

    def decide(self, conn: ConnectionInfo, now: float) -> Decision:
        """Route one connection: see the module docstring for the steps."""
        return self.decide_resolved(self.resolve(conn), now)

    def decide_resolved(self, rk: ResolvedKey, now: float, *, hold: bool = True) -> Decision:
        """Steps 3-8 for a key from :meth:`resolve`. ``hold=False``: a cached key whose pair is
        failing over is re-placed by the policy (its wait is over)."""
        special = rk.special
        if special is None:
            return self._route(rk.raw, rk.filtered, now, True, hold=hold)  # type: ignore[return-value]
        if special == _TOO_LONG:
            return self._too_long(rk.raw, self.key_too_long(rk.raw))
        return self._local(rk.raw, rk.raw, rk.raw, False, "artemis internal client id")

    def decide_for_key(self, key: str, now: float) -> Decision:
        """Management lookup: route a raw key, skipping the key filter (populates the cache)."""
        reason = self.key_too_long(key)
        if reason is not None:
            return self._too_long(key, reason)
        return self._route(key, key, now, True, count=False)  # type: ignore[return-value]

    def lookup(self, conn: ConnectionInfo, now: float) -> tuple[Decision | None, str]:
        """Steps 1-7 without side effects beyond the cache access time.

        Returns ``(decision, key)``; ``decision`` is None when the policy would have to choose
        (cache miss or stale), ``key`` is the transformed key (for a remote cache lookup).
        """
        return self.lookup_resolved(self.resolve(conn), now)

    def lookup_resolved(self, rk: ResolvedKey, now: float, *,
                        hold: bool = True) -> tuple[Decision | None, str]:
        """:meth:`lookup` for a key from :meth:`resolve`."""
        special = rk.special
        if special == _TOO_LONG:
            return self._too_long(rk.raw, self.key_too_long(rk.raw)), NULL_KEY
        if special == _INTERNAL:
            return self._local(rk.raw, rk.raw, rk.raw, False, "artemis internal client id"), rk.raw
        d = self._route(rk.raw, rk.filtered, now, False, hold=hold)
        if isinstance(d, str):
            return None, d
        return d, d.explanation.key

    def _expl(self, raw, filtered, key, local_match, pin, cache, tier, age, reason) -> dict:
        pool = self.pool
        policy = self._policy
        resolver = self.resolver
        kf = resolver.key_filter
        lf = self.local_filter
        if pool is not None:
            ready = len(pool._ready)
            qsize = pool.quorum_size
            total, qmet = pool._group_count, ready >= qsize
        else:
            ready, total, qsize, qmet = 0, 0, 0, False
        return {"router": self.name, "key_type": resolver.key_type_name, "raw_key": raw,
                "filtered_key": filtered, "key": key,
                "key_filter": kf.pattern if kf is not None else None,
                "local_filter": lf.pattern if lf is not None else None,
                "local_match": local_match, "pin": pin, "cache": cache, "cache_tier": tier,
                "cache_age_s": age, "policy": policy.name if policy is not None else None,
                "ready_targets": ready, "total_targets": total, "quorum_size": qsize,
                "quorum_met": qmet, "reason": reason, "waited_s": 0.0, "failover": None}

    def _local(self, raw, filtered, key, local_match, reason) -> Decision:
        local = self.local
        if local is None:  # config validation prevents this; refuse rather than crash
            return _decision(_ANOTHER, None, False,
                            self._expl(raw, filtered, key, local_match, None, "skipped", None,
                                       None, "local target matched but none is configured"))
        if not local.ready:
            return _decision(_UNAVAIL, None, False,
                            self._expl(raw, filtered, key, local_match, None, "skipped", None,
                                       None, f"{reason}; local target not ready"))
        return _decision(_OK, local.target, True,
                        self._expl(raw, filtered, key, local_match, None, "skipped", None, None,
                                   reason))

    def _root(self, raw, filtered, key, pool: Pool) -> Decision:
        """``root-target-filter`` matched: the cluster's root, whatever the policy or the cache
        say (the root moves; nothing is cached). No root known, or the root not ready: refused
        as unavailable (transient: the client retries, by then a root is elected)."""
        root = pool.root
        if root is None:
            return _decision(_UNAVAIL, None, False,
                             self._expl(raw, filtered, key, False, None, "skipped", None, None,
                                        "root-target-filter matched; the cluster has no root now"))
        why = f"root-target-filter matched: the cluster's root {root}"
        lc = self.local
        if lc is not None and root in (lc.target.node_id, lc.target.name):   # a broker's own router, on the root
            if lc.ready:
                return _decision(_OK, lc.target, True,
                                 self._expl(raw, filtered, key, False, None, "skipped", None, None, why))
            target = None
        else:
            target = pool.ready_target(root)
        if target is None:
            return _decision(_UNAVAIL, None, False,
                             self._expl(raw, filtered, key, False, None, "skipped", None, None,
                                        f"root-target-filter matched; the root {root} is not ready"))
        return _decision(_OK, target, False,
                         self._expl(raw, filtered, key, False, None, "skipped", None, None, why))

    def _route(self, raw: str | None, filtered: str, now: float, commit: bool, count: bool = True,
               hold: bool = True):
        policy = self._policy
        key = filtered
        transform = self._transform
        if transform is not None and key != NULL_KEY:
            key = transform(key)
        lf = self.local_filter
        if lf is not None and lf.matches(key):
            return self._local(raw, filtered, key, True, "local-target-filter matched")
        pool = self.pool
        rf = self.root_filter
        if rf is not None and pool is not None and rf.matches(key):
            return self._root(raw, filtered, key, pool)
        pins = self.pins
        pin_note = None
        if pins is not None and pins:
            hit = pins.lookup(key)
            if hit is not None:
                node, rule = hit
                target = pool.ready_target(node) if pool is not None else None
                if target is not None:
                    local = self.local is not None and target is self.local.target
                    return _decision(_OK, target, local,
                                    self._expl(raw, filtered, key, False, rule, "skipped", None,
                                               None, "pinned route"))
                lc = self.local
                if lc is not None and lc.ready and node in (lc.target.identity, lc.target.slot):
                    return _decision(_OK, lc.target, True,
                                    self._expl(raw, filtered, key, False, rule, "skipped", None,
                                               None, "pinned route (local target)"))
                pin_note = rule
        if policy is None or pool is None:
            return _decision(_ANOTHER, None, False,
                            self._expl(raw, filtered, key, False, pin_note, "skipped", None, None,
                                       "no policy" if policy is None else "no pool"))
        cache = self.cache
        cache_state = "off"
        if cache is not None:
            e = cache.get(key, now)
            if e is not None:
                target = pool.ready_target(e[0])
                if target is not None:
                    if commit and count and policy.tracks_assignments \
                            and self.assigned.get(key) != target.slot:
                        # an entry no connection was counted for yet (a management lookup's,
                        # or loaded from a persisted/shared tier): this connection makes it live
                        self._cache_dropped(key)
                        policy.acquire(target.slot)
                        self.assigned[key] = target.slot
                    lc = self.local
                    return _decision(_OK, target, lc is not None and target is lc.target,
                                    self._expl(raw, filtered, key, False, pin_note, "hit", "local",
                                               now - e[2], "cache hit"))
                if hold and self.failover_wait:
                    pair = pool.failing_over(e[0])
                    if pair is not None:
                        # its pair is failing over: wait for a member rather than re-place it
                        ex = self._expl(raw, filtered, key, False, pin_note, "stale", None,
                                        now - e[2], f"pair {pair} is failing over (no member "
                                                    f"active); the key waits for it")
                        ex["failover"] = pair
                        return _decision(_UNAVAIL, None, False, ex)
                cache_state = "stale"
            else:
                cache_state = "miss"
        if not commit:
            return key
        if hold and self.failover_wait and pool._first_pair_down is not None \
                and policy.follows_pool_order:
            pair = pool.first_failing_over(now, self.failover_wait_s)
            if pair is not None:
                # the first choice in pool order is a pair failing over: wait for it rather
                # than send the connection to the next one for the second a failover takes
                ex = self._expl(raw, filtered, key, False, pin_note, cache_state, None, None,
                                f"pair {pair}, first in pool order, is failing over (no member "
                                f"active); the connection waits for it")
                ex["failover"] = pair
                return _decision(_UNAVAIL, None, False, ex)
        targets = pool.targets()
        counting = policy.tracks_assignments
        if counting and not count:
            target = policy.choose_target(targets, key)  # a management lookup assigns nothing
        else:
            target = policy.select_target(targets, key)
        if target is None:
            if not pool.quorum_met:
                reason = (f"below quorum ({pool.ready_count} of {pool.quorum_size} "
                          "targets ready)")
            elif not targets:
                reason = "no target ready"
            else:
                reason = f"policy {policy.name} selected no target"
            return _decision(_UNAVAIL, None, False,
                            self._expl(raw, filtered, key, False, pin_note, cache_state, None,
                                       None, reason))
        reason = f"selected by {policy.name}"
        if cache is not None:
            if cache_state == "stale" and self._keep_stale(e[0], pool):
                reason += f" (fail-back = return: the cache keeps {e[0]})"
            else:
                cache.put(key, target.identity, now)  # a re-pointed entry releases its old slot
                if counting and count:
                    self.assigned[key] = target.slot
                    counting = False  # the cache entry holds this assignment
        lc = self.local
        d = _decision(_OK, target, lc is not None and target is lc.target,
                      self._expl(raw, filtered, key, False, pin_note, cache_state, None, None,
                                 reason))
        if counting and count:
            # no cache entry holds it (no cache, or fail-back = return kept the old entry):
            # the connection does, until it closes
            d.__dict__["hold"] = (self._policy, target.slot)
        return d

    def _keep_stale(self, identity: str, pool: Pool) -> bool:
        """``fail-back = return``: leave a stale entry in place while its target is a pool member
        (down for now, expected back), so the key's next connection after the target returns
        goes back to it. A target that left the pool is replaced as under ``stay``."""
        if self.fail_back != "return":
            return False
        return any(st.target.identity == identity for st in pool.all_states())
