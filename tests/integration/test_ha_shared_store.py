"""Shared-store HA (issue 12, first step): a primary and its backup(s) as real broker processes
on one data directory (tests/haproc.py). Faults are SIGKILL and SIGTERM; every wait is on what
the members' management APIs show; counts are exact. The oracle for "the same broker" is the
messages themselves (each body numbered) and the node id the backup serves with (the pair's,
read from the shared ``node.id`` the primary made)."""

from __future__ import annotations

import time

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN
from tests.haproc import CLIENT, broker_info, receive_all, send, ha_view, start_member, start_pair, wait_active, wait_phase
from tests.serverproc import http_json

pytestmark = pytest.mark.timeout(180)



@pytest.fixture
def members():
    made = []
    yield made
    for m in made:
        if m.proc is not None and m.proc.poll() is None:
            m.kill()


def test_the_backup_takes_over_a_killed_primary_with_every_acknowledged_message(tmp_path, members):
    primary, backup = start_pair(tmp_path)
    members += [primary, backup]
    pair_id = primary.node_id
    assert broker_info(primary) ["node_id"] == pair_id and broker_info(primary)["active"] is True
    passive = broker_info(backup)
    assert passive["active"] is False          # a router's probe keeps clients away from it
    assert ha_view(backup)["role"] == "backup" and ha_view(backup)["pair"]["state"] == "live"
    status, health = http_json(backup.management_url + "/health")
    assert status == 503 and health["status"] == "passive"

    bodies = [f"m{i}" for i in range(400)]
    send(primary, "orders", bodies)
    primary.kill()
    t0 = time.monotonic()
    view = wait_active(backup, 20)
    took = time.monotonic() - t0
    assert view["node_id"] == pair_id and view["pair"]["failovers"] == 1
    assert broker_info(backup)["node_id"] == pair_id
    assert receive_all(backup, "orders") == bodies, "every acknowledged message, once, in order"
    print(f"failover: backup active {took:.2f} s after SIGKILL")
    assert any("ha: waiting-for-live-lock -> active" in ln for ln in backup.stderr_text().splitlines())


def test_a_clean_stop_leaves_the_backup_passive_unless_failover_on_shutdown(tmp_path, members):
    primary, backup = start_pair(tmp_path)
    members += [primary, backup]
    send(primary, "q", ["kept"])
    assert primary.terminate() == 0
    view = wait_phase(backup, "waiting-for-live-lock")
    assert view["pair"]["state"] == "paused" and view["active"] is False
    # the primary comes back and serves what it had
    primary.start()
    wait_active(primary)
    assert receive_all(primary, "q") == ["kept"]
    assert ha_view(backup)["phase"] == "waiting-for-live-lock"

    # with failover-on-shutdown the same clean stop hands over
    primary.terminate()
    shared = primary.shared_dir
    p2 = start_member(tmp_path, "primary2", shared, "primary", ha={"failover-on-shutdown": True})
    members.append(p2)
    wait_active(p2)
    send(p2, "q", ["handed over"])
    assert p2.terminate() == 0
    wait_active(backup)
    assert receive_all(backup, "q") == ["handed over"]


def test_failback_to_the_restarted_primary_and_back_to_standby(tmp_path, members):
    primary, backup = start_pair(tmp_path)
    members += [primary, backup]
    send(primary, "fb", ["before"])
    primary.kill()
    wait_active(backup)
    send(backup, "fb", ["during"])
    primary.start()                   # allow-failback (the default): the backup hands over
    wait_active(primary)
    view = wait_phase(backup, "waiting-for-live-lock")    # restart-backup: standby again
    assert view["pair"]["failbacks"] == 1 and view["active"] is False
    assert receive_all(primary, "fb") == ["before", "during"]
    # and it still protects the primary
    primary.kill()
    wait_active(backup)
    assert ha_view(backup)["pair"]["failovers"] == 2


def test_without_allow_failback_the_restarted_primary_waits(tmp_path, members):
    primary, backup = start_pair(tmp_path, backup_ha={"allow-failback": False})
    members += [primary, backup]
    primary.kill()
    wait_active(backup)
    send(backup, "nf", ["served by the backup"])
    primary.start()
    wait_phase(primary, "waiting-for-live-lock")
    assert ha_view(backup)["active"] is True
    assert broker_info(primary)["active"] is False
    assert receive_all(backup, "nf") == ["served by the backup"]
    backup.kill()                     # now the waiting primary takes its own node id back
    wait_active(primary)


def test_a_spare_backup_waits_behind_the_first(tmp_path, members):
    primary, backup = start_pair(tmp_path)
    members += [primary, backup]
    spare = start_member(tmp_path, "spare", primary.shared_dir, "backup")
    members.append(spare)
    wait_phase(spare, "waiting-for-backup-lock")
    send(primary, "s", ["x"])
    primary.kill()
    wait_active(backup)
    wait_phase(spare, "waiting-for-live-lock")      # it is the pair's waiting backup now
    backup.kill()
    wait_active(spare)
    assert receive_all(spare, "s") == ["x"]
    assert ha_view(spare)["node_id"] == primary.node_id


def test_a_backup_with_scale_down_moves_the_messages_to_another_node_instead_of_serving(tmp_path, members):
    from tests.haproc import start_clustered_primary

    other, primary, cluster, shared = start_clustered_primary(tmp_path, members)
    backup = start_member(tmp_path, "backup", shared, "backup", cluster=cluster, ha={"scale-down": True})
    members.append(backup)
    wait_phase(backup, "waiting-for-live-lock")
    bodies = [f"s{i}" for i in range(300)]
    send(primary, "sd", bodies)            # acknowledged: journaled in the shared store
    primary.kill()
    assert backup.proc.wait(60) == 0, backup.stderr_text()[-3000:]     # scaled down, then stopped
    assert "this backup scaled down instead of serving" in backup.stderr_text()
    assert sorted(receive_all(other, "sd")) == sorted(bodies)          # every message, once, on the other node
    assert (shared / "ha.state").read_bytes() == b"P"   # paused: no spare takes the emptied node id over
    # the primary comes back to its (now empty) node id and serves again
    primary.start()
    wait_active(primary)
    assert receive_all(primary, "sd", quiet_s=0.5) == []


def test_config_errors_name_file_key_and_value(tmp_path):
    import subprocess
    import sys

    from tests.brokerproc import write_config
    from tests.serverproc import REPO

    for ha, key, text in [({"policy": "shared-store", "role": "observer"}, "ha.role", "'observer' must be one of"),
                          ({"policy": "live-only", "allow-failback": True}, "ha.allow-failback",
                           "is a shared-store or replication backup setting"),
                          ({"policy": "shared-store", "quorum-size": 3}, "ha.quorum-size", "is a replication setting")]:
        p = write_config(tmp_path / key, config={"ha": ha})
        out = subprocess.run([sys.executable, "-m", "broker", "check", str(p)], cwd=REPO, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [f"lodestone-broker: {p}: {key}: " + out.stderr.split(f"{key}: ", 1)[1].strip()]
        assert text in out.stderr, out.stderr
