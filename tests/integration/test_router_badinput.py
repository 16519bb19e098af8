"""Bad input at the router's edge: every case closes cleanly, is counted, and others are still served.

Real router process, real broker, raw sockets for the misbehaving clients and an unmodified
proton client for the well-behaved one.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

import pytest
import trustme
from proton.utils import BlockingConnection

from broker.wire.frames import AMQP_HEADER, FRAME_SASL, SASL_HEADER, Open, SaslInit, encode_frame
from router.client import connect_following_redirects
from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

HANDSHAKE_MS = 1000
USERS = {"admin": ("admin-pw", ["admin"]), "alice": ("alice-pw", ["app"])}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-bad")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    pem = tmp / "router.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    users = write_users_file(tmp / "users.toml", USERS)
    broker = start_broker(tmp, name="b1", users_file=users)
    common = [f"handshake-timeout-ms = {HANDSHAKE_MS}", f"tls-handshake-timeout-ms = {HANDSHAKE_MS}"]
    text = "\n".join([
        f"users-file = {toml_str(users)}",
        "[management]", "port = 0",
        "[routing-log]", "enabled = false",
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", "check-period = 300", 'username = "admin"', 'password = "admin-pw"',
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {broker.port}",
        f"management-url = {toml_str(broker.management_url)}",
        "[[acceptors]]", 'name = "plain"', "port = 0", 'router = "main"', 'mode = "redirect"', *common,
        "[[acceptors]]", 'name = "tls"', "port = 0", 'router = "main"', 'mode = "proxy"', *common,
        f"tls-cert = {toml_str(pem)}", f"tls-key = {toml_str(pem)}",
        "[[acceptors]]", 'name = "limited"', "port = 0", 'router = "main"', 'mode = "proxy"', *common,
        "max-connections = 2", "idle-timeout-s = 5",
    ]) + "\n"
    router = start_router(tmp / "router", text, expect=4, auth=("admin", "admin-pw"))
    wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 1, 15)
    try:
        yield router
    finally:
        status = router.terminate()
        broker.kill()
        assert status == 0, router.stderr_text()


def _sock(router, acceptor: str, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", router.port(acceptor)), timeout=timeout)


def _read_until_closed(s: socket.socket) -> tuple[bytes, float]:
    """Everything the router writes until it closes, and how long that took."""
    t0 = time.monotonic()
    out = b""
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        out += data
    s.close()
    return out, time.monotonic() - t0


def _good_client(router) -> None:
    conn = connect_following_redirects(router.url("plain"), timeout=10, allowed_mechs="PLAIN",
                                       user="alice", password=USERS["alice"][0])
    conn.close()


def _counter_grows(router, acceptor: str, name: str, before: int) -> int:
    return wait_for(lambda: router.counters(acceptor)[name] > before and router.counters(acceptor)[name], 5)


@pytest.mark.parametrize("payload, counter", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "protocol_header_rejected"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", "protocol_header_rejected"),  # a TLS ClientHello
    (b"AMQP\x01\x01\x00\x00", "protocol_header_rejected"),                        # unknown protocol id
    (b"AMQP\x00\x02\x00\x00", "protocol_header_rejected"),                        # unknown version
    (SASL_HEADER + b"\x00\x00\x00\x0c\x01\x00\x00\x00\x00\x53\x41\x45", "protocol_error"),  # not sasl-init
    (SASL_HEADER + b"\x00\x00\x00\x02\x02\x00\x00\x00", "protocol_error"),        # frame size < 8
    (SASL_HEADER + b"\x7f\xff\xff\xff\x02\x01\x00\x00", "protocol_error"),        # 2 GiB frame declared
])
def test_garbage_and_wrong_headers_close_at_once_with_the_protocol_header_reply(env, payload, counter):
    before = env.counters("plain")[counter]
    s = _sock(env, "plain")
    s.sendall(payload)
    reply, took = _read_until_closed(s)
    assert took < HANDSHAKE_MS / 1000  # not waiting for a deadline: refused on sight
    if counter == "protocol_header_rejected":
        assert reply == SASL_HEADER  # AMQP §2.2: answer with the header we speak, then close
    _counter_grows(env, "plain", counter, before)
    _good_client(env)


def test_a_handshake_larger_than_the_limit_is_cut_off(env):
    before = env.counters("plain")["handshake_oversized"]
    s = _sock(env, "plain")
    init = encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\0alice\0alice-pw", None))
    s.sendall(SASL_HEADER + init + AMQP_HEADER)
    try:
        for _ in range(20_000):  # empty frames (heartbeats) are legal, but never reach an Open
            s.sendall(b"\x00\x00\x00\x08\x02\x00\x00\x00")
    except OSError:
        pass  # the router already closed
    reply, _ = _read_until_closed(s)
    assert b"amqp:connection:framing-error" in reply
    _counter_grows(env, "plain", "handshake_oversized", before)
    _good_client(env)


def test_a_truncated_handshake_is_counted_when_the_client_leaves(env):
    before = env.counters("plain")["handshake_eof"]
    s = _sock(env, "plain")
    init = encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\0alice\0alice-pw", None))
    s.sendall(SASL_HEADER + init[: len(init) // 2])
    time.sleep(0.1)   # the thing under test: half a handshake arrives on its own, then the client leaves
    s.shutdown(socket.SHUT_WR)
    _read_until_closed(s)
    _counter_grows(env, "plain", "handshake_eof", before)


@pytest.mark.parametrize("drip", [False, True], ids=["silent", "slow-drip"])
def test_silent_and_slow_clients_are_closed_at_the_handshake_deadline(env, drip):
    before = env.counters("plain")["handshake_timeout"]
    s = _sock(env, "plain")
    opened = time.monotonic()
    stop = threading.Event()

    def dripper():
        data = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\0alice\0alice-pw", None)) + \
            AMQP_HEADER + encode_frame(0, 0, Open(container_id="slow" * 50))
        for b in data:
            if stop.is_set():
                return
            try:
                s.sendall(bytes([b]))
            except OSError:
                return
            time.sleep(0.05)  # pacing, the thing under test: 20 bytes/s, the whole handshake would take ~20 s

    t = threading.Thread(target=dripper, daemon=True)
    if drip:
        t.start()
    _good_client(env)  # others are served while it hangs on
    _read_until_closed(s)
    took = time.monotonic() - opened
    stop.set()
    assert HANDSHAKE_MS / 1000 * 0.8 < took < HANDSHAKE_MS / 1000 + 3
    _counter_grows(env, "plain", "handshake_timeout", before)


def test_tls_silent_client_and_tls_garbage(env):
    before = env.counters("tls")
    s = _sock(env, "tls")
    _, took = _read_until_closed(s)  # never sends a ClientHello
    assert took < HANDSHAKE_MS / 1000 + 3
    s = _sock(env, "tls")
    s.sendall(AMQP_HEADER)  # plain AMQP on the TLS port
    _read_until_closed(s)
    wait_for(lambda: env.counters("tls")["tls_handshake_timeout"] == before["tls_handshake_timeout"] + 1, 5)
    wait_for(lambda: env.counters("tls")["tls_handshake_failed"] == before["tls_handshake_failed"] + 1, 5)
    # a TLS client that completes TLS but then stays silent: the AMQP handshake deadline applies
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with ctx.wrap_socket(_sock(env, "tls"), server_hostname="localhost") as tls:
        t0 = time.monotonic()
        try:
            while tls.recv(65536):
                pass
        except (ssl.SSLError, OSError):
            pass
        assert time.monotonic() - t0 < HANDSHAKE_MS / 1000 + 3
    wait_for(lambda: env.counters("tls")["handshake_timeout"] == before["handshake_timeout"] + 1, 5)


def test_connection_limit_refuses_the_extra_connection_at_once_then_recovers(env):
    before = env.counters("limited")["connection_limit_rejected"]
    held = [_sock(env, "limited"), _sock(env, "limited")]
    wait_for(lambda: env.get("/api/v1/router")[1]["acceptors"][2]["active_connections"] == 2, 5)
    extra = _sock(env, "limited")
    _, took = _read_until_closed(extra)
    assert took < 0.5
    assert env.counters("limited")["connection_limit_rejected"] == before + 1
    for s in held:
        s.close()
    wait_for(lambda: env.get("/api/v1/router")[1]["acceptors"][2]["active_connections"] == 0, 5)
    conn = BlockingConnection(env.url("limited"), timeout=10, allowed_mechs="PLAIN", user="alice",
                              password=USERS["alice"][0])
    conn.close()


def test_sigterm_drains_open_proxied_connections_then_exits(tmp_path):
    users = write_users_file(tmp_path / "users.toml", USERS)
    broker = start_broker(tmp_path, name="b1", users_file=users)
    text = "\n".join([
        f"users-file = {toml_str(users)}", "[management]", "port = 0",
        "[routers.main]", "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", "check-period = 300", 'username = "admin"', 'password = "admin-pw"',
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {broker.port}",
        f"management-url = {toml_str(broker.management_url)}",
        "[[acceptors]]", 'name = "p"', "port = 0", 'router = "main"', 'mode = "proxy"',
    ]) + "\n"
    router = start_router(tmp_path / "router", text, expect=2, auth=("admin", "admin-pw"),
                          extra_args=["--drain-timeout-s", "20"])
    try:
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 1, 15)
        conn = BlockingConnection(router.url("p"), timeout=10, allowed_mechs="PLAIN", user="alice",
                                  password=USERS["alice"][0])
        from proton import Message

        sender = conn.create_sender("drain.q")
        router.proc.send_signal(15)  # SIGTERM
        wait_for(lambda: router.get("/health")[0] == 503, 5)  # draining
        with pytest.raises(OSError):  # no new connections
            socket.create_connection(("127.0.0.1", router.port("p")), timeout=2).close()
        sender.send(Message(body="still proxied while draining"))
        receiver = conn.create_receiver("drain.q")
        assert receiver.receive(timeout=10).body == "still proxied while draining"
        receiver.accept()
        assert router.proc.poll() is None  # waiting for us
        conn.close()
        assert router.proc.wait(15) == 0
    finally:
        router.kill()
        broker.kill()
