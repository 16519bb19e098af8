"""`lodestone-router dry-run` on a routing log written by a real router from real connections,
node ids read from the running router's management API (issue 8, item 6)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from proton import ConnectionException
from proton.utils import BlockingConnection

from tests.brokerproc import start_broker
from tests.routerproc import run_dry_run as _dry_run, start_router
from tests.serverproc import REPO
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
KEYS = [f"newcomer-{i}" for i in range(24)]


def _router_toml(brokers, log) -> str:
    lines = ['name = "r"', f'users-file = "{REPO / "etc" / "users.toml"}"',
             '[management]', 'port = 0', 'user = "admin"', 'password = "admin"',
             '[routing-log]', f'path = "{log}"',
             '[[acceptors]]', 'name = "redir"', 'port = 0', 'router = "main"', 'mode = "redirect"',
             '[routers.main]', 'key-type = "CLIENT_ID"',
             '[routers.main.policy]', 'name = "CONSISTENT_HASH"',
             '[routers.main.pool]', 'check-period = 300', 'quorum-size = 2',
             'username = "admin"', 'password = "admin"']
    for i, b in enumerate(brokers):
        lines += ['[[routers.main.pool.targets]]', f'name = "b{i}"', 'host = "127.0.0.1"',
                  f'port = {b.port}', f'management-url = "{b.management_url}"']
    return "\n".join(lines) + "\n"


@pytest.fixture
def routed(tmp_path):
    """Two brokers, a router in front, one redirected connection per key; the routing log."""
    brokers = [start_broker(tmp_path, name=f"b{i}") for i in range(2)]
    log = tmp_path / "routing.log"
    router = start_router(tmp_path / "router", _router_toml(brokers, log), expect=2)
    try:
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["quorum_met"], 15)
        for key in KEYS:  # a real AMQP client; the redirect is the answer we expect
            try:
                BlockingConnection(router.url("redir"), container_id=key, user="app", password="app",
                                   allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=10).close()
            except ConnectionException:
                pass
        wait_for(lambda: log.exists() and sum('"event":"route"' in ln for ln in log.read_text().splitlines())
                 >= len(KEYS), 15)
        yield brokers, router, log
    finally:
        router.terminate()
        for b in brokers:
            b.kill()




def test_dry_run_reads_the_real_routing_log_and_live_node_ids(routed):
    brokers, router, log = routed
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    placed = {r["key_filtered"]: r["target_name"] for r in lines if r["event"] == "route"}
    assert set(placed) == set(KEYS) and set(placed.values()) == {"b0", "b1"}
    user_url = router.management_url.replace("http://", "http://admin:admin@")
    out = _dry_run(str(router.config_path), "--routing-log", str(log), "--router-url", user_url,
                   "--remove", "b0", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["total_keys"] == len(KEYS)  # the old reader found 0 (it read `filtered_key`)
    # node ids are the brokers' own, read from the router's pool view, not hand-copied
    assert report["before_targets"] == [b.node_id for b in brokers]
    assert report["before_target_names"] == ["b0", "b1"]
    # independent expectation: under consistent hashing exactly the keys the live router put on
    # b0 move, all to b1
    assert {m["key"] for m in report["moved"]} == {k for k, t in placed.items() if t == "b0"}
    assert all(m["before_name"] == "b0" and m["after_name"] == "b1" for m in report["moved"])
    # the text report names targets by name
    text = _dry_run(str(router.config_path), "--routing-log", str(log), "--router-url", user_url,
                    "--remove", "b0")
    assert text.returncode == 0, text.stderr
    assert f"b0 ({brokers[0].node_id})" in text.stdout and "note: no node id" not in text.stdout
    moved_lines = [ln for ln in text.stdout.splitlines() if ln.startswith("  newcomer-")]
    assert moved_lines and all(ln.endswith(": b0 -> b1") for ln in moved_lines)


def test_router_url_needs_credentials(routed):
    brokers, router, log = routed
    out = _dry_run(str(router.config_path), "--routing-log", str(log), "--router-url", router.management_url,
                   "--remove", "b0")
    assert out.returncode == 2 and "HTTP 401" in out.stderr and "--user" in out.stderr
    out = _dry_run(str(router.config_path), "--routing-log", str(log), "--router-url", router.management_url,
                   "--user", "admin", "--password", "admin", "--add", "b9=127.0.0.1:1", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["total_keys"] == len(KEYS)
    assert report["after_target_names"] == ["b0", "b1", "b9"]
    # a new target without a node id is hashed by its name: deterministic, and said so
    assert report["after_targets"][2] == "b9"
    again = _dry_run(str(router.config_path), "--routing-log", str(log), "--router-url", router.management_url,
                     "--user", "admin", "--password", "admin", "--add", "b9=127.0.0.1:1", "--json")
    assert json.loads(again.stdout) == report
    text = _dry_run(str(router.config_path), "--routing-log", str(log), "--router-url", router.management_url,
                    "--user", "admin", "--password", "admin", "--add", "b9=127.0.0.1:1")
    assert "note: no node id for b9: hashing their names as stand-ins" in text.stdout


def test_dry_run_piped_to_head_exits_quietly(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(f"k{i}" for i in range(200_000)) + "\n")
    t0 = time.monotonic()
    out = subprocess.run(["bash", "-o", "pipefail", "-c",
                          f'"{sys.executable}" -m router dry-run etc/router.toml --keys {keys} '
                          f'--target broker-1=127.0.0.1:15672 --target broker-2=127.0.0.1:15673 '
                          f'--add broker-4=127.0.0.1:15675 --json | head -n 3'],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, (out.returncode, out.stderr)
    assert out.stderr == ""  # no BrokenPipeError traceback
    assert len(out.stdout.splitlines()) == 3
    assert time.monotonic() - t0 < 120
