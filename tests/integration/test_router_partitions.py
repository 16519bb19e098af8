"""The router across a real network partition: the router and two brokers each in their own
network namespace (tests/netns.py); the test's clients reach the router over a link that is never
cut. Cutting router–b1 drops packets silently, as a real partition does.

* b1's probes time out, so b1 leaves the pool and the next connection of the same key goes to b2;
  when the link heals b1 is ready again.
* A proxied connection that was pushing bytes to b1 when the link went silent holds a full send
  buffer towards a broker that acknowledges nothing. When its client goes away the router must
  still let it go: ``tcp-user-timeout-ms`` (TCP_USER_TIMEOUT on both sockets) ends it once
  bytes stay unacknowledged that long; before, it stayed active until TCP gave up (15 minutes or
  more), holding a connection slot and two descriptors.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import BrokerProcess, write_config, write_users_file
from tests.clusterproc import wait_until
from tests.netns import Network, available
from tests.routerproc import start_router, toml_str
from tests.serverproc import REPO

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(available() is not None, reason=str(available()))]

USERS = {"admin": ("admin-pw", ["admin", "amq"]), "app": ("app-pw", ["app"])}
USER_TIMEOUT_MS = 2000

CLIENT = r"""
import sys
from proton import Message
from proton.utils import BlockingConnection
c = BlockingConnection(sys.argv[1], timeout=120, user="app", password="app-pw", allowed_mechs="PLAIN",
                       container_id="stuck-client")
s = c.create_sender("big")
s.send(Message(body="hello"))
print("ready", flush=True)
sys.stdin.readline()
print("sending", flush=True)
s.send(Message(body=b"x" * (8 * 1024 * 1024)))
print("sent", flush=True)
"""


@pytest.fixture
def env(tmp_path):
    net = Network(["router", "b1", "b2"])
    started = []
    try:
        users = write_users_file(tmp_path / "users.toml", USERS)
        brokers = {}
        for name in ("b1", "b2"):
            h = net.host(name)
            path = write_config(tmp_path / name, name=name, users_file=users,
                                config={"acceptors.amqp": {"host": h}, "management": {"host": h}})
            b = BrokerProcess(tmp_path / name, path)
            b.preexec = net.enter(name)
            started.append(b.start())
            brokers[name] = b
        lines = [f"users-file = {toml_str(users)}", "[management]", f"host = {toml_str(net.host('router'))}",
                 "port = 0", "[routing-log]", "enabled = false",
                 "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
                 "[routers.main.pool]", "check-period = 500", 'username = "admin"', 'password = "admin-pw"']
        for name, b in brokers.items():
            lines += ["[[routers.main.pool.targets]]", f"name = {toml_str(name)}", f"host = {toml_str(net.host(name))}",
                      f"port = {b.port}", f"management-url = {toml_str(b.management_url)}"]
        lines += ["[[acceptors]]", 'name = "front"', f"host = {toml_str(net.host('router'))}", "port = 0",
                  'router = "main"', 'mode = "proxy"', f"tcp-user-timeout-ms = {USER_TIMEOUT_MS}"]
        router = start_router(tmp_path / "router", "\n".join(lines) + "\n", expect=2, auth=("admin", "admin-pw"),
                              preexec_fn=net.enter("router"))
        started.append(router)
        yield net, brokers, router
    finally:
        for p in started:
            p.kill()
        net.close()


def _front(router) -> dict:
    status, body = router.get("/api/v1/counters")
    assert status == 200, body
    return body["acceptors"]["front"]


def _ready(router) -> set[str]:
    status, body = router.get("/api/v1/routers/main")
    assert status == 200, body
    return {t["name"] for t in body["pool"]["targets"] if t["ready"]}


def _round_trip(router, container_id: str) -> None:
    c = BlockingConnection(router.url("front"), timeout=20, user="app", password="app-pw", allowed_mechs="PLAIN",
                           container_id=container_id)
    try:
        c.create_sender("rt").send(Message(body=container_id))
        r = c.create_receiver("rt")
        assert r.receive(timeout=20).body == container_id
        r.accept()
    finally:
        c.close()


def test_a_broker_cut_off_from_the_router_leaves_the_pool_and_its_stuck_connections_end(env):
    net, brokers, router = env
    wait_until(lambda: _ready(router) == {"b1", "b2"}, 60, "both brokers ready")
    assert router.target_for("main", "stuck-client")["target"]["name"] == "b1"   # FIRST_ELEMENT
    client = subprocess.Popen([sys.executable, "-c", CLIENT, router.url("front")], cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert client.stdout.readline().strip() == "ready"
        assert _front(router)["active_connections"] == 1
        net.cut("router", "b1")
        client.stdin.write("go\n")
        client.stdin.flush()
        assert client.stdout.readline().strip() == "sending"
        # b1's probes time out: it leaves the pool, and the same key now goes to b2; meanwhile the
        # router took what the sockets would hold of the 8 MiB and is stuck writing the rest to b1
        wait_until(lambda: _ready(router) == {"b2"}, 30, "b1 leaving the pool")
        assert _front(router)["active_connections"] == 1
        _round_trip(router, "stuck-client")
        client.send_signal(signal.SIGKILL)     # the client gives up
        client.wait(10)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        client.stdin.close()
        client.stdout.close()
    t0 = time.monotonic()
    wait_until(lambda: _front(router)["active_connections"] == 0, 60, "the stuck proxied connection ending")
    ended_s = time.monotonic() - t0
    print(f"the stuck connection ended {ended_s:.1f} s after its client was killed")
    assert ended_s < 30
    net.heal()
    wait_until(lambda: _ready(router) == {"b1", "b2"}, 30, "b1 ready again once the link healed")
    _round_trip(router, "after-heal")
