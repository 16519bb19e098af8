"""``allow-failback = false`` in the router's shell: the config keys and their errors, the held
targets written to the state file and held again after a restart, a state file that cannot be
read refused at start, the holds pushed to a worker with the probe results, and the log lines."""

from __future__ import annotations

import json
import logging
import textwrap
from dataclasses import replace

import pytest

from broker.wire.io.tomlconfig import ConfigError
from router.config import TargetConfig, load_router_config
from router.service import RouterService
from tests.unit.router.test_service import rconfig

TWO_SITES = """
[routers.r.policy]
name = "FIRST_ELEMENT"
[routers.r.pool]
{pool}
[[routers.r.pool.targets]]
name = "site-1"
host = "127.0.0.1"
port = 5672
[[routers.r.pool.targets]]
name = "site-2"
host = "127.0.0.1"
port = 5673
"""


def load(tmp_path, pool: str):
    p = tmp_path / "router.toml"
    p.write_text(textwrap.dedent(TWO_SITES.format(pool=pool)))
    return p, load_router_config(p)


def test_config_defaults_and_the_state_file_beside_the_config(tmp_path):
    _, cfg = load(tmp_path, "")
    pc = cfg.routers["r"].pool
    assert (pc.allow_failback, pc.state_path) == (True, None)
    _, cfg = load(tmp_path, "allow-failback = false")
    assert cfg.routers["r"].pool.state_path == tmp_path / "router-pool-r.json"
    _, cfg = load(tmp_path, "allow-failback = false\nstate-path = 'var/held.json'")
    assert cfg.routers["r"].pool.state_path == tmp_path / "var" / "held.json"


@pytest.mark.parametrize("pool, key, msg", [
    ("allow-failback = 'no'", "routers.r.pool.allow-failback", "'no'"),
    ("state-path = 'x.json'", "routers.r.pool.state-path", "only used with allow-failback = false"),
])
def test_config_errors_name_file_key_value(tmp_path, pool, key, msg):
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, pool)
    assert ei.value.path == key and msg in ei.value.message, str(ei.value)


def sites_config(tmp_path, **kw):
    targets = [TargetConfig("site-1", "127.0.0.1", 5672), TargetConfig("site-2", "127.0.0.1", 5673)]
    cfg = rconfig(targets, **kw)
    return replace(cfg, pool=replace(cfg.pool, allow_failback=False,
                                     state_path=tmp_path / "router-pool-r.json"))


def fail_over_and_back(svc: RouterService) -> None:
    pool = svc.pool
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    pool.report_probe("site-1", False, error="refused")
    pool.note_routed(pool.ready_targets()[0])   # a client went to site 2 meanwhile
    pool.report_probe("site-1", True)


def test_holds_are_written_logged_and_held_again_after_a_restart(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="router")
    cfg = sites_config(tmp_path)
    svc = RouterService(cfg)
    fail_over_and_back(svc)
    assert list(svc.pool.held) == ["site-1"] and svc.counters["pool_holds"] == 1
    doc = json.loads(cfg.pool.state_path.read_text())
    assert doc["router"] == "r" and list(doc["held"]) == ["site-1"]
    assert any("target site-1 is held out of routing" in r.getMessage() for r in caplog.records)
    # a restart: site 1 stays held although both first probes pass
    svc2 = RouterService(cfg)
    assert list(svc2.pool.held) == ["site-1"]
    assert any("holding site-1 out of routing as before the restart" in r.getMessage()
               for r in caplog.records)
    svc2.pool.report_probe("site-1", True)
    svc2.pool.report_probe("site-2", True)
    assert [t.name for t in svc2.pool.targets()] == ["site-2"]
    # the operator readmits it: logged, written
    out = svc2.readmit_target("site-1")
    assert out["target"] == "site-1" and out["was_held"] is True
    assert json.loads(cfg.pool.state_path.read_text())["held"] == {}
    assert any("target site-1 takes connections again (readmitted)" in r.getMessage()
               for r in caplog.records)
    assert [t.name for t in svc2.pool.targets()] == ["site-1", "site-2"]
    with pytest.raises(ValueError):
        svc2.readmit_target("nope")


def test_a_state_file_that_cannot_be_read_stops_the_start_naming_it(tmp_path):
    cfg = sites_config(tmp_path)
    cfg.pool.state_path.write_text("{not json")
    with pytest.raises(ConfigError) as ei:
        RouterService(cfg)
    assert str(cfg.pool.state_path) in str(ei.value) and "deleting it admits every target" in str(ei.value)
    cfg.pool.state_path.write_text('{"held": ["site-1"]}')
    with pytest.raises(ConfigError, match="'held' is not an object"):
        RouterService(cfg)


def test_a_worker_holds_what_its_supervisor_pushes(tmp_path):
    cfg = sites_config(tmp_path)
    owner = RouterService(cfg)
    worker = RouterService(cfg, shared=object())     # a follower: never decides a hold itself
    assert worker.pool.follow_holds
    fail_over_and_back(owner)
    worker.apply_pool_states(owner.pool_states())
    assert [t.name for t in worker.pool.targets()] == ["site-2"]
    assert list(worker.pool.held) == ["site-1"]
    owner.readmit_target("site-1")
    worker.apply_pool_states(owner.pool_states())
    assert [t.name for t in worker.pool.targets()] == ["site-1", "site-2"]


def test_a_planned_hold_through_the_service(tmp_path):
    svc = RouterService(sites_config(tmp_path))
    svc.pool.report_probe("site-1", True)
    svc.pool.report_probe("site-2", True)
    out = svc.hold_target("site-1")
    assert out["target"] == "site-1" and out["pool"]["held"]["site-1"].startswith("held by an operator")
    with pytest.raises(ValueError, match="no other target"):
        svc.hold_target("site-2")
