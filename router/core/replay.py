"""Decision replay: what a candidate router config would decide for every decision of a routing log.

Theory of operation
-------------------
A routing log's ``event = "route"`` lines (docs/router.md "Routing log") are what a running router
decided. ``replay(decisions, candidate)`` hands each one, in log order, to ``candidate``: a core
``Router`` built from the candidate config by ``candidate_router``, every pool target ready. Each
decision starts from the *connection* as logged (container id, SNI, client address, user, roles →
``ConnectionInfo``), so the candidate's key type, key filter, max-key-length, key transform,
local-target filter, pins, quorum and policy run exactly as ``Router.decide`` runs them live.

The sticky cache: a decision the log shows as a cache hit is replayed against a warm cache that
holds the logged target under the logged transformed key — what a router with a warm cache does:
the key keeps that target as long as it is a ready member of the candidate pool (the local-target
filter and pins still come first, as live; a candidate that transforms keys differently, or has no
cache, finds no entry). Every other decision is replayed against an empty cache, so one replayed
decision never warms the cache for the next and the log order does not matter.

Each logged decision ends up in exactly one bucket:

* **refused in the log** (``outcome`` not OK): counted by outcome; nothing was placed, nothing
  to compare.
* **not replayable**: the candidate's answer would depend on what the log does not hold — its
  policy decides and is not key-deterministic (ROUND_ROBIN: the order of connections;
  LEAST_CONNECTIONS: live connection counts; CONSISTENT_HASH with LOAD_FACTOR: live
  assignments), or its policy decides a decision the router made while fewer targets were ready
  than its full pool (which ones were down is not logged), or the key comes from a field the log
  truncated. Counted by reason; never given an invented target.
* **replayed**: the candidate's target (or its refusal) beside the logged one: reproduced, or a
  move ``key: logged -> candidate``.

Targets are compared by config name (``aliases`` maps an HA backup's name to its pair's, as the
pool serves a pair under one name). Pure: no I/O, no clock (``now`` is a constant 0), the policy
built with a seeded ``random.Random``.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .cache import StickyCache
from .decide import Router
from .dryrun import json_objects
from .filters import compile_key_filter, compile_local_filter
from .keys import ConnectionInfo, KeyResolver, KeyType
from .pins import PinTable
from .policies.base import Target
from .policies.registry import create_policy
from .pool import Pool

REFUSED = None
"""The "target" of a refused decision in distributions and moves (printed ``(refused)``)."""

_TRUNCATED = re.compile(r"\.\.\.\[truncated, \d+ chars\]\Z")

#: why a policy's choice cannot be replayed from a log (else: "<name>: not key-deterministic")
NOT_DETERMINISTIC = {
    "ROUND_ROBIN": "ROUND_ROBIN: the target depends on the order of connections, not on the key",
    "LEAST_CONNECTIONS": "LEAST_CONNECTIONS: the target depends on live connection counts",
    "CONSISTENT_HASH": "CONSISTENT_HASH with LOAD_FACTOR: the target depends on live assignments",
}
DEGRADED = ("decided while fewer targets were ready than the full pool "
            "(which ones were down is not logged)")
TRUNCATED = "the key was truncated in the log (longer than max-field-chars)"


@dataclass(frozen=True)
class LoggedDecision:
    """One ``event = "route"`` line: the connection as the edge saw it and what the router did."""

    router: str
    conn: ConnectionInfo
    key_type: str | None
    key_filtered: str | None
    key_transformed: str | None
    target_name: str | None
    target_node_id: str | None
    policy: str | None
    cache: str | None
    pin: str | None
    outcome: str
    ready_targets: int | None = None
    local: bool = False


@dataclass
class RoutingLogRead:
    """What ``decisions_from_routing_log`` found: route decisions, and the lines it skipped."""

    decisions: list[LoggedDecision] = field(default_factory=list)
    bad_lines: int = 0     # not JSON, not an object, or a route line without its fields
    other_lines: int = 0   # other events (``close``)


def _source(addr: object, port: object) -> str | None:
    if not isinstance(addr, str) or not addr:
        return None
    host = f"[{addr}]" if ":" in addr else addr  # the log writes IPv6 without brackets
    return f"{host}:{port}" if isinstance(port, int) else host


def decisions_from_routing_log(lines: Iterable[str], into: RoutingLogRead | None = None) -> RoutingLogRead:
    """Parse routing-log lines (JSON Lines, schema in docs/router.md) into ``LoggedDecision`` s.

    ``close`` lines are counted as ``other_lines``; a line that is not a JSON object, or a route
    line without ``router`` / ``outcome``, is counted in ``bad_lines`` and skipped. ``into``:
    append to an earlier result (several files).
    """
    out = into if into is not None else RoutingLogRead()
    for rec in json_objects(lines):
        if rec is None:
            out.bad_lines += 1
            continue
        event = rec.get("event")
        if event != "route":
            if isinstance(event, str):
                out.other_lines += 1
            else:
                out.bad_lines += 1
            continue
        router, outcome = rec.get("router"), rec.get("outcome")
        if not isinstance(router, str) or not isinstance(outcome, str):
            out.bad_lines += 1
            continue
        roles = rec.get("roles")

        def s(k: str, rec=rec) -> str | None:  # a string field, else None (hand-made or damaged lines)
            v = rec.get(k)
            return v if isinstance(v, str) else None

        conn = ConnectionInfo(_source(rec.get("client_address"), rec.get("client_port")),  # type: ignore[arg-type]
                              sni_host=s("sni"), container_id=s("container_id"), user=s("user"),
                              roles=tuple(r for r in roles if isinstance(r, str)) if isinstance(roles, list) else (),
                              acceptor=s("acceptor") or "")
        ready = rec.get("ready_targets")
        out.decisions.append(LoggedDecision(
            router, conn, s("key_type"), s("key_filtered"), s("key_transformed"), s("target_name"),
            s("target_node_id"), s("policy"), s("cache"), s("pin"), outcome,
            ready if isinstance(ready, int) else None, rec.get("local") is True))
    return out


def candidate_router(name: str, *, key_type: KeyType, policy: str | None,
                     properties: Mapping[str, str] | None = None, targets: Sequence[Target] = (),
                     quorum_size: int = 1, key_filter: str | None = None,
                     local_filter: str | None = None, local_target: Target | None = None,
                     local_target_enabled: bool = False, pins: PinTable | None = None,
                     cache: bool = False, artemis_keys: bool = False,
                     max_key_length: int = 0, seed: int = 0) -> Router:
    """A core ``Router`` as a running router builds it from its config (``router.service``),
    with every target of ``targets`` (and the local target) ready under the node id it carries.
    Raises ``FilterError`` / ``PolicyError`` for a bad filter or policy."""
    pool = Pool(targets, quorum_size=quorum_size, local_target=local_target,
                local_target_enabled=local_target_enabled)
    for t in pool.all_states():
        pool.set_ready(t.target.slot, True, t.target.node_id)
    p = create_policy(policy, properties, random.Random(seed)) if policy is not None else None
    router = Router(name, KeyResolver(key_type, compile_key_filter(key_filter), artemis_keys=artemis_keys),
                    policy=p, pool=pool if p is not None or targets else None,
                    cache=StickyCache(0) if cache else None,
                    local_filter=compile_local_filter(local_filter, from_config=True),
                    local=pool.local, pins=pins, max_key_length=max_key_length)
    router.failover_wait = False  # every target is ready: no pair is failing over
    return router


@dataclass(frozen=True)
class ReplayMove:
    """A key the candidate sends elsewhere than the log shows (names; None = refused)."""

    key: str
    before_name: str | None
    after_name: str | None
    decisions: int = 1


def skew(counts: Mapping[str | None, int], targets: Iterable[str]) -> float | None:
    """Max share / mean share over ``targets`` (plus any other target that got decisions; refusals
    left out): 1.0 is perfectly even, N means all of it on one of N targets. None with no decision."""
    names = set(targets) | {n for n in counts if n is not REFUSED}
    placed = [counts.get(n, 0) for n in names]
    total = sum(placed)
    if not names or not total:
        return None
    return max(placed) * len(names) / total


@dataclass(frozen=True)
class ReplayReport:
    """The result of ``replay``; ``to_dict()`` for JSON output (keys shared with ``DryRunReport``
    mean the same: ``total_keys``, ``moved_count``, ``moved_fraction``, ``moved[]``)."""

    policy: str | None
    deterministic: bool
    logged_policies: tuple[str, ...]
    decisions: int
    refused_in_log: Mapping[str, int]
    not_replayable: Mapping[str, int]
    replayed: int
    reproduced: int
    total_keys: int
    moved: tuple[ReplayMove, ...]
    logged: Mapping[str | None, int]      # every OK decision of the log, by target name
    candidate: Mapping[str | None, int]   # the replayed decisions, by candidate target name
    logged_targets: tuple[str, ...] = ()
    candidate_targets: tuple[str, ...] = ()

    @property
    def not_replayable_count(self) -> int:
        return sum(self.not_replayable.values())

    @property
    def refused_in_log_count(self) -> int:
        return sum(self.refused_in_log.values())

    @property
    def moved_count(self) -> int:
        return len({m.key for m in self.moved})

    @property
    def moved_fraction(self) -> float:
        return self.moved_count / self.total_keys if self.total_keys else 0.0

    @property
    def logged_skew(self) -> float | None:
        return skew(self.logged, self.logged_targets)

    @property
    def candidate_skew(self) -> float | None:
        return skew(self.candidate, self.candidate_targets)

    def distribution(self) -> list[dict]:
        """One row per target (pool order: logged pool, then candidate pool, then others; the
        refused row last): counts and shares of each column."""
        names: dict[str | None, None] = dict.fromkeys([*self.logged_targets, *self.candidate_targets])
        names.update(dict.fromkeys(n for n in [*self.logged, *self.candidate] if n is not REFUSED))
        if REFUSED in self.candidate or REFUSED in self.logged:
            names[REFUSED] = None
        lt, ct = sum(self.logged.values()), sum(self.candidate.values())
        return [{"target": n, "logged": self.logged.get(n, 0),
                 "logged_share": self.logged.get(n, 0) / lt if lt else 0.0,
                 "candidate": self.candidate.get(n, 0),
                 "candidate_share": self.candidate.get(n, 0) / ct if ct else 0.0} for n in names]

    def to_dict(self) -> dict:
        return {"mode": "replay", "policy": self.policy, "deterministic": self.deterministic,
                "logged_policies": list(self.logged_policies), "decisions": self.decisions,
                "refused_in_log": dict(self.refused_in_log),
                "refused_in_log_count": self.refused_in_log_count,
                "not_replayable": dict(self.not_replayable),
                "not_replayable_count": self.not_replayable_count,
                "replayed": self.replayed, "reproduced": self.reproduced,
                "total_keys": self.total_keys, "moved_count": self.moved_count,
                "moved_fraction": self.moved_fraction,
                "distribution": self.distribution(),
                "skew": {"logged": self.logged_skew, "candidate": self.candidate_skew},
                "logged_target_names": list(self.logged_targets),
                "after_target_names": list(self.candidate_targets),
                "moved": [{"key": m.key, "before_name": m.before_name, "after_name": m.after_name,
                           "decisions": m.decisions} for m in self.moved]}


def replay(decisions: Iterable[LoggedDecision], candidate: Router, *,
           full_pool: int | None = None, aliases: Mapping[str, str] | None = None,
           logged_targets: Sequence[str] = ()) -> ReplayReport:
    """Replay every logged decision against ``candidate`` (see the module docstring).

    ``full_pool``: how many targets the logging router had ready when all were up; a decision
    the log shows with fewer (``ready_targets``) is not replayed by a policy (None: the most
    the log shows). ``aliases``: logged target name → the name it is compared by (an HA
    backup → its pair). ``logged_targets``: the logging router's pool, for the distribution.
    """
    decisions = list(decisions)
    alias = dict(aliases or {})
    if full_pool is None:
        full_pool = max((d.ready_targets for d in decisions if d.ready_targets is not None), default=0)
    policy = candidate.policy
    pool = candidate.pool
    cache = candidate.cache
    why_not = None
    if policy is not None and not getattr(policy, "key_deterministic", False):
        why_not = NOT_DETERMINISTIC.get(policy.name, f"{policy.name}: not key-deterministic")
    refused: dict[str, int] = {}
    not_replayable: dict[str, int] = {}
    logged: dict[str | None, int] = {}
    placed: dict[str | None, int] = {}
    moves: dict[tuple[str, str | None, str | None], int] = {}
    keys: set[str] = set()
    logged_policies: dict[str, None] = {}
    replayed = reproduced = 0
    for d in decisions:
        if d.policy:
            logged_policies.setdefault(d.policy, None)
        if d.outcome != "OK":
            refused[d.outcome] = refused.get(d.outcome, 0) + 1
            continue
        was = alias.get(d.target_name, d.target_name) if d.target_name is not None else None
        logged[was] = logged.get(was, 0) + 1
        rk = candidate.resolve(d.conn)
        if rk.raw is not None and _TRUNCATED.search(rk.raw):
            not_replayable[TRUNCATED] = not_replayable.get(TRUNCATED, 0) + 1
            continue
        if cache is not None:
            cache.clear()
            if d.cache == "hit" and was is not None:
                # the warm cache of the router that wrote the log, under the key it used
                cache.put(d.key_transformed or d.key_filtered or "", was, 0.0)
        got = candidate.decide_resolved(rk, 0.0)
        ex = got.explanation
        if ex.cache in ("off", "miss", "stale") and ex.quorum_met and pool is not None and pool.targets():
            # the policy chose: only key-deterministic policies over the full pool replay
            why = why_not if why_not is not None else (
                DEGRADED if d.ready_targets is not None and d.ready_targets < full_pool else None)
            if why is not None:
                not_replayable[why] = not_replayable.get(why, 0) + 1
                continue
        cand = REFUSED
        if got.target is not None:
            cand = alias.get(got.target.slot, got.target.slot)
        placed[cand] = placed.get(cand, 0) + 1
        replayed += 1
        key = d.key_filtered if d.key_filtered is not None else rk.filtered
        keys.add(key)
        if cand == was:
            reproduced += 1
        else:
            moves[(key, was, cand)] = moves.get((key, was, cand), 0) + 1
    cand_targets: list[str] = []
    if pool is not None:
        for st in pool.all_states():
            if st.local and not pool.local_target_enabled:
                continue
            n = alias.get(st.target.slot, st.target.slot)
            if n not in cand_targets:
                cand_targets.append(n)
    log_targets = list(dict.fromkeys(alias.get(n, n) for n in logged_targets))
    return ReplayReport(
        policy.name if policy is not None else None, why_not is None, tuple(logged_policies),
        len(decisions), refused, not_replayable, replayed, reproduced, len(keys),
        tuple(ReplayMove(k, a, b, n) for (k, a, b), n in moves.items()), logged, placed,
        tuple(log_targets), tuple(cand_targets))
