"""Crash tests of the journal with real processes and ``kill -9``.

A child process appends records of a deterministic plan (op ``i`` has seq ``i + 1``), flushes
in batches and prints ``synced <seq>`` after each flush returns: that line is the
acknowledgement a broker would send. The test kills it at an arbitrary point, reopens the
journal and checks that the recovered state is exactly the plan replayed up to some seq
R >= the last acknowledged one: nothing acknowledged is lost, and nothing acked-then-deleted
comes back. Small segments and auto-compaction make rolls and compactions happen under fire.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broker.store.journal import Journal, JournalConfig

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CFG = dict(segment_bytes=64 * 1024, compact_min_bytes=128 * 1024, compact_dead_ratio=0.5)

PLAN = '''
def op(i):
    """Operation number i (seq i + 1)."""
    if i % 16 == 3:
        return ("kv", "k%d" % (i % 5), str(i).encode())
    if i % 2 == 1:      # most messages are acked right after: dead records pile up
        return ("ack", "q%d" % ((i - 1) % 3), i - 1)
    body = (b"%08d" % i) * (512 if i % 97 == 0 else 8)
    return ("add", "q%d" % (i % 3), i, body)
'''

CHILD = PLAN + '''
import random, sys
from broker.store.journal import Journal, JournalConfig
cfg = JournalConfig(segment_bytes={segment_bytes}, compact_min_bytes={compact_min_bytes},
                    compact_dead_ratio={compact_dead_ratio})
j = Journal.open(sys.argv[1], cfg)
rng = random.Random(int(sys.argv[2]))
i = j.last_seq
print("start", i, flush=True)
while i < 10**6:
    for _ in range(rng.randint(1, 40)):
        o = op(i)
        if o[0] == "add":
            seq = j.add_message(o[1], o[2], o[3], {{"address": o[1]}})
        elif o[0] == "ack":
            seq = j.ack(o[1], o[2])
        else:
            seq = j.put_kv("ns", o[1], o[2])
        assert seq == i + 1, (seq, i)
        i += 1
    print("synced", j.flush(), flush=True)
'''

ns: dict = {}
exec(PLAN, ns)
op = ns["op"]


def expected_state(upto: int):
    msgs: dict[str, dict[int, bytes]] = {}
    kv: dict[str, bytes] = {}
    for i in range(upto):
        o = op(i)
        if o[0] == "add":
            msgs.setdefault(o[1], {})[o[2]] = o[3]
        elif o[0] == "ack":
            msgs[o[1]].pop(o[2])
        else:
            kv[o[1]] = o[2]
    return {q: list(d.items()) for q, d in msgs.items() if d}, kv


def recovered_state(j: Journal):
    return ({q: [(m.message_id, m.body) for m in ms] for q, ms in j.live_messages().items()},
            j.kv("ns"))


def run_child_until(journal_dir: Path, seed: int, kill_after_seq: int) -> int:
    """Run the writer, kill -9 it once it has acknowledged ``kill_after_seq``; return the last
    acknowledged seq."""
    code = CHILD.format(**CFG)
    proc = subprocess.Popen([sys.executable, "-c", code, str(journal_dir), str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    acked = 0
    deadline = time.monotonic() + 120
    try:
        first = proc.stdout.readline().decode()
        assert first.startswith("start"), first + proc.stderr.read().decode()
        while acked < kill_after_seq:
            assert time.monotonic() < deadline, "writer too slow"
            line = proc.stdout.readline().decode()
            assert line.startswith("synced "), line + proc.stderr.read().decode()
            seq = int(line.split()[1])
            assert seq > acked
            acked = seq
        proc.send_signal(signal.SIGKILL)
        # acknowledgements printed before the kill landed also count
        rest = proc.stdout.read().decode().split("\n")
        for line in rest:
            if line.startswith("synced "):
                acked = max(acked, int(line.split()[1]))
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return acked


def test_kill_9_loses_no_acknowledged_record(tmp_path):
    jdir = tmp_path / "journal"
    acked_total = 0
    compactions_seen = False
    for round_no, target in enumerate([1500, 8000, 30000]):
        acked = run_child_until(jdir, seed=round_no, kill_after_seq=target)
        assert acked >= target
        with Journal.open(jdir, JournalConfig(**CFG)) as j:
            recovered = j.last_seq
            assert recovered >= acked, f"acknowledged seq {acked} lost (recovered {recovered})"
            assert recovered_state(j) == expected_state(recovered)
            assert j.report.corrupt_records == 0
            # segment 1 is gone only once a compaction replaced it
            compactions_seen = compactions_seen or j.segment_files()[0].name != "journal-00000001.log"
        acked_total = acked
    assert acked_total >= 30000
    assert compactions_seen


LOCKER = '''
import sys, time
from broker.store.datadir import open_data_dir
from broker.store.errors import DataDirLocked
try:
    dd = open_data_dir(sys.argv[1])
except DataDirLocked as exc:
    print("locked-out", exc.holder_pid, str(exc), flush=True)
    sys.exit(3)
print("holding", dd.node_id, flush=True)
time.sleep(float(sys.argv[2]))  # the thing under test: the lock is held this long
'''


def _locker(data_dir: Path, hold_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOCKER, str(data_dir), str(hold_s)],
                            stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_second_process_on_same_data_dir_is_refused(tmp_path):
    data_dir = tmp_path / "node"
    holder = _locker(data_dir, 60)
    try:
        line = holder.stdout.readline().decode().split()
        assert line[0] == "holding"
        node_id = line[1]
        second = _locker(data_dir, 0)
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 3
        text = out.decode()
        assert text.startswith(f"locked-out {holder.pid} ")
        assert str(data_dir) in text and f"process {holder.pid}" in text
        holder.send_signal(signal.SIGKILL)          # the kernel drops the flock with the process
        holder.wait(timeout=30)
        third = _locker(data_dir, 0)
        out, _ = third.communicate(timeout=60)
        assert third.returncode == 0 and out.decode().split() == ["holding", node_id]
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
