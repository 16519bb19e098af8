"""Replication HA (issue 12): a primary streams its journal to a backup with its own data
directory; the backup votes and takes over. Real broker processes (tests/haproc.py), faults by
SIGKILL and by cutting the replication link (tests/tcpproxy.py), exact counts, waits on what
the management APIs show."""

from __future__ import annotations

import time

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN
from tests.haproc import (CLIENT, broker_info, receive_all, send, ha_view, start_replica, wait_active, wait_phase,
                          wait_replication)
from tests.serverproc import http_json, metric_by_label
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(240)

FAST_VOTES = {"vote-retries": 2, "vote-retry-wait-ms": 200, "quorum-vote-wait-s": 5}


def in_sync_pair(tmp_path, members):
    """A replication primary, active, and its backup in sync."""
    primary = start_replica(tmp_path, "primary", "primary")
    members.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES)
    members.append(backup)
    wait_phase(backup, "in-sync")
    return primary, backup


@pytest.fixture
def members():
    made = []
    yield made
    for m in made:
        if m.proc is not None and m.proc.poll() is None:
            m.kill()


def test_a_lone_pair_fails_over_with_every_acknowledged_message(tmp_path, members):
    primary = start_replica(tmp_path, "primary", "primary")
    members.append(primary)
    wait_active(primary)
    send(primary, "orders", [f"early-{i}" for i in range(100)])      # in the initial sync's snapshot
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES)
    members.append(backup)
    view = wait_phase(backup, "in-sync")
    assert view["node_id"] == primary.node_id and view["active"] is False
    assert broker_info(backup)["active"] is False
    pview = ha_view(primary)
    assert pview["replication"]["state"] == "in-sync" and pview["replication"]["backup"]["name"] == "backup"
    # Artemis's failover-server-list in the primary's Open names the backup (unmodified proton reads it)
    conn = BlockingConnection(primary.amqp_url, **CLIENT)
    try:
        fsl = conn.conn.remote_properties["failover-server-list"]
    finally:
        conn.close()
    assert [dict(m) for m in fsl] == [{"network-host": "127.0.0.1", "scheme": "amqp", "hostname": "127.0.0.1",
                                       "port": backup.port}]
    bodies = [f"m{i}" for i in range(500)]
    send(primary, "orders", bodies)       # each acknowledged once both nodes hold it
    primary.kill()
    t0 = time.monotonic()
    view = wait_active(backup, 30)
    print(f"replication failover: backup active {time.monotonic() - t0:.2f} s after SIGKILL")
    assert view["node_id"] == primary.node_id and view["pair"]["failovers"] == 1
    assert broker_info(backup)["node_id"] == primary.node_id
    got = receive_all(backup, "orders")
    assert got == [f"early-{i}" for i in range(100)] + bodies
    assert "vote to take over node" in backup.stderr_text()


def test_with_three_primaries_the_majority_decides(tmp_path, members):
    p1 = start_replica(tmp_path, "p1", "primary", ha={"group-name": "g1"})
    members.append(p1)
    wait_active(p1)
    p2 = start_replica(tmp_path, "p2", "primary", static=[p1.amqp_url], ha={"group-name": "g2"})
    p3 = start_replica(tmp_path, "p3", "primary", static=[p1.amqp_url], ha={"group-name": "g3"})
    members += [p2, p3]
    for p in (p2, p3):
        wait_active(p)
    # the backup tries p2 and p3 first: their group is not its own, they refuse it
    backup = start_replica(tmp_path, "backup", "backup", static=[p2.amqp_url, p3.amqp_url, p1.amqp_url],
                           ha={"group-name": "g1", **FAST_VOTES})
    members.append(backup)
    view = wait_phase(backup, "in-sync")
    assert view["node_id"] == p1.node_id
    send(p1, "q", [f"x{i}" for i in range(200)])
    p1.kill()
    view = wait_active(backup, 30)
    text = backup.stderr_text()
    assert "WON (2 of 2 needed votes from 2 primaries" in text, text[-3000:]
    assert receive_all(backup, "q") == [f"x{i}" for i in range(200)]


@pytest.fixture
def proxies():
    made = []
    yield made
    for p in made:
        p.close()


def three_primaries(tmp_path, members, *, p1_ha=None):
    p1 = start_replica(tmp_path, "p1", "primary", ha={"group-name": "g1", **(p1_ha or {})})
    members.append(p1)
    wait_active(p1)
    p2 = start_replica(tmp_path, "p2", "primary", static=[p1.amqp_url], ha={"group-name": "g2"})
    p3 = start_replica(tmp_path, "p3", "primary", static=[p1.amqp_url], ha={"group-name": "g3"})
    members += [p2, p3]
    for p in (p2, p3):
        wait_active(p)
    # every primary sees the two others (the backup's voters answer from their views)
    for p in (p1, p2, p3):
        wait_for(lambda: sum(1 for m in http_json(p.management_url + "/api/v1/cluster", auth=ADMIN)[1]["members"]
                             if m["connected"]) >= 2, 30, what=f"{p.workdir.name} to see the two others")
    return p1, p2, p3


def test_a_cut_replication_link_with_three_primaries_keeps_one_active_node(tmp_path, members, proxies):
    from tests.tcpproxy import TcpProxy

    p1, p2, p3 = three_primaries(tmp_path, members)
    link = TcpProxy("127.0.0.1", p1.port).start()
    proxies.append(link)
    backup = start_replica(tmp_path, "backup", "backup", static=[f"amqp://127.0.0.1:{link.port}"],
                           ha={"group-name": "g1", **FAST_VOTES})
    members.append(backup)
    wait_phase(backup, "in-sync")
    send(p1, "q", ["before the cut"])
    link.cut()                          # the backup loses p1; p2 and p3 still see it
    wait_for(lambda: "vote to take over node" in backup.stderr_text(), 30, what="the backup's vote")
    assert "lost (0 of 2 needed votes" in backup.stderr_text()
    assert ha_view(backup)["active"] is False and ha_view(p1)["active"] is True   # one active node id
    assert ha_view(backup)["pair"]["failovers"] == 0
    link.restore()                      # the backup finds its primary again and re-syncs
    wait_phase(backup, "in-sync")
    send(p1, "q", ["after the link came back"])
    assert receive_all(p1, "q") == ["before the cut", "after the link came back"]


def test_a_lone_pair_splits_on_a_cut_link_as_documented(tmp_path, members, proxies):
    """Artemis's arithmetic with one primary: no vote is needed, so a backup cut off from its
    primary activates while the primary still serves — two active nodes with one node id. This
    is why docs/ha.md says a lone pair does not protect against partitions."""
    from tests.tcpproxy import TcpProxy

    primary = start_replica(tmp_path, "primary", "primary")
    members.append(primary)
    wait_active(primary)
    link = TcpProxy("127.0.0.1", primary.port).start()
    proxies.append(link)
    backup = start_replica(tmp_path, "backup", "backup", static=[f"amqp://127.0.0.1:{link.port}"], ha=FAST_VOTES)
    members.append(backup)
    wait_phase(backup, "in-sync")
    link.cut()
    wait_active(backup)
    assert ha_view(primary)["active"] is True and ha_view(backup)["active"] is True
    assert ha_view(primary)["node_id"] == ha_view(backup)["node_id"]
    assert "WON (0 of 0 needed votes" in backup.stderr_text()


def test_an_isolated_primary_stops_with_vote_on_replication_failure(tmp_path, members, proxies):
    from tests.tcpproxy import TcpProxy

    p1, p2, p3 = three_primaries(tmp_path, members, p1_ha={"vote-on-replication-failure": True, **FAST_VOTES})
    link = TcpProxy("127.0.0.1", p1.port).start()
    proxies.append(link)
    backup = start_replica(tmp_path, "backup", "backup", static=[f"amqp://127.0.0.1:{link.port}"],
                           ha={"group-name": "g1", **FAST_VOTES})
    members.append(backup)
    wait_phase(backup, "in-sync")
    p2.kill()
    p3.kill()                           # p1 is now alone: a minority of the three primaries it knew
    link.cut()                          # and loses its backup
    assert p1.proc.wait(30) == 3, p1.stderr_text()[-3000:]      # it stops rather than risk a split
    assert "ISOLATED" in p1.stderr_text()
    # the backup cannot win a vote either (no other primary answers): nobody serves the node id
    wait_for(lambda: "vote to take over node" in backup.stderr_text(), 30, what="the backup's vote")
    assert ha_view(backup)["active"] is False


def test_garbage_on_the_replication_link_closes_that_connection_only(tmp_path, members):
    from proton.utils import BlockingConnection as BC

    from tests.haproc import CLIENT, broker_info, receive_all, send, CLUSTER_PASSWORD

    primary = start_replica(tmp_path, "primary", "primary")
    members.append(primary)
    wait_active(primary)
    fake = BC(primary.amqp_url, user="cluster-user", password=CLUSTER_PASSWORD, allowed_mechs="PLAIN", timeout=10)
    with pytest.raises(Exception) as info:
        snd = fake.create_sender("$lodestone.replication.acks")
        snd.send(Message(body=b"not the replication format"))
        fake.create_receiver("$lodestone.replication.records").receive(timeout=5)
    assert "amqp:decode-error" in str(info.value) or "bad magic" in str(info.value), info.value
    # a client that is not the cluster user cannot even attach
    app = BC(primary.amqp_url, **CLIENT)
    with pytest.raises(Exception) as info:
        app.create_receiver("$lodestone.replication.records")
    assert "unauthorized" in str(info.value)
    app.close()
    send(primary, "still", ["serving"])
    assert receive_all(primary, "still") == ["serving"]
    assert ha_view(primary)["active"] is True


def check_live_pair(tmp_path, members, backup_ha=None):
    """A primary with check-for-live-server whose cluster knows the backup's connector (where it
    looks for its node id when it restarts), and its backup."""
    backup = start_replica(tmp_path, "backup", "backup", ha={**FAST_VOTES, **(backup_ha or {})}, start=False)
    primary = start_replica(tmp_path, "primary", "primary", static=[backup.amqp_url],
                            ha={"check-for-live-server": True})
    members.append(primary)
    wait_active(primary)
    text = backup.config_path.read_text().replace("static-connectors = []",
                                                  f'static-connectors = ["{primary.amqp_url}"]')
    backup.config_path.write_text(text)
    backup.start()
    members.append(backup)
    return primary, backup


def test_failback_to_the_restarted_primary_and_back_to_standby(tmp_path, members):
    primary, backup = check_live_pair(tmp_path, members)
    wait_phase(backup, "in-sync")
    send(primary, "fb", [f"a{i}" for i in range(100)])
    primary.kill()
    wait_active(backup)
    send(backup, "fb", [f"b{i}" for i in range(50)])
    primary.start()        # stale data on disk: it must not serve it
    view = wait_active(primary, 60)
    assert view["node_id"] == backup.node_id
    bview = wait_phase(backup, "in-sync", 60)        # restart-backup: a backup of the primary again
    assert bview["pair"]["failbacks"] == 1 and bview["active"] is False
    assert receive_all(primary, "fb") == [f"a{i}" for i in range(100)] + [f"b{i}" for i in range(50)]
    assert (primary.workdir / "data" / "journal.old-1").is_dir()      # the stale copy, kept aside
    assert "failing back" in primary.stderr_text()


def test_without_allow_failback_the_restarted_primary_stays_a_backup(tmp_path, members):
    primary, backup = check_live_pair(tmp_path, members, {"allow-failback": False})
    wait_phase(backup, "in-sync")
    primary.kill()
    wait_active(backup)
    send(backup, "nf", ["kept by the backup"])
    primary.start()
    wait_phase(primary, "in-sync", 60)        # a copy of the active backup, not serving
    assert ha_view(backup)["active"] is True and ha_view(primary)["active"] is False
    assert broker_info(primary)["active"] is False
    assert receive_all(backup, "nf") == ["kept by the backup"]


def test_a_backup_of_a_primary_with_an_empty_journal_gets_in_sync(tmp_path, members):
    """The snapshot of an empty journal is seq 0: confirming it puts the backup in sync."""
    primary = start_replica(tmp_path, "primary", "primary", config={"node": {"persistent": True}})
    members.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES)
    members.append(backup)
    wait_phase(backup, "in-sync")
    wait_replication(primary, "in-sync")
    send(primary, "e", ["first"])
    primary.kill()
    wait_active(backup)
    assert receive_all(backup, "e") == ["first"]


def test_the_failover_client_learns_the_backup_and_keeps_sending(tmp_path, members):
    """router.client.FailoverConnection given only the primary's URL learns the backup from the
    Open's failover-server-list; the primary is SIGKILLed mid-stream; every send returns once
    stored, and the backup holds every one of them."""
    import threading

    from router.client import FailoverConnection

    primary, backup = in_sync_pair(tmp_path, members)
    wait_replication(primary, "in-sync")
    conn = FailoverConnection(primary.amqp_url, reconnect_timeout_s=30, **CLIENT)
    assert conn.learned == [f"amqp://127.0.0.1:{backup.port}"]
    snd = conn.sender("fo")
    sent = []
    killer = None
    for i in range(400):
        if i == 150:
            killer = threading.Thread(target=primary.kill)
            killer.start()
        snd.send(Message(body=f"m{i}", durable=True))
        sent.append(f"m{i}")
    killer.join()
    assert conn.failovers == 1 and conn.current == f"amqp://127.0.0.1:{backup.port}"
    conn.close()
    got = receive_all(backup, "fo")
    assert sorted(got) == sorted(sent)      # every acknowledged send is on the backup, once (_AMQ_DUPL_ID)


def test_a_backup_with_scale_down_moves_the_messages_instead_of_serving(tmp_path, members):
    p1, p2, p3 = three_primaries(tmp_path, members)
    backup = start_replica(tmp_path, "backup", "backup", static=[p1.amqp_url, p2.amqp_url, p3.amqp_url],
                           ha={"group-name": "g1", "scale-down": True, **FAST_VOTES})
    members.append(backup)
    wait_phase(backup, "in-sync")
    bodies = [f"s{i}" for i in range(300)]
    send(p1, "sd", bodies)
    p1.kill()
    assert backup.proc.wait(60) == 0, backup.stderr_text()[-3000:]    # scaled down, then stopped
    assert "this backup scaled down instead of serving" in backup.stderr_text()
    got = receive_all(p2, "sd") + receive_all(p3, "sd")
    assert sorted(got) == sorted(bodies)                               # every message, once


def test_a_backup_killed_during_its_initial_sync_starts_over(tmp_path, members):
    primary = start_replica(tmp_path, "primary", "primary")
    members.append(primary)
    wait_active(primary)
    big = "x" * 4096
    send(primary, "big", [f"{i}:{big}" for i in range(3000)])       # a 12 MB initial sync
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES)
    members.append(backup)
    wait_phase(backup, "syncing")
    backup.kill()                        # mid-copy
    wait_replication(primary, "no-backup")
    assert ha_view(primary)["replication"]["synced_at"] is None       # it never got in sync: killed mid-copy
    send(primary, "big", ["still serving"])                          # the primary never stopped
    backup.start()
    wait_phase(backup, "in-sync", 60)    # a fresh copy (the partial one kept aside or replaced)
    primary.kill()
    wait_active(backup)
    got = receive_all(backup, "big")
    assert len(got) == 3001 and got[-1] == "still serving"


def test_ha_metrics(tmp_path, members):
    primary, backup = in_sync_pair(tmp_path, members)
    wait_replication(primary, "in-sync")
    send(primary, "m", ["x"] * 10)
    status, text = http_json(primary.management_url + "/metrics", auth=ADMIN)
    assert 'lodestone_broker_ha_replication_lag_records{state="in-sync"}' in text
    assert 'lodestone_broker_ha_active{role="primary"} 1' in text
    primary.kill()
    wait_active(backup)
    status, text = http_json(backup.management_url + "/metrics", auth=ADMIN)
    assert 'lodestone_broker_ha_votes_total{outcome="won"} 1' in text
    assert "lodestone_broker_ha_failovers_total 1" in text


def _logins(member) -> dict[str, float]:
    status, text = http_json(member.management_url + "/metrics", auth=ADMIN, timeout_s=10)
    assert status == 200
    return metric_by_label(text, "lodestone_broker_logins_total")


def test_the_backup_knows_the_logins_its_primary_verified(tmp_path, members):
    """A reconnect storm after a failover costs no password hash per client: the primary sends
    the logins it verified to its backup (LOGINS), which caches them. Oracle: the activated
    backup's own login counters — its first login of ``app`` is answered from the cache, not by
    scrypt (without the hand-over ``login_verifications`` grows by one)."""
    primary, backup = in_sync_pair(tmp_path, members)
    BlockingConnection(primary.amqp_url, **CLIENT).close()       # app logs in on the primary only
    wait_for(lambda: ha_view(backup)["replication"]["logins_adopted"] >= 2, 10)   # admin (the test's calls), app
    primary.kill()
    wait_active(backup, 30)
    before = _logins(backup)        # (admin is known to it: the test's own management calls)
    conn = BlockingConnection(backup.amqp_url, **CLIENT)          # a failed-over client
    conn.close()
    after = _logins(backup)
    assert after["login_verifications"] == before["login_verifications"]
    assert after["login_ok_cached"] == before["login_ok_cached"] + 2   # app, and this scrape's admin


def test_a_backup_the_primary_drops_as_slow_syncs_again_instead_of_taking_over(tmp_path, members):
    """The primary drops a backup that did not confirm within call-timeout-ms (it goes on alone,
    alive): the backup must not read that as its primary's death. In a lone pair its vote needs
    no other primary, so a vote here would make both members active at once."""
    primary = start_replica(tmp_path, "primary", "primary", config={"cluster": {"call-timeout-ms": 1000}})
    members.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES,
                           config={"cluster": {"call-timeout-ms": 1000}})
    members.append(backup)
    wait_phase(backup, "in-sync")
    backup.proc.send_signal(19)    # SIGSTOP: it confirms nothing while sends go on
    try:
        send(primary, "orders", ["sent-while-the-backup-sleeps"])   # answered once the backup is dropped
        wait_for(lambda: "serving alone" in primary.stderr_text(), 15, what="the primary drops its backup")
    finally:
        backup.proc.send_signal(18)    # SIGCONT
    wait_for(lambda: "dropped this backup" in backup.stderr_text(), 15, what="the backup sees it was dropped")
    view = wait_phase(backup, "in-sync", 30)   # it syncs again from the live primary
    assert view["active"] is False and broker_info(backup)["active"] is False
    assert ha_view(primary)["active"] is True
    assert "vote to take over node" not in backup.stderr_text(), backup.stderr_text()[-2000:]
    send(primary, "orders", ["after"])
    assert receive_all(primary, "orders") == ["sent-while-the-backup-sleeps", "after"]
