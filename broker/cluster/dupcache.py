"""The duplicate-id cache of forwarded messages (Artemis ``DuplicateIDCache``), pure.

A node remembers the ``dup-id`` of the last ``id-cache-size`` messages each other node forwarded
to it; a forwarded message whose id is remembered is a resend (its bridge reconnected before our
acknowledgement reached it) and is acknowledged without being stored again. The oldest id leaves
when the cache is full, as Artemis's circular cache does.

Persistence (``persist-id-cache``) is the shell's: :meth:`DuplicateCache.add` returns the entry
that fell out, so the journal can forget it, and :meth:`DuplicateCache.restore` rebuilds the cache
from what the journal kept. Each entry carries a ``token`` (the journal's record key) for that.
"""

from __future__ import annotations

import collections

__all__ = ["DuplicateCache"]


class DuplicateCache:
    """The last ``size`` ids, oldest first; ``token`` is whatever the owner keys its record by."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError("id-cache-size must be >= 1")
        self.size = size
        self._ids: "collections.OrderedDict[bytes, object]" = collections.OrderedDict()
        self.dropped = 0  # duplicates seen

    def __contains__(self, dup_id: bytes) -> bool:
        return dup_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def seen(self, dup_id: bytes) -> bool:
        """True (and counted) when ``dup_id`` is a duplicate."""
        if dup_id in self._ids:
            self.dropped += 1
            return True
        return False

    def add(self, dup_id: bytes, token: object = None) -> list[tuple[bytes, object]]:
        """Remember ``dup_id``; returns the (id, token) entries pushed out by the size bound."""
        ids = self._ids
        ids[dup_id] = token
        out = []
        while len(ids) > self.size:
            out.append(ids.popitem(last=False))
        return out

    def set_token(self, dup_id: bytes, token: object) -> None:
        if dup_id in self._ids:
            self._ids[dup_id] = token

    def restore(self, entries) -> list[tuple[bytes, object]]:
        """Load (id, token) entries, oldest first (recovery); returns those beyond the size."""
        out = []
        for dup_id, token in entries:
            out.extend(self.add(dup_id, token))
        return out

    def items(self):
        return list(self._ids.items())
