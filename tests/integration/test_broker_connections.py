"""Broker connections (``[broker-connections.<name>]``, docs/broker-connections.md) between real
broker processes: A dials B; A's senders move A's messages to B, A's receivers pull B's into A.
Checked with unmodified python-qpid-proton clients on both brokers; B killed with SIGKILL and
restarted on its port in the middle of a stream."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from tests.brokerproc import ADMIN, BrokerProcess, write_config
from tests.haproc import receive_all, send
from tests.serverproc import free_ports, http_json
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

APP = ("app", "app")


def start(tmp_path: Path, name: str, *, port: int = 0, extra: str = "") -> BrokerProcess:
    """A broker with anycast addresses ``orders`` and ``inbound`` (and ``extra`` TOML appended)."""
    workdir = tmp_path / name
    path = write_config(workdir, name=name, config={
        "acceptors.amqp": {"port": port},
        "addresses.orders": {"routing-types": ["anycast"]},
        "addresses.inbound": {"routing-types": ["anycast"]}})
    path.write_text(path.read_text() + "\n" + extra)
    return BrokerProcess(workdir, path).start()


def connection(uri: str, *, senders=(), receivers=(), **keys) -> str:
    """``[broker-connections.to-b]`` logging in as app."""
    lines = ["[broker-connections.to-b]", f'uri = "{uri}"', 'user = "app"', 'password = "app"',
             "retry-interval-ms = 200"]
    lines += [f"{k.replace('_', '-')} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in keys.items()]
    for kind, elements in (("senders", senders), ("receivers", receivers)):
        for el in elements:
            lines.append(f"[[broker-connections.to-b.{kind}]]")
            lines += [f'{k} = "{v}"' for k, v in el.items()]
    return "\n".join(lines) + "\n"


def dead_port() -> int:
    """A loopback port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def depth(b: BrokerProcess, queue: str) -> int:
    q = b.queue(queue)
    return -1 if q is None else q["depth"]


def view(b: BrokerProcess) -> dict:
    status, body = b.management_get("/api/v1/broker-connections")
    assert status == 200, body
    (v,) = body
    return v


def test_senders_and_receivers_move_every_message_both_ways(tmp_path):
    b = start(tmp_path, "b")
    a = start(tmp_path, "a", extra=connection(b.amqp_url, senders=[{"queue-name": "orders"}],
                                              receivers=[{"queue-name": "inbound"}]))
    try:
        wait_for(lambda: view(a)["connected"], 20, what="A connected to B")
        send(a, "orders", [f"o-{i}" for i in range(200)])
        send(b, "inbound", [f"i-{i}" for i in range(150)])
        wait_for(lambda: depth(b, "orders") == 200 and depth(a, "orders") == 0, 30, what="orders moved to B")
        wait_for(lambda: depth(a, "inbound") == 150 and depth(b, "inbound") == 0, 30, what="inbound pulled to A")
        got_b = receive_all(b, "orders", quiet_s=2.0)
        got_a = receive_all(a, "inbound", quiet_s=2.0)
        assert sorted(got_b) == sorted(f"o-{i}" for i in range(200)) and len(got_b) == 200
        assert sorted(got_a) == sorted(f"i-{i}" for i in range(150)) and len(got_a) == 150
        assert got_b == [f"o-{i}" for i in range(200)]   # in order: one producer, one queue, one link
        v = view(a)
        assert v["host"] == b.amqp_url and v["state"] == "connected" and v["started"] is True
        (s,) = v["senders"]
        assert (s["queue"], s["remote_address"], s["sent"], s["acknowledged"], s["in_flight"]) == \
            ("orders", "orders", 200, 200, 0)
        (r,) = v["receivers"]
        assert (r["local"], r["remote_address"], r["stored"]) == ("inbound", "inbound", 150)
        status, text = http_json(a.management_url + "/metrics", auth=ADMIN)
        assert status == 200
        assert 'lodestone_broker_connection_up{connection="to-b"} 1' in text
        assert 'lodestone_broker_connection_acknowledged_total{connection="to-b",queue="orders"} 200' in text
    finally:
        a.stop()
        b.stop()


def test_the_peer_killed_and_restarted_mid_stream_loses_nothing(tmp_path):
    (port,) = free_ports(1)
    b = start(tmp_path, "b", port=port)
    a = start(tmp_path, "a", extra=connection(f"amqp://127.0.0.1:{port}", senders=[{"queue-name": "orders"}]))
    n = 1000
    try:
        wait_for(lambda: view(a)["connected"], 20, what="A connected to B")
        send(a, "orders", [f"o-{i}" for i in range(n // 2)])
        wait_for(lambda: depth(b, "orders") > 50, 30, what="some orders on B")
        b.kill()   # SIGKILL
        send(a, "orders", [f"o-{i}" for i in range(n // 2, n)])    # held on A while B is down
        wait_for(lambda: not view(a)["connected"], 20, what="A saw B go")
        b.restart()
        wait_for(lambda: view(a)["connected"], 30, what="A connected to B again")
        wait_for(lambda: depth(a, "orders") == 0, 60, what="A's orders all sent")
        got = receive_all(b, "orders", quiet_s=2.0)
        missing = set(f"o-{i}" for i in range(n)) - set(got)
        assert not missing, f"{len(missing)} lost"
        # at-least-once: what B had stored but not yet acknowledged when it died comes again
        dup = len(got) - len(set(got))
        assert dup <= 100, dup
        print(f"\n{n} sent through a SIGKILL of the peer: {len(set(got))} arrived, {dup} twice")
        v = view(a)
        assert v["connections"] == 2 and v["senders"][0]["in_flight"] == 0
    finally:
        a.stop()
        b.stop()


def test_the_first_host_down_lands_on_the_alternate(tmp_path):
    dead = dead_port()
    b = start(tmp_path, "b")
    a = start(tmp_path, "a", extra=connection(f"amqp://127.0.0.1:{dead}#{b.amqp_url}",
                                              senders=[{"address-match": "orders.#"}]))
    try:
        wait_for(lambda: view(a)["connected"], 20, what="A connected to the alternate")
        v = view(a)
        assert v["host"] == b.amqp_url and v["uri"] == f"amqp://127.0.0.1:{dead}#{b.amqp_url}"
        assert v["attempts"] >= 2
        send(a, "orders", ["x"])
        wait_for(lambda: depth(b, "orders") == 1, 20, what="the order on B")
    finally:
        a.stop()
        b.stop()


def test_auto_start_false_waits_for_the_start_call_and_stop_closes(tmp_path):
    b = start(tmp_path, "b")
    a = start(tmp_path, "a", extra=connection(b.amqp_url, auto_start=False, senders=[{"queue-name": "orders"}]))
    try:
        send(a, "orders", [f"o-{i}" for i in range(10)])
        time.sleep(1.0)   # the thing under test: nothing moves without the start call
        v = view(a)
        assert (v["state"], v["connected"], v["attempts"]) == ("stopped", False, 0) and depth(b, "orders") == 0
        status, body = http_json(a.management_url + "/api/v1/broker-connections/to-b/start", "POST", {}, auth=ADMIN)
        assert status == 200 and body["started"] is True
        wait_for(lambda: depth(b, "orders") == 10, 20, what="orders on B after the start call")
        status, body = http_json(a.management_url + "/api/v1/broker-connections/to-b/stop", "POST", {}, auth=ADMIN)
        assert status == 200 and body["started"] is False
        wait_for(lambda: view(a)["state"] == "stopped", 10, what="stopped")
        send(a, "orders", ["after-stop"])
        time.sleep(1.0)   # the thing under test: a stopped connection moves nothing
        assert depth(a, "orders") == 1 and depth(b, "orders") == 10
        status, body = http_json(a.management_url + "/api/v1/broker-connections/nope/start", "POST", {}, auth=ADMIN)
        assert status == 404 and "nope" in str(body)
        status, body = http_json(a.management_url + "/api/v1/broker-connections/to-b/start", "POST", {}, auth=APP)
        assert status == 403
    finally:
        a.stop()
        b.stop()


def test_spent_reconnect_attempts_leave_it_failed_until_started_again(tmp_path):
    dead = dead_port()
    a = start(tmp_path, "a", extra=connection(f"amqp://127.0.0.1:{dead}", reconnect_attempts=2,
                                              senders=[{"queue-name": "orders"}]))
    try:
        v = wait_for(lambda: view(a), 20, until=lambda v: v["state"] == "failed", what="failed")
        assert (v["attempts"], v["started"], v["connected"]) == (3, False, False)   # 1 + 2 retries
        assert "127.0.0.1" in (v["last_error"] or "")
        assert any("gave up after 3 attempts" in line for line in a.stderr_text().splitlines())
        status, body = http_json(a.management_url + "/api/v1/broker-connections/to-b/start", "POST", {}, auth=ADMIN)
        assert status == 200 and body["started"] is True
        v = wait_for(lambda: view(a), 20, until=lambda v: v["state"] == "failed" and v["attempts"] == 3
                     and v["since"] > body["since"], what="failed again after three more attempts")
    finally:
        a.stop()
