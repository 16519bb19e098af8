"""Replication HA across real network partitions (issue 12): every broker in its own network
namespace with a link to each other member (tests/netns.py). A cut link drops every packet
silently, as a real partition does: no reset, no refused connection, so each side learns of it
only by its timeouts (`idle-timeout-s`, `connection-ttl-ms`, `call-timeout-ms`). The test itself
reaches every member over a link it never cuts, so clients keep talking to a primary on the
minority side. Exact counts: every acknowledged message is delivered, none twice.
(The TCP-proxy cuts of test_ha_replication.py reset connections; these do not.)"""

from __future__ import annotations

import threading
import time

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN
from tests.clusterproc import wait_until
from tests.haproc import CLIENT, ha_view, receive_all, send, start_replica, wait_active, wait_phase
from tests.netns import Network, available
from tests.serverproc import http_json

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(available() is not None, reason=str(available()))]

# every side of a partition notices within about two seconds
FAST_FAILURE = {"amqp": {"idle-timeout-s": 2.0},
                "cluster": {"connection-ttl-ms": 2000, "call-timeout-ms": 2000}}
VOTES = {"vote-retries": 20, "vote-retry-wait-ms": 500, "quorum-vote-wait-s": 4}


@pytest.fixture
def net():
    n = Network(["p1", "p2", "p3", "backup"])
    members = []
    n.started = members
    yield n
    for m in members:
        if m.proc is not None and m.proc.poll() is None:
            m.kill()
    n.close()


def _start(tmp_path, net, name, role, *, static=(), ha=None):
    m = start_replica(tmp_path, name, role, static=list(static), ha=ha, config=FAST_FAILURE, net=net)
    net.started.append(m)
    return m


def _connected(m) -> int:
    status, body = http_json(m.management_url + "/api/v1/cluster", auth=ADMIN, timeout_s=10)
    assert status == 200, body
    return sum(1 for x in body["members"] if x["connected"] and x.get("role") != "backup")


def cluster_with_a_backup(tmp_path, net):
    """Three primaries p1..p3 (each in its own namespace), p1 with vote-on-replication-failure,
    and p1's replicated backup, in sync."""
    p1 = _start(tmp_path, net, "p1", "primary", ha={"group-name": "g1", "vote-on-replication-failure": True, **VOTES})
    wait_active(p1)
    p2 = _start(tmp_path, net, "p2", "primary", static=[p1.amqp_url], ha={"group-name": "g2"})
    p3 = _start(tmp_path, net, "p3", "primary", static=[p1.amqp_url], ha={"group-name": "g3"})
    for p in (p2, p3):
        wait_active(p)
    for p in (p1, p2, p3):
        wait_until(lambda p=p: _connected(p) >= 2, 60, f"{p.workdir.name} never saw the two other primaries")
    backup = _start(tmp_path, net, "backup", "backup", static=[p1.amqp_url], ha={"group-name": "g1", **VOTES})
    wait_phase(backup, "in-sync", 60)
    wait_until(lambda: ha_view(p1)["replication"]["state"] == "in-sync", 60, "p1 never saw its backup in sync")
    return p1, p2, p3, backup


def test_a_silently_cut_replication_link_loses_no_acknowledged_send(tmp_path, net):
    """Only the link p1–backup is cut. A send in flight waits: p1 neither hears from its backup
    nor knows whether the backup took over. p1 drops the backup after call-timeout, asks the
    other primaries, is still in the majority, and answers the send. The backup votes and loses
    (p2 and p3 still see p1): one active node id. When the link heals the backup copies p1 again;
    then p1 is SIGKILLed and the backup takes over with every acknowledged message."""
    p1, p2, p3, backup = cluster_with_a_backup(tmp_path, net)
    send(p1, "q", ["before"])
    net.cut("p1", "backup")
    t0 = time.monotonic()
    send(p1, "q", ["during"])                   # held, then answered once p1 knows it is in the majority
    held_s = time.monotonic() - t0
    assert 1.5 < held_s < 30, held_s
    print(f"the send in flight at the cut was answered after {held_s:.2f} s")
    p1_log = p1.stderr_text()
    assert "held sends wait for the quorum check" in p1_log
    assert "quorum check after losing the backup: still in the majority" in p1_log
    wait_until(lambda: "vote to take over node" in backup.stderr_text(), 60, "the backup never voted")
    assert "WON" not in backup.stderr_text()
    assert ha_view(backup)["active"] is False and ha_view(p1)["active"] is True
    net.heal()
    wait_phase(backup, "in-sync", 90)
    wait_until(lambda: ha_view(p1)["replication"]["state"] == "in-sync", 60, "p1 never saw its backup in sync again")
    send(p1, "q", ["after"])
    p1.kill()
    wait_active(backup, 60)
    assert receive_all(backup, "q") == ["before", "during", "after"]


def test_an_isolated_primary_stops_without_acknowledging_what_its_backup_lacks(tmp_path, net):
    """p1 is cut off from every other member while a producer (on the test's side, which still
    reaches p1) keeps sending durable messages to it. p1 loses its backup, is in the minority and
    exits 3 without answering the sends it could not replicate; the backup wins the vote of p2 and
    p3 and serves p1's node id. Every send p1 acknowledged is on the backup, none twice."""
    p1, p2, p3, backup = cluster_with_a_backup(tmp_path, net)
    acked: list[str] = []
    tried: list[str] = []
    failed: list[BaseException] = []
    go_isolate = threading.Event()

    def producer() -> None:
        try:
            conn = BlockingConnection(p1.amqp_url, **{**CLIENT, "timeout": 60})
            snd = conn.create_sender("orders")
            for i in range(100_000):
                body = f"m{i}"
                tried.append(body)
                snd.send(Message(body=body, durable=True))
                acked.append(body)
                if i == 100:
                    go_isolate.set()
        except BaseException as exc:   # p1 stopped: its connection went away under a send
            failed.append(exc)
        finally:
            go_isolate.set()

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    assert go_isolate.wait(60)
    net.isolate("p1")
    cut_at = time.monotonic()
    at = len(acked)
    assert p1.proc.wait(90) == 3, p1.stderr_text()[-3000:]
    t.join(90)
    assert not t.is_alive() and failed, "the producer never noticed p1 stop"
    p1_log = p1.stderr_text()
    assert "ISOLATED" in p1_log and "held sends are not acknowledged" in p1_log, p1_log[-3000:]
    # p1 acknowledged nothing after it lost its backup: at most what was in flight at the cut
    assert len(acked) - at <= 2, (at, len(acked))
    stopped_s = time.monotonic() - cut_at
    wait_active(backup, 90)
    print(f"isolated p1 exited 3 after {stopped_s:.2f} s, the backup was serving by "
          f"{time.monotonic() - cut_at:.2f} s; {len(acked)} sends acknowledged, {len(acked) - at} of them after the cut")
    assert "WON (2 of 2 needed votes" in backup.stderr_text(), backup.stderr_text()[-3000:]
    assert ha_view(p2)["active"] is True and ha_view(p3)["active"] is True
    got = receive_all(backup, "orders")
    assert len(got) == len(set(got)), "a message was stored twice"
    assert set(acked) <= set(got), sorted(set(acked) - set(got))[:10]
    assert set(got) <= set(tried)
    assert len(got) - len(acked) <= 1     # at most the send that was held when p1 stopped
