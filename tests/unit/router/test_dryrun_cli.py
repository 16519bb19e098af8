"""The dry-run command: which keys move when a target joins or leaves the pool (in-process; the
command as a process: tests/integration/test_router_dryrun_command.py)."""

import json

from router.dryrun_cli import dry_run_main
from tests.paths import REPO

ROUTER_TOML = str(REPO / "etc" / "router.toml")
# etc/router.toml's pool is the cluster: the members are given by hand (--target)
IDS = ["--target", "broker-1=127.0.0.1:15672", "--target", "broker-2=127.0.0.1:15673",
       "--target", "broker-3=127.0.0.1:15674",
       "--node-id", "broker-1=263b9e60-fab6-3a0b-bf68-95583cf86466",
       "--node-id", "broker-2=38b9d67a-01aa-390b-92a4-0f3e2f3d9531",
       "--node-id", "broker-3=78c30cdd-0620-35fb-8ad2-6c39c91738b9"]


def _keys(tmp_path, n=2000):
    p = tmp_path / "keys.txt"
    p.write_text("# client ids\n" + "\n".join(f"client-{i}" for i in range(n)) + "\n")
    return p


def test_adding_a_fourth_target_moves_about_a_quarter(tmp_path, capsys):
    rc = dry_run_main([ROUTER_TOML, "--keys", str(_keys(tmp_path)), "--json",
                       "--add", "broker-4=127.0.0.1:15675", "--node-id", "broker-4=9a0a0f3e-0000-4000-8000-000000000004",
                       *IDS])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total_keys"] == 2000
    assert report["deterministic"] is True
    # consistent hashing moves only the keys the new target takes: about 1/4, never the rest
    assert 0.15 < report["moved_fraction"] < 0.35
    assert all(m["after"] == "9a0a0f3e-0000-4000-8000-000000000004" for m in report["moved"])


def test_removing_a_target_moves_only_its_keys(tmp_path, capsys):
    rc = dry_run_main([ROUTER_TOML, "--keys", str(_keys(tmp_path)), "--json",
                       "--remove", "broker-2", *IDS])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["moved"] and all(m["before"] == "38b9d67a-01aa-390b-92a4-0f3e2f3d9531" for m in report["moved"])


def test_routing_log_input_and_text_report(tmp_path, capsys):
    log = tmp_path / "routing.log"
    log.write_text("\n".join(json.dumps({"filtered_key": f"k{i}"}) for i in range(100)) + "\nnot json\n")
    assert dry_run_main([ROUTER_TOML, "--routing-log", str(log), "--remove", "broker-1",
                         *IDS[:6]]) == 0
    out = capsys.readouterr().out
    assert "of 100 keys move" in out and "note: no node id" in out


def test_bad_config_is_one_line_and_status_2(tmp_path, capsys):
    bad = tmp_path / "r.toml"
    bad.write_text("[routers.main]\nkey-type = 'NOPE'\n")
    assert dry_run_main([str(bad), "--keys", str(_keys(tmp_path, 1))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "routers.main.key-type" in err and "NOPE" in err


def test_a_cluster_pool_needs_its_members(tmp_path, capsys):
    assert dry_run_main([ROUTER_TOML, "--keys", str(_keys(tmp_path, 5)), "--remove", "broker-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "routers.main.pool: source 'cluster'" in err and "--router-url" in err


def test_replay_reads_every_routing_log_flag_and_needs_one(tmp_path, capsys):
    """--candidate (decision replay): repeated --routing-log flags all count; --keys is refused."""
    logs = []
    for i in range(2):
        p = tmp_path / f"routing-w{i}.log"
        p.write_text(json.dumps({"event": "route", "router": "main", "outcome": "REFUSED_UNAVAILABLE"}) + "\n")
        logs += ["--routing-log", str(p)]
    assert dry_run_main([ROUTER_TOML, *logs, "--candidate", ROUTER_TOML, "--json", *IDS]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["decisions"] == 2 and report["refused_in_log"] == {"REFUSED_UNAVAILABLE": 2}
    assert dry_run_main([ROUTER_TOML, "--keys", str(_keys(tmp_path, 1)), "--candidate", ROUTER_TOML, *IDS]) == 2
    assert "give --routing-log" in capsys.readouterr().err
