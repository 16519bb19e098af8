"""`lodestone-router dry-run --candidate` (decision replay, issue 26) on the routing log a real router
wrote from real connections: one router process, one router per policy (CONSISTENT_HASH with a
cache, FIRST_ELEMENT with a pins file, ROUND_ROBIN, CONSISTENT_HASH_MODULO sharding to a local
target), three real brokers. The oracle is the log itself (the unchanged config must reproduce
every decision) and the existing ``dry-run --remove`` (a candidate without a target must move
the same keys)."""

from __future__ import annotations

import json
import subprocess

import pytest
from proton import ConnectionException
from proton.utils import BlockingConnection

from tests.brokerproc import start_broker
from tests.routerproc import run_dry_run as _dry_run, start_router
from tests.serverproc import REPO
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
KEYS = [f"replay-{i}" for i in range(24)]
ROUTERS = {"ch": "CONSISTENT_HASH", "fe": "FIRST_ELEMENT", "rr": "ROUND_ROBIN", "mod": "CONSISTENT_HASH_MODULO"}
PINNED = "replay-3"  # fe: pinned to b2 (FIRST_ELEMENT alone would say b0)


def _router_toml(brokers, log, pins, *, drop: tuple[str, ...] = ()) -> str:
    """Every router of the test; ``drop``: target names the ``ch`` router leaves out."""
    lines = ['name = "r"', f'users-file = "{REPO / "etc" / "users.toml"}"',
             '[management]', 'port = 0', 'user = "admin"', 'password = "admin"',
             '[routing-log]', f'path = "{log}"']
    for r in ROUTERS:
        lines += ['[[acceptors]]', f'name = "{r}"', 'port = 0', f'router = "{r}"', 'mode = "redirect"']
    for r, policy in ROUTERS.items():
        lines += [f'[routers.{r}]', 'key-type = "CLIENT_ID"']
        if r == "mod":  # sharding: keys whose hash is even are this router's local broker's
            lines += ['local-target-filter = "0"', f'[routers.{r}.local-target]', 'name = "b0-local"',
                      'host = "127.0.0.1"', f'port = {brokers[0].port}',
                      f'management-url = "{brokers[0].management_url}"', 'username = "admin"',
                      'password = "admin"']
        lines += [f'[routers.{r}.policy]', f'name = "{policy}"']
        if r == "mod":
            lines += [f'[routers.{r}.policy.properties]', 'MODULO = "2"']
        if r == "ch":
            lines += [f'[routers.{r}.cache]', 'timeout = 0']
        if r == "fe":
            lines += [f'[routers.{r}.pins]', f'file = "{pins}"']
        lines += [f'[routers.{r}.pool]', 'check-period = 300', 'quorum-size = 1',
                  'username = "admin"', 'password = "admin"']
        for i, b in enumerate(brokers):
            if r == "ch" and f"b{i}" in drop:
                continue
            lines += [f'[[routers.{r}.pool.targets]]', f'name = "b{i}"', 'host = "127.0.0.1"',
                      f'port = {b.port}', f'management-url = "{b.management_url}"']
    return "\n".join(lines) + "\n"


def _connect(router, acceptor: str, key: str) -> None:
    try:  # a real AMQP client; the redirect (or refusal) is the answer we expect
        BlockingConnection(router.url(acceptor), container_id=key, user="app", password="app",
                           allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=10).close()
    except ConnectionException:
        pass


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """The router process, its config, the routing log it wrote, and the brokers."""
    tmp = tmp_path_factory.mktemp("replay")
    brokers = [start_broker(tmp, name=f"b{i}") for i in range(3)]
    log, pins = tmp / "routing.log", tmp / "pins.jsonl"
    pins.write_text(json.dumps({"key": PINNED, "node_id": "b2"}) + "\n")
    router = start_router(tmp / "router", _router_toml(brokers, log, pins), expect=len(ROUTERS) + 1)
    try:
        def all_ready() -> bool:
            for r in ROUTERS:
                pool = router.get(f"/api/v1/routers/{r}/pool")[1]
                if not pool["targets"] or not all(t.get("ready") for t in pool["targets"]):
                    return False
            return True
        wait_for(all_ready, 20)
        expected = 0
        for key in KEYS:
            for r in ROUTERS:
                _connect(router, r, key)
                expected += 1
            _connect(router, "ch", key)  # again: a cache hit
            expected += 1
        wait_for(lambda: log.exists() and sum('"event":"route"' in ln for ln in log.read_text().splitlines())
                 >= expected, 15)
        yield router, brokers, log, pins
    finally:
        router.terminate()
        for b in brokers:
            b.kill()




def _replay(router, log, router_name: str, *extra: str, candidate=None) -> subprocess.CompletedProcess:
    cand = str(candidate or router.config_path)
    return _dry_run(str(router.config_path), "--routing-log", str(log), "--candidate", cand,
                    "--router", router_name, *extra)


def _route_lines(log, router_name: str) -> list[dict]:
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]
    return [r for r in lines if r["event"] == "route" and r["router"] == router_name]


@pytest.mark.parametrize("router_name", ["ch", "fe", "mod"])
def test_the_unchanged_config_reproduces_every_deterministic_decision(routed, router_name):
    router, brokers, log, pins = routed
    lines = _route_lines(log, router_name)
    ok = [r for r in lines if r["outcome"] == "OK"]
    out = _replay(router, log, router_name, "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["decisions"] == len(lines)
    assert rep["not_replayable"] == {} and rep["moved"] == [] and rep["moved_count"] == 0
    assert rep["replayed"] == rep["reproduced"] == len(ok)
    assert rep["refused_in_log_count"] == len(lines) - len(ok)
    logged = {}
    for r in ok:
        logged[r["target_name"]] = logged.get(r["target_name"], 0) + 1
    by_target = {row["target"]: row for row in rep["distribution"]}
    assert {n: row["logged"] for n, row in by_target.items() if row["logged"]} == logged
    assert all(row["candidate"] == row["logged"] for row in rep["distribution"])
    assert rep["skew"]["logged"] == rep["skew"]["candidate"]
    # what each router's log shows, so the replays above covered the cases the issue names
    if router_name == "ch":
        assert {r["cache"] for r in ok} == {"miss", "hit"} and len({r["target_name"] for r in ok}) == 3
    elif router_name == "fe":
        pinned = [r for r in ok if r["pin"]]
        assert [(r["key_filtered"], r["target_name"]) for r in pinned] == [(PINNED, "b2")]
        assert {r["target_name"] for r in ok if not r["pin"]} == {"b0"}
    else:
        assert ok and all(r["local"] and r["target_name"] == "b0-local" for r in ok)
        assert rep["refused_in_log_count"] > 0
    text = _replay(router, log, router_name)
    assert text.returncode == 0, text.stderr
    assert f"{len(ok)} replayed: {len(ok)} reproduced, 0 differ" in text.stdout
    assert f"0 of {rep['total_keys']} keys move" in text.stdout


def test_a_candidate_without_a_target_moves_the_keys_dry_run_remove_moves(routed, tmp_path):
    router, brokers, log, pins = routed
    cand = tmp_path / "candidate.toml"
    cand.write_text(_router_toml(brokers, log, pins, drop=("b1",)))
    rep = _replay(router, log, "ch", "--json", candidate=cand)
    assert rep.returncode == 0, rep.stderr
    replayed = json.loads(rep.stdout)
    user_url = router.management_url.replace("http://", "http://admin:admin@")
    dry = _dry_run(str(router.config_path), "--router", "ch", "--routing-log", str(log), "--router-url",
                   user_url, "--remove", "b1", "--json")
    assert dry.returncode == 0, dry.stderr
    removed = json.loads(dry.stdout)
    moved = {(m["key"], m["before_name"], m["after_name"]) for m in replayed["moved"]}
    assert moved and moved == {(m["key"], m["before_name"], m["after_name"]) for m in removed["moved"]}
    assert replayed["moved_count"] == removed["moved_count"]
    assert replayed["total_keys"] == removed["total_keys"] == len(KEYS)
    # independent of both: exactly the keys the live router put on b1 move
    assert {k for k, _, _ in moved} == {r["key_filtered"] for r in _route_lines(log, "ch")
                                         if r["target_name"] == "b1"}
    # node ids came from the log, not from the running router: the same ring as --router-url
    assert replayed["after_targets"] == [brokers[0].node_id, brokers[2].node_id]
    assert next(r for r in replayed["distribution"] if r["target"] == "b1")["candidate"] == 0
    # the text reports print the same moved lines
    text_replay = _replay(router, log, "ch", candidate=cand).stdout.splitlines()
    text_dry = _dry_run(str(router.config_path), "--router", "ch", "--routing-log", str(log), "--router-url",
                        user_url, "--remove", "b1").stdout.splitlines()
    moved_lines = [ln for ln in text_dry if ln.startswith("  replay-")]
    assert moved_lines and sorted(ln for ln in text_replay if ln.startswith("  replay-")) == sorted(moved_lines)
    assert [ln for ln in text_dry if " keys move (" in ln] == [ln for ln in text_replay if " keys move (" in ln]


def test_a_round_robin_log_cannot_be_reproduced(routed):
    router, brokers, log, pins = routed
    n = len(_route_lines(log, "rr"))
    out = _replay(router, log, "rr")
    assert out.returncode == 0, out.stderr
    assert f"not replayable: {n} (cannot reproduce: ROUND_ROBIN: the target depends on the order" in out.stdout
    assert f"0 replayed: 0 reproduced, 0 differ; 0 refused in the log; {n} not replayable" in out.stdout
    rep = json.loads(_replay(router, log, "rr", "--json").stdout)
    assert rep["not_replayable_count"] == n and rep["replayed"] == 0 and rep["deterministic"] is False
    # the log's own distribution is still reported: round robin spread the keys over all three
    assert sum(r["logged"] for r in rep["distribution"]) == n
    assert sorted(r["target"] for r in rep["distribution"] if r["logged"]) == ["b0", "b1", "b2"]


def test_a_bad_candidate_config_is_one_line_naming_the_file(routed, tmp_path):
    router, brokers, log, pins = routed
    bad = tmp_path / "bad.toml"
    bad.write_text("[routers.ch]\nkey-type = 'NOPE'\n")
    out = _replay(router, log, "ch", candidate=bad)
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and str(bad) in out.stderr and "NOPE" in out.stderr
