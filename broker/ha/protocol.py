"""The replication wire format between a primary and its backup (sans-IO; docs/ha.md
"Replication").

The backup dials the primary (as the cluster user, ``broker.amqp.peer``) and attaches two links:

* ``$lodestone.replication.records`` — primary → backup: :data:`START`, the snapshot
  (:data:`SNAPSHOT` chunks then :data:`SNAPSHOT_END`), then :data:`RECORDS` batches as the
  primary's journal grows, :data:`TOPOLOGY` whenever the cluster's members change,
  :data:`LOGINS` (the password logins the primary verified, to a backup whose hello asked for
  them) after the snapshot and then as clients log in, and :data:`HANDOVER` (the last seq) when
  the primary hands its node id over to this backup;
* ``$lodestone.replication.acks`` — backup → primary: :data:`HELLO` first, then
  :data:`SYNCED` each time its journal holds more records durably, and :data:`FAILBACK` when
  the backup is the node id's original primary asking for it back (``check-for-live-server``).

Every transfer body is ``b"LRP1"``, one kind byte, then the kind's payload: JSON (UTF-8) for
START, HELLO, TOPOLOGY and LOGINS; for SNAPSHOT and RECORDS a sequence of journal records, each as a
u32 length then the record's own bytes (the journal's framing, CRC included, verified again by
``Journal.apply``); for SNAPSHOT_END, SYNCED and HANDOVER a u64 seq; FAILBACK has no payload. Anything else — another magic, an
unknown kind, a truncated record, bad JSON, a field of the wrong type, a body over
:data:`MAX_BODY` — raises :class:`ProtocolError`, and the receiving side closes that connection
with ``amqp:decode-error`` (the primary keeps serving its clients).
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass
from typing import Any

RECORDS_ADDRESS = "$lodestone.replication.records"
ACKS_ADDRESS = "$lodestone.replication.acks"
MAGIC = b"LRP1"
MAX_BODY = 8 * 1024 * 1024        # one transfer: a batch of records, a chunk of the snapshot
BATCH_BYTES = 1024 * 1024         # the primary cuts batches and snapshot chunks at this size

START, SNAPSHOT, SNAPSHOT_END, RECORDS, TOPOLOGY, HANDOVER, LOGINS = 1, 2, 3, 4, 5, 6, 7
MAX_LOGINS = 1024                 # entries in one LOGINS transfer (the login cache's size)
HELLO, SYNCED, FAILBACK = 16, 17, 18
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")

__all__ = ["RECORDS_ADDRESS", "ACKS_ADDRESS", "ProtocolError", "Start", "Hello", "Topology", "encode",
           "decode", "START", "SNAPSHOT", "SNAPSHOT_END", "RECORDS", "TOPOLOGY", "HANDOVER", "HELLO", "SYNCED",
           "FAILBACK", "LOGINS", "MAX_LOGINS", "logins_batches",
           "BATCH_BYTES", "batches"]


class ProtocolError(Exception):
    """A replication transfer that is not the format; ``condition`` is the AMQP error to close with."""

    condition = "amqp:decode-error"


@dataclass(frozen=True)
class Start:
    """What the primary says first: whose journal this is and what follows."""

    node_id: str
    through_seq: int          # the snapshot that follows covers every seq up to this one
    name: str = ""
    #: the primary's activation sequence ([ha.manager], broker.ha.quorum); a backup in sync
    #: holds the same one. None: the primary runs without a coordination service
    activation_sequence: int | None = None


@dataclass(frozen=True)
class Hello:
    """What the backup says first: its group (a primary with another ``group-name`` refuses it),
    its name and where it would serve once active."""

    group: str | None
    name: str
    connector: str | None = None
    management_url: str | None = None
    logins: bool = False      # it adopts verified logins (LOGINS); an older backup does not say so


@dataclass(frozen=True)
class Topology:
    """The primary's cluster as the backup needs it to vote: the other live members."""

    members: tuple[tuple[str, str], ...]   # (node id, management URL)
    cluster_size: int                      # primaries in the cluster, the primary included


def _json(kind: int, obj: dict) -> bytes:
    return MAGIC + bytes([kind]) + json.dumps(obj, separators=(",", ":")).encode()


def _records(kind: int, records) -> bytes:
    out = bytearray(MAGIC + bytes([kind]))
    for r in records:
        out += _U32.pack(len(r))
        out += r
    return bytes(out)


def encode(kind: int, payload: Any) -> bytes:
    """One transfer body. ``payload``: a :class:`Start`/:class:`Hello`/:class:`Topology`, a list
    of record bytes (SNAPSHOT, RECORDS) or a seq (SNAPSHOT_END, SYNCED)."""
    if kind == START:
        return _json(kind, {"node_id": payload.node_id, "through_seq": payload.through_seq, "name": payload.name,
                            "activation_sequence": payload.activation_sequence})
    if kind == HELLO:
        return _json(kind, {"group": payload.group, "name": payload.name, "connector": payload.connector,
                            "management_url": payload.management_url, "logins": payload.logins})
    if kind == TOPOLOGY:
        return _json(kind, {"members": [list(m) for m in payload.members], "cluster_size": payload.cluster_size})
    if kind == LOGINS:
        if len(payload) > MAX_LOGINS:
            raise ValueError(f"more than {MAX_LOGINS} logins in one transfer")
        return _json(kind, {"logins": [[u, base64.b64encode(d).decode(), base64.b64encode(f).decode()]
                                       for u, d, f in payload]})
    if kind in (SNAPSHOT, RECORDS):
        return _records(kind, payload)
    if kind in (SNAPSHOT_END, SYNCED, HANDOVER):
        return MAGIC + bytes([kind]) + _U64.pack(payload)
    if kind == FAILBACK:
        return MAGIC + bytes([kind])
    raise ValueError(f"unknown kind {kind}")


def logins_batches(entries, limit: int = MAX_LOGINS):
    """Cut verified logins into LOGINS payloads of at most ``limit`` entries."""
    entries = list(entries)
    for i in range(0, len(entries), limit):
        yield entries[i:i + limit]


def _b64(v: Any, size: int, what: str) -> bytes:
    try:
        out = base64.b64decode(v, validate=True) if isinstance(v, str) else None
    except ValueError:
        out = None
    if out is None or len(out) != size:
        raise ProtocolError(f"a login's {what} must be {size} bytes in base64")
    return out


def batches(records, limit: int = BATCH_BYTES):
    """Cut an iterable of record bytes into lists of about ``limit`` bytes each."""
    batch, size = [], 0
    for r in records:
        batch.append(r)
        size += len(r) + 4
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _str(obj: dict, key: str, *, optional: bool = False, limit: int = 4096) -> str | None:
    v = obj.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise ProtocolError(f"field {key!r} must be a string of at most {limit} characters")
    return v


def _int(obj: dict, key: str) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ProtocolError(f"field {key!r} must be a non-negative integer")
    return v


def decode(body: bytes) -> tuple[int, Any]:
    """``(kind, payload)`` of one transfer body; raises :class:`ProtocolError`."""
    if len(body) > MAX_BODY:
        raise ProtocolError(f"transfer of {len(body)} bytes is over {MAX_BODY}")
    if len(body) < 5 or body[:4] != MAGIC:
        raise ProtocolError("not a replication transfer (bad magic)")
    kind = body[4]
    rest = memoryview(body)[5:]
    if kind in (START, HELLO, TOPOLOGY, LOGINS):
        try:
            obj = json.loads(bytes(rest))
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"bad JSON: {exc}") from None
        if not isinstance(obj, dict):
            raise ProtocolError("payload must be a JSON object")
        if kind == START:
            seq = obj.get("activation_sequence")
            return kind, Start(_str(obj, "node_id", limit=64), _int(obj, "through_seq"),
                               _str(obj, "name", optional=True) or "",
                               None if seq is None else _int(obj, "activation_sequence"))
        if kind == HELLO:
            return kind, Hello(_str(obj, "group", optional=True), _str(obj, "name"),
                               _str(obj, "connector", optional=True), _str(obj, "management_url", optional=True),
                               obj.get("logins") is True)
        if kind == LOGINS:
            logins = obj.get("logins")
            if not isinstance(logins, list) or len(logins) > MAX_LOGINS:
                raise ProtocolError(f"logins must be a list of at most {MAX_LOGINS} entries")
            entries = []
            for e in logins:
                if not (isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and 0 < len(e[0]) <= 4096):
                    raise ProtocolError("a login must be [user, password digest, hash fingerprint]")
                entries.append((e[0], _b64(e[1], 32, "password digest"), _b64(e[2], 16, "hash fingerprint")))
            return kind, entries
        members = obj.get("members")
        if not isinstance(members, list) or len(members) > 4096:
            raise ProtocolError("members must be a list of at most 4096 entries")
        out = []
        for m in members:
            if not (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) and len(x) <= 4096 for x in m)):
                raise ProtocolError("a member must be [node id, management URL]")
            out.append((m[0], m[1]))
        return kind, Topology(tuple(out), _int(obj, "cluster_size"))
    if kind in (SNAPSHOT, RECORDS):
        records, pos, n = [], 0, len(rest)
        while pos < n:
            if pos + 4 > n:
                raise ProtocolError("truncated record length")
            (size,) = _U32.unpack_from(rest, pos)
            pos += 4
            if size == 0 or pos + size > n:
                raise ProtocolError("truncated record")
            records.append(bytes(rest[pos:pos + size]))
            pos += size
        return kind, records
    if kind in (SNAPSHOT_END, SYNCED, HANDOVER):
        if len(rest) != 8:
            raise ProtocolError("a seq is 8 bytes")
        return kind, _U64.unpack(rest)[0]
    if kind == FAILBACK:
        if len(rest):
            raise ProtocolError("failback has no payload")
        return kind, None
    raise ProtocolError(f"unknown kind {kind}")
