"""Colocated backups (issue 12, item 7): a primary asks another node of the cluster to host its
backup in that node's process, on ports offset by backup-port-offset; when the primary dies the
colocated backup takes over its node id there. Real broker processes (tests/haproc.py)."""

from __future__ import annotations

import socket

import pytest

from tests.haproc import ha_view, start_replica, wait_active
from tests.haproc import receive_all, send
from tests.integration.test_ha_replication import FAST_VOTES, three_primaries
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def members():
    made = []
    yield made
    for m in made:
        if m.proc is not None and m.proc.poll() is None:
            m.kill()


def free_offset(*ports: int) -> int:
    """An offset that lands every port on a free one."""
    for off in range(101, 2000, 7):
        ok = True
        for p in ports:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", p + off))
            except OSError:
                ok = False
            finally:
                s.close()
        if ok and all(p + off < 65536 for p in ports):
            return off
    raise AssertionError("no free offset")


def test_a_colocated_backup_takes_over_inside_another_node(tmp_path, members):
    p1 = start_replica(tmp_path, "p1", "primary", start=False, ha={"group-name": "g1"}, config={
        "ha.colocated": {"request-backup": True, "max-backups": 0, "backup-request-retry-interval-ms": 200}})
    p2 = start_replica(tmp_path, "p2", "primary", start=False, ha={"group-name": "g2", **FAST_VOTES})
    mgmt_port = int([ln for ln in p2.config_path.read_text().splitlines() if ln.startswith("port = ")][1][7:])
    off = free_offset(p2.port, mgmt_port)
    text = p2.config_path.read_text() + f"\n[ha.colocated]\nmax-backups = 1\nbackup-port-offset = {off}\n"
    p2.config_path.write_text(text)
    # the p1/p2/p3 cluster, p1 first
    p1.start()
    members.append(p1)
    wait_active(p1)
    text = p2.config_path.read_text().replace("static-connectors = []", f'static-connectors = ["{p1.amqp_url}"]')
    p2.config_path.write_text(text)
    p2.start()
    members.append(p2)
    wait_active(p2)
    p3 = start_replica(tmp_path, "p3", "primary", static=[p1.amqp_url], ha={"group-name": "g3"})
    members.append(p3)
    wait_active(p3)
    # p1 asks; p3 hosts none (404), p2 hosts it
    wait_for(lambda: ha_view(p1), 60, interval_s=0.1,
             until=lambda v: (v["replication"] or {}).get("state") == "in-sync", what="p1's colocated backup in sync")
    assert ha_view(p1)["replication"]["backup"]["name"] == "p2-colocated-1"
    hosted = ha_view(p2)["colocated"]
    assert [(h["name"], h["for_node_id"], h["phase"]) for h in hosted] == [("p2-colocated-1", p1.node_id, "in-sync")]
    bodies = [f"c{i}" for i in range(200)]
    send(p1, "colo", bodies)
    p1.kill()
    wait_for(lambda: ha_view(p2), 30, until=lambda v: v["colocated"][0]["active"],
             what="p2's colocated backup active")

    class At:   # the colocated backup's AMQP address: p2's port + the offset
        amqp_url = f"amqp://127.0.0.1:{p2.port + off}"
    assert receive_all(At, "colo") == bodies
    assert ha_view(p2)["active"] is True             # p2 still serves its own node id too
