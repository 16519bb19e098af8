"""Hot reload of a running router (docs/router.md, "Reload"): real broker processes, the real router
process, unmodified python-qpid-proton clients.

Clients hold proxied connections open and exchange messages while the configuration file changes
five times (a key filter, a target added, a target removed, a policy, a certificate renewed in
place), through ``POST /api/v1/reload`` and ``SIGHUP``, and twice to a file the router must refuse
whole (a syntax error; a live change beside one that needs a restart). The oracles: every held
connection still carries a message both ways after each step (none dropped: the acceptor's
connection count and closes are checked too), each applied change is in effect for new
connections (the routing decision, the pool, the certificate a new TLS client is shown), and
after a refusal the router answers exactly as before it.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import ssl

import pytest
import trustme
from proton import Message
from proton.reactor import Container
from proton.utils import BlockingConnection

from tests.brokerproc import BrokerProcess, write_config, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "alice": ("alice-pw", ["app"])}
HELD = 12


def _config(users, brokers: dict, *, names, pem, key_filter="^app-", policy="CONSISTENT_HASH",
            extra: str = "", check_period_ms: int = 200, workers: int = 1) -> str:
    lines = [f"users-file = {toml_str(users)}", f"workers = {workers}", "[management]", "port = 0", "[routing-log]", "enabled = false",
             "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
             "[[acceptors]]", 'name = "tls"', "port = 0", 'router = "main"', 'mode = "redirect"',
             f"tls-cert = {toml_str(pem)}", f"tls-key = {toml_str(pem)}",
             "[routers.main]", 'key-type = "CLIENT_ID"', f"key-filter = {toml_str(key_filter)}",
             "[routers.main.policy]", f"name = {toml_str(policy)}",
             "[routers.main.pool]", f"check-period = {check_period_ms}", 'username = "admin"', 'password = "admin"']
    for name in names:
        b = brokers[name]
        lines += ["[[routers.main.pool.targets]]", f"name = {toml_str(name)}", 'host = "127.0.0.1"', f"port = {b.port}",
                  f"management-url = {toml_str(b.management_url)}"]
    return "\n".join(lines) + "\n" + extra


class Held:
    """One client holding a proxied connection, with a sender and a receiver on its own queue."""

    def __init__(self, router, i: int):
        self.name = f"app-{i}"
        self.conn = BlockingConnection(router.url("proxy"), user="alice", password="alice-pw", allowed_mechs="PLAIN",
                                       timeout=20, container=Container(container_id=self.name))
        self.sender = self.conn.create_sender(f"reload.{i}")
        self.receiver = self.conn.create_receiver(f"reload.{i}", credit=1)
        self.n = 0

    def round_trip(self) -> None:
        body = f"{self.name}-{self.n}"
        self.n += 1
        self.sender.send(Message(body=body, durable=True))
        got = self.receiver.receive(timeout=20)
        self.receiver.accept()
        assert got.body == body


def _served_cert_serial(router) -> int:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", router.port("tls")), timeout=10) as raw:
        with ctx.wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
    from cryptography import x509
    return x509.load_der_x509_certificate(der).serial_number


def _reload(router) -> tuple[int, dict]:
    return router.request("POST", "/api/v1/reload")


def _router(router) -> dict:
    status, body = router.get("/api/v1/routers/main")
    assert status == 200, body
    return body


#: what the health prober changes on its own between two reads of a router's view
_PROBE_FIELDS = {"probes", "last_probe_at"}


def _config_view(router) -> dict:
    """The router's view without what the prober moves by itself: a refused reload leaves the
    rest exactly as it was."""
    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in _PROBE_FIELDS}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return strip(_router(router))


def _pool_names(router) -> list[str]:
    return [t["name"] for t in _router(router)["pool"]["targets"]]


@pytest.mark.parametrize("workers,count", [(1, HELD), (2, 200)], ids=["one-process", "two-workers-200"])
def test_five_reloads_and_two_refusals_drop_no_connection(tmp_path, workers, count):
    users = write_users_file(tmp_path / "users.toml", USERS)
    brokers = {n: BrokerProcess(tmp_path / n, write_config(tmp_path / n, name=n, users_file=users)).start()
               for n in ("b1", "b2", "b3")}
    ca = trustme.CA()
    pem = tmp_path / "router.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))

    config = functools.partial(_config, workers=workers)     # every file of this test
    text = config(users, brokers, names=["b1", "b2"], pem=pem)
    router = start_router(tmp_path / "router", text, expect=3, auth=("admin", "admin"))
    path = router.config_path
    held: list[Held] = []
    try:
        wait_for(lambda: all(t["ready"] for t in _router(router)["pool"]["targets"]), 20, what="b1, b2 ready")
        held = [Held(router, i) for i in range(count)]
        placed = {h.name: router.target_for("main", h.name)["target"]["name"] for h in held}
        assert set(placed.values()) == {"b1", "b2"}, placed     # both brokers hold some

        def all_alive(step: str) -> None:
            for h in held:
                h.round_trip()
            counters = router.counters("proxy")
            assert counters.get("proxied", 0) == count, (step, counters)
            closed = {k: v for k, v in counters.items() if k.startswith("proxy_") and v}
            assert not closed, (step, closed)                 # no proxied connection ended

        all_alive("start")
        serial = _served_cert_serial(router)

        # 1. a key filter, by POST
        path.write_text(config(users, brokers, names=["b1", "b2"], pem=pem, key_filter="^svc-"))
        status, body = _reload(router)
        assert status == 200 and body["applied"], body
        assert body["changes"] == ["routers.main.key-filter: '^app-' -> '^svc-'"], body
        assert _router(router)["key_filter"] == "^svc-"
        all_alive("key filter")

        # 2. a target added, by SIGHUP
        path.write_text(config(users, brokers, names=["b1", "b2", "b3"], pem=pem, key_filter="^svc-"))
        os.kill(router.proc.pid, signal.SIGHUP)
        wait_for(lambda: "b3" in _pool_names(router), 20, what="b3 in the pool after SIGHUP")
        wait_for(lambda: all(t["ready"] for t in _router(router)["pool"]["targets"]), 20, what="b3 ready")
        all_alive("target added")

        # 3. a target removed: its clients keep their connections; new ones go elsewhere
        path.write_text(config(users, brokers, names=["b2", "b3"], pem=pem, key_filter="^svc-"))
        status, body = _reload(router)
        assert status == 200 and body["changes"] == ["routers.main.pool.targets.b1: target removed"], body
        assert _pool_names(router) == ["b2", "b3"]
        on_b1 = [name for name, t in placed.items() if t == "b1"]
        assert on_b1
        for name in on_b1:       # a key cached on b1 is placed again, on a broker still in the pool
            assert router.target_for("main", name)["target"]["name"] in ("b2", "b3")
        all_alive("target removed")

        # 4. a policy
        path.write_text(config(users, brokers, names=["b2", "b3"], pem=pem, key_filter="^svc-",
                                policy="FIRST_ELEMENT"))
        status, body = _reload(router)
        assert status == 200 and body["changes"] == ["routers.main.policy.name: 'CONSISTENT_HASH' -> 'FIRST_ELEMENT'"]
        assert _router(router)["policy"] == "FIRST_ELEMENT"
        assert router.target_for("main", "a-new-key")["target"]["name"] == "b2"
        all_alive("policy")

        # 5. the certificate renewed in place: new handshakes get the new one
        ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
        status, body = _reload(router)
        assert status == 200, body
        assert [c.split(":")[0] for c in body["changes"]] == ["acceptors.tls.tls-cert", "acceptors.tls.tls-key"]
        renewed = _served_cert_serial(router)
        assert renewed != serial
        for _ in range(6):      # whichever worker the kernel hands the handshake to
            assert _served_cert_serial(router) == renewed
        all_alive("certificate")

        # refused whole: a file that does not load...
        good = path.read_text()
        path.write_text(good.replace('name = "FIRST_ELEMENT"', 'name = "NO_SUCH_POLICY"'))
        before = _config_view(router)
        status, body = _reload(router)
        assert status == 409, body
        assert str(path) in body["error"] and "policy" in body["error"] and "NO_SUCH_POLICY" in body["error"], body
        assert _config_view(router) == before
        # ...and a live change beside one that needs a restart
        path.write_text(good.replace('key-filter = "^svc-"', 'key-filter = "^other-"').replace(
            'key-type = "CLIENT_ID"', 'key-type = "SNI_HOST"'))
        status, body = _reload(router)
        assert status == 409 and "routers.main.key-type" in body["error"] and "cannot change live" in body["error"]
        assert "key-filter" not in body["error"]           # only what cannot apply is named
        assert _config_view(router) == before                   # the filter did not change either
        assert _served_cert_serial(router) == renewed
        all_alive("refusals")

        log = router.stderr_text()
        ours = log.count("reload (POST") + log.count("reload (SIGHUP")
        assert ours == 7 and log.count("refused, the configuration in force stays") == 2, log
        if workers > 1:     # each worker applied the five changes, told by the supervisor
            assert log.count("reload (by the supervisor)") == 5 * workers, log
        assert "admin-pw" not in log and "alice-pw" not in log
    finally:
        for h in held:
            h.conn.close()
        router.terminate()
        for b in brokers.values():
            b.kill()


def test_runtime_filters_and_pins_follow_the_file_at_a_reload(tmp_path):
    """A key filter set at runtime (PUT) is set back to the file's value, and said so; a pins
    file whose content changed is in force when the reload answers; a pins file with no valid pin
    refuses the reload whole."""
    users = write_users_file(tmp_path / "users.toml", USERS)
    brokers = {n: BrokerProcess(tmp_path / n, write_config(tmp_path / n, name=n, users_file=users)).start()
               for n in ("b1", "b2")}
    ca = trustme.CA()
    pem = tmp_path / "router.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    pins = tmp_path / "pins.txt"
    pins.write_text('{"key": "pinned-key", "node_id": "b1"}\n')
    extra = f"[routers.main.pins]\nfile = {toml_str(pins)}\n"
    router = start_router(tmp_path / "router",
                          _config(users, brokers, names=["b1", "b2"], pem=pem, policy="FIRST_ELEMENT", extra=extra,
                                  check_period_ms=60_000),     # the pins loop would not see it for a minute
                          expect=3, auth=("admin", "admin"))
    try:
        wait_for(lambda: all(t["ready"] for t in _router(router)["pool"]["targets"]), 20, what="b1, b2 ready")
        assert router.target_for("main", "pinned-key")["target"]["name"] == "b1"
        assert router.target_for("main", "pinned-key")["explanation"]["pin"] is not None
        status, body = router.request("PUT", "/api/v1/routers/main/key-filter", {"key_filter": "^runtime-"})
        assert status == 200, body
        pins.write_text('{"key": "pinned-key", "node_id": "b2"}\n')
        status, body = _reload(router)
        assert status == 200 and body["filters_reset"] == ["main"], body
        assert "runtime filters set back" in body["summary"]
        assert _router(router)["key_filter"] == "^app-"
        assert router.target_for("main", "pinned-key")["target"]["name"] == "b2"    # at once
        pins.write_text("this line is not a pin\n")
        status, body = _reload(router)
        assert status == 409 and "routers.main.pins" in body["error"], body
        assert router.target_for("main", "pinned-key")["target"]["name"] == "b2"    # the pins in force stay
    finally:
        router.terminate()
        for b in brokers.values():
            b.kill()


def test_workers_refuse_a_reload_whole_and_a_restarted_worker_runs_the_configuration_in_force(tmp_path):
    """Two workers: an acceptor added on a port another process listens on is refused by the
    supervisor; one with a certificate only the workers load is refused whole after their
    prepare step, naming each worker; the file on disk is then left invalid, a worker is SIGKILLed, and its restart
    runs the text in force (it would exit on the file's), serving on every acceptor."""
    users = write_users_file(tmp_path / "users.toml", USERS)
    broker = BrokerProcess(tmp_path / "b1", write_config(tmp_path / "b1", name="b1", users_file=users)).start()
    ca = trustme.CA()
    pem = tmp_path / "router.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    text = _config(users, {"b1": broker}, names=["b1"], pem=pem, workers=2)
    router = start_router(tmp_path / "router", text, expect=3, auth=("admin", "admin"))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        wait_for(lambda: all(t["ready"] for t in _router(router)["pool"]["targets"]), 20, what="b1 ready")
        before = _config_view(router)
        # a port another process listens on: the supervisor refuses before any worker prepares
        router.config_path.write_text(text.replace('key-filter = "^app-"', 'key-filter = "^svc-"') + "\n".join([
            "[[acceptors]]", 'name = "extra"', 'host = "127.0.0.1"', f"port = {taken.getsockname()[1]}",
            'router = "main"', 'mode = "redirect"']) + "\n")
        status, body = _reload(router)
        assert status == 409, body
        assert "acceptors.extra" in body["error"] and "cannot listen" in body["error"], body
        assert _config_view(router) == before
        # a certificate only the workers load (the supervisor accepts no client): each worker's
        # prepare fails, and the reload is refused whole, naming both
        bad = tmp_path / "bad.pem"
        bad.write_text("not a certificate\n")
        router.config_path.write_text(text.replace('key-filter = "^app-"', 'key-filter = "^svc-"') + "\n".join([
            "[[acceptors]]", 'name = "extra"', 'host = "127.0.0.1"', "port = 0", 'router = "main"',
            'mode = "redirect"', f"tls-cert = {toml_str(str(bad))}", f"tls-key = {toml_str(str(bad))}"]) + "\n")
        status, body = _reload(router)
        assert status == 409, body
        assert "worker 0" in body["error"] and "worker 1" in body["error"], body
        assert _config_view(router) == before                  # the key filter did not change either
        status, info = router.get("/api/v1/router")
        assert status == 200 and [a["name"] for a in info["acceptors"]] == ["proxy", "tls"], info

        router.config_path.write_text("this is not TOML [\n")
        os.kill(router.proc.pid, signal.SIGHUP)
        wait_for(lambda: "reload (SIGHUP) refused" in router.stderr_text(), 10, what="the refusal logged")
        victim = _workers(router)[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: (lambda w: w["restarts"] == 1 and w["ready"] and w["pid"] != victim)(_workers(router)[1]),
                 30, what="worker 1 restarted and ready")
        assert router.proc.poll() is None
        for i in range(20):     # the kernel spreads them over both workers: every one is served
            h = Held(router, 1000 + i)
            h.round_trip()
            h.conn.close()
        assert _served_cert_serial(router)
    finally:
        taken.close()
        router.terminate()
        broker.kill()


def _workers(router) -> list[dict]:
    status, body = router.get("/api/v1/router")
    assert status == 200, body
    return sorted(body["processes"], key=lambda w: w["worker"])


def test_a_worker_that_cannot_start_on_a_broken_certificate_waits_while_the_other_serves(tmp_path):
    """Two workers; the certificate is broken on disk (no reload), then a worker is SIGKILLed:
    its restart cannot load the certificate. The router does not stop (it would have after five
    quick failed starts): the other worker serves every new connection, /health says which
    worker is down and why, and once the file is fixed the worker comes back by itself."""
    users = write_users_file(tmp_path / "users.toml", USERS)
    broker = BrokerProcess(tmp_path / "b1", write_config(tmp_path / "b1", name="b1", users_file=users)).start()
    ca = trustme.CA()
    pem = tmp_path / "router.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    good = pem.read_bytes()
    router = start_router(tmp_path / "router", _config(users, {"b1": broker}, names=["b1"], pem=pem, workers=2),
                          expect=3, auth=("admin", "admin"))
    try:
        wait_for(lambda: all(t["ready"] for t in _router(router)["pool"]["targets"]), 20, what="b1 ready")
        pem.write_text("not a certificate\n")
        victim = _workers(router)[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: "worker 1" in router.stderr_text() and "cannot start" in router.stderr_text(), 20,
                 what="worker 1 cannot start")
        wait_for(lambda: sum("worker 1 (pid" in ln and "cannot start" in ln
                             for ln in router.stderr_text().splitlines()) >= 2, 30,
                 what="worker 1 tried again, after a back-off")
        assert router.proc.poll() is None                  # the router did not stop
        status, health = router.get("/health")
        assert status == 200 and health["status"] == "degraded", health
        assert [(d["component"], d["worker"]) for d in health["degraded"]] == [("worker", 1)], health
        for i in range(10):                               # worker 0 takes every connection
            h = Held(router, 2000 + i)
            h.round_trip()
            h.conn.close()
        pem.write_bytes(good)
        wait_for(lambda: _workers(router)[1]["ready"], 40, what="worker 1 back once the file is fixed")
        wait_for(lambda: router.get("/health")[1]["status"] == "ok", 10, what="health ok again")
    finally:
        router.terminate()
        broker.kill()
