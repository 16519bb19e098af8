"""Plain proxied connections held without a task of their own (``router.net.proxy.Relay``): a
real router, a real broker, unmodified python-qpid-proton clients.

An idle proxied connection is kept by the shared poller and one keeper task per process, not by
a task and its stack of frames (3.3 KiB per held connection instead of 9.2, loadtest/bench_held.py).
What must not change: a held connection still carries traffic both ways after being idle, its
acceptor's ``max-connections`` slot is given back when it ends, ``idle-timeout-s`` still ends
it (counted and logged ``idle_timeout``), and a client that sends in bulk after being held is
handed over to the two-task pump without losing a byte.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
from proton import Message
from proton.reactor import Container
from proton.utils import BlockingConnection

from broker.wire.frames import AMQP_HEADER, FRAME_AMQP, FRAME_SASL, SASL_HEADER, Open, SaslInit, encode_frame
from tests.brokerproc import BrokerProcess, write_config, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "alice": ("alice-pw", ["app"])}


@pytest.fixture
def env(tmp_path):
    users = write_users_file(tmp_path / "users.toml", USERS)
    broker = BrokerProcess(tmp_path / "b1", write_config(tmp_path / "b1", name="b1", users_file=users)).start()
    log_path = tmp_path / "routing.log"
    text = "\n".join([
        f"users-file = {toml_str(users)}", "[management]", "port = 0", "[routing-log]", f"path = {toml_str(log_path)}",
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", "check-period = 300", 'username = "admin"', 'password = "admin"',
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {broker.port}",
        f"management-url = {toml_str(broker.management_url)}",
        "[[acceptors]]", 'name = "held"', "port = 0", 'router = "main"', 'mode = "proxy"', "max-connections = 4",
        "[[acceptors]]", 'name = "brief"', "port = 0", 'router = "main"', 'mode = "proxy"', "idle-timeout-s = 1",
    ]) + "\n"
    router = start_router(tmp_path / "router", text, expect=3, auth=("admin", "admin"))
    try:
        yield broker, router, log_path
    finally:
        router.terminate()
        broker.kill()


def _connect(router, acceptor: str, container: str) -> BlockingConnection:
    return BlockingConnection(router.url(acceptor), user="alice", password="alice-pw", allowed_mechs="PLAIN",
                              timeout=20, container=Container(container_id=container))


def _closes(log_path: Path) -> list[dict]:
    if not log_path.exists():
        return []
    return [e for e in (json.loads(x) for x in log_path.read_text().splitlines() if x.strip())
            if e.get("event") == "close"]


def test_held_connections_carry_traffic_and_give_their_slot_back(env):
    broker, router, log_path = env
    held = [_connect(router, "held", f"held-{i}") for i in range(4)]
    try:
        time.sleep(0.5)                                  # idle: no task of their own now
        # the acceptor is full: a fifth client is refused (amqp:resource-limit-exceeded)
        with pytest.raises(Exception):
            _connect(router, "held", "fifth").create_sender("q.fifth")
        for i, c in enumerate(held):                     # each still works both ways
            c.create_sender(f"q.{i}").send(Message(body=f"m{i}", durable=True))
            r = c.create_receiver(f"q.{i}")
            assert r.receive(timeout=20).body == f"m{i}"
            r.accept()
        held.pop().close()                               # its slot comes back when it ends
        wait_for(lambda: router.counters("held").get("proxy_closed", 0) >= 1, 10)
        again = _connect(router, "held", "again")
        again.create_sender("q.again").send(Message(body="in"))
        again.close()
    finally:
        for c in held:
            c.close()
    wait_for(lambda: router.counters("held").get("proxy_closed", 0) >= 5, 10)
    closes = wait_for(lambda: [c for c in _closes(log_path) if c["acceptor"] == "held"] or None, 10)
    assert {c["close_reason"] for c in closes} == {"closed"}
    assert all(c["bytes_client_to_broker"] > 0 and c["bytes_broker_to_client"] > 0 for c in closes)


def test_an_idle_held_connection_is_ended_by_the_idle_timeout(env):
    broker, router, log_path = env
    hello = (SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\0alice\0alice-pw", None))
             + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id="idle-one")))
    host, port = router.url("brief").removeprefix("amqp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    try:
        s.sendall(hello)
        s.settimeout(20)
        got = b""
        while b"\x00\x53\x10" not in got[8:]:            # the broker's Open (descriptor 0x10), through
            data = s.recv(65536)
            assert data, "closed before the broker's Open"
            got += data
        t0 = time.monotonic()
        while True:                                      # then silence, until the router ends it
            data = s.recv(65536)
            if not data:
                break
        idle = time.monotonic() - t0
    finally:
        s.close()
    # idle-timeout-s = 1: the keeper checks every 1/8 of it, plus the 1 % slack
    assert 0.9 <= idle <= 2.0, idle
    wait_for(lambda: router.counters("brief").get("proxy_idle_timeout", 0) == 1, 10)
    close = wait_for(lambda: [c for c in _closes(log_path) if c["container_id"] == "idle-one"] or None, 10)[0]
    assert close["close_reason"] == "idle_timeout"


def test_bulk_after_being_held_goes_over_to_the_pump_whole(env):
    broker, router, log_path = env
    c = _connect(router, "held", "bulk")
    try:
        time.sleep(0.3)
        body = "x" * 300_000                              # more than a read: the two-task pump (splice)
        c.create_sender("q.bulk").send(Message(body=body, durable=True))
        r = c.create_receiver("q.bulk")
        got = r.receive(timeout=20)
        r.accept()
        assert got.body == body
    finally:
        c.close()
    close = wait_for(lambda: [x for x in _closes(log_path) if x["container_id"] == "bulk"] or None, 10)[0]
    assert close["close_reason"] == "closed" and close["spliced"] is True
    assert close["bytes_client_to_broker"] > 300_000 and close["bytes_broker_to_client"] > 300_000
    assert router.counters("held").get("internal_error", 0) == 0
