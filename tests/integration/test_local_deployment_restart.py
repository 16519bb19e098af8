"""The local deployment survives a broker's death: kill -9 one broker, the deployment stays up,
reports which broker exited and how, the router marks it not ready, and the broker comes back
(restarted with back-off). Real processes; every wait is on observable state."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.integration.test_local_deployment import FIXED_PORTS, REPO
from tests.serverproc import free_ports, read_banner
from tests.serverproc import http_json
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def local_deployment(tmp_path):
    """As tests/integration/test_local_deployment.py's fixture (a private copy of etc/ on free
    ports), with the router probing every 200 ms so its view of a dead broker is observable
    before the 1 s restart back-off ends."""
    etc = tmp_path / "etc"
    etc.mkdir()
    mapping = dict(zip(FIXED_PORTS, free_ports(len(FIXED_PORTS))))
    for f in (REPO / "etc").glob("*.toml"):
        text = f.read_text()
        for old, new in mapping.items():
            text = re.sub(rf"(?<![0-9]){old}(?![0-9])", str(new), text)
        if f.name == "router.toml":
            text, n = re.subn(r"(?m)^check-period = 2000", "check-period = 200", text)
            assert n == 1
        (etc / f.name).write_text(text)
    proc = subprocess.Popen([sys.executable, "-m", "router.local", "--etc", str(etc), "--logs", str(tmp_path / "logs")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    banner = read_banner(proc, 90)
    yield proc, banner, tmp_path, mapping
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
    finally:
        proc.stdout.close()


def test_banner_shows_pids_and_client_helpers(local_deployment):
    proc, banner, tmp_path, ports = local_deployment
    pids = [int(p) for p in re.findall(r"pid (\d+)", banner)]
    children = {int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                               text=True).stdout.split()}
    assert children <= set(pids) and len(children) == 5 and proc.pid in pids
    assert "docs/clients.md" in banner
    assert "connect_following_redirects" in banner


def test_a_killed_broker_is_reported_and_restarted(local_deployment):
    proc, banner, tmp_path, ports = local_deployment
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    m = re.search(r"broker-2 .* pid (\d+)", banner)
    assert m, banner
    old_pid = int(m.group(1))
    mgmt = f"http://127.0.0.1:{ports[8160]}"

    # the router's pool is the cluster: targets are named by node id, each broker says its own
    names = {http_json(f"http://127.0.0.1:{ports[m]}/api/v1/broker", auth=("admin", "admin"))[1]["node_id"]:
             f"broker-{i}" for i, m in enumerate((18161, 18162, 18163), 1)}

    def pool_ready():
        status, body = http_json(mgmt + "/api/v1/routers/main/pool", auth=("admin", "admin"))
        assert status == 200, body
        out: dict = {}   # broker -> served (broker-1's passive backup is a second member of its node id)
        for t in body["targets"]:
            name = names.get(t["node_id"], t["name"])
            out[name] = out.get(name, False) or t["ready"]
        return out

    all_ready = {"broker-1": True, "broker-2": True, "broker-3": True}
    wait_for(pool_ready, 60, interval_s=0.1, until=lambda v: v == all_ready, what="every broker ready")
    os.kill(old_pid, signal.SIGKILL)
    text = lambda: "".join(out)  # noqa: E731
    wait_for(lambda: f"broker-2 (pid {old_pid}) exited with signal 9 (SIGKILL)" in text(), 60, interval_s=0.1,
             what="the exit report")
    assert "restarting it in 1 s" in text()
    assert proc.poll() is None  # the deployment stays up
    # the router notices within a check-period (200 ms here), before the 1 s back-off ends
    back = re.compile(r"broker-2 is back \(pid (\d+), restart 1\)")
    wait_for(pool_ready, 60, interval_s=0.1, until=lambda v: v["broker-2"] is False, what="broker-2 not ready")
    assert not back.search(text())
    new_pid = int(wait_for(lambda: back.search(text()), 60, interval_s=0.1, what="broker-2 back").group(1))
    assert new_pid != old_pid and os.path.exists(f"/proc/{new_pid}")
    wait_for(pool_ready, 60, interval_s=0.1, until=lambda v: v == all_ready, what="every broker ready again")
    assert proc.poll() is None


def _key_to(router: str, node_id: str, prefix: str) -> str:
    """A key the router's CONSISTENT_HASH sends to ``node_id``."""
    from urllib.parse import quote

    for i in range(500):
        key = f"{prefix}-{i}"
        status, body = http_json(f"{router}/api/v1/routers/main/target?key={quote(key)}", auth=("admin", "admin"))
        if status == 200 and body["target"]["node_id"] == node_id:
            return key
    raise AssertionError(f"no key of {prefix} goes to {node_id}")


def _records(path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


@pytest.mark.spark
def test_broker_1_fails_over_to_its_backup_and_back(local_deployment):
    """broker-1 has a replicated backup (etc/broker-1-backup.toml): kill -9 broker-1, the backup
    takes over its node id with every acknowledged message and the router sends broker-1's keys
    there; lodestone-local restarts broker-1, which takes its node id back (failback).

    Then the data-gravity job runs on the deployment's real logs (var/: the routing log, every
    broker's activity log, the backup's included): broker-1's node id, served by both names, is
    labelled broker-1 and says the backup served part; a key that moved no bytes shows ``n/a``,
    never ``None``; the histogram and the text count the same keys; the bytes-moved plot's colour
    bar label lies inside the saved image."""
    from proton import Message
    from proton.utils import BlockingConnection

    proc, banner, tmp_path, ports = local_deployment
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    auth = ("admin", "admin")
    b1_mgmt, bk_mgmt = (f"http://127.0.0.1:{ports[p]}" for p in (18161, 18164))
    ha = lambda url: http_json(url + "/api/v1/ha", auth=auth)[1]  # noqa: E731
    wait_for(lambda: ha(bk_mgmt), 60, interval_s=0.1, until=lambda v: v["phase"] == "in-sync",
             what="the backup in sync")
    node_id = ha(b1_mgmt)["node_id"]
    assert ha(bk_mgmt)["node_id"] == node_id
    b1 = f"amqp://127.0.0.1:{ports[15672]}"
    conn = BlockingConnection(b1, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    snd = conn.create_sender("ha.local")
    for i in range(50):
        snd.send(Message(body=f"m{i}", durable=True))
    conn.close()
    pid = int(re.search(r"broker-1 .* pid (\d+)", banner).group(1))
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: ha(bk_mgmt), 60, interval_s=0.1, until=lambda v: v["active"] is True,
             what="the backup active")
    assert ha(bk_mgmt)["node_id"] == node_id
    router = f"http://127.0.0.1:{ports[8160]}"

    def routed_to_backup():
        status, body = http_json(router + "/api/v1/routers/main/pool", auth=auth)
        return any(t["node_id"] == node_id and t["ready"] and t["port"] == ports[15675] for t in body["targets"])
    wait_for(routed_to_backup, 60, interval_s=0.1)  # the router's cluster pool follows the node id to the backup
    # through the router while the backup serves: a producer of a key that goes to broker-1's node
    # id (the backup writes its activity under its own name), and a key that moves no bytes
    proxy = f"amqp://127.0.0.1:{ports[5673]}"  # the router's proxy acceptor
    producer_key, consumer_key = _key_to(router, node_id, "grav-p"), _key_to(router, node_id, "grav-c")
    conn = BlockingConnection(proxy, container_id=producer_key, user="app", password="app", allowed_mechs="PLAIN",
                              allow_insecure_mechs=True, timeout=20)
    snd = conn.create_sender("grav.q")
    for i in range(10):
        snd.send(Message(body="x" * 500, durable=True))
    conn.close()
    BlockingConnection(proxy, container_id="grav-idle", user="app", password="app", allowed_mechs="PLAIN",
                       allow_insecure_mechs=True, timeout=20).close()
    # lodestone-local restarts broker-1: it finds its node id served by the backup and fails back
    wait_for(lambda: "broker-1 is back" in "".join(out), 90, interval_s=0.1, what="broker-1 restarted")
    wait_for(lambda: ha(b1_mgmt), 60, interval_s=0.1, until=lambda v: v["active"] is True,
             what="broker-1 active again")
    view = wait_for(lambda: ha(bk_mgmt), 60, interval_s=0.1,
                    until=lambda v: v["phase"] == "in-sync" and not v["active"], what="the backup standing by")
    assert view["pair"]["failbacks"] == 1
    conn = BlockingConnection(b1, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    rcv = conn.create_receiver("ha.local", credit=100)
    got = []
    for _ in range(50):
        got.append(rcv.receive(timeout=20).body)
        rcv.accept()
    conn.close()
    assert got == [f"m{i}" for i in range(50)]
    conn = BlockingConnection(proxy, container_id=consumer_key, user="app", password="app", allowed_mechs="PLAIN",
                              allow_insecure_mechs=True, timeout=20)
    rcv = conn.create_receiver("grav.q", credit=10)
    for _ in range(10):
        assert rcv.receive(timeout=20).body == "x" * 500
        rcv.accept()
    conn.close()

    # the job reads what is on disk: the backup's produce record (written at the connection's
    # close, before it stood down), broker-1's consume record, the routing log's close lines
    var = tmp_path / "var"

    def on_disk():
        routing = [r for p in sorted((var / "router").glob("routing.log*")) for r in _records(p)]
        closed = {r["container_id"] for r in routing if r["event"] == "close"}
        backup = _records(var / "broker-1-backup" / "activity.jsonl")
        primary = _records(var / "broker-1" / "activity.jsonl")
        return {"routing log closes": sorted({producer_key, consumer_key, "grav-idle"} - closed),
                "backup's produce": any(r["container_id"] == producer_key and r["direction"] == "produce"
                                        for r in backup),
                "broker-1's consume": any(r["container_id"] == consumer_key and r["direction"] == "consume"
                                          for r in primary)}
    wait_for(on_disk, 30, interval_s=0.2, ignore=(OSError, ValueError), what="the logs on disk",
             until=lambda v: not v["routing log closes"] and v["backup's produce"] and v["broker-1's consume"])
    out_dir = tmp_path / "gravity"
    t0 = time.monotonic()
    job = subprocess.run([sys.executable, "-m", "spark.jobs.gravity", str(var), "--out", str(out_dir), "--quiet",
                          "--master", "local[2]", "--driver-memory", "1g", "--shuffle-partitions", "2"],
                         capture_output=True, text=True, cwd=REPO, timeout=240)
    assert job.returncode == 0, job.stdout + job.stderr
    print(f"lodestone-gravity on the deployment's logs: {time.monotonic() - t0:.1f} s")
    s = json.loads((out_dir / "summary.json").read_text())
    html = (out_dir / "report.html").read_text()
    # (a) the node is broker-1, as the user knows it; the backup's part is said, not its name as the label
    assert s["broker_names"][node_id] == "broker-1", s["broker_names"]
    assert [x["name"] for x in s["broker_served_by"][node_id]] == ["broker-1", "broker-1-backup"]
    assert f"broker-1 ({node_id[:8]}; also served by broker-1-backup: " in html
    assert "broker-1-backup (" not in html
    # (b) a key without bytes has no score, shown as n/a
    rows = {r["key"]: r for r in s["per_key"]}
    assert rows["grav-idle"]["gravity_score"] is None and rows[producer_key]["gravity_score"] is not None
    assert "None" not in html
    # (c) the histogram and the text count the same keys, and say how many have a score
    scored = sum(1 for r in s["per_key"] if r["gravity_score"] is not None)
    assert s["keys"] == len(rows) == s["plots"]["gravity"]["keys"] and s["keys_scored"] == scored
    assert s["plots"]["gravity"]["keys_plotted"] == scored < s["keys"]
    assert s["plots"]["gravity"]["title"] == \
        f"Gravity scores of {s['keys']} keys: {scored} plotted, {s['keys'] - scored} without bytes (n/a)"
    assert f"{s['keys']} ({scored} with a gravity score, {s['keys'] - scored} without bytes: n/a)" in html
    # (d) the colour bar's label box lies inside the saved image, and something is drawn there
    import matplotlib.image

    png = matplotlib.image.imread(out_dir / "bytes_moved.png")
    m = s["plots"]["matrix"]
    h, w = png.shape[:2]
    assert m["size_px"] == [w, h] and m["colorbar_label"] == "bytes"
    x0, y0, x1, y1 = m["colorbar_label_px"]
    assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h, (m, w, h)
    assert png[int(y0):int(y1) + 1, int(x0):int(x1) + 1, :3].min() < 0.5   # the label's dark pixels
