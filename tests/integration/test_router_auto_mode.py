"""``mode = "auto"``: one port serves every client.

A client whose Open announces the desired capability ``lodestone:follows-redirect``
(``broker.wire.frames.FOLLOWS_REDIRECT``) gets a native ``amqp:connection:redirect`` to the broker
the routing core chose; every other client is proxied to that broker. Real router process, two
real broker processes, raw AMQP frames for both kinds of client, and an unmodified
python-qpid-proton ``BlockingConnection`` (which announces nothing: proxied, its message arrives).
Which broker a proxied client reached is read from the broker's own Open (``node-id``).
"""

from __future__ import annotations

import json
import socket
import uuid

import pytest
from proton import Message
from proton.utils import BlockingConnection

from broker.wire.codec import Symbol
from broker.wire.frames import (
    AMQP_HEADER,
    FOLLOWS_REDIRECT,
    FRAME_AMQP,
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    Close,
    FrameReader,
    Open,
    SaslInit,
    SaslOutcome,
    decode_performative,
    encode_frame,
)
from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin-pw", ["admin"]), "alice": ("alice-pw", ["app"])}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-auto")
    users = write_users_file(tmp / "users.toml", USERS)
    brokers = [start_broker(tmp / f"b{i}", name=f"b{i}", users_file=users) for i in (1, 2)]
    log_path = tmp / "logs" / "routing.log"
    lines = [f"users-file = {toml_str(users)}", "[management]", "port = 0",
             "[routing-log]", f"path = {toml_str(log_path)}",
             "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
             "[routers.main.pool]", "check-period = 300", 'username = "admin"', 'password = "admin-pw"']
    for i, b in enumerate(brokers, 1):
        lines += ["[[routers.main.pool.targets]]", f'name = "b{i}"', 'host = "127.0.0.1"', f"port = {b.port}",
                  f"management-url = {toml_str(b.management_url)}"]
    lines += ["[[acceptors]]", 'name = "auto"', "port = 0", 'router = "main"', 'mode = "auto"',
              'sasl-mechanisms = ["PLAIN"]', "idle-timeout-s = 30"]
    router = start_router(tmp / "router", "\n".join(lines) + "\n", expect=2, auth=("admin", "admin-pw"))
    try:
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 2, 20)
        yield type("Env", (), {"router": router, "brokers": brokers, "log_path": log_path})()
    finally:
        status = router.terminate()
        for b in brokers:
            b.kill()
        assert status == 0, router.stderr_text()
        assert "Traceback" not in router.stderr_text(), router.stderr_text()


def _raw_client(env, container_id: str, capabilities: tuple[str, ...] | None) -> list:
    """SASL PLAIN + AMQP header + Open (with ``desired-capabilities``), pipelined as proton does;
    returns the AMQP performatives the router sent back, up to a Close (or its EOF)."""
    open_ = Open(container_id=container_id, hostname="localhost",
                 desired_capabilities=tuple(Symbol(c) for c in capabilities) if capabilities else None)
    with socket.create_connection(("127.0.0.1", env.router.port("auto")), timeout=10) as s:
        s.sendall(SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\x00alice\x00alice-pw"))
                  + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, open_))
        reader = FrameReader()
        assert reader.next_protocol_header() is NEED_DATA
        perfs: list = []
        need_header = True  # a protocol header starts the stream and follows the sasl-outcome
        while not perfs or not isinstance(perfs[-1], Close):
            chunk = s.recv(65536)
            if not chunk:
                break
            reader.receive_data(chunk)
            while True:
                if need_header:
                    hdr = reader.next_protocol_header()
                    if hdr is NEED_DATA:
                        break
                    assert hdr in (SASL_HEADER, AMQP_HEADER), hdr
                    need_header = False
                    continue
                f = reader.next_event()
                if f is NEED_DATA:
                    break
                perf = decode_performative(f.body)
                if isinstance(perf, SaslOutcome):
                    assert perf.code == 0, perf
                    need_header = True
                    continue
                if f.type == FRAME_AMQP:
                    perfs.append(perf)
                    if isinstance(perf, Open) and not (perf.properties or {}).get(
                            Symbol("amqp:connection-establishment-failed")):
                        s.sendall(encode_frame(FRAME_AMQP, 0, Close()))  # a proxied client says goodbye
    return perfs


def _route_lines(env, container_id: str) -> list[dict]:
    if not env.log_path.exists():
        return []
    return [r for r in map(json.loads, env.log_path.read_text().splitlines())
            if r.get("container_id") == container_id and r["event"] == "route"]


def test_a_client_that_follows_redirects_is_redirected(env):
    cid = f"follows-{uuid.uuid4()}"
    before = env.router.counters("auto")
    perfs = _raw_client(env, cid, ("some:other-capability", FOLLOWS_REDIRECT))
    assert isinstance(perfs[0], Open) and perfs[0].properties.get(Symbol("amqp:connection-establishment-failed"))
    close = perfs[-1]
    assert isinstance(close, Close) and close.error.condition == "amqp:connection:redirect", perfs
    target = env.router.target_for("main", cid)["target"]
    assert close.error.info == {"network-host": "127.0.0.1", "port": target["port"]}
    after = env.router.counters("auto")
    assert after["redirected"] == before["redirected"] + 1
    assert after["proxied"] == before["proxied"]
    wait_for(lambda: _route_lines(env, cid), 5)
    line = _route_lines(env, cid)[0]
    assert (line["mode"], line["action"], line["target_name"]) == ("auto", "redirected", target["name"])


def test_a_client_without_the_capability_is_proxied_to_the_broker_the_api_names(env):
    by_node = {b.node_id: b for b in env.brokers}
    seen = set()
    # several keys until both brokers were reached (random keys: 8 fixed ones all hashed to one
    # broker 1 run in 128), each where the API says
    for i in range(40):
        if i >= 8 and seen == set(by_node):
            break
        cid = f"plain-{i}-{uuid.uuid4()}"
        before = env.router.counters("auto")
        perfs = _raw_client(env, cid, ("some:other-capability",) if i % 2 else None)
        target = env.router.target_for("main", cid)["target"]
        broker_open = perfs[0]
        assert isinstance(broker_open, Open), perfs
        assert not (broker_open.properties or {}).get(Symbol("amqp:connection-establishment-failed")), perfs
        node = broker_open.properties[Symbol("node-id")]
        assert by_node[node].port == target["port"]
        seen.add(node)
        after = env.router.counters("auto")
        assert after["proxied"] == before["proxied"] + 1
        assert after["redirected"] == before["redirected"]
        wait_for(lambda: _route_lines(env, cid), 5)
        line = _route_lines(env, cid)[0]
        assert (line["mode"], line["action"], line["target_name"]) == ("auto", "proxied", target["name"])
    assert seen == set(by_node)


def test_an_unmodified_proton_client_is_proxied_and_its_message_arrives(env):
    before = env.router.counters("auto")
    conn = BlockingConnection(env.router.url("auto"), timeout=20, allowed_mechs="PLAIN", user="alice",
                              password="alice-pw")
    try:
        node = (conn.conn.remote_properties or {}).get("node-id")
        cid = conn.conn.container
        address = f"auto-{uuid.uuid4()}"
        conn.create_sender(address).send(Message(body="through auto"))
        receiver = conn.create_receiver(address)
        assert receiver.receive(timeout=20).body == "through auto"
        receiver.accept()
    finally:
        conn.close()
    target = env.router.target_for("main", cid)["target"]
    assert {b.node_id: b.port for b in env.brokers}[node] == target["port"]
    after = env.router.counters("auto")
    assert after["proxied"] == before["proxied"] + 1
    assert after["redirected"] == before["redirected"]
    wait_for(lambda: _route_lines(env, cid), 5)
    assert _route_lines(env, cid)[0]["action"] == "proxied"
