"""The journal's in-memory live state: the messages of each queue and the KV namespaces.

Theory of operation
===================

Plain logic, no I/O and no locks: the :class:`~broker.store.journal.Journal` holds its ``_lock``
around every call (or is single-threaded, during recovery). Appends, recovery and a replica's
``apply`` all change the state through the same methods, so a journal reopened from disk, a
replica fed the raw records and the node that wrote them hold the same state.

Each live item remembers the seq and on-disk size of the record that created it: the seq is
what compaction writes it back under, the sizes add up to ``live_bytes`` (what a compacted
journal would need), which against the total bytes decides when to compact. Values are
immutable (an update replaces the item), so compaction and snapshots can copy the state under
the lock cheaply and encode it outside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from broker.store.journal.records import Record, RecordType, _op_size


class StoredMessage(NamedTuple):
    """A live durable message in one queue. Immutable: updates replace it. (A named tuple: one
    is made per durable message stored, and a frozen dataclass costs several times as much.)"""

    queue: str
    message_id: int
    body: bytes
    properties: Mapping[str, Any]
    delivery_count: int
    seq: int        # seq of its ADD_MESSAGE record
    size: int       # bytes of that record on disk


@dataclass(frozen=True, slots=True)
class _KV:
    value: bytes
    seq: int
    size: int


class LiveState:
    """Live messages per queue (in the order added) and KV namespaces, with their live bytes."""

    def __init__(self) -> None:
        self.messages: dict[str, dict[int, StoredMessage]] = {}
        self.kv: dict[str, dict[str, _KV]] = {}
        self.live_bytes = 0

    def clear(self) -> None:
        self.messages.clear()
        self.kv.clear()
        self.live_bytes = 0

    def live_items(self) -> tuple[list[tuple[int, StoredMessage]], list[tuple[int, tuple[str, str, _KV]]]]:
        """``(seq, message)`` and ``(seq, (namespace, key, entry))`` of every live item, for
        compaction and snapshots (``compaction._encode_live``)."""
        live_state = [(m.seq, m) for q in self.messages.values() for m in q.values()]
        live_kv = [(e.seq, (ns, k, e)) for ns, d in self.kv.items() for k, e in d.items()]
        return live_state, live_kv

    def apply(self, rec: Record, size: int) -> int:
        """Apply one decoded record of ``size`` bytes (recovery, replicas); returns how many of
        its ACK/UPDATE operations found no message (orphans: harmless, but reported)."""
        t = rec.type
        if t == RecordType.ADD_KV:
            self.put_kv(rec.namespace, rec.key, _KV(rec.value, rec.seq, size))
        elif t == RecordType.DEL_KV:
            self.del_kv(rec.namespace, rec.key)
        elif t == RecordType.GROUP:
            return sum(not self.apply_op(op, _op_size(op)) for op in rec.ops or ())
        else:
            return 0 if self.apply_op(rec, size) else 1
        return 0

    def apply_op(self, rec: Record, size: int) -> bool:
        """Apply an ADD_MESSAGE, ACK or UPDATE_DELIVERY_COUNT (alone or one operation of a GROUP);
        False if it is an orphan (its message is not in the state)."""
        t = rec.type
        if t == RecordType.ADD_MESSAGE:
            self.add(StoredMessage(rec.queue, rec.message_id, rec.body, rec.properties or {},
                                   rec.delivery_count, rec.seq, size))
            return True
        if t == RecordType.ACK:
            return self.ack(rec.queue, rec.message_id)
        if t == RecordType.UPDATE_DELIVERY_COUNT:
            return self.count(rec.queue, rec.message_id, rec.delivery_count)
        return True

    def add(self, m: StoredMessage) -> None:
        q = self.messages.setdefault(m.queue, {})
        old = q.pop(m.message_id, None)
        if old is not None:
            self.live_bytes -= old.size
        q[m.message_id] = m
        self.live_bytes += m.size

    def ack(self, queue: str, message_id: int) -> bool:
        q = self.messages.get(queue)
        m = q.pop(message_id, None) if q is not None else None
        if m is None:
            return False
        self.live_bytes -= m.size
        if not q:
            del self.messages[queue]
        return True

    def count(self, queue: str, message_id: int, count: int) -> bool:
        q = self.messages.get(queue)
        m = q.get(message_id) if q is not None else None
        if m is None:
            return False
        q[message_id] = StoredMessage(m.queue, m.message_id, m.body, m.properties, count, m.seq, m.size)
        return True

    def put_kv(self, ns: str, key: str, entry: _KV) -> None:
        d = self.kv.setdefault(ns, {})
        old = d.get(key)
        if old is not None:
            self.live_bytes -= old.size
        d[key] = entry
        self.live_bytes += entry.size

    def del_kv(self, ns: str, key: str) -> None:
        d = self.kv.get(ns)
        old = d.pop(key, None) if d is not None else None
        if old is not None:
            self.live_bytes -= old.size
            if not d:
                del self.kv[ns]
