"""Proxy mode when the broker fails: the client always gets a clean answer, the router stays up.

Real router process, real broker processes (killed with ``kill -9`` where a dying broker is the
point), unmodified proton clients, trustme TLS. A broker that accepts TCP and then never answers,
closes or resets is a plain listening socket in this test (a peer stand-in: a real broker cannot be
made to hang like that).

* the chosen broker is down (connection refused) → ``amqp:connection:forced`` naming the broker
  (``upstream_connect_failed``), and the target leaves rotation at once: the failure marks it
  not ready and has it probed again, without waiting for the next check-period;
* the broker is killed while a proxied client is mid-stream → that client's connection ends
  (proton reports the disconnect), the router stays up, a client on another broker is unaffected;
* the broker accepts TCP but never answers → ``amqp:connection:forced`` within
  ``connect-timeout-ms`` (``upstream_connect_timeout``), not a hang; one that closes or resets
  during the replay → ``amqp:connection:forced`` (``upstream_protocol_error``);
* the broker refuses the replayed credentials → ``amqp:unauthorized-access`` (``upstream_auth_failed``).
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import trustme
from proton import ConnectionException, Message, SSLDomain, Timeout
from proton.utils import BlockingConnection, ConnectionClosed, LinkDetached

from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin-pw", ["admin"]), "alice": ("alice-pw", ["app"])}
CONNECT_TIMEOUT_MS = 1000


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-upstream-pki")
    ca = trustme.CA()
    ca_pem = tmp / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    pem = tmp / "router.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    users = write_users_file(tmp / "users.toml", USERS)
    return type("Pki", (), {"ca": ca, "ca_pem": ca_pem, "pem": pem, "users": users})()


def _router_text(pki, routers: dict[str, list[dict]], acceptors: list[dict], *, check_period_ms: int = 500) -> str:
    """A router config: ``routers`` name → targets (dicts of target keys), ``acceptors`` dicts
    with name, router and optional tls (client side) / upstream-tls."""
    lines = [f"users-file = {toml_str(pki.users)}", "[management]", "port = 0", "[routing-log]", "enabled = false"]
    for name, targets in routers.items():
        lines += [f"[routers.{name}]", 'key-type = "CLIENT_ID"', f"[routers.{name}.policy]", 'name = "FIRST_ELEMENT"',
                  f"[routers.{name}.pool]", f"check-period = {check_period_ms}", 'username = "admin"',
                  'password = "admin-pw"']
        for t in targets:
            lines.append(f"[[routers.{name}.pool.targets]]")
            lines += [f"{k} = {toml_str(v)}" for k, v in t.items()]
    for a in acceptors:
        lines += ["[[acceptors]]", f"name = {toml_str(a['name'])}", "port = 0", f"router = {toml_str(a['router'])}",
                  'mode = "proxy"', f"connect-timeout-ms = {CONNECT_TIMEOUT_MS}", "idle-timeout-s = 60",
                  f"upstream-ca = {toml_str(pki.ca_pem)}"]
        if a.get("tls"):
            lines += [f"tls-cert = {toml_str(pki.pem)}", f"tls-key = {toml_str(pki.pem)}"]
        if a.get("upstream-tls"):
            lines += ["upstream-tls = true"]
        if "connect-retries" in a:
            lines += [f"connect-retries = {a['connect-retries']}"]
    return "\n".join(lines) + "\n"


def _target(name: str, broker, *, tls: bool = False) -> dict:
    port = int(broker.amqps_url.rsplit(":", 1)[1]) if tls else broker.port
    return {"name": name, "host": "127.0.0.1", "port": port, "tls": tls, "management-url": broker.management_url}


def _connect(pki, router, acceptor: str, *, tls: bool, user: str = "alice", timeout: float = 20) -> BlockingConnection:
    kw = {"timeout": timeout, "allowed_mechs": "PLAIN", "user": user, "password": USERS[user][0]}
    if tls:
        d = SSLDomain(SSLDomain.MODE_CLIENT)
        d.set_trusted_ca_db(str(pki.ca_pem))
        d.set_peer_authentication(SSLDomain.VERIFY_PEER)
        kw["ssl_domain"] = d
    return BlockingConnection(router.url(acceptor), **kw)


def _round_trip(conn: BlockingConnection, address: str, body: str) -> None:
    conn.create_sender(address).send(Message(body=body))
    receiver = conn.create_receiver(address)
    assert receiver.receive(timeout=20).body == body
    receiver.accept()


def _pool(router, name: str) -> dict:
    status, body = router.get(f"/api/v1/routers/{name}/pool")
    assert status == 200, body
    return body


def _target_state(router, router_name: str, target: str) -> dict:
    return next(t for t in _pool(router, router_name)["targets"] if t["name"] == target)


def _acceptor(router, name: str) -> tuple[dict[str, int], int]:
    status, body = router.get("/api/v1/counters")
    assert status == 200, body
    return body["acceptors"][name]["counters"], body["acceptors"][name]["active_connections"]


def _stop(router, *brokers) -> None:
    alive = router.proc.poll() is None
    status = router.terminate()
    for b in brokers:
        b.kill()
    assert alive and status == 0, router.stderr_text()
    assert "Traceback" not in router.stderr_text(), router.stderr_text()


# -- the chosen broker is down -----------------------------------------------------------------

def test_a_broker_that_went_down_gets_connection_forced_naming_it_and_leaves_rotation_at_once(tmp_path, pki):
    # two brokers that go down, one per acceptor (FIRST_ELEMENT: each failing client takes one
    # out of rotation, the next is tried by the next client), and one that stays up
    downs = [start_broker(tmp_path, name=f"down{i}", users_file=pki.users) for i in (1, 2)]
    up = start_broker(tmp_path, name="up", users_file=pki.users)
    period_ms = 30000  # no probe during the test but the first round: only failures re-probe
    # connect-retries = 0: the client meets the failure (the default routes it again: below)
    text = _router_text(pki, {"main": [_target("down1", downs[0]), _target("down2", downs[1]),
                                       _target("up", up)]},
                        [{"name": "plain", "router": "main", "connect-retries": 0},
                         {"name": "tls", "router": "main", "tls": True, "connect-retries": 0}],
                        check_period_ms=period_ms)
    router = start_router(tmp_path / "router", text, expect=3, auth=("admin", "admin-pw"))
    try:
        wait_for(lambda: _pool(router, "main")["ready"] == 3, 20)
        ports = [d.port for d in downs]
        probes = {n: _target_state(router, "main", n)["probes"] for n in ("down1", "down2")}
        for d in downs:
            d.kill()
        killed = time.monotonic()
        for (acceptor, tls), name, port in zip((("plain", False), ("tls", True)), ("down1", "down2"), ports):
            before = _acceptor(router, acceptor)[0]
            with pytest.raises(ConnectionClosed) as info:
                _connect(pki, router, acceptor, tls=tls)
            assert info.value.condition == "amqp:connection:forced"
            assert f"could not reach broker {name}:{port}" in str(info.value)
            after = wait_for(lambda a=acceptor: _acceptor(router, a)[1] == 0 and _acceptor(router, a)[0], 10)
            assert after["upstream_connect_failed"] == before["upstream_connect_failed"] + 1
            assert after["internal_error"] == before["internal_error"]
            # the failure took it out of rotation at once and had it probed again: not ready
            # (the re-probe's error, or the upstream failure's), long before its next probe
            state = _target_state(router, "main", name)
            assert not state["ready"] and state["last_error"], state
        counters = router.get("/api/v1/counters")[1]["routers"]["main"]
        assert counters["upstream_marked_down"] == 2 and counters["upstream_reprobes"] == 2
        # the re-probe confirms it (a probe each, within 2 s of a 30 s period), and clients land
        # on "up"
        wait_for(lambda: all(_target_state(router, "main", n)["probes"] == probes[n] + 1
                             for n in ("down1", "down2")), 2, interval_s=0.02)
        assert all(not _target_state(router, "main", n)["ready"] for n in ("down1", "down2"))
        assert time.monotonic() - killed < 5
        for acceptor, tls in (("plain", False), ("tls", True)):
            conn = _connect(pki, router, acceptor, tls=tls)
            try:
                assert conn.conn.remote_properties["node-id"] == up.node_id
                _round_trip(conn, f"after-down.{acceptor}", "served by up")
            finally:
                conn.close()
    finally:
        _stop(router, *downs, up)


def test_a_client_whose_broker_went_down_is_routed_again_before_it_sees_anything(tmp_path, pki):
    """connect-retries: four brokers of five are killed before any probe notices (FIRST_ELEMENT
    tries them in order). A client of an acceptor with one retry is tried on down1, then down2,
    and gets down2's failure. A client of the default acceptor (two retries) is tried on down3,
    then down4, then served by up, and never sees the failures. Each failure took its broker out
    of rotation; the routing log has one line per attempt."""
    downs = [start_broker(tmp_path, name=f"down{i}", users_file=pki.users) for i in (1, 2, 3, 4)]
    up = start_broker(tmp_path, name="up", users_file=pki.users)
    routing_log = tmp_path / "routing.log"
    text = _router_text(pki, {"main": [*(_target(f"down{i + 1}", d) for i, d in enumerate(downs)), _target("up", up)]},
                        [{"name": "once", "router": "main", "connect-retries": 1},
                         {"name": "retry", "router": "main"}],
                        check_period_ms=30000)
    text = text.replace("[routing-log]\nenabled = false", f"[routing-log]\npath = {toml_str(routing_log)}")
    router = start_router(tmp_path / "router", text, expect=3, auth=("admin", "admin-pw"))
    try:
        wait_for(lambda: _pool(router, "main")["ready"] == 5, 20)
        ports = [d.port for d in downs]
        for d in downs:
            d.kill()
        keys = ("upstream_connect_failed", "upstream_retried", "proxied", "route_ok", "refused")

        before = _acceptor(router, "once")[0]
        with pytest.raises(ConnectionClosed) as info:
            _connect(pki, router, "once", tls=False)
        assert info.value.condition == "amqp:connection:forced"
        assert f"could not reach broker down2:{ports[1]}" in str(info.value)
        after = wait_for(lambda: _acceptor(router, "once")[1] == 0 and _acceptor(router, "once")[0], 10)
        assert {k: after[k] - before[k] for k in keys} == \
            {"upstream_connect_failed": 2, "upstream_retried": 1, "proxied": 0, "route_ok": 2, "refused": 0}

        before = _acceptor(router, "retry")[0]
        conn = _connect(pki, router, "retry", tls=False)
        try:
            assert conn.conn.remote_properties["node-id"] == up.node_id
            _round_trip(conn, "routed.again", "served by up")
        finally:
            conn.close()
        after = wait_for(lambda: _acceptor(router, "retry")[1] == 0 and _acceptor(router, "retry")[0], 10)
        assert {k: after[k] - before[k] for k in keys} == \
            {"upstream_connect_failed": 2, "upstream_retried": 2, "proxied": 1, "route_ok": 3, "refused": 0}
        assert [n for n in ("down1", "down2", "down3", "down4", "up") if _target_state(router, "main", n)["ready"]] \
            == ["up"]

        def route_lines():
            if not routing_log.exists():
                return None
            lines = [json.loads(x) for x in routing_log.read_text().splitlines() if '"event":"route"' in x]
            return lines if len(lines) == 5 else None
        lines = wait_for(route_lines, 10)
        assert [(x["acceptor"], x["target_name"], x["action"]) for x in lines] == [
            ("once", "down1", "upstream_retried"), ("once", "down2", "upstream_failed"),
            ("retry", "down3", "upstream_retried"), ("retry", "down4", "upstream_retried"), ("retry", "up", "proxied")]
        assert len({x["connection_id"] for x in lines[:2]}) == 1 and len({x["connection_id"] for x in lines[2:]}) == 1
    finally:
        _stop(router, *downs, up)


# -- the broker dies mid-stream ----------------------------------------------------------------

@pytest.mark.parametrize("client_tls, upstream_tls", [(False, False), (True, False), (True, True)],
                         ids=["plain", "tls-client", "tls-both"])
def test_a_broker_killed_mid_stream_ends_only_its_clients(tmp_path, pki, client_tls, upstream_tls):
    victim_broker = start_broker(tmp_path, name="victim", users_file=pki.users, tls=pki.ca)
    other_broker = start_broker(tmp_path, name="other", users_file=pki.users)
    text = _router_text(pki, {"r1": [_target("victim", victim_broker, tls=upstream_tls)],
                              "r2": [_target("other", other_broker)]},
                        [{"name": "p1", "router": "r1", "tls": client_tls},
                         {"name": "p2", "router": "r2", "tls": client_tls}])
    router = start_router(tmp_path / "router", text, expect=3, auth=("admin", "admin-pw"))
    victim = bystander = None
    try:
        wait_for(lambda: _pool(router, "r1")["ready"] == 1 and _pool(router, "r2")["ready"] == 1, 20)
        victim = _connect(pki, router, "p1", tls=client_tls)
        bystander = _connect(pki, router, "p2", tls=client_tls)
        assert victim.conn.remote_properties["node-id"] == victim_broker.node_id
        assert bystander.conn.remote_properties["node-id"] == other_broker.node_id
        v_sender = victim.create_sender("stream.v")
        v_receiver = victim.create_receiver("stream.v")
        b_sender = bystander.create_sender("stream.b")
        b_receiver = bystander.create_receiver("stream.b")
        for i in range(20):  # both streams flowing
            v_sender.send(Message(body=f"v{i}" + "x" * 10_000))
            b_sender.send(Message(body=f"b{i}"))
        before = _acceptor(router, "p1")[0]

        victim_broker.kill()  # kill -9 while the victim's stream is open
        t0 = time.monotonic()
        with pytest.raises((ConnectionException, LinkDetached)) as info:
            for i in range(10_000):  # keeps the stream going until the transport is gone
                v_sender.send(Message(body=f"after-kill {i}"))
        assert not isinstance(info.value, Timeout)
        assert time.monotonic() - t0 < 20
        after = wait_for(lambda: _acceptor(router, "p1")[1] == 0 and _acceptor(router, "p1")[0], 20)
        ended = {k: after[k] - before[k] for k in ("proxy_closed", "proxy_upstream_error", "proxy_client_error")}
        assert sum(ended.values()) == 1, ended
        assert ended["proxy_client_error"] == 0, ended
        assert after["internal_error"] == before["internal_error"]
        assert router.proc.poll() is None, router.stderr_text()

        # the bystander on the other broker never noticed
        got = [b_receiver.receive(timeout=20).body for _ in range(20)]
        b_receiver.accept()
        assert got == [f"b{i}" for i in range(20)]
        b_sender.send(Message(body="after the kill"))
        assert b_receiver.receive(timeout=20).body == "after the kill"
        b_receiver.accept()
        # the victim's router still serves new clients on the live broker
        fresh = _connect(pki, router, "p2", tls=client_tls)
        try:
            _round_trip(fresh, "stream.fresh", "fresh")
        finally:
            fresh.close()
        del v_receiver
    finally:
        for c in (victim, bystander):
            if c is not None:
                try:
                    c.close()
                except Exception:  # noqa: BLE001 - the victim's transport is gone
                    pass
        _stop(router, victim_broker, other_broker)


# -- a broker that accepts TCP and then misbehaves (peer stand-in) -----------------------------

class StandIn:
    """A listening socket playing a broken broker: ``mode`` says what each accepted connection
    gets — ``silent`` (held open, never read), ``close`` (FIN at once), ``reset`` (RST at once)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.mode = "silent"
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            if self.mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            elif self.mode == "close":
                conn.close()
            else:
                self.held.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def standin_router(tmp_path, pki):
    standin = StandIn()
    # no management-url: the probe is a TCP connect, which the stand-in accepts, so it is "ready"
    target = {"name": "standin", "host": "127.0.0.1", "port": standin.port}
    text = _router_text(pki, {"main": [target]},
                        [{"name": "plain", "router": "main"}, {"name": "tls", "router": "main", "tls": True},
                         {"name": "tls-up", "router": "main", "upstream-tls": True}])
    router = start_router(tmp_path / "router", text, expect=4, auth=("admin", "admin-pw"))
    try:
        wait_for(lambda: _pool(router, "main")["ready"] == 1, 20)
        yield router, standin
    finally:
        try:
            _stop(router)
        finally:
            standin.close()


@pytest.mark.parametrize("acceptor, tls, phase", [("plain", False, "replaying the handshake to"),
                                                  ("tls", True, "replaying the handshake to"),
                                                  ("tls-up", False, "connecting to broker")])
def test_a_broker_that_never_answers_gets_a_clean_error_within_the_connect_timeout(standin_router, pki, acceptor,
                                                                                   tls, phase):
    router, standin = standin_router
    standin.mode = "silent"
    before = _acceptor(router, acceptor)[0]
    t0 = time.monotonic()
    with pytest.raises(ConnectionClosed) as info:
        _connect(pki, router, acceptor, tls=tls, timeout=30)  # a hang would be proton's Timeout
    took = time.monotonic() - t0
    assert info.value.condition == "amqp:connection:forced"
    assert f"timed out {phase} standin:{standin.port}" in str(info.value)
    assert CONNECT_TIMEOUT_MS / 1000 * 0.8 <= took < CONNECT_TIMEOUT_MS / 1000 + 5
    after = wait_for(lambda: _acceptor(router, acceptor)[1] == 0 and _acceptor(router, acceptor)[0], 10)
    assert after["upstream_connect_timeout"] == before["upstream_connect_timeout"] + 1
    assert after["internal_error"] == before["internal_error"]


@pytest.mark.parametrize("mode", ["close", "reset"])
@pytest.mark.parametrize("acceptor, tls", [("plain", False), ("tls", True), ("tls-up", False)])
def test_a_broker_that_hangs_up_during_the_replay_gets_connection_forced(standin_router, pki, acceptor, tls, mode):
    router, standin = standin_router
    standin.mode = mode
    before = _acceptor(router, acceptor)[0]
    with pytest.raises(ConnectionClosed) as info:
        _connect(pki, router, acceptor, tls=tls)
    assert info.value.condition == "amqp:connection:forced"
    assert f"standin:{standin.port}" in str(info.value)
    after = wait_for(lambda: _acceptor(router, acceptor)[1] == 0 and _acceptor(router, acceptor)[0], 10)
    # Over TLS upstream the hang-up breaks the TLS handshake (a connect failure); plain, the
    # replay. A reset can also beat the router's connect check (SO_ERROR): a connect failure.
    counters = ("upstream_connect_failed", "upstream_protocol_error")
    moved = {k: after[k] - before[k] for k in counters}
    if acceptor == "tls-up":
        assert moved == {"upstream_connect_failed": 1, "upstream_protocol_error": 0}
    elif mode == "close":
        assert moved == {"upstream_connect_failed": 0, "upstream_protocol_error": 1}
    else:
        assert sum(moved.values()) == 1, moved
    assert after["internal_error"] == before["internal_error"]
    assert router.proc.poll() is None


# -- the broker refuses the replayed credentials -----------------------------------------------

@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_broker_that_refuses_the_replayed_credentials_gives_unauthorized_access(tmp_path, pki, tls):
    # the broker knows admin (the probe's user) but not alice, whom the router accepts
    broker_users = write_users_file(tmp_path / "broker-users.toml", {"admin": USERS["admin"]})
    strict = start_broker(tmp_path, name="strict", users_file=broker_users)
    text = _router_text(pki, {"main": [_target("strict", strict)]},
                        [{"name": "p", "router": "main", "tls": tls}])
    router = start_router(tmp_path / "router", text, expect=2, auth=("admin", "admin-pw"))
    try:
        wait_for(lambda: _pool(router, "main")["ready"] == 1, 20)
        before = _acceptor(router, "p")[0]
        with pytest.raises(ConnectionClosed) as info:
            _connect(pki, router, "p", tls=tls)
        assert info.value.condition == "amqp:unauthorized-access"
        assert f"broker strict:{strict.port} refused the credentials" in str(info.value)
        after = wait_for(lambda: _acceptor(router, "p")[1] == 0 and _acceptor(router, "p")[0], 10)
        assert after["auth_ok"] == before["auth_ok"] + 1  # the router itself accepted alice
        assert after["upstream_auth_failed"] == before["upstream_auth_failed"] + 1
        assert after["internal_error"] == before["internal_error"]
        # a user the broker knows is proxied through the same acceptor
        conn = _connect(pki, router, "p", tls=tls, user="admin")
        try:
            _round_trip(conn, "strict.q", "admin gets in")
        finally:
            conn.close()
    finally:
        _stop(router, strict)
