"""The README's main command: 3 brokers + the router, real processes, real AMQP clients."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from proton import Message
from proton.utils import BlockingConnection

from router.client import connect_following_redirects
from tests.serverproc import free_ports, read_banner
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


# (9876: the brokers' multicast discovery group; 15675/18164: broker-1's replicated backup)
FIXED_PORTS = [5672, 5673, 5674, 8160, 15672, 15673, 15674, 18161, 18162, 18163, 9876, 15675, 18164]


@pytest.fixture
def local_deployment(tmp_path):
    """A private copy of etc/ (data and logs in tmp_path), its fixed ports swapped for free ones."""
    yield from start_local(tmp_path)


def start_local(tmp_path, *extra_args: str):
    etc = tmp_path / "etc"
    etc.mkdir()
    mapping = dict(zip(FIXED_PORTS, free_ports(len(FIXED_PORTS))))
    for f in (REPO / "etc").glob("*.toml"):
        text = f.read_text()
        for old, new in mapping.items():
            text = re.sub(rf"(?<![0-9]){old}(?![0-9])", str(new), text)
        (etc / f.name).write_text(text)
    proc = subprocess.Popen([sys.executable, "-m", "router.local", "--etc", str(etc), "--logs", str(tmp_path / "logs"),
                             *extra_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    banner = read_banner(proc, 90)
    yield proc, banner, tmp_path, mapping
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
    finally:
        proc.stdout.close()


def test_local_deployment_serves_proxy_and_redirect_clients(local_deployment):
    proc, banner, tmp_path, ports = local_deployment
    auto, proxy, redirect = (f"amqp://127.0.0.1:{ports[p]}" for p in (5672, 5673, 5674))
    assert redirect in banner and proxy in banner and auto in banner
    for url in (proxy, redirect, auto):
        conn = connect_following_redirects(url, user="app", password="app", allowed_mechs="PLAIN",
                                           allow_insecure_mechs=True)
        try:
            conn.create_sender("local.q").send(Message(body=f"via {url}"))
            receiver = conn.create_receiver("local.q")
            msg = receiver.receive(timeout=10)
            receiver.accept()
            assert msg.body == f"via {url}"
        finally:
            conn.close()
    log = (tmp_path / "var" / "router" / "routing.log")
    wait_for(lambda: log.exists() and '"outcome":"OK"' in log.read_text(), 10, interval_s=0.2,
             what="a routed connection in the routing log")
    assert '"outcome":"OK"' in log.read_text()
    # the front door (5672, mode auto): the helper above announced lodestone:follows-redirect and
    # was redirected; an unmodified client that does not announce it is proxied
    plain = BlockingConnection(auto, user="app", password="app", allowed_mechs="PLAIN",
                               allow_insecure_mechs=True, timeout=10)
    try:
        plain.create_sender("local.q").send(Message(body="plain"))
        receiver = plain.create_receiver("local.q")
        assert receiver.receive(timeout=10).body == "plain"
        receiver.accept()
    finally:
        plain.close()

    def auto_actions():
        lines = [ln for ln in log.read_text().splitlines() if '"acceptor":"auto"' in ln and '"event":"route"' in ln]
        return [a for a in ("redirected", "proxied") if any(f'"action":"{a}"' in ln for ln in lines)], lines
    wait_for(auto_actions, 10, interval_s=0.2, until=lambda a: len(a[0]) >= 2,
             what="both auto-mode actions in the routing log")
    actions, lines = auto_actions()
    assert actions == ["redirected", "proxied"] and len(lines) == 2, lines


def test_children_stop_when_the_supervisor_is_killed(local_deployment):
    proc, banner, tmp_path, ports = local_deployment
    children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 5          # three brokers, broker-1's backup, the router
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def alive():
        return [pid for pid in children if Path(f"/proc/{pid}").exists()
                and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]]
    # a child may vanish between the two reads: FileNotFoundError is "not yet"
    left = wait_for(alive, 30, interval_s=0.2, until=lambda pids: not pids, ignore=FileNotFoundError,
                    what="every child gone")
    assert not left


def test_the_three_brokers_are_one_cluster(local_deployment):
    """A producer on broker-1 and a consumer on broker-3 meet (ON_DEMAND over the cluster's
    bridges); every node warns about the sample cluster password. The brokers found each other
    by multicast discovery where this machine allows it (the same probe as lodestone-local's,
    run here), else by static connectors, and the banner says which; the router's pool is the
    cluster: every broker, by node id."""
    proc, banner, tmp_path, ports = local_deployment
    b1, b3 = (f"amqp://127.0.0.1:{ports[p]}" for p in (15672, 15674))
    mgmt1 = f"http://127.0.0.1:{ports[18161]}"
    from router.local import multicast_probe
    from tests.serverproc import http_json

    why = multicast_probe("231.7.7.7", "127.0.0.1")
    ids = {http_json(f"http://127.0.0.1:{ports[m]}/api/v1/broker", auth=("admin", "admin"))[1]["node_id"]
           for m in (18161, 18162, 18163)}
    if why is None:
        assert "cluster lodestone-local: discovery over UDP multicast 231.7.7.7:" in banner, banner
        heard = lambda: {e["node_id"] for e in http_json(mgmt1 + "/api/v1/cluster", auth=("admin", "admin"))[1][  # noqa: E731
            "discovery"]["entries"]}
        others = ids - {http_json(mgmt1 + "/api/v1/broker", auth=("admin", "admin"))[1]["node_id"]}
        wait_for(heard, 30, interval_s=0.1, until=lambda h: h == others,
                 what="broker-1's discovery group to hear the two others")
    else:
        assert "multicast discovery does not work on this machine" in banner, banner
    router_mgmt = f"http://127.0.0.1:{ports[8160]}"

    def pool():   # node id -> served (broker-1's backup is a second member of its node id, passive)
        status, body = http_json(router_mgmt + "/api/v1/routers/main/pool", auth=("admin", "admin"))
        out: dict = {}
        for t in (body["targets"] if status == 200 else ()):
            out[t["node_id"]] = out.get(t["node_id"], False) or t["ready"]
        return out
    wait_for(pool, 30, interval_s=0.1, until=lambda p: p == dict.fromkeys(ids, True),
             what="the router's cluster pool to hold the three brokers")

    def meshed():
        status, view = http_json(mgmt1 + "/api/v1/cluster", auth=("admin", "admin"))
        return status == 200 and sum(1 for b in view["bridges"] if b["connected"]) == 2
    wait_for(meshed, 30, interval_s=0.1, what="broker-1 bridged to the two others")
    consumer = BlockingConnection(b3, timeout=20, user="app", password="app", allowed_mechs="PLAIN")
    r = consumer.create_receiver("cluster.q", credit=100)

    def known():
        status, view = http_json(mgmt1 + "/api/v1/cluster", auth=("admin", "admin"))
        return any(b["queue"] == "cluster.q" and b["consumers"] == 1 for b in view["remote_bindings"])
    wait_for(known, 30, interval_s=0.1, what="broker-1 to learn broker-3's consumer")
    producer = BlockingConnection(b1, timeout=20, user="app", password="app", allowed_mechs="PLAIN")
    s = producer.create_sender("cluster.q")
    for i in range(50):
        s.send(Message(body=f"m{i}", durable=True))
    producer.close()
    got = []
    for _ in range(50):
        got.append(r.receive(timeout=20).body)
        r.accept()
    consumer.close()
    assert got == [f"m{i}" for i in range(50)]
    for i in (1, 2, 3):
        text = (tmp_path / "logs" / f"broker-{i}.log").read_text()
        assert "cluster password is a published sample" in text


def test_static_connectors_when_asked_and_said_so(tmp_path):
    """``--cluster-discovery static`` (what ``auto`` falls back to where multicast fails): the
    banner says so, the brokers run with --static-connectors and still form one cluster."""
    gen = start_local(tmp_path, "--cluster-discovery", "static")
    proc, banner, tmp_path, ports = next(gen)
    try:
        assert "cluster lodestone-local: static connectors (--cluster-discovery static)" in banner, banner
        from tests.serverproc import http_json
        mgmt1 = f"http://127.0.0.1:{ports[18161]}"
        status, view = wait_for(lambda: http_json(mgmt1 + "/api/v1/cluster", auth=("admin", "admin")), 30,
                                interval_s=0.1, what="broker-1 bridged to the two others",
                                until=lambda r: r[0] == 200 and sum(1 for b in r[1]["bridges"] if b["connected"]) == 2)
        assert view["discovery"] is None   # no discovery group: the static connectors formed it
    finally:
        for _ in gen:
            pass


def test_a_second_deployment_on_the_same_folder_says_why_it_did_not_start(local_deployment):
    """``bash etc/run-local.sh`` started again while the first runs: broker-1's data directory is
    locked by the first deployment's broker-1. The console (not only the log) names the lock and
    the process holding it, and shows the warnings the children logged (the sample credentials);
    the first deployment keeps running. The first one's banner shows the same warnings, once
    each with the processes that logged them, and no open-files warning (etc/router.toml fits)."""
    proc, banner, tmp_path, ports = local_deployment
    b1_pid = int(re.search(r"broker-1 .* pid (\d+)", banner).group(1))
    assert "warnings while starting (from the logs):" in banner, banner
    assert re.search(r"users.toml: user 'app' has sample credentials; accepted from loopback only  "
                     r"\[broker-1, broker-2, broker-3, broker-1-backup, router\]", banner), banner
    assert "file descriptors" not in banner and "max-connections needs" not in banner, banner
    second = subprocess.run([sys.executable, "-m", "router.local", "--etc", str(tmp_path / "etc"),
                             "--logs", str(tmp_path / "logs")], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120)
    console = second.stdout + second.stderr
    assert second.returncode == 1, console
    assert "lodestone-local: broker-1 did not start (exited with status 1); see" in second.stderr, console
    assert re.search(rf"data directory \S*broker-1 is locked by process {b1_pid}\b", second.stderr), console
    assert f"another deployment (or broker) runs on this data directory (pid {b1_pid}: " in second.stderr, console
    assert "has sample credentials; accepted from loopback only" in second.stderr, console
    # the reason is this start's: the first deployment's lines in the same log are not repeated
    assert "listening" not in second.stderr, console
    assert proc.poll() is None   # the first deployment is untouched
