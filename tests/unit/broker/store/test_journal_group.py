"""The journal's GROUP record: a committed transaction's operations, atomic on disk and on replicas."""

from __future__ import annotations

import pytest

from broker.store.errors import BadRecord, LocalStoreError
from broker.store.journal import (REC_HEADER_BYTES, GroupOp, Journal, JournalConfig, RecordType,
                                  decode_record)

SMALL = JournalConfig(segment_bytes=4096, compact_min_bytes=1 << 40)


def state(j: Journal):
    return {q: [(m.message_id, m.body, dict(m.properties), m.delivery_count) for m in ms]
            for q, ms in j.live_messages().items()}


def before_and_group(j: Journal) -> int:
    """Some plain records, then one group (adds in two queues, an ack, a count change)."""
    j.add_message("q", 1, b"one")
    j.add_message("q", 2, b"two")
    return j.append_group([GroupOp.add("q", 10, b"ten", {"address": "a"}),
                           GroupOp.add("other", 11, b"eleven"),
                           GroupOp.ack("q", 1),
                           GroupOp.count("q", 2, 3),
                           GroupOp.add("q", 12, b"twelve" * 20)])


def test_group_applies_all_operations_under_one_seq(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        seq = before_and_group(j)
        assert seq == 3 and j.last_seq == 3
        want = {"q": [(2, b"two", {}, 3), (10, b"ten", {"address": "a"}, 0), (12, b"twelve" * 20, {}, 0)],
                "other": [(11, b"eleven", {}, 0)]}
        assert state(j) == want
        j.flush()
    with Journal.open(tmp_path, SMALL) as j:
        assert state(j) == want and j.report.clean and j.report.records_read == 3


def test_group_record_round_trip():
    from broker.store.journal import _payload_group
    payload = _payload_group([(RecordType.ADD_MESSAGE, GroupOp.add("q", 5, b"x").payload()),
                              (RecordType.ACK, GroupOp.ack("q", 4).payload())])
    from broker.store.journal import encode_record
    rec = decode_record(encode_record(RecordType.GROUP, 9, payload))
    assert rec.type == RecordType.GROUP and rec.seq == 9
    assert [(o.type, o.queue, o.message_id, o.seq) for o in rec.ops] == [
        (RecordType.ADD_MESSAGE, "q", 5, 9), (RecordType.ACK, "q", 4, 9)]
    assert rec.ops[0].body == b"x"


@pytest.mark.parametrize("mangle", [
    lambda p: p[:4] + bytes([4]) + p[5:],                      # a KV inside a group
    lambda p: p + b"\x00",                                     # trailing bytes
    lambda p: (9).to_bytes(4, "big") + p[4:],                  # claims more operations than it has
    lambda p: p[:5] + (1 << 20).to_bytes(4, "big") + p[9:],    # an operation longer than the record
])
def test_damaged_group_payload_is_a_bad_record(mangle):
    from broker.store.journal import _payload_group, encode_record
    payload = _payload_group([(RecordType.ACK, GroupOp.ack("q", 4).payload())])
    with pytest.raises(BadRecord):
        decode_record(encode_record(RecordType.GROUP, 1, mangle(payload)))


def test_empty_group_and_foreign_operations_are_refused(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        with pytest.raises(LocalStoreError):
            j.append_group([])
        from broker.store.journal import _payload_group
        with pytest.raises(LocalStoreError):
            _payload_group([(RecordType.ADD_KV, b"")])


def test_torn_group_at_every_byte_leaves_no_trace(tmp_path):
    """A crash while the group record was being written: none of its operations survive."""
    src = tmp_path / "src"
    with Journal.open(src, SMALL) as j:
        before_and_group(j)
    seg = sorted(src.glob("journal-*.log"))[-1]
    data = seg.read_bytes()
    # the group is the last record: walk the records from the segment header to find its start
    from broker.store.journal import SEG_HEADER_BYTES, _parse_at
    pos = SEG_HEADER_BYTES
    starts = []
    while pos < len(data):
        starts.append(pos)
        pos = _parse_at(data, pos)[2]
    start = starts[-1]
    assert data[start + 4] == RecordType.GROUP
    want = {"q": [(1, b"one", {}, 0), (2, b"two", {}, 0)]}
    for cut in range(start + 1, len(data)):
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / seg.name).write_bytes(data[:cut])
        with Journal.open(d, SMALL) as j:
            assert state(j) == want, cut
            assert j.report.torn_bytes_truncated == cut - start
            assert j.last_seq == 2


def test_torn_group_by_a_flipped_byte_inside_it(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        before_and_group(j)
    seg = sorted(tmp_path.glob("journal-*.log"))[-1]
    data = bytearray(seg.read_bytes())
    data[-30] ^= 0xFF          # inside the last operation of the group: CRC mismatch
    seg.write_bytes(bytes(data))
    with Journal.open(tmp_path, SMALL) as j:
        assert state(j) == {"q": [(1, b"one", {}, 0), (2, b"two", {}, 0)]}
        assert j.report.torn_bytes_truncated > REC_HEADER_BYTES


def test_replica_applies_a_group_atomically(tmp_path):
    live = Journal.open(tmp_path / "live", SMALL)
    replica = Journal.open(tmp_path / "backup", SMALL)
    before_and_group(live)
    raws = list(live.records_after(0))
    assert len(raws) == 3
    for raw in raws:
        replica.apply(raw)
    assert state(replica) == state(live) and replica.last_seq == live.last_seq
    with pytest.raises(BadRecord):
        replica.apply(raws[-1][:-1])            # a group cut short is refused whole
    replica.flush()
    expected = state(live)
    live.close()
    replica.close()
    with Journal.open(tmp_path / "backup", SMALL) as r2:
        assert state(r2) == expected


def test_compaction_and_snapshot_keep_group_messages(tmp_path):
    with Journal.open(tmp_path / "j", SMALL) as j:
        before_and_group(j)
        j.append_group([GroupOp.add("q", 20, b"a"), GroupOp.add("q", 21, b"b"), GroupOp.add("q", 22, b"c")])
        j.ack("q", 21)
        j.append_group([GroupOp.ack("q", 20), GroupOp.ack("q", 22)])    # a group of acks only
        j.add_message("q", 30, b"after")
        expected = state(j)
        last = j.last_seq
        j.compact()
        assert state(j) == expected
        snap = j.snapshot()
        replica = Journal.open(tmp_path / "r", SMALL)
        replica.install_snapshot(snap)
        assert state(replica) == expected
        replica.close()
    with Journal.open(tmp_path / "j", SMALL) as j:
        assert state(j) == expected and j.last_seq == last and j.report.clean
        # the three live messages of the first group were rewritten as one GROUP record
        seg = j.segment_files()[0]
    from broker.store.journal import SEG_HEADER_BYTES, _parse_at
    data = seg.read_bytes()
    pos, types = SEG_HEADER_BYTES, []
    while pos < len(data):
        rtype, _, pos = _parse_at(data, pos)
        types.append(RecordType(rtype))
    assert RecordType.GROUP in types
