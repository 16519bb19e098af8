"""Dry runs: which keys would move to another target if the pool changed.

Pure: give the policy (name + properties), the keys (a key list or the keys of a routing log),
the ready targets before and after the change; fresh policy instances route every key both ways.
Keys are *filtered* keys (the routing log's ``key_filtered``); the policy's
``transform_key`` is applied as the router would (never to ``NULL``).

Only key-deterministic policies (CONSISTENT_HASH without LOAD_FACTOR, FIRST_ELEMENT,
CONSISTENT_HASH_MODULO) give a prediction that holds for live traffic; for the others the report
is computed the same way but flagged ``deterministic = False``. The sticky cache is ignored: a
dry run answers "where would a new connection for this key go". Replaying a routing log's
decisions against a whole candidate config (filters, pins, cache hits, quorum): ``router.core.replay``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, Sequence

from .policies.base import NULL_KEY, Target
from .policies.registry import create_policy


@dataclass(frozen=True)
class KeyMove:
    key: str
    before: str | None   # target identity before the change (None = refused)
    after: str | None
    before_name: str | None = None  # the target's config name (``Target.slot``)
    after_name: str | None = None


@dataclass(frozen=True)
class DryRunReport:
    """Result of a dry run; ``to_dict()`` for JSON output."""

    policy: str
    deterministic: bool
    total_keys: int
    moved: tuple[KeyMove, ...]
    before_targets: tuple[str, ...]
    after_targets: tuple[str, ...]
    before_names: tuple[str, ...] = ()
    after_names: tuple[str, ...] = ()

    @property
    def moved_count(self) -> int:
        return len(self.moved)

    @property
    def moved_fraction(self) -> float:
        return len(self.moved) / self.total_keys if self.total_keys else 0.0

    def to_dict(self) -> dict:
        return {"policy": self.policy, "deterministic": self.deterministic,
                "total_keys": self.total_keys, "moved_count": self.moved_count,
                "moved_fraction": self.moved_fraction,
                "before_targets": list(self.before_targets),
                "after_targets": list(self.after_targets),
                "before_target_names": list(self.before_names),
                "after_target_names": list(self.after_names),
                "moved": [{"key": m.key, "before": m.before, "after": m.after,
                           "before_name": m.before_name, "after_name": m.after_name}
                          for m in self.moved]}


def change_pool(targets: Sequence[Target], *, add: Iterable[Target] = (),
                remove: Iterable[str] = ()) -> list[Target]:
    """The target list after removing the slots/identities in ``remove`` and appending ``add``."""
    gone = set(remove)
    out = [t for t in targets if t.slot not in gone and t.identity not in gone]
    out.extend(add)
    return out


def dry_run(policy_name: str, properties: Mapping[str, str] | None, keys: Iterable[str],
            before: Sequence[Target], after: Sequence[Target], *, seed: int = 0) -> DryRunReport:
    """Route every distinct key over ``before`` and ``after``; report the keys whose target changed."""
    p_before = create_policy(policy_name, properties, random.Random(seed))
    p_after = create_policy(policy_name, properties, random.Random(seed))
    deterministic = bool(getattr(p_before, "key_deterministic", False))
    before_t, after_t = tuple(before), tuple(after)
    moved: list[KeyMove] = []
    seen: set[str] = set()
    total = 0
    for key in keys:
        if key in seen:
            continue
        seen.add(key)
        total += 1
        k1 = p_before.transform_key(key) if key != NULL_KEY else key
        k2 = p_after.transform_key(key) if key != NULL_KEY else key
        t1 = p_before.select_target(before_t, k1)
        t2 = p_after.select_target(after_t, k2)
        i1 = t1.identity if t1 is not None else None
        i2 = t2.identity if t2 is not None else None
        if i1 != i2:
            moved.append(KeyMove(key, i1, i2, t1.slot if t1 is not None else None,
                                 t2.slot if t2 is not None else None))
    return DryRunReport(policy_name, deterministic, total, tuple(moved),
                        tuple(t.identity for t in before_t), tuple(t.identity for t in after_t),
                        tuple(t.slot for t in before_t), tuple(t.slot for t in after_t))


def keys_from_key_list(text: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments skipped; surrounding spaces kept out."""
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def json_objects(lines: Iterable[str]) -> Iterator[dict | None]:
    """Each non-blank line of a JSON Lines file as its object, or None for a line that is not a
    JSON object (the caller counts or skips it)."""
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            yield None
            continue
        yield rec if isinstance(rec, dict) else None


def keys_from_routing_log(lines: Iterable[str]) -> list[str]:
    """Distinct filtered keys of a routing log (JSON Lines), in first-seen order.

    The router's routing log (``router.routelog``, schema in docs/router.md) writes one
    ``"event": "route"`` object per decision with the filtered key in ``key_filtered``; ``close``
    lines carry no key and are skipped, and so are connections refused for a key over
    ``max-key-length`` (never routed). For older hand-made files an explanation nested under
    ``"explanation"`` and the names ``filtered_key`` / ``key`` are accepted too. Lines that are
    not JSON objects are skipped.
    """
    out: dict[str, None] = {}
    for rec in json_objects(lines):
        if rec is None:
            continue
        if isinstance(rec.get("reason"), str) and rec["reason"].startswith("key too long"):
            continue  # refused before routing (max-key-length): its key_filtered is "NULL"
        ex = rec.get("explanation")
        src = ex if isinstance(ex, dict) else rec
        key = src.get("key_filtered", src.get("filtered_key", src.get("key")))
        if isinstance(key, str):
            out.setdefault(key, None)
    return list(out)
