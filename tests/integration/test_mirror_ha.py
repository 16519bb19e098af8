"""A mirror run by a replicated HA pair (docs/broker-connections.md "HA"): the primary mirrors
to B and is killed with SIGKILL; its backup takes the node id over and continues the mirror
where the primary stopped — from the replicated store-and-forward queue, with the same origin
id, so B's duplicate cache drops what was in flight. Real processes, unmodified
python-qpid-proton clients; B's queue (browsed) against the backup's is the oracle."""

from __future__ import annotations

import pytest

from tests.haproc import receive_all, send, start_replica, wait_active, wait_phase
from tests.integration.test_broker_connections import depth, view as source_view
from tests.integration.test_ha_replication import FAST_VOTES
from tests.integration.test_mirror import browse, consume, start, target_events
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def mirror_tables(b) -> dict:
    return {"broker-connections.dr": {"uri": b.amqp_url, "user": "admin", "password": "admin",
                                      "retry-interval-ms": 200},
            "broker-connections.dr.mirror": {"message-acknowledgements": True}}


def test_the_backup_of_a_mirroring_primary_continues_the_mirror_after_a_sigkill(tmp_path, procs):
    b = start(tmp_path, "b")
    procs.append(b)
    primary = start_replica(tmp_path, "primary", "primary", config=mirror_tables(b))
    procs.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES,
                           config=mirror_tables(b))
    procs.append(backup)
    wait_phase(backup, "in-sync")
    wait_for(lambda: source_view(primary)["mirror"]["attached"], 30, what="the primary's mirror attached")
    sent = [f"m-{i}" for i in range(600)]
    for k in range(3):
        if k:
            consume(primary, "orders", 50)
        send(primary, "orders", sent[k * 200:(k + 1) * 200])   # each answered once the backup has it
    primary.kill()          # the last answer means the backup has everything before it; events
    #                         may still wait to go to B
    wait_active(backup, 30)
    wait_for(lambda: source_view(backup)["mirror"]["attached"], 30, what="the backup's mirror attached")
    send(backup, "orders", [f"after-{i}" for i in range(100)])
    consume(backup, "orders", 50)
    wait_for(lambda: source_view(backup)["mirror"]["pending"] == 0, 60, what="every event accepted by B")
    on_backup, on_b = browse(backup, "orders"), browse(b, "orders")
    assert len(set(on_b)) == len(on_b), "a message stored twice on B"
    assert on_b == on_backup
    expected = sent[100:] + [f"after-{i}" for i in range(100)]
    assert on_backup == expected[50:]
    assert target_events(b)["bad_events"] == 0
    assert depth(b, "orders") == len(expected) - 50
    assert receive_all(b, "orders") == expected[50:]
