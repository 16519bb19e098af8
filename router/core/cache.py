"""The sticky cache: key → target identity (node id), expiring after last access (spec §5).

Theory of operation
-------------------
An ordered dict of ``key -> [identity, last_access, stored_at]`` (monotonic seconds, passed in
as ``now``), least recently used first. ``timeout_ms == 0`` never expires. A read of a live entry
refreshes ``last_access`` in place and moves it to the end (expire-after-access, as Caffeine
``expireAfterAccess``); an expired entry is dropped when read or swept by ``expire(now)``.

``max_entries`` (0 = unbounded) caps the cache: a put of a new key over the cap evicts the least
recently used entry (``evictions`` counts them). An eviction is logged in ``changes`` like an
expiry (so the embedded file forgets it too, and a shared tier keeps its own copy).

The shell persists or shares the cache (embedded file, Redis) by draining ``changes`` — the
``(key, identity or None)`` writes and deletions since the last drain — and ``touched`` — the
keys whose access time moved — when ``track_changes`` is on. The hit path allocates nothing.
With ``log_expiry=False`` an entry dropped because it went idle is not logged as a deletion: a
shared tier (Redis) keeps its own TTL, refreshed by every replica, so one replica's local idle
time must not delete the shared entry.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Iterable, Iterator

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class StickyCache:
    """In-memory sticky cache with expire-after-access."""

    __slots__ = ("timeout_s", "entries", "track_changes", "log_expiry", "changes", "touched",
                 "max_entries", "evictions", "_move", "on_drop")

    def __init__(self, timeout_ms: int = 0, *, track_changes: bool = False,
                 log_expiry: bool = True, max_entries: int = 0) -> None:
        self.timeout_s = timeout_ms / 1000.0
        self.entries: OrderedDict[str, list] = OrderedDict()
        self._move = self.entries.move_to_end
        self.max_entries = max_entries
        self.evictions = 0
        self.track_changes = track_changes
        self.log_expiry = log_expiry
        self.changes: dict[str, str | None] = {}
        self.touched: set[str] = set()
        #: called with the key whenever an entry goes (expired, evicted, removed, cleared) or is
        #: re-pointed to another identity: the router releases the key's live assignment
        self.on_drop: Callable[[str], None] | None = None

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str, now: float) -> list | None:
        """The live entry ``[identity, last_access, stored_at]`` for key (access refreshed), or None."""
        e = self.entries.get(key)
        if e is None:
            return None
        t = self.timeout_s
        if t and now - e[1] >= t:
            self._drop(key, expired=True)
            return None
        e[1] = now
        self._move(key)
        if self.track_changes and t:
            self.touched.add(key)
        return e

    def peek(self, key: str, now: float) -> list | None:
        """Like ``get`` without refreshing the access time."""
        e = self.entries.get(key)
        if e is None or (self.timeout_s and now - e[1] >= self.timeout_s):
            return None
        return e

    def put(self, key: str, identity: str, now: float) -> bool:
        """Store ``key -> identity``; returns True when the stored value changed."""
        e = self.entries.get(key)
        if e is not None and e[0] == identity:
            e[1] = now
            self._move(key)
            if self.track_changes and self.timeout_s:
                self.touched.add(key)
            return False
        if e is not None and self.on_drop is not None:
            self.on_drop(key)
        self.entries[key] = [identity, now, now]
        self._move(key)
        if self.track_changes:
            self.changes[key] = identity
        if self.max_entries and len(self.entries) > self.max_entries:
            self._evict()
        return True

    def restore(self, key: str, identity: str, last_access: float, stored_at: float) -> None:
        """Load an entry from a persisted or shared tier (does not count as a change); it
        becomes the most recently used (over ``max_entries`` the least recently used goes)."""
        e = self.entries.get(key)
        if e is not None and e[0] != identity and self.on_drop is not None:
            self.on_drop(key)
        self.entries[key] = [identity, last_access, stored_at]
        self._move(key)
        if self.max_entries and len(self.entries) > self.max_entries:
            self._evict()

    def _evict(self) -> None:
        while len(self.entries) > self.max_entries:
            key = next(iter(self.entries))
            self._drop(key, expired=True)
            self.evictions += 1

    def remove(self, key: str) -> bool:
        """Forget ``key``; True if it was present."""
        if key in self.entries:
            self._drop(key)
            return True
        return False

    def _drop(self, key: str, expired: bool = False) -> None:
        del self.entries[key]
        if self.on_drop is not None:
            self.on_drop(key)
        self.touched.discard(key)
        if self.track_changes and (self.log_expiry or not expired):
            self.changes[key] = None

    def expire(self, now: float) -> list[str]:
        """Drop every entry idle for ``timeout`` or longer; returns the dropped keys."""
        t = self.timeout_s
        if not t:
            return []
        dead = [k for k, e in self.entries.items() if now - e[1] >= t]
        for k in dead:
            self._drop(k, expired=True)
        return dead

    def drain(self) -> tuple[dict[str, str | None], set[str]]:
        """Take the pending ``changes`` and ``touched`` keys (for the persistence/Redis shell)."""
        changes, touched = self.changes, self.touched
        self.changes, self.touched = {}, set()
        return changes, touched

    def clear(self) -> None:
        for k in list(self.entries):
            self._drop(k)

    def items(self, now: float) -> Iterator[tuple[str, str, float, float]]:
        """``(key, identity, idle_s, age_s)`` of live entries, for the management API."""
        t = self.timeout_s
        for k, (ident, last, stored) in list(self.entries.items()):
            if t and now - last >= t:
                continue
            yield k, ident, now - last, now - stored


def page(items: Iterable[tuple], *, after: str | None, limit: int) -> tuple[list[tuple], str | None]:
    """One page of ``(key, ...)`` rows in key order: the ``limit`` smallest keys greater than
    ``after`` (None = from the start). Returns ``(rows, next)`` where ``next`` is the cursor
    for the following page (the last key returned), or None when nothing follows.

    O(n log limit): a listing never sorts or copies the whole cache."""
    if after is not None:
        items = (row for row in items if row[0] > after)
    rows = heapq.nsmallest(limit + 1, items, key=lambda row: row[0])
    if len(rows) > limit:
        return rows[:limit], rows[limit - 1][0]
    return rows, None
