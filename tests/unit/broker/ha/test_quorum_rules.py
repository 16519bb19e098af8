"""The pluggable quorum's rules without ZooKeeper (broker.ha.quorum): try_activate and claim_next
over an in-memory coordinator, each crash point of the two-step claim recovered, the local file,
and the [ha.manager] configuration's errors. The real service: tests/integration/test_ha_zookeeper.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from broker.config import load_config
from broker.ha.quorum import (SequenceError, claim_next, read_local_sequence, try_activate,
                              write_local_sequence)
from broker.wire.io.tomlconfig import ConfigError


class FakeCoordinator:
    """The lock and the sequence of one coordination id, in memory, shared by several members."""

    def __init__(self, seq: int = 0, held_by: str | None = None) -> None:
        self.seq = seq
        self.held_by = held_by

    def member(self, name: str) -> "Member":
        return Member(self, name)


class Member:
    def __init__(self, shared: FakeCoordinator, name: str) -> None:
        self.shared = shared
        self.name = name
        self.fail_cas_after: int | None = None    # crash: the n-th compare-and-set never happens
        self.cas_count = 0

    async def try_lock(self, timeout_s: float) -> bool:
        if self.shared.held_by in (None, self.name):
            self.shared.held_by = self.name
            return True
        return False

    async def unlock(self) -> None:
        if self.shared.held_by == self.name:
            self.shared.held_by = None

    async def holder(self):
        return self.shared.held_by

    async def get_sequence(self) -> int:
        return self.shared.seq

    async def cas_sequence(self, expect: int, new: int) -> bool:
        self.cas_count += 1
        if self.fail_cas_after is not None and self.cas_count > self.fail_cas_after:
            raise RuntimeError("crashed")
        if self.shared.seq != expect:
            return False
        self.shared.seq = new
        return True


class Local:
    def __init__(self, value) -> None:
        self.value = value

    def write(self, v) -> None:
        self.value = v


def run(fn, *args):
    return trio.run(fn, *args)


def test_equal_sequences_activate_and_the_claim_moves_both_on():
    shared = FakeCoordinator(seq=4)
    m, local = shared.member("a"), Local(4)
    ok, how = run(try_activate, m, local.value, local.write, 0.0)
    assert ok and "current" in how and shared.held_by == "a"
    assert run(claim_next, m, local.value, local.write) == 5
    assert (shared.seq, local.value) == (5, 5)


def test_a_copy_behind_the_coordinated_sequence_never_activates_and_says_why():
    shared = FakeCoordinator(seq=3)
    ok, why = run(try_activate, shared.member("stale"), 2, lambda v: None, 0.0)
    assert not ok and "out of date" in why and "is 2" in why and "one 3" in why
    assert shared.held_by is None          # it did not even hold the lock


def test_a_copy_never_in_sync_never_activates():
    ok, why = run(try_activate, FakeCoordinator().member("b"), None, lambda v: None, 0.0)
    assert not ok and "never in sync" in why


def test_a_held_lock_is_not_taken():
    shared = FakeCoordinator(seq=1, held_by="primary")
    ok, why = run(try_activate, shared.member("backup"), 1, lambda v: None, 0.0)
    assert not ok and "held by primary" in why and shared.held_by == "primary"


def test_a_copy_ahead_of_the_coordinated_sequence_is_refused_and_the_lock_released():
    shared = FakeCoordinator(seq=1)
    ok, why = run(try_activate, shared.member("x"), 5, lambda v: None, 0.0)
    assert not ok and "ahead" in why and shared.held_by is None


@pytest.mark.parametrize("crash_after", [0, 1])
def test_a_crash_inside_the_claim_is_repaired_by_the_same_member(crash_after):
    """Crash after the claim (-(n+1) written) and before or after the local write: the next
    try_activate commits the claim, with the local file at n+1."""
    shared = FakeCoordinator(seq=2)
    local = Local(2)
    m = shared.member("a")
    m.fail_cas_after = 1          # the commit (second compare-and-set) never happens
    if crash_after == 0:          # ... nor the local write
        local.write = lambda v: (_ for _ in ()).throw(RuntimeError("crashed"))
    with pytest.raises(RuntimeError):
        run(claim_next, m, 2, local.write)
    assert shared.seq == -3
    shared.held_by = None          # the session went with the crash
    restarted, disk = shared.member("a"), Local(local.value)
    ok, how = run(try_activate, restarted, disk.value, disk.write, 0.0)
    assert ok and "repaired" in how
    assert (shared.seq, disk.value) == (3, 3)


def test_an_uncommitted_claim_two_ahead_is_not_repaired():
    shared = FakeCoordinator(seq=-5)
    ok, why = run(try_activate, shared.member("a"), 3, lambda v: None, 0.0)
    assert not ok and "claimed at 5" in why and shared.held_by is None


def test_a_claim_fails_when_the_sequence_moved():
    shared = FakeCoordinator(seq=7)
    with pytest.raises(SequenceError):
        run(claim_next, shared.member("a"), 6, lambda v: None)
    assert shared.seq == 7


def test_the_local_file(tmp_path: Path):
    assert read_local_sequence(tmp_path) == 0          # a fresh or pre-quorum data directory
    write_local_sequence(tmp_path, 12)
    assert read_local_sequence(tmp_path) == 12
    write_local_sequence(tmp_path, None)               # a copy in progress
    assert read_local_sequence(tmp_path) is None
    (tmp_path / "activation.seq").write_text("garbage\n")
    assert read_local_sequence(tmp_path) is None       # never current


# -- [ha.manager] configuration ---------------------------------------------------------------------

def _config(tmp_path: Path, ha: str) -> Path:
    (tmp_path / "users.toml").write_text("")
    p = tmp_path / "broker.toml"
    p.write_text(f"""
[acceptors.amqp]
port = 0
[cluster]
name = "c"
connector = "amqp://127.0.0.1:5672"
user = "cluster-user"
password = "secret"
[ha]
policy = "replication"
role = "primary"
{ha}
""")
    return p


def test_manager_defaults_are_artemis_curator_defaults(tmp_path):
    cfg = load_config(_config(tmp_path, '[ha.manager]\nconnect-string = "zk1:2181,zk2:2181"'))
    m = cfg.ha.manager
    assert (m.type, m.connect_string, m.session_ms, m.session_percent, m.connection_ms, m.retries, m.retries_ms,
            m.namespace) == ("zookeeper", "zk1:2181,zk2:2181", 18000, 33, 8000, 1, 1000, None)
    assert cfg.ha.coordination_id is None


@pytest.mark.parametrize("ha,key,words", [
    ('vote-on-replication-failure = true\n[ha.manager]\nconnect-string = "z:1"', "vote-on-replication-failure",
     "no meaning under [ha.manager]"),
    ('quorum-vote-wait-s = 5\n[ha.manager]\nconnect-string = "z:1"', "quorum-vote-wait-s", "session-ms"),
    ('quorum-size = 3\n[ha.manager]\nconnect-string = "z:1"', "quorum-size", "no meaning"),
    ('[ha.manager]\nsession-ms = 1000', "connect-string", "is required"),
    ('[ha.manager]\nconnect-string = "z"', "connect-string", "not host:port"),
    ('[ha.manager]\nconnect-string = "z:1"\ntype = "etcd"', "type", "etcd"),
    ('[ha.manager]\nconnect-string = "z:1"\nsession-percent = 100', "session-percent", "100"),
    ('[ha.manager]\nconnect-string = "z:1"\nsessions-ms = 5', "sessions-ms", "unknown"),
    ('coordination-id = "pair-a"', "coordination-id", "no [ha.manager]"),
    ('coordination-id = "a/b"\n[ha.manager]\nconnect-string = "z:1"', "coordination-id", "letters"),
])
def test_manager_errors_name_file_key_and_value(tmp_path, ha, key, words):
    with pytest.raises(ConfigError) as ei:
        load_config(_config(tmp_path, ha))
    text = str(ei.value)
    assert "broker.toml" in text and key in text and words in text, text
