"""The journal's on-disk format, pinned by golden bytes (tests/unit/broker/store/journal_golden/).

The files there were written by the single-file ``broker/store/journal.py`` of ``main`` (commit
f5841f0) running :func:`golden_workload`; ``expected.json`` is what that code read back. The
tests check both directions against today's code:

* writing: the same workload produces the same files, byte for byte (so the old code reads
  what the new code writes: they are the old code's own bytes);
* reading: the golden files recover to exactly the recorded state (messages with their seq and
  on-disk size, KV, last seq, live/total bytes, recovery report), and the replication hooks
  hand out the recorded raw records and snapshot.

Never regenerate these files to make a test pass: a difference is a change of the on-disk
format. Regenerate only with the code that defines the format, e.g.::

    git archive f5841f0 broker | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python tests/unit/broker/store/test_journal_golden.py tests/unit/broker/store/journal_golden
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from broker.store.errors import JournalGap
from broker.store.journal import GroupOp, Journal, JournalConfig, RecordType, decode_record, encode_record

GOLDEN = Path(__file__).with_name("journal_golden")
CFG = JournalConfig(segment_bytes=4096, compact_min_bytes=1 << 40)  # rolls often, never compacts by itself


def golden_workload(j: Journal) -> None:
    """Every record type, unicode names, JSON properties of every kind, an empty body, an orphan
    ACK, groups (one with several adds, one of acks only) and several segment rolls."""
    j.put_kv("address", "orders", b'{"routing":"anycast"}')
    j.put_kv("address", "\u00e9v\u00e9nements", b"\x00\x01\xff")
    for i in range(60):
        props = ({"address": "orders", "priority": i % 10, "expiry_ms": None, "durable": True,
                  "ratio": 0.5, "name": "\u00fc\u2603"} if i % 3 else None)
        j.add_message("orders", i, bytes([i]) * (i * 7 % 200), props, delivery_count=i % 2)
        if i % 4 == 1:
            j.ack("orders", i - 1)
        if i % 5 == 2:
            j.update_delivery_count("orders", i, i % 7)
        if i % 8 == 0:
            j.flush()
    j.append_group([GroupOp.add("orders", 100, b"tx one", {"address": "orders"}),
                    GroupOp.add("\u00e9v\u00e9nements", 101, b"", None, 2),
                    GroupOp.ack("orders", 3),
                    GroupOp.count("orders", 5, 4),
                    GroupOp.add("orders", 102, b"tx three" * 30)])
    j.append_group([GroupOp.ack("orders", 7), GroupOp.ack("orders", 11)])
    j.delete_kv("address", "orders")
    j.put_kv("address", "\u00e9v\u00e9nements", b"v2")
    j.ack("nowhere", 999)                                     # an orphan: harmless
    j.delete_kv("nothing", "here")
    j.flush()


def compacted_workload(j: Journal) -> None:
    """The golden workload, compacted (a group's live adds become one GROUP), then more records."""
    golden_workload(j)
    j.compact()
    j.add_message("orders", 500, b"after compaction", {"address": "orders"})
    j.append_group([GroupOp.ack("orders", 100), GroupOp.add("orders", 501, b"x")])
    j.flush()


WORKLOADS = {"plain": golden_workload, "compacted": compacted_workload}


def codec_vectors() -> dict[str, str]:
    """Single records of each type, encoded (hex), independent of any file."""
    return {
        "add_message": encode_record(RecordType.ADD_MESSAGE, 1, GroupOp.add(
            "q", 7, b"body", {"a": 1, "b": [1, "x"], "c": None}, 3).payload()).hex(),
        "ack": encode_record(RecordType.ACK, 2, GroupOp.ack("q", 7).payload()).hex(),
        "update_delivery_count": encode_record(RecordType.UPDATE_DELIVERY_COUNT, 3,
                                               GroupOp.count("q", 7, 9).payload()).hex(),
    }


def read_state(j: Journal) -> dict:
    """Everything recovery restores, as JSON-able values."""
    return {
        "messages": {q: [[m.message_id, m.body.hex(), dict(m.properties), m.delivery_count, m.seq, m.size]
                         for m in ms] for q, ms in j.live_messages().items()},
        "kv": {ns: {k: v.hex() for k, v in j.kv(ns).items()} for ns in j.namespaces()},
        "last_seq": j.last_seq,
        "total_bytes": j.total_bytes,
        "live_bytes": j.live_bytes,
        "report": {k: getattr(j.report, k) for k in ("segments", "records_read", "torn_bytes_truncated",
                                                      "orphan_records", "last_seq", "messages")},
    }


def _records_after(j: Journal, name: str) -> list[str]:
    """Raw records as a replica receives them: all of them, or the tail after compaction."""
    return [r.hex() for r in j.records_after(0 if name == "plain" else j.last_seq - 2)]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def write_golden(out: Path) -> None:
    """Write the golden files with whatever ``broker.store.journal`` is importable (see above)."""
    expected: dict = {"codec": codec_vectors()}
    for name, workload in WORKLOADS.items():
        d = out / name
        shutil.rmtree(d, ignore_errors=True)
        with Journal.open(d, CFG) as j:
            workload(j)
        with Journal.open(d, CFG) as j:
            st = read_state(j)
            st["records_after"] = _records_after(j, name)
            st["snapshot"] = {"through_seq": j.snapshot().through_seq,
                              "records": [r.hex() for r in j.snapshot().records]}
            expected[name] = st
    (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=True) + "\n")


def _expected() -> dict:
    return json.loads((GOLDEN / "expected.json").read_text())


def test_codec_writes_and_reads_the_golden_records():
    vectors = _expected()["codec"]
    assert codec_vectors() == vectors
    add = decode_record(bytes.fromhex(vectors["add_message"]))
    assert (add.type, add.seq, add.queue, add.message_id, add.delivery_count, add.properties, add.body) == (
        RecordType.ADD_MESSAGE, 1, "q", 7, 3, {"a": 1, "b": [1, "x"], "c": None}, b"body")
    ack = decode_record(bytes.fromhex(vectors["ack"]))
    assert (ack.type, ack.seq, ack.queue, ack.message_id) == (RecordType.ACK, 2, "q", 7)
    count = decode_record(bytes.fromhex(vectors["update_delivery_count"]))
    assert (count.type, count.seq, count.delivery_count) == (RecordType.UPDATE_DELIVERY_COUNT, 3, 9)


def test_new_code_writes_the_golden_files(tmp_path):
    for name, workload in WORKLOADS.items():
        with Journal.open(tmp_path / name, CFG) as j:
            workload(j)
        golden = _files(GOLDEN / name)
        assert len(golden) >= 2
        assert _files(tmp_path / name) == golden, name


def test_new_code_reads_the_golden_files(tmp_path):
    expected = _expected()
    for name in WORKLOADS:
        d = tmp_path / name
        shutil.copytree(GOLDEN / name, d)
        with Journal.open(d, CFG) as j:
            st = read_state(j)
            snap = j.snapshot()
            assert j.report.clean and not j.report.problems
            if name == "compacted":
                with pytest.raises(JournalGap):
                    j.records_after(0)
            want = dict(expected[name])
            want_snap = want.pop("snapshot")
            assert want.pop("records_after") == _records_after(j, name)
            assert st == want, name
            assert {"through_seq": snap.through_seq, "records": [r.hex() for r in snap.records]} == want_snap
        assert _files(d) == _files(GOLDEN / name)       # reading changed nothing on disk


def test_golden_records_replay_on_a_replica(tmp_path):
    """``apply`` of the golden raw records rebuilds the golden state (the replication wire)."""
    want = _expected()["plain"]
    with Journal.open(tmp_path / "r", CFG) as r:
        for raw in want["records_after"]:
            r.apply(bytes.fromhex(raw))
        r.flush()
    with Journal.open(tmp_path / "r", CFG) as r:
        assert read_state(r)["messages"] == want["messages"] and r.last_seq == want["last_seq"]


if __name__ == "__main__":
    write_golden(Path(sys.argv[1]))
