"""The replication wire format and the backup's sink, without a network (broker.ha.protocol,
broker.ha.replication.ReplicationSink): round trips, garbage refused, and a journal record whose
CRC fails cuts the copy off without applying anything."""

from __future__ import annotations

import pytest

from broker.ha.protocol import (FAILBACK, HANDOVER, HELLO, LOGINS, MAX_LOGINS, RECORDS, SNAPSHOT, SNAPSHOT_END, START,
                                SYNCED, TOPOLOGY, Hello, ProtocolError, Start, Topology, batches, decode, encode,
                                logins_batches)
from broker.ha.replication import ReplicationSink, move_aside
from broker.ha.vote import votes_needed
from broker.store.datadir import open_data_dir
from broker.store.journal import Journal, JournalConfig


@pytest.mark.parametrize("kind,payload", [
    (START, Start("0f1e2d3c-0000-4000-8000-000000000001", 42, "p1")),
    (START, Start("0f1e2d3c-0000-4000-8000-000000000001", 42, "p1", 7)),
    (HELLO, Hello("g1", "backup", "amqp://h:1", "http://h:2")),
    (HELLO, Hello(None, "b", None, None)),
    (HELLO, Hello(None, "b", None, None, logins=True)),
    (LOGINS, [("app", b"d" * 32, b"f" * 16), ("ü", bytes(32), bytes(16))]),
    (LOGINS, []),
    (TOPOLOGY, Topology((("n1", "http://a:1"), ("n2", "http://b:2")), 3)),
    (SNAPSHOT, [b"r1", b"record two"]),
    (RECORDS, [b"x" * 1000]),
    (SNAPSHOT_END, 7), (SYNCED, 2 ** 40), (HANDOVER, 9), (FAILBACK, None),
])
def test_round_trip(kind, payload):
    assert decode(encode(kind, payload)) == (kind, payload)


@pytest.mark.parametrize("body,why", [
    (b"", "bad magic"), (b"LRP2\x01{}", "bad magic"), (b"LRP1\x63", "unknown kind"),
    (b"LRP1\x01not json", "bad JSON"), (b"LRP1\x01[]", "JSON object"),
    (b"LRP1\x01{\"node_id\": 5, \"through_seq\": 1}", "node_id"),
    (b"LRP1\x01{\"node_id\": \"n\", \"through_seq\": -1}", "through_seq"),
    (b"LRP1\x04\x00\x00\x00\x09abc", "truncated record"), (b"LRP1\x04\x00\x00", "truncated record length"),
    (b"LRP1\x04\x00\x00\x00\x00", "truncated record"), (b"LRP1\x11\x00\x01", "8 bytes"),
    (b"LRP1\x12x", "no payload"),
    (b"LRP1\x05{\"members\": [[\"a\"]], \"cluster_size\": 1}", "member"),
    (b"LRP1\x07{\"logins\": 5}", "list"),
    (b"LRP1\x07{\"logins\": [[\"u\", \"AAAA\", \"AAAA\"]]}", "32 bytes"),
    (b"LRP1\x07{\"logins\": [[\"\", \"AAAA\", \"AAAA\"]]}", "a login must be"),
    (b"LRP1\x07{\"logins\": [[\"u\", \"!!\", \"AAAA\"]]}", "base64"),
])
def test_garbage_is_refused(body, why):
    with pytest.raises(ProtocolError) as info:
        decode(body)
    assert why in str(info.value)


def test_batches_cut_by_size():
    recs = [b"a" * 400] * 10
    out = list(batches(recs, limit=1000))
    assert sum(len(b) for b in out) == 10 and all(len(b) <= 3 for b in out)


@pytest.mark.parametrize("n,needed", [(1, 0), (2, 1), (3, 2), (4, 3), (5, 3), (6, 4), (7, 4)])
def test_artemis_quorum_arithmetic(n, needed):
    assert votes_needed(n) == needed


def _live_journal(tmp_path, n=5):
    j = Journal.open(tmp_path / "live", JournalConfig(sync="never"))
    for i in range(n):
        j.add_message("q", i + 1, b"body-%d" % i, {"address": "q"})
    j.flush()
    return j


def _sink(tmp_path):
    dd = open_data_dir(tmp_path / "backup")
    got = []
    sink = ReplicationSink(dd, JournalConfig(sync="never"), keep_saved=2, fsync=True, on_node_id=got.append)
    return dd, sink, got


def test_the_sink_copies_a_journal(tmp_path):
    live = _live_journal(tmp_path)
    snap = live.snapshot()
    dd, sink, got = _sink(tmp_path)
    for kind, payload in [(START, Start("n-1", snap.through_seq)), (SNAPSHOT, snap.records),
                          (SNAPSHOT_END, snap.through_seq)]:
        assert sink.on_message(encode(kind, payload)) == "accepted"
    live.add_message("q", 99, b"after", {"address": "q"})
    assert sink.on_message(encode(RECORDS, list(live.records_after(snap.through_seq)))) == "accepted"
    assert sink.error is None and got == ["n-1"] and sink.in_sync
    assert sink.flush() == live.last_seq
    assert [m.body for m in sink.journal.messages("q")] == [m.body for m in live.messages("q")]
    sink.close()
    dd.close()


def test_a_record_with_a_bad_crc_cuts_the_copy_off(tmp_path):
    live = _live_journal(tmp_path)
    snap = live.snapshot()
    dd, sink, _ = _sink(tmp_path)
    for kind, payload in [(START, Start("n-1", snap.through_seq)), (SNAPSHOT, snap.records),
                          (SNAPSHOT_END, snap.through_seq)]:
        sink.on_message(encode(kind, payload))
    live.add_message("q", 99, b"after", {"address": "q"})
    rec = bytearray(next(iter(live.records_after(snap.through_seq))))
    rec[-3] ^= 0xFF                      # damage the record: its CRC no longer matches
    before = sink.journal.last_seq
    sink.on_message(encode(RECORDS, [bytes(rec)]))
    assert sink.error is not None and "BadRecord" in sink.error
    assert sink.journal.last_seq == before            # nothing applied
    sink.close()
    dd.close()


def test_records_out_of_order_are_refused(tmp_path):
    dd, sink, _ = _sink(tmp_path)
    sink.on_message(encode(RECORDS, [b"x"]))
    assert sink.error is not None and "before the snapshot" in sink.error
    dd.close()


def test_old_copies_are_kept_up_to_the_limit(tmp_path):
    jd = tmp_path / "journal"
    for i in range(4):
        jd.mkdir()
        (jd / "seg").write_text(str(i))
        move_aside(jd, keep=2)
    kept = sorted(p.name for p in tmp_path.glob("journal.old-*"))
    assert kept == ["journal.old-3", "journal.old-4"]
    assert (tmp_path / "journal.old-4" / "seg").read_text() == "3"


def test_the_streamed_snapshot_is_the_compaction_encoding_of_a_churned_journal(tmp_path):
    """iter_snapshot (the initial sync's generator: a lazy merge of each queue's messages, which
    LiveState keeps in seq order) gives exactly the records compaction's _encode_live gives after
    sorting the whole live set, on a journal that went through adds, groups, acks, redelivery
    counts, re-adds of the same message id and key-value puts over many queues."""
    import random

    from broker.store.journal import GroupOp, Journal
    from broker.store.journal.compaction import _encode_live
    from broker.store.journal.replication import iter_snapshot

    rng = random.Random(7)
    j = Journal.open(tmp_path / "j")
    live: dict[tuple[str, int], bool] = {}
    for i in range(3000):
        q = f"q{rng.randrange(7)}"
        op = rng.random()
        if op < 0.45:
            mid = rng.randrange(400)
            j.add_message(q, mid, b"b%d" % i, {"i": i})
            live[(q, mid)] = True
        elif op < 0.55:
            ops = []
            for _ in range(rng.randrange(2, 5)):
                qq, mid = f"q{rng.randrange(7)}", rng.randrange(400)
                ops.append(GroupOp.add(qq, mid, b"g%d" % i, {}))
                live[(qq, mid)] = True
            if live and rng.random() < 0.5:
                qq, mid = rng.choice(sorted(k for k in live if all((o.queue, o.message_id) != k for o in ops)))
                ops.append(GroupOp.ack(qq, mid))
                del live[(qq, mid)]
            j.append_group(ops)
        elif op < 0.8 and live:
            q, mid = rng.choice(sorted(live))
            j.ack(q, mid)
            del live[(q, mid)]
        elif op < 0.9 and live:
            q, mid = rng.choice(sorted(live))
            j.update_delivery_count(q, mid, rng.randrange(1, 9))
        else:
            j.put_kv("ns", f"k{rng.randrange(30)}", b"v%d" % i)
        if i % 500 == 0:
            j.flush()
    j.flush()
    through, items = j.snapshot_items()
    streamed = list(iter_snapshot(items))
    assert streamed == _encode_live(*j._state.live_items())
    assert j.snapshot().records == streamed and through == j.last_seq
    j.close()


def test_an_older_backup_s_hello_does_not_ask_for_logins():
    body = b'LRP1\x10{"group": null, "name": "old", "connector": null, "management_url": null}'
    assert decode(body) == (HELLO, Hello(None, "old", None, None, logins=False))


def test_logins_are_cut_into_transfers_of_at_most_max_logins():
    entries = [(f"u{i}", bytes(32), bytes(16)) for i in range(MAX_LOGINS * 2 + 1)]
    cut = list(logins_batches(entries))
    assert [len(b) for b in cut] == [MAX_LOGINS, MAX_LOGINS, 1]
    assert [e for b in cut for e in decode(encode(LOGINS, b))[1]] == entries
    with pytest.raises(ValueError):
        encode(LOGINS, entries)
