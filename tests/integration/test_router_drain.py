"""Draining a broker through the router (docs/router.md, "Drain"): real broker processes, the real
router process, python-qpid-proton clients of three kinds held on the drained broker:

* **proxied**: unmodified proton Container clients connected to the router's proxy acceptor
  (reconnect on);
* **redirect-capable**: clients of ``router.client.events.connect`` (they announce
  ``lodestone:follows-redirect``) that came through the router's redirect acceptor;
* **redirected, unannounced**: clients that follow the router's redirect without announcing
  it (``connect(..., announce=False)``, as Qpid JMS follows redirects natively): the broker ends
  their connection (it cannot know they would follow) and they come back through the router.

Every client sends durable messages the whole time. The oracles are the brokers' own views (which
container ids each broker holds, queue depths), not the router's: after ``drain`` every client
is on another broker within ``count / rate + 2 s``; the redirect-capable ones went straight
there (the router's redirect acceptor saw no new connection); no acknowledged message is missing
from the brokers. ``undrain`` gives the broker new clients again.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from proton import Message
from proton.handlers import MessagingHandler
from proton.reactor import Container

from router.client.events import connect as connect_following
from tests.brokerproc import BrokerProcess, write_config, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

USERS = {"admin": ("admin", ["admin"]), "alice": ("alice-pw", ["app"])}
PER_KIND = 8
RATE = 12.0
QUEUE = "drain.q"
SEND_EVERY_S = 0.05


def _config(users, brokers: dict, *, workers: int) -> str:
    lines = [f"users-file = {toml_str(users)}", f"workers = {workers}", "[management]", "port = 0",
             "[routing-log]", "enabled = false",
             "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
             "[[acceptors]]", 'name = "redirect"', "port = 0", 'router = "main"', 'mode = "redirect"',
             "[routers.main]", 'key-type = "CLIENT_ID"',
             "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
             "[routers.main.pool]", "check-period = 200", 'username = "admin"', 'password = "admin"',
             f"drain-rate-per-s = {RATE}"]
    for name, b in brokers.items():
        lines += ["[[routers.main.pool.targets]]", f"name = {toml_str(name)}", 'host = "127.0.0.1"',
                  f"port = {b.port}", f"management-url = {toml_str(b.management_url)}"]
    return "\n".join(lines) + "\n"


class Clients(MessagingHandler):
    """Every client in one proton Container thread; each sends a durable message every
    SEND_EVERY_S to QUEUE and counts what the broker accepted."""

    def __init__(self, specs: list[tuple[str, str, dict]]) -> None:
        super().__init__()
        self.specs = specs            # (container id, kind, how to connect)
        self.accepted = 0
        self.sent = 0
        self.stopping = False
        self.senders = []
        self.container = Container(self)
        self.thread = threading.Thread(target=self.container.run, daemon=True)

    def on_start(self, event) -> None:
        creds = {"user": "alice", "password": "alice-pw", "allowed_mechs": "PLAIN"}
        for cid, kind, how in self.specs:
            if kind in ("capable", "unannounced"):
                conn = connect_following(event.container, how["url"], container_id=cid,
                                         announce=kind == "capable", **creds)
            else:
                conn = event.container.connect(urls=how["urls"], container_id=cid, **creds)
            self.senders.append(event.container.create_sender(conn, QUEUE))
        event.container.schedule(SEND_EVERY_S, self)

    def on_timer_task(self, event) -> None:
        if self.stopping:
            return
        for s in self.senders:
            if s.credit > 0 and s.connection.state & s.connection.REMOTE_ACTIVE:
                s.send(Message(body=f"m-{self.sent}", durable=True))
                self.sent += 1
        event.container.schedule(SEND_EVERY_S, self)

    def on_accepted(self, event) -> None:
        self.accepted += 1

    def stop(self) -> None:
        self.stopping = True
        self.container.stop()
        self.thread.join(10)


def _clients_on(broker) -> set[str]:
    status, conns = broker.management_get("/api/v1/connections")
    assert status == 200, conns
    return {c["container_id"] for c in conns if not c.get("internal") and c["container_id"]}


def _depth(broker) -> int:
    q = broker.queue(QUEUE)
    return q["depth"] if q else 0


@pytest.mark.parametrize("workers,how", [(1, "api"), (2, "cli")], ids=["one-process-api", "two-workers-cli"])
def test_every_client_of_a_drained_broker_moves_within_count_over_rate_plus_2s(tmp_path, workers, how):
    users = write_users_file(tmp_path / "users.toml", USERS)
    brokers = {n: BrokerProcess(tmp_path / n, write_config(tmp_path / n, name=n, users_file=users)).start()
               for n in ("b1", "b2", "b3")}
    router = start_router(tmp_path / "router", _config(users, brokers, workers=workers), expect=3,
                          auth=("admin", "admin"))
    b1, b2, b3 = brokers["b1"], brokers["b2"], brokers["b3"]
    clients = None
    try:
        wait_for(lambda: all(t["ready"] for t in router.get("/api/v1/routers/main/pool")[1]["targets"]), 20,
                 what="b1, b2, b3 ready")
        specs = []
        for i in range(PER_KIND):
            specs.append((f"proxied-{i}", "proxied", {"urls": [router.url("proxy")]}))
            specs.append((f"capable-{i}", "capable", {"url": router.url("redirect")}))
            specs.append((f"unannounced-{i}", "unannounced", {"url": router.url("redirect")}))
        everyone = {cid for cid, _k, _h in specs}
        clients = Clients(specs)
        clients.thread.start()
        wait_for(lambda: _clients_on(b1) == everyone, 30, what="every client on b1")
        wait_for(lambda: clients.accepted > 3 * len(specs), 30, what="every client sending")
        redirect_accepted = router.counters("redirect").get("accepted", 0)

        cli = None
        if how == "api":
            status, body = router.request("POST", "/api/v1/routers/main/targets/b1/drain")
            assert status == 200 and body["draining"] and body["target"] == "b1", body
        else:
            cli = subprocess.Popen([sys.executable, "-m", "router", "drain", str(router.config_path), "b1",
                                    "--port", router.management_url.rsplit(":", 1)[1], "--user", "admin",
                                    "--password", "admin", "--wait", "--timeout-s", "60"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen: dict = {}

        def moved() -> bool:
            seen["b1"], seen["elsewhere"] = _clients_on(b1) & everyone, _clients_on(b2) | _clients_on(b3)
            return not seen["b1"] and seen["elsewhere"] >= everyone

        try:
            wait_for(moved, 30, what="every client off b1 and on another broker")
        except AssertionError:
            raise AssertionError(f"still on b1: {sorted(seen['b1'])}; missing: {sorted(everyone - seen['elsewhere'])}; "
                                 f"pool: {router.get('/api/v1/routers/main/pool')[1]}") from None
        moved_at = time.time()
        if cli is not None:
            out, err = cli.communicate(timeout=90)
            assert cli.returncode == 0, (out, err)
            assert "b1: draining" in out and "b1: drained" in out, out
        (started,) = [d["started_at"] for d in router.get("/api/v1/routers/main/pool")[1]["drains"]]
        elapsed = moved_at - started       # from the router's own start of the drain (same clock)
        bound = len(specs) / RATE + 2.0
        print(f"drain: {len(specs)} clients moved in {elapsed:.2f}s (bound {bound:.2f}s)")
        assert elapsed <= bound, f"{elapsed:.2f}s > {bound:.2f}s"
        # ...and no faster than the rate: the proxied clients, then the broker's, one per 1/RATE s
        assert elapsed >= (len(specs) - 2) / RATE, f"{elapsed:.2f}s: faster than {RATE}/s"

        status, pool = router.get("/api/v1/routers/main/pool")
        assert pool["draining"] == ["b1"], pool
        (b1_view,) = [t for t in pool["targets"] if t["name"] == "b1"]
        assert b1_view["draining"] and b1_view["ready"]
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["drains"][0]["phase"] == "drained", 10,
                 what="the drain's phase drained")
        (d,) = router.get("/api/v1/routers/main/pool")[1]["drains"]
        assert d["left"] == 0 and d["proxied_ended"] == PER_KIND and d["broker_closed"] == 2 * PER_KIND, (d, router.counters("proxy"))
        # the redirect-capable clients went straight to their new broker; only the unannounced
        # ones came back through the router's redirect acceptor
        assert router.counters("redirect").get("accepted", 0) == redirect_accepted + PER_KIND
        assert router.counters("proxy").get("proxy_drained", 0) == PER_KIND

        before = clients.accepted
        wait_for(lambda: clients.accepted > before + len(specs), 10, what="sends accepted on the new brokers")
        clients.stop()
        sent, accepted = clients.sent, clients.accepted
        clients = None
        # no acknowledged message is missing: every accepted send is on one of the brokers (a
        # send cut by the move may be stored without its acceptance reaching the client)
        total = sum(_depth(b) for b in (b1, b2, b3))
        assert accepted <= total <= sent, (accepted, total, sent)

        status, body = router.request("POST", "/api/v1/routers/main/targets/b1/undrain")
        assert status == 200 and body["was_draining"], body
        assert router.target_for("main", "after-undrain")["target"]["name"] == "b1"
        assert "draining" not in router.get("/api/v1/routers/main/pool")[1]
    finally:
        if clients is not None:
            clients.stop()
        router.terminate()
        for b in brokers.values():
            b.kill()
