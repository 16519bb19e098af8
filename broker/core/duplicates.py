"""Duplicate-id detection (Artemis ``DuplicateIDCache``), pure: every duplicate-id cache of a node
and the journal records that keep them.

Theory of operation
-------------------
Two kinds of cache live here, one mechanism for both:

* **per address** — a producer may give a message the application property ``_AMQ_DUPL_ID``
  (a string or binary, Artemis's ``Message.HDR_DUPLICATE_DETECTION_ID``). The node remembers the
  last ``id-cache-size`` ids sent to each address; a message whose id is remembered is a resend
  and is not routed (Artemis ``PostOfficeImpl.checkDuplicateID``). The shell answers such a send
  ``accepted`` anyway, or — inside a transaction — fails the discharge (Artemis marks the
  transaction rollback-only);
* **per origin node** — the cluster bridge's own duplicate ids (:mod:`broker.cluster.bridge`): a
  forwarded message whose ``dup-id`` this node already stored is a bridge's resend after a
  reconnect (Artemis's ``BRIDGE`` caches; ours are per origin node, not per address).

A cache (:class:`DuplicateCache`) is a ring: once full, the oldest id is forgotten when a new one
comes (Artemis's circular ``ids`` list). Ids are compared as *keys* (:func:`duplicate_key`): a
string and a binary id are told apart by a tag byte, and an id longer than
:data:`MAX_RAW_KEY_BYTES` is kept as its SHA-256 digest, so one remembered id costs a bounded
amount of memory whatever the producer sends.

**Bounds.** Each address has its own ring of ``id-cache-size`` ids (per-address override:
``size_for``); over all addresses the node remembers at most ``max_ids`` ids: past that, the
address that remembered an id least recently gives up its oldest ids first (counted in
``cap_evicted``), and an address left with none has no cache any more. A cache goes away with
its address (Artemis deletes it when the address's last binding goes). Per-origin caches are
bounded by ``id-cache-size`` per cluster member and do not count in ``max_ids``.

**Persistence** (``persist-id-cache``): an id is written as a record of a journal pseudo-queue
(``$lodestone.records.addressids.<address>`` / ``$lodestone.records.dupids.<origin>``; its
message id is the record's key, kept as the entry's *token*) through the store's
``add_record`` — which joins the journal group open at the time, so the caller brackets the
message and its id in one group and a crash keeps both or neither. Only the ids of messages
that were written to the journal are persisted: a non-durable message does not survive a
restart, so neither may its id (a resend after the restart must get through). An id pushed out
of its ring has its record removed (``remove_record``) in the same group. :meth:`DuplicateIds.restore`
rebuilds the caches from the records the node recovered, oldest first, and removes the records
of ids that no longer fit (``id-cache-size`` or ``max_ids`` lowered).

Nothing here reads a clock or does I/O; the shell is told about each duplicate through
``on_duplicate(address, transactional)`` and about each id the cap takes through
``on_cap_evicted(address)`` (it counts and logs).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Callable, Iterable

from broker.wire.errors import LodestoneError

__all__ = ["DuplicateCache", "DuplicateIds", "InvalidDuplicateId", "duplicate_key", "MISSING",
           "DUPLICATE_ID_PROPERTY", "ADDRESS_RECORDS", "ORIGIN_RECORDS", "MAX_RAW_KEY_BYTES",
           "DEFAULT_ID_CACHE_SIZE", "DEFAULT_MAX_IDS"]

#: the application property Artemis reads (``Message.HDR_DUPLICATE_DETECTION_ID``)
DUPLICATE_ID_PROPERTY = "_AMQ_DUPL_ID"
#: journal pseudo-queues (``broker.node.INTERNAL_RECORDS_PREFIX`` + …) of the two kinds of cache
ADDRESS_RECORDS = "$lodestone.records.addressids."
ORIGIN_RECORDS = "$lodestone.records.dupids."
#: a key (tag byte + id) longer than this is remembered as a digest instead
MAX_RAW_KEY_BYTES = 65
DEFAULT_ID_CACHE_SIZE = 20000     # Artemis id-cache-size
DEFAULT_MAX_IDS = 1_000_000       # ids over all address caches of a node
_JOURNAL_NAME_BYTES = 0xFFFF      # the journal's limit on a queue name

_STRING, _BINARY, _DIGEST = b"S", b"B", b"H"

#: what :meth:`DuplicateCache.get` and :meth:`DuplicateIds.lookup` return for an id not remembered
MISSING = object()


class InvalidDuplicateId(LodestoneError):
    """``_AMQ_DUPL_ID`` is neither a string nor binary (Artemis fails such a send too: its cast to
    ``byte[]`` throws, and the delivery is rejected)."""

    condition = "amqp:invalid-field"


def duplicate_key(value: bytes, *, string: bool) -> bytes:
    """The cache key of an id: its raw bytes (a string's UTF-8) behind a tag byte telling a string
    from binary; a key longer than :data:`MAX_RAW_KEY_BYTES` becomes a tagged SHA-256 digest (33
    bytes; an id of any length is accepted, as in Artemis)."""
    key = (_STRING if string else _BINARY) + value
    if len(key) > MAX_RAW_KEY_BYTES:
        return _DIGEST + hashlib.sha256(key).digest()
    return key


class DuplicateCache:
    """The last ``size`` ids, oldest first; ``token`` is whatever the owner keys its record by."""

    __slots__ = ("size", "_ids", "dropped", "held")

    def __init__(self, size: int):
        if size < 1:
            raise ValueError("id-cache-size must be >= 1")
        self.size = size
        self._ids: "collections.OrderedDict[bytes, object]" = collections.OrderedDict()
        self.dropped = 0  # duplicates seen
        #: id -> names of the local queues holding a copy of its message (see ``DuplicateIds.hold``)
        self.held: dict[bytes, set[str]] = {}

    def __contains__(self, dup_id: bytes) -> bool:
        return dup_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, dup_id: bytes, default: object = MISSING) -> object:
        """The token of a remembered id, else ``default``."""
        return self._ids.get(dup_id, default)

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
            self.held.pop(out[-1][0], None)
        return out

    def pop_oldest(self) -> tuple[bytes, object]:
        dup_id, token = self._ids.popitem(last=False)
        self.held.pop(dup_id, None)
        return dup_id, token

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


class DuplicateIds:
    """Every duplicate-id cache of one node (see the module docstring).

    ``size`` is the default ring size of an address (``[node] id-cache-size``), ``size_for(address)``
    its per-address override or None (``[address-settings] id-cache-size``); ``persist`` writes
    ids to the store (``persist-id-cache`` and a journal); ``max_ids`` bounds the ids of all
    address caches together. ``origin_size`` / ``origin_persist`` are the cluster bridge's
    (``[cluster] id-cache-size`` / ``persist-id-cache``). The owner (the core's ``Broker``) sets
    ``store`` (``add_record``/``remove_record``) and ``next_mid`` (record keys).
    """

    def __init__(self, *, size: int = DEFAULT_ID_CACHE_SIZE, persist: bool = True, max_ids: int = DEFAULT_MAX_IDS,
                 size_for: Callable[[str], int | None] | None = None, origin_size: int | None = None,
                 origin_persist: bool | None = None):
        if size < 1 or max_ids < 1:
            raise ValueError("id-cache-size and the id cap must be >= 1")
        self.size = size
        self.persist = persist
        self.max_ids = max_ids
        self.size_for = size_for
        self.origin_size = size if origin_size is None else origin_size
        self.origin_persist = persist if origin_persist is None else origin_persist
        self.store = None
        self.next_mid: Callable[[], int] | None = None
        #: address -> its cache, least recently added to first (the cap takes from the front)
        self.addresses: "collections.OrderedDict[str, DuplicateCache]" = collections.OrderedDict()
        self.origins: dict[str, DuplicateCache] = {}
        self.address_ids = 0                     # ids over all address caches
        self.dropped: collections.Counter = collections.Counter()  # address -> duplicates
        self.cap_evicted = 0                     # ids forgotten early because of max_ids
        #: the shell's hooks: ``on_duplicate(address, transactional)`` for every duplicate found,
        #: ``on_cap_evicted(address)`` for every id forgotten early because of ``max_ids``
        self.on_duplicate: Callable[[str, bool], None] | None = None
        self.on_cap_evicted: Callable[[str], None] | None = None

    # -- per address (_AMQ_DUPL_ID) --------------------------------------------------------------
    def lookup(self, address: str, key: bytes) -> object:
        """The token of ``key`` in ``address``'s cache (None: remembered, not journaled), else
        :data:`MISSING`."""
        cache = self.addresses.get(address)
        return MISSING if cache is None else cache.get(key)

    def duplicate(self, address: str, *, transactional: bool = False) -> None:
        """Count a duplicate sent to ``address`` (dropped, or failing its transaction)."""
        self.dropped[address] += 1
        if self.on_duplicate is not None:
            self.on_duplicate(address, transactional)

    def remember(self, address: str, key: bytes, *, persist: bool, held: Iterable[str] = ()) -> None:
        """Remember ``key`` for ``address`` (a message carrying it was routed); ``persist``: its
        message was written to the store, so the id is too (in the caller's store group);
        ``held``: the local queues a copy was enqueued in (:meth:`hold`)."""
        cache = self.addresses.get(address)
        if cache is None:
            size = self.size_for(address) if self.size_for is not None else None
            cache = self.addresses[address] = DuplicateCache(size or self.size)
        elif key in cache:
            self.hold(address, key, held)  # a moved message's id (see the bridge): already remembered here
            return
        else:
            self.addresses.move_to_end(address)
        name = ADDRESS_RECORDS + address
        token = self._write(name, key) if persist and self.persist else None
        out = cache.add(key, token)
        self.address_ids += 1 - len(out)
        self._unwrite(name, out)
        self.hold(address, key, held)
        if self.address_ids > self.max_ids:
            self._cap(keep=cache)

    # -- which local queues hold a copy (moved messages) ---------------------------------------
    def hold(self, address: str, key: bytes, queues: Iterable[str]) -> None:
        """A copy of the message with id ``key`` was enqueued in each of ``queues`` here. A copy
        of the *same id* moved here later (redistribution, scale-down) for one of these queues is
        a second copy of one message — the producer's resend stored elsewhere, or the original
        after its resend — and is dropped (:meth:`holds`); one for another queue is stored. The
        entry lives as long as the id (it goes with the ring), consuming the copy keeps it (the
        message was delivered: its other copy must not be), moving the copy away drops it
        (:meth:`release`: the same copy may come back)."""
        cache = self.addresses.get(address)
        if cache is None or key not in cache:
            return
        for q in queues:
            cache.held.setdefault(key, set()).add(q)

    def holds(self, address: str, key: bytes, queue: str) -> bool:
        """Did ``queue`` here get a copy of the message with id ``key`` (not moved away since)?"""
        cache = self.addresses.get(address)
        if cache is None:
            return False
        held = cache.held.get(key)
        return held is not None and queue in held

    def release(self, address: str, key: bytes, queue: str) -> None:
        """The copy of ``queue`` moved to another node (redistribution): it may come back."""
        cache = self.addresses.get(address)
        held = None if cache is None else cache.held.get(key)
        if held is not None:
            held.discard(queue)
            if not held:
                del cache.held[key]

    def forget_address(self, address: str) -> None:
        """The address is gone: so are its cache, its records and its count."""
        self.dropped.pop(address, None)
        cache = self.addresses.pop(address, None)
        if cache is not None:
            self.address_ids -= len(cache)
            self._unwrite(ADDRESS_RECORDS + address, cache.items())

    def remembered(self, address: str) -> int:
        cache = self.addresses.get(address)
        return 0 if cache is None else len(cache)

    def _cap(self, keep: DuplicateCache) -> None:
        """Over ``max_ids``: the least recently used caches give up their oldest ids (the one just
        added to only if it is the last one left)."""
        caches = self.addresses
        while self.address_ids > self.max_ids and caches:
            address, cache = next(iter(caches.items()))
            if cache is keep and len(caches) > 1:
                caches.move_to_end(address)
                continue
            dup_id, token = cache.pop_oldest()
            self.address_ids -= 1
            self.cap_evicted += 1
            self._unwrite(ADDRESS_RECORDS + address, ((dup_id, token),))
            if self.on_cap_evicted is not None:
                self.on_cap_evicted(address)
            if not len(cache):
                del caches[address]

    # -- per origin node (the cluster bridge) ------------------------------------------------------
    def origin(self, origin: str) -> DuplicateCache:
        c = self.origins.get(origin)
        if c is None:
            c = self.origins[origin] = DuplicateCache(self.origin_size)
        return c

    def seen_from(self, origin: str, dup_id: bytes) -> bool:
        """Did ``origin`` forward ``dup_id`` already? (Counted per origin when it did.)"""
        return self.origin(origin).seen(dup_id)

    def remember_from(self, origin: str, dup_id: bytes, *, persist: bool) -> None:
        """Remember a forward of ``origin`` (``persist``: its message was written to the store)."""
        name = ORIGIN_RECORDS + origin
        token = self._write(name, dup_id) if persist and self.origin_persist else None
        self._unwrite(name, self.origin(origin).add(dup_id, token))

    def dropped_from(self, origin: str | None) -> int:
        c = self.origins.get(origin) if origin else None
        return c.dropped if c is not None else 0

    # -- the records ---------------------------------------------------------------------------
    def _write(self, name: str, key: bytes) -> object:
        store = self.store
        if store is None or self.next_mid is None or len(name.encode()) > _JOURNAL_NAME_BYTES:
            return None  # (an address too long for a journal name: its ids stay in memory)
        token = self.next_mid()
        store.add_record(name, token, key)
        return token

    def _unwrite(self, name: str, entries: Iterable[tuple[bytes, object]]) -> None:
        store = self.store
        for _key, token in entries:
            if token is not None and store is not None:
                store.remove_record(name, token)

    def restore(self, records: dict[str, list[tuple[int, bytes]]]) -> int:
        """Rebuild the caches from recovered records (pseudo-queue name -> [(message id, key)]);
        the entries used are taken out of ``records``. Records of ids that do not fit any more
        are removed. Returns the number of ids restored."""
        restored = 0
        loaded = []
        for name in list(records):
            if name.startswith(ADDRESS_RECORDS):
                address = name[len(ADDRESS_RECORDS):]
                cache = self.addresses.get(address)
                if cache is None:
                    size = self.size_for(address) if self.size_for is not None else None
                    cache = self.addresses[address] = DuplicateCache(size or self.size)
                is_address = True
            elif name.startswith(ORIGIN_RECORDS):
                cache = self.origin(name[len(ORIGIN_RECORDS):])
                is_address = False
            else:
                continue
            entries = sorted(records.pop(name))
            before = len(cache)
            self._unwrite(name, cache.restore((key, mid) for mid, key in entries))
            restored += len(cache) - before
            if is_address:
                self.address_ids += len(cache) - before
                loaded.append((entries[-1][0] if entries else 0, name[len(ADDRESS_RECORDS):]))
        for _newest, address in sorted(loaded):  # least recently written first, as remember() orders them
            self.addresses.move_to_end(address)
        if self.address_ids > self.max_ids and self.addresses:
            self._cap(keep=next(reversed(self.addresses.values())))
        return restored
