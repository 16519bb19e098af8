"""Unit tests of the durable journal (broker/store/journal.py) and data dir (datadir.py).

Real files in tmp_path: the journal is file I/O, and a fake file system would test nothing.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from broker.store.datadir import open_data_dir
from broker.store.errors import (BadRecord, DataDirError, DataDirLocked, JournalCorrupt, JournalFailed,
                                 JournalGap)
from broker.store.journal import (REC_HEADER_BYTES, SEG_HEADER_BYTES, Journal, JournalConfig,
                                  RecordType, Snapshot, decode_record, encode_record)
from broker.wire.io.tomlconfig import ConfigError, Table

SMALL = JournalConfig(segment_bytes=4096, compact_min_bytes=1 << 40)  # no auto compaction


def state(j: Journal):
    """Everything recovery must restore, in comparable form."""
    msgs = {q: [(m.message_id, m.body, dict(m.properties), m.delivery_count) for m in ms]
            for q, ms in j.live_messages().items()}
    kv = {ns: j.kv(ns) for ns in j.namespaces()}
    return msgs, kv


def workload(j: Journal) -> None:
    """A mix of every record type."""
    j.put_kv("address", "orders", b'{"routing":"anycast"}')
    j.put_kv("address", "events", b'{"routing":"multicast"}')
    for i in range(20):
        j.add_message("orders", i, f"order {i}".encode() * 3, {"address": "orders", "priority": i % 10,
                                                             "expiry_ms": None, "durable": True})
    j.add_message("events::sub1", 100, b"\x00\xff" * 50)
    for i in range(0, 20, 3):
        j.ack("orders", i)
    j.update_delivery_count("orders", 1, 3)
    j.update_delivery_count("orders", 2, 1)
    j.put_kv("address", "orders", b'{"routing":"anycast","max":5}')
    j.delete_kv("address", "events")
    j.put_kv("ünïcode ns", "kéy", b"")


# -- records ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rtype,payload", [
    (RecordType.ACK, b"\x00\x01q" + (7).to_bytes(8, "big")),
    (RecordType.DEL_KV, b"\x00\x02ns\x00\x01k"),
    (RecordType.ADD_KV, b"\x00\x02ns\x00\x01k" + b"value"),
])
def test_record_round_trip(rtype, payload):
    raw = encode_record(rtype, 42, payload)
    assert len(raw) == REC_HEADER_BYTES + len(payload)
    rec = decode_record(raw)
    assert rec.type == rtype and rec.seq == 42


@pytest.mark.parametrize("mangle,reason", [
    (lambda r: r[:-1], "partial record"),
    (lambda r: r[:5], "partial header"),
    (lambda r: r + b"x", "trailing"),
    (lambda r: r[:4] + b"\x09" + r[5:], "unknown record type"),
    (lambda r: r[:-1] + bytes([r[-1] ^ 1]), "CRC mismatch"),
    (lambda r: r[:10] + bytes([r[10] ^ 1]) + r[11:], "CRC mismatch"),   # seq bit flip
])
def test_decode_record_rejects(mangle, reason):
    raw = encode_record(RecordType.ADD_KV, 5, b"\x00\x02ns\x00\x01k" + b"value")
    with pytest.raises(BadRecord, match=reason):
        decode_record(mangle(raw))


def test_decode_rejects_payload_that_lies_about_lengths():
    # CRC-good but the string length runs past the end
    with pytest.raises(BadRecord):
        decode_record(encode_record(RecordType.ACK, 1, b"\x00\x50q"))


# -- round trip ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sync", ["batch", "always", "never"])
def test_round_trip_all_record_types(tmp_path, sync):
    cfg = JournalConfig(sync=sync, segment_bytes=4096, compact_min_bytes=1 << 40)
    with Journal.open(tmp_path, cfg) as j:
        workload(j)
        expected = state(j)
        last = j.last_seq
        assert j.flush() == last == j.synced_seq == j.written_seq
    with Journal.open(tmp_path, cfg) as j2:
        assert state(j2) == expected
        assert j2.report.clean and j2.report.records_read == last and j2.report.last_seq == last
        assert [m.message_id for m in j2.messages("orders")] == [i for i in range(20) if i % 3]
        assert j2.get_message("orders", 1).delivery_count == 3
        assert j2.kv("address") == {"orders": b'{"routing":"anycast","max":5}'}
        assert j2.add_message("q", 1, b"x") == last + 1


def test_seq_increases_by_one_and_synced_seq_lags_until_flush(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        seqs = [j.put_kv("n", str(i), b"v") for i in range(10)]
        assert seqs == list(range(1, 11))
        assert j.synced_seq == 0 and j.written_seq == 0
        assert j.flush() == 10
        assert j.synced_seq == 10


def _on_disk(path: Path) -> dict:
    """What a restart would find: the journal reopened from a copy of its files."""
    copy = path.parent / (path.name + "-copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(path, copy)
    with Journal.open(copy, SMALL) as j2:
        return {k: v.decode() for k, v in j2.kv("n").items()}


def test_a_hold_keeps_the_newest_record_and_later_ones_for_one_write(tmp_path):
    """Journal.hold (a mirror's batch): the record just appended and everything after it wait
    until release, whatever flushes run meanwhile; earlier records are written as usual."""
    with Journal.open(tmp_path, SMALL) as j:
        j.put_kv("n", "before", b"1")
        j.put_kv("n", "cause", b"2")
        j.hold()                      # the cause is the newest record: it is held too
        j.put_kv("n", "during", b"3")
        assert j.flush() == 1 and j.written_seq == 1
        assert _on_disk(tmp_path) == {"before": "1"}
        j.hold()                      # holds nest
        j.put_kv("n", "event", b"4")
        j.release()
        j.flush()
        assert _on_disk(tmp_path) == {"before": "1"}
        j.release()
        assert j.flush() == 4
        assert _on_disk(tmp_path) == {"before": "1", "cause": "2", "during": "3", "event": "4"}
        j.hold()                      # the newest record is written already: only later ones wait
        j.put_kv("n", "after", b"5")
        j.flush()
        assert j.written_seq == 4
        j.release()


def test_close_and_compaction_write_held_records(tmp_path):
    j = Journal.open(tmp_path, SMALL)
    j.put_kv("n", "a", b"1")
    j.hold()
    j.put_kv("n", "b", b"2")
    j.compact()
    assert _on_disk(tmp_path) == {"a": "1", "b": "2"}
    j.put_kv("n", "c", b"3")
    j.close()
    with Journal.open(tmp_path, SMALL) as j2:
        assert set(j2.kv("n")) == {"a", "b", "c"}


def test_sync_always_is_durable_on_return(tmp_path):
    with Journal.open(tmp_path, JournalConfig(sync="always")) as j:
        seq = j.add_message("q", 1, b"x")
        assert j.synced_seq == seq
        assert os.path.getsize(j.segment_files()[-1]) > SEG_HEADER_BYTES


def test_segments_roll_at_configured_size(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        for i in range(200):
            j.add_message("q", i, b"y" * 100)
            if i % 17 == 0:
                j.flush()
        j.flush()
        files = j.segment_files()
        assert len(files) > 4
        # every closed segment stays within the limit (a lone oversize record is allowed)
        assert all(os.path.getsize(f) <= 4096 for f in files)
        expected = state(j)
    with Journal.open(tmp_path, SMALL) as j2:
        assert state(j2) == expected and j2.report.segments == len(files)


def test_oversize_record_gets_a_segment(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        j.add_message("q", 1, b"a")
        j.add_message("q", 2, b"b" * 10000)
        j.add_message("q", 3, b"c")
        j.flush()
    with Journal.open(tmp_path, SMALL) as j2:
        assert [m.body[:1] for m in j2.messages("q")] == [b"a", b"b", b"c"]


def test_concurrent_appends_and_flushes(tmp_path):
    """Appends from one thread while another flushes: group commit must lose and reorder nothing."""
    j = Journal.open(tmp_path, SMALL)
    stop = threading.Event()
    synced: list[int] = []

    def flusher():
        while not stop.is_set():
            synced.append(j.flush())

    t = threading.Thread(target=flusher)
    t.start()
    for i in range(3000):
        j.add_message("q", i, i.to_bytes(4, "big"))
        if i:
            j.ack("q", i - 1)
    stop.set()
    t.join()
    j.close()
    assert synced == sorted(synced)
    with Journal.open(tmp_path, SMALL) as j2:
        assert [m.message_id for m in j2.messages("q")] == [2999]
        assert j2.last_seq == 5999


def test_failed_fsync_poisons_the_journal(tmp_path, monkeypatch):
    import errno

    import broker.store.journal as journal_mod

    j = Journal.open(tmp_path, SMALL)
    j.add_message("q", 1, b"durable")
    assert j.flush() == 1

    def broken(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(journal_mod, "_datasync", broken)
    j.add_message("q", 2, b"never acknowledged")
    with pytest.raises(JournalFailed, match="Input/output error"):
        j.flush()
    assert j.synced_seq == 1                              # seq 2 is never reported durable
    monkeypatch.undo()
    with pytest.raises(JournalFailed, match="restart the broker"):
        j.add_message("q", 3, b"refused")
    with pytest.raises(JournalFailed):
        j.flush()                                         # a later fsync must not "succeed"
    j.close()
    with Journal.open(tmp_path, SMALL) as j2:
        assert [m.message_id for m in j2.messages("q")][:1] == [1]


# -- torn tails and corruption --------------------------------------------------------------------

def _three_records(tmp_path: Path) -> tuple[Path, int, int]:
    with Journal.open(tmp_path, SMALL) as j:
        j.add_message("q", 1, b"first")
        j.add_message("q", 2, b"second")
        j.add_message("q", 3, b"third, the last record")
        j.flush()
        seg = j.segment_files()[-1]
    size = os.path.getsize(seg)
    last_len = REC_HEADER_BYTES + len(b"third, the last record") + 2 + 1 + 12 + 4
    return seg, size - last_len, size


def test_torn_tail_truncated_at_every_byte_offset_of_last_record(tmp_path):
    seg, start, end = _three_records(tmp_path)
    original = seg.read_bytes()
    for cut in range(start, end):
        seg.write_bytes(original[:cut])
        with Journal.open(tmp_path, SMALL) as j:
            assert [m.body for m in j.messages("q")] == [b"first", b"second"], cut
            assert j.report.torn_bytes_truncated == cut - start
            assert (j.report.problems != []) == (cut > start)
            assert os.path.getsize(seg) == start      # truncated on disk
            assert j.last_seq == 2
            assert j.add_message("q", 9, b"after") == 3  # seq reused: 3 was never durable
        with Journal.open(tmp_path, SMALL) as j:
            assert j.report.clean and [m.message_id for m in j.messages("q")] == [1, 2, 9]
        seg.write_bytes(original)


def test_crc_bad_last_record_at_every_byte_is_a_torn_tail(tmp_path):
    seg, start, end = _three_records(tmp_path)
    original = seg.read_bytes()
    for off in range(start, end):
        damaged = bytearray(original)
        damaged[off] ^= 0x5A
        seg.write_bytes(bytes(damaged))
        with Journal.open(tmp_path, SMALL) as j:
            assert [m.body for m in j.messages("q")] == [b"first", b"second"], off
            assert j.report.torn_bytes_truncated == end - start
            assert not j.report.clean
        seg.write_bytes(original)


def test_corruption_with_valid_records_after_it_is_not_a_torn_tail(tmp_path):
    seg, start, end = _three_records(tmp_path)
    data = bytearray(seg.read_bytes())
    mid = SEG_HEADER_BYTES + REC_HEADER_BYTES + 3        # inside record 1
    data[mid] ^= 0xFF
    seg.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt) as ei:
        Journal.open(tmp_path, SMALL)
    assert ei.value.file == str(seg) and ei.value.offset == SEG_HEADER_BYTES
    assert "CRC mismatch" in str(ei.value) and str(seg) in str(ei.value)
    assert seg.read_bytes() == bytes(data)               # nothing truncated or lost
    with Journal.open(tmp_path, SMALL, repair=True) as j:
        assert [m.body for m in j.messages("q")] == [b"second", b"third, the last record"]
        assert j.report.corrupt_records == 1 and j.report.corrupt_bytes > 0
        assert j.compactions == 1                      # the damage is rewritten away
    with Journal.open(tmp_path, SMALL) as j:
        assert j.report.clean and len(j.messages("q")) == 2


def test_corruption_in_a_non_final_segment_is_reported(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        for i in range(100):
            j.add_message("q", i, b"z" * 200)
        j.flush()
        files = j.segment_files()
    assert len(files) >= 3
    first = files[0]
    data = bytearray(first.read_bytes())
    data[-5] ^= 1                                       # last record of a closed segment
    first.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=first.name):
        Journal.open(tmp_path, SMALL)
    with Journal.open(tmp_path, SMALL, repair=True) as j:
        assert len(j.messages("q")) == 99 and j.report.corrupt_records == 1


def test_bad_segment_header(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        for i in range(50):
            j.add_message("q", i, b"z" * 200)
    files = sorted(tmp_path.glob("journal-*.log"))
    files[0].write_bytes(b"NOTAJRNL" + files[0].read_bytes()[8:])
    with pytest.raises(JournalCorrupt, match="bad magic"):
        Journal.open(tmp_path, SMALL)


def test_partial_header_of_last_segment_is_rewritten(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        j.add_message("q", 1, b"x")
    (tmp_path / "journal-00000002.log").write_bytes(b"LODE")   # crashed while rolling
    with Journal.open(tmp_path, SMALL) as j:
        assert len(j.messages("q")) == 1 and j.report.torn_bytes_truncated == 4
        assert j.add_message("q", 2, b"y") == 2
    with Journal.open(tmp_path, SMALL) as j:
        assert len(j.messages("q")) == 2 and j.report.clean


# -- compaction -----------------------------------------------------------------------------------

def test_compaction_keeps_live_state_and_reclaims_space(tmp_path):
    cfg = JournalConfig(segment_bytes=8192, compact_min_bytes=1 << 40)
    with Journal.open(tmp_path, cfg) as j:
        workload(j)
        for i in range(500):
            j.add_message("churn", i, b"c" * 100)
            j.ack("churn", i)
        j.flush()
        before_files = len(j.segment_files())
        expected = state(j)
        last = j.last_seq
        assert j.needs_compaction() is False            # below compact_min_bytes
        reclaimed = j.compact()
        assert reclaimed > 50_000 and j.compactions == 1
        assert state(j) == expected
        assert len(j.segment_files()) == 2 < before_files  # compacted + new active
        assert j.total_bytes == j.live_bytes
        assert j.add_message("q", 1, b"new") == last + 1
        expected = state(j)
    assert not list(tmp_path.glob("*.compact"))
    with Journal.open(tmp_path, cfg) as j2:
        assert state(j2) == expected and j2.last_seq == last + 1 and j2.report.clean


def test_seq_does_not_regress_when_the_newest_records_are_dead(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        j.add_message("q", 1, b"x")
        j.ack("q", 1)
        j.compact()
    with Journal.open(tmp_path, SMALL) as j:
        assert j.last_seq == 2 and j.live_messages() == {}
        assert j.put_kv("n", "k", b"v") == 3


def test_auto_compaction_on_flush(tmp_path):
    cfg = JournalConfig(segment_bytes=4096, compact_min_bytes=20_000, compact_dead_ratio=0.6)
    with Journal.open(tmp_path, cfg) as j:
        j.put_kv("address", "a", b"1")
        for i in range(2000):
            j.add_message("q", i, b"m" * 50)
            if i >= 5:
                j.ack("q", i - 5)
            if i % 50 == 0:
                j.flush()
        j.flush()
        assert j.compactions >= 1
        assert j.total_bytes < 60_000
        expected = state(j)
    with Journal.open(tmp_path, cfg) as j:
        assert state(j) == expected and [m.message_id for m in j.messages("q")] == list(range(1995, 2000))


def test_interrupted_compaction_before_rename_is_discarded(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        workload(j)
        expected = state(j)
    (tmp_path / "journal-00000001.compact").write_bytes(b"half written garbage")
    with Journal.open(tmp_path, SMALL) as j:
        assert state(j) == expected and j.report.leftover_compactions_removed == 1
    assert not list(tmp_path.glob("*.compact"))


def test_interrupted_compaction_after_rename_ignores_older_segments(tmp_path):
    """Crash between step 4 (rename) and 5 (unlink older): old segments must not replay,
    or acked messages would come back."""
    with Journal.open(tmp_path, SMALL) as j:
        for i in range(100):
            j.add_message("q", i, b"p" * 100)
        for i in range(90):
            j.ack("q", i)
        j.flush()
        saved = {f.name: f.read_bytes() for f in j.segment_files()}
        j.compact()
        expected = state(j)
        compacted = j.segment_files()[0].name
    for name, data in saved.items():
        if name < compacted:
            (tmp_path / name).write_bytes(data)         # "not yet unlinked"
    with Journal.open(tmp_path, SMALL) as j:
        assert state(j) == expected
        assert j.report.stale_segments_removed == sum(1 for n in saved if n < compacted)
        assert [m.message_id for m in j.messages("q")] == list(range(90, 100))


# -- replication ----------------------------------------------------------------------------------

def test_replica_apply_reuses_recovery_and_matches_live(tmp_path):
    live = Journal.open(tmp_path / "live", SMALL)
    replica = Journal.open(tmp_path / "backup", SMALL)
    workload(live)
    live.flush()
    live.add_message("late", 1, b"not yet flushed on live")   # pending records replicate too
    for raw in live.records_after(0):
        replica.apply(raw)
    assert state(replica) == state(live) and replica.last_seq == live.last_seq
    # duplicates are ignored; a gap is refused
    raws = list(live.records_after(0))
    assert replica.apply(raws[0]) == 1 and state(replica) == state(live)
    live.ack("orders", 1)
    live.ack("orders", 2)
    with pytest.raises(JournalGap):
        replica.apply(list(live.records_after(live.last_seq - 1))[0])
    for raw in live.records_after(replica.last_seq):
        replica.apply(raw)
    assert replica.flush() == live.last_seq
    expected = state(live)
    live.close()
    replica.close()
    with Journal.open(tmp_path / "backup", SMALL) as r2:
        assert state(r2) == expected and r2.report.clean


def test_replica_behind_compaction_installs_a_snapshot(tmp_path):
    live = Journal.open(tmp_path / "live", SMALL)
    replica = Journal.open(tmp_path / "backup", SMALL)
    replica.put_kv("stale", "x", b"from an older life")   # a snapshot replaces everything
    workload(live)
    live.compact()
    with pytest.raises(JournalGap):
        live.records_after(0)
    snap = live.snapshot()
    assert isinstance(snap, Snapshot) and snap.through_seq == live.last_seq
    replica.install_snapshot(snap)
    live.add_message("orders", 500, b"after the snapshot")
    for raw in live.records_after(snap.through_seq):
        replica.apply(raw)
    assert state(replica) == state(live) and replica.last_seq == live.last_seq
    expected = state(live)
    replica.close()
    live.close()
    with Journal.open(tmp_path / "backup", SMALL) as r2:
        assert state(r2) == expected and r2.last_seq == snap.through_seq + 1


def test_apply_rejects_damaged_bytes(tmp_path):
    with Journal.open(tmp_path, SMALL) as j:
        raw = encode_record(RecordType.ADD_KV, 1, b"\x00\x01n\x00\x01k")
        with pytest.raises(BadRecord):
            j.apply(raw[:-1] + b"\x00")
        assert j.last_seq == 0


# -- config ---------------------------------------------------------------------------------------

def test_config_from_table():
    t = Table(Path("etc/broker.toml"), "journal", {"sync": "always", "segment-bytes": 1 << 20})
    cfg = JournalConfig.from_table(t)
    assert cfg.sync == "always" and cfg.segment_bytes == 1 << 20


@pytest.mark.parametrize("data,message", [
    ({"sync": "sometimes"}, "etc/broker.toml: journal.sync: 'sometimes' must be one of batch, always, never"),
    ({"segment-bytes": 10}, "etc/broker.toml: journal.segment-bytes: 10 must be >= 4096"),
    ({"compact-dead-ratio": 1.5}, "etc/broker.toml: journal.compact-dead-ratio: 1.5 must be < 1"),
    ({"fsync": "batch"}, "etc/broker.toml: journal.fsync: unknown key"),
])
def test_config_errors_name_file_key_value(data, message):
    with pytest.raises(ConfigError) as ei:
        JournalConfig.from_table(Table(Path("etc/broker.toml"), "journal", data))
    assert str(ei.value).startswith(message)


# -- data dir -------------------------------------------------------------------------------------

def test_data_dir_node_id_is_created_once_and_kept(tmp_path):
    d = tmp_path / "node1"
    with open_data_dir(d) as dd:
        node_id = dd.node_id
        assert len(node_id) == 36 and node_id == node_id.lower() and node_id.count("-") == 4
        with dd.open_journal(SMALL) as j:
            j.put_kv("n", "k", b"v")
    with open_data_dir(d) as dd:
        assert dd.node_id == node_id
        assert (d / "node.id").read_text() == node_id + "\n"
        with dd.open_journal(SMALL) as j:
            assert j.kv("n") == {"k": b"v"}


def test_data_dir_lock_names_dir_and_holder(tmp_path):
    dd = open_data_dir(tmp_path)
    with pytest.raises(DataDirLocked) as ei:
        open_data_dir(tmp_path)
    assert ei.value.holder_pid == os.getpid()
    assert str(tmp_path) in str(ei.value) and str(os.getpid()) in str(ei.value)
    dd.close()
    open_data_dir(tmp_path).close()                   # released


def test_data_dir_rejects_malformed_node_id(tmp_path):
    (tmp_path / "node.id").write_text("not-a-uuid\n")
    with pytest.raises(DataDirError, match="not a lowercase UUID"):
        open_data_dir(tmp_path)
    open_data_dir(tmp_path / "fresh").close()
    shutil.rmtree(tmp_path / "fresh")


# -- differential: random operations against a dict model ----------------------------------------

_OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.sampled_from(["q1", "q2"]), st.integers(0, 15), st.binary(max_size=300)),
    st.tuples(st.just("ack"), st.sampled_from(["q1", "q2"]), st.integers(0, 15)),
    st.tuples(st.just("count"), st.sampled_from(["q1", "q2"]), st.integers(0, 15), st.integers(0, 9)),
    st.tuples(st.just("put"), st.sampled_from(["a", "b"]), st.sampled_from(["k1", "k2", "k3"]), st.binary(max_size=50)),
    st.tuples(st.just("del"), st.sampled_from(["a", "b"]), st.sampled_from(["k1", "k2", "k3"])),
    st.tuples(st.just("flush")), st.tuples(st.just("compact")), st.tuples(st.just("reopen")),
), max_size=120)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS)
def test_random_operations_match_a_model(ops):
    import tempfile

    # sync="never": fsync adds nothing to what a model comparison checks, only time
    cfg = JournalConfig(sync="never", segment_bytes=4096, compact_min_bytes=2048, compact_dead_ratio=0.3)
    msgs: dict[str, dict[int, list]] = {}
    kv: dict[str, dict[str, bytes]] = {}
    want: tuple = ({}, {})
    with tempfile.TemporaryDirectory() as d:
        j = Journal.open(d, cfg)
        try:
            for op in ops:
                if op[0] == "add":
                    j.add_message(op[1], op[2], op[3])
                    q = msgs.setdefault(op[1], {})
                    q.pop(op[2], None)
                    q[op[2]] = [op[3], 0]
                elif op[0] == "ack":
                    j.ack(op[1], op[2])
                    msgs.get(op[1], {}).pop(op[2], None)
                elif op[0] == "count":
                    j.update_delivery_count(op[1], op[2], op[3])
                    if op[2] in msgs.get(op[1], {}):
                        msgs[op[1]][op[2]][1] = op[3]
                elif op[0] == "put":
                    j.put_kv(op[1], op[2], op[3])
                    kv.setdefault(op[1], {})[op[2]] = op[3]
                elif op[0] == "del":
                    j.delete_kv(op[1], op[2])
                    kv.get(op[1], {}).pop(op[2], None)
                elif op[0] == "flush":
                    assert j.flush() == j.last_seq
                elif op[0] == "compact":
                    j.compact()
                else:
                    last = j.last_seq
                    j.close()
                    j = Journal.open(d, cfg)
                    assert j.report.clean and j.last_seq == last
                want = ({q: [(i, b, {}, c) for i, (b, c) in d_.items()] for q, d_ in msgs.items() if d_},
                        {ns: d_ for ns, d_ in kv.items() if d_})
                assert state(j) == want
        finally:
            j.close()
        with Journal.open(d, cfg) as j2:
            assert state(j2) == want
