"""The replicated cluster state (OpenAMQ): addresses declared in config or through the
management API, the same on every node. Pure.

Theory of operation
-------------------
OpenAMQ replicates its cluster's declared state so that every node serves the same exchanges and
queues; Lodestone replicates the *declared* addresses (with their anycast queue's filter): those
in ``[addresses.<name>]`` of a node's config and those created with ``POST /api/v1/addresses``.
Auto-created addresses and subscription queues are per node (they follow their clients) and
are not replicated.

Each entry is an :class:`~broker.wire.cluster.AddressNote`: name, routing types, filter,
``version`` (the declaring node's wall clock in ms; 0 for an address from a config file) and the
declaring node's id; a deletion is a tombstone with its own version. Nodes send their whole
state after every (re)connection (so a node that joins later receives it) and every change as
it happens, and pass on what changed for them (so it crosses chains).

**Conflicts** (:func:`merge`): the entry with the greater ``(version, origin)`` wins outright —
latest declaration or deletion, ties broken by node id — a last-writer-wins register per address,
so every node ends with the same state whatever the order the notes arrive in. Declaring an
address that already stands with the same filter adds the new routing types to it (as Artemis's
``createAddress`` does): the declaring node makes that union before it publishes the new
version (:meth:`ClusterState.declaration`).

**Cap**: the state's encoded size is bounded (``[cluster] max-state-bytes``); a declaration that
would pass the bound is refused where it is made (the management API answers 507) and ignored,
counted and logged where it arrives.
"""

from __future__ import annotations

from dataclasses import replace

from broker.wire.cluster import AddressNote, encode_note

__all__ = ["ClusterState", "merge"]


def _key(n: AddressNote) -> tuple[int, str]:
    return (n.version, n.origin)


def merge(old: AddressNote | None, new: AddressNote) -> AddressNote:
    """The entry that stands once ``new`` meets ``old`` (last writer wins; see the module doc)."""
    if old is None:
        return new
    return new if _key(new) > _key(old) else old


class ClusterState:
    """The entries by address name, and their encoded size (for the cap)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: dict[str, AddressNote] = {}
        self.sizes: dict[str, int] = {}
        self.bytes = 0
        self.refused = 0

    def offer(self, note: AddressNote) -> AddressNote | None:
        """Merge ``note``; returns the entry now standing if it changed, else None. A note that
        would take the state past its cap is refused (None, counted)."""
        old = self.entries.get(note.name)
        new = merge(old, note)
        if new == old:
            return None
        size = len(encode_note(new))
        grown = self.bytes - self.sizes.get(note.name, 0) + size
        if grown > self.max_bytes and size > self.sizes.get(note.name, 0):
            self.refused += 1
            return None
        self.entries[note.name] = new
        self.sizes[note.name] = size
        self.bytes = grown
        return new

    def declaration(self, note: AddressNote) -> AddressNote:
        """``note`` as the declaring node publishes it: a live declaration with the filter of the
        live entry standing adds its routing types to that entry's."""
        old = self.entries.get(note.name)
        if old is not None and not old.deleted and not note.deleted and old.filter_text == note.filter_text:
            return replace(note, routing_types=tuple(sorted(set(old.routing_types) | set(note.routing_types))),
                           shared=old.shared or note.shared)
        return note

    def would_fit(self, note: AddressNote) -> bool:
        size = len(encode_note(note))
        return self.bytes - self.sizes.get(note.name, 0) + size <= self.max_bytes

    def __iter__(self):
        return iter(list(self.entries.values()))

    def __len__(self) -> int:
        return len(self.entries)
