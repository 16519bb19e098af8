"""PROXY protocol v2 between a real router (``upstream-proxy-protocol = true``) and a real broker
whose acceptor trusts the router's address (``proxy-protocol-from``): the broker's connection
list, its logs, its activity log and the users file's allowed ``sources`` see the client's real
address. A header from an address the acceptor does not trust is never honoured; a trusted
address that sends no header is refused.

The client is an unmodified python-qpid-proton client; to make its address differ from the
router's (both on loopback) it reaches the router through a small TCP forwarder whose outgoing
socket is bound to 127.0.0.2.
"""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest
import trustme
from proton import ConnectionException, Message
from proton.utils import BlockingConnection

from broker.wire.frames import (
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    FrameReader,
    SaslInit,
    SaslOutcome,
    decode_performative,
    encode_frame,
)
from broker.wire.proxyproto import build_header
from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

CLIENT_IP = "127.0.0.2"
USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"]), "edgeonly": ("edgeonly", ["app"])}


class Forwarder:
    """Listen on 127.0.0.1:<port>; each accepted connection is relayed to ``target`` from a socket
    bound to ``bind_ip`` (so the far end sees ``bind_ip`` as the client address)."""

    def __init__(self, target: tuple[str, int], bind_ip: str):
        self.target, self.bind_ip = target, bind_ip
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.local_ports: list[int] = []
        self.sockets: list[socket.socket] = []      # closed by close(): none left to the GC
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(a)
            b = socket.create_connection(self.target, source_address=(self.bind_ip, 0))
            self.sockets.append(b)
            self.local_ports.append(b.getsockname()[1])
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            s.close()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("proxyproto")
    users = write_users_file(tmp / "users.toml", USERS)
    text = users.read_text()
    # edgeonly may connect from the client's address only, never from the router's
    users.write_text(text.replace('roles = ["app"]\n\n[[permissions]]',
                                  f'roles = ["app"]\nsources = ["{CLIENT_IP}/32"]\n\n[[permissions]]'))
    assert f'sources = ["{CLIENT_IP}/32"]' in users.read_text()
    broker = start_broker(tmp, users_file=users, config={
        "acceptors.edge": {"host": "127.0.0.1", "port": 0, "sasl-mechanisms": ["PLAIN"],
                           "proxy-protocol-from": ["127.0.0.1/32"]}})
    amqp_urls = [ln.split()[2] for ln in broker.lines if ln.startswith("listening amqp ")]
    plain_port, edge_port = (int(u.rsplit(":", 1)[1]) for u in amqp_urls)
    router_text = "\n".join([
        f"users-file = {toml_str(users)}",
        "[management]", "port = 0",
        "[routing-log]", "enabled = false",
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", "check-period = 300", 'username = "admin"', 'password = "admin"',
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {edge_port}",
        f"management-url = {toml_str(broker.management_url)}",
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        'sasl-mechanisms = ["PLAIN"]', "upstream-proxy-protocol = true",
    ]) + "\n"
    router = start_router(tmp / "router", router_text, expect=2, auth=("admin", "admin"))
    wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 1, 15)
    fwd = Forwarder(("127.0.0.1", router.port("proxy")), CLIENT_IP)
    try:
        yield broker, router, fwd, plain_port, edge_port
    finally:
        fwd.close()
        router.terminate()
        broker.terminate()


def events(broker) -> dict[str, int]:
    status, text = broker.management_get("/metrics")
    assert status == 200
    return {m[0]: int(m[1]) for m in re.findall(r'^lodestone_broker_events_total\{event="([a-z_]+)"\} (\d+)',
                                                text, re.M)}


def bystander(broker, plain_port: int) -> None:
    c = BlockingConnection(f"amqp://app:app@127.0.0.1:{plain_port}", timeout=10, allowed_mechs="PLAIN")
    c.create_sender("bystander").send(Message(body="b"))
    r = c.create_receiver("bystander")
    assert r.receive(timeout=10).body == "b"
    r.accept()
    c.close()


def test_the_broker_sees_the_clients_real_address_through_the_router(env):
    broker, _router, fwd, plain_port, _edge = env
    url = f"amqp://edgeonly:edgeonly@127.0.0.1:{fwd.port}"
    c = BlockingConnection(url, timeout=10, allowed_mechs="PLAIN", container_id="real-client")
    try:
        s = c.create_sender("pp-orders")
        for i in range(3):
            s.send(Message(body=i))
        status, conns = broker.management_get("/api/v1/connections")
        me = [x for x in conns if x["container_id"] == "real-client"]
        assert len(me) == 1, conns
        source = me[0]["source"]
        assert source == f"{CLIENT_IP}:{fwd.local_ports[-1]}", (source, fwd.local_ports)
        assert re.search(rf"connection open .*container_id=real-client .*source={re.escape(source)}",
                         broker.stderr_text())
    finally:
        c.close()
    log = broker.data_dir / "activity.jsonl"

    def records():
        if not log.exists():
            return []
        return [r for r in map(json.loads, log.read_text().splitlines()) if r["container_id"] == "real-client"]
    recs = wait_for(records, 10)
    assert {r["source"] for r in recs} == {source}
    assert sum(r["messages"] for r in recs if r["direction"] == "produce") == 3
    assert events(broker)["proxy_header_ok"] >= 1
    bystander(broker, plain_port)


def test_a_trusted_address_without_a_header_is_refused(env):
    broker, _router, _fwd, plain_port, edge_port = env
    before = events(broker).get("proxy_header_invalid", 0)
    with socket.create_connection(("127.0.0.1", edge_port), timeout=5) as s:
        s.sendall(SASL_HEADER)
        assert s.recv(100) == b""  # closed without a word: this is not a PROXY header
    wait_for(lambda: events(broker).get("proxy_header_invalid", 0) == before + 1)
    assert "connection refused: PROXY protocol: no PROXY v2 signature" in broker.stderr_text()
    # a real client straight to the router-only acceptor does not get in either
    with pytest.raises(ConnectionException):
        BlockingConnection(f"amqp://app:app@127.0.0.1:{edge_port}", timeout=5, allowed_mechs="PLAIN")
    bystander(broker, plain_port)


def test_a_header_from_an_untrusted_address_is_never_honoured(env):
    broker, _router, _fwd, plain_port, edge_port = env
    before = events(broker).get("bad_protocol_header", 0)
    forged = build_header(("10.9.9.9", 4242), ("127.0.0.1", edge_port))
    # 127.0.0.3 is not in proxy-protocol-from: the header is just bytes that are not AMQP
    with socket.create_connection(("127.0.0.1", edge_port), timeout=5, source_address=("127.0.0.3", 0)) as s:
        s.sendall(forged + SASL_HEADER)
        reply = b""
        while chunk := s.recv(100):
            reply += chunk
    assert reply == SASL_HEADER  # §2.2: the header we speak, then close
    wait_for(lambda: events(broker).get("bad_protocol_header", 0) == before + 1)
    status, conns = broker.management_get("/api/v1/connections")
    assert not any(c["source"].startswith("10.9.9.9") for c in conns)
    assert "10.9.9.9" not in broker.stderr_text()
    bystander(broker, plain_port)


def test_allowed_sources_of_the_users_file_use_the_real_address(env):
    broker, _router, _fwd, _plain, edge_port = env
    # edgeonly may connect from 127.0.0.2 only. Through the router it got in (first test); a
    # header from the trusted address naming 127.0.0.1 as the client makes the same login fail
    with socket.create_connection(("127.0.0.1", edge_port), timeout=5) as s:
        s.sendall(build_header(("127.0.0.1", 5555)) + SASL_HEADER +
                  encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\x00edgeonly\x00edgeonly")))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    r = FrameReader()
    r.receive_data(data)
    assert r.next_protocol_header() == SASL_HEADER
    perfs = []
    while (f := r.next_event()) is not NEED_DATA:
        perfs.append(decode_performative(f.body))
    assert isinstance(perfs[-1], SaslOutcome) and perfs[-1].code == 1, perfs
    assert re.search(r"authentication failed .*source=127\.0\.0\.1:5555", broker.stderr_text())


def test_the_header_comes_before_tls(tmp_path):
    """A TLS acceptor that trusts the router: the header is read on the raw socket, then TLS."""
    ca = trustme.CA()
    users = write_users_file(tmp_path / "users.toml", USERS)
    broker = start_broker(tmp_path, users_file=users, tls=ca,
                          config={"acceptors.amqps": {"proxy-protocol-from": ["127.0.0.1/32"]}})
    ca_pem = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    tls_port = int(broker.amqps_url.rsplit(":", 1)[1])
    router = start_router(tmp_path / "router", "\n".join([
        f"users-file = {toml_str(users)}",
        "[management]", "port = 0",
        "[routing-log]", "enabled = false",
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", "check-period = 300", 'username = "admin"', 'password = "admin"',
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {tls_port}",
        "tls = true", f"management-url = {toml_str(broker.management_url)}",
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        'sasl-mechanisms = ["PLAIN"]', "upstream-proxy-protocol = true", f"upstream-ca = {toml_str(ca_pem)}",
    ]) + "\n", expect=2, auth=("admin", "admin"))
    fwd = Forwarder(("127.0.0.1", router.port("proxy")), CLIENT_IP)
    try:
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 1, 15)
        c = BlockingConnection(f"amqp://app:app@127.0.0.1:{fwd.port}", timeout=10, allowed_mechs="PLAIN",
                               container_id="tls-client")
        c.create_sender("over-tls").send(Message(body="x"))
        status, conns = broker.management_get("/api/v1/connections")
        me = [x for x in conns if x["container_id"] == "tls-client"]
        assert len(me) == 1 and me[0]["tls"] is True and me[0]["source"].startswith(f"{CLIENT_IP}:"), conns
        c.close()
    finally:
        fwd.close()
        router.terminate()
        broker.terminate()
