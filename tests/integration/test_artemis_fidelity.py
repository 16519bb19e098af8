"""Artemis fidelity at the router's edge, byte for byte (issue 8, item 5).

A real router process in front of a real broker. Raw sockets read what the router writes when it
turns a connection away and decode it frame by frame; the management API's target lookup is
compared field by field with Artemis's ``getTargetAsJSON``.

Artemis sources: ``AMQPRoutingHandler`` (descriptions, info map), ``AMQPConnectionContext
.onRemoteOpen`` + proton-j ``TransportImpl.processOpen`` (the failed-establishment Open),
``ConnectionRouterControlImpl.getTargetAsJSON`` + ``TransportConfiguration.toJson`` +
``BeanSupport.setData`` (the connector object).
"""

from __future__ import annotations

import socket
import struct

import pytest

from broker.wire.codec import Symbol
from broker.wire.frames import (AMQP_HEADER, FRAME_AMQP, FRAME_SASL, SASL_HEADER, Close, FrameReader, Open,
                                SaslInit, decode_performative, encode_frame)
from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin-pw", ["admin"]), "alice": ("alice-pw", ["app"])}
FAILED_OPEN = Open(container_id="", hostname=None, max_frame_size=131072, channel_max=65535,
                   idle_time_out=30000,
                   properties={Symbol("amqp:connection-establishment-failed"): True})
NETTY = "org.apache.activemq.artemis.core.remoting.impl.netty.NettyConnectorFactory"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("artemis-fidelity")
    users = write_users_file(tmp / "users.toml", USERS)
    broker = start_broker(tmp, name="b1", users_file=users)

    def pool(r, *, quorum=1, tls=False):
        return [f"[routers.{r}.pool]", "check-period = 200", f"quorum-size = {quorum}", "quorum-timeout = 0",
                'username = "admin"', 'password = "admin-pw"',
                f"[[routers.{r}.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {broker.port}",
                f"tls = {toml_str(tls)}", f"management-url = {toml_str(broker.management_url)}"]

    text = "\n".join([
        f"users-file = {toml_str(users)}",
        "[management]", "port = 0",
        "[routing-log]", "enabled = false",
        "[routers.first]", 'key-type = "CLIENT_ID"', "[routers.first.policy]", 'name = "FIRST_ELEMENT"', *pool("first"),
        "[routers.tls]", 'key-type = "CLIENT_ID"', "[routers.tls.policy]", 'name = "FIRST_ELEMENT"',
        *pool("tls", tls=True),
        "[routers.quorum]", 'key-type = "CLIENT_ID"', "[routers.quorum.policy]", 'name = "FIRST_ELEMENT"',
        *pool("quorum", quorum=2),
        # no policy, no pool: keys the local filter does not take are rejected (REFUSED_USE_ANOTHER)
        "[routers.loc]", 'key-type = "CLIENT_ID"', 'local-target-filter = "L.*"',
        "[routers.loc.local-target]", 'name = "self"', 'host = "127.0.0.1"', f"port = {broker.port}",
        'node-id = "self-node"',
        "[[acceptors]]", 'name = "first"', "port = 0", 'router = "first"', 'mode = "redirect"',
        "[[acceptors]]", 'name = "quorum"', "port = 0", 'router = "quorum"', 'mode = "redirect"',
        "[[acceptors]]", 'name = "loc"', "port = 0", 'router = "loc"', 'mode = "redirect"',
    ]) + "\n"
    router = start_router(tmp / "router", text, expect=4, auth=("admin", "admin-pw"))
    wait_for(lambda: router.get("/api/v1/routers/first/pool")[1]["ready"] == 1, 15)
    wait_for(lambda: router.get("/api/v1/routers/tls/pool")[1]["ready"] == 1, 15)
    try:
        yield router, broker
    finally:
        status = router.terminate()
        broker.kill()
        assert status == 0, router.stderr_text()


def _turned_away(router, acceptor: str, container_id: str) -> tuple[bytes, list]:
    """Log in as alice, send our Open; return the raw AMQP bytes after the SASL exchange and the
    decoded performatives the router wrote before closing."""
    s = socket.create_connection(("127.0.0.1", router.port(acceptor)), timeout=10)
    s.sendall(SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\0alice\0alice-pw", None))
              + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id=container_id)))
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    s.close()
    assert data.startswith(SASL_HEADER), data[:16]
    # SASL header, sasl-mechanisms, sasl-outcome, then the AMQP header and our frames
    amqp = data[data.index(AMQP_HEADER, 8):]
    r = FrameReader(1 << 20)
    r.receive_data(amqp[8:])
    out = []
    while True:
        ev = r.next_event()
        if not hasattr(ev, "body"):
            break
        out.append(decode_performative(ev.body))
    return amqp, out


# -- what proton-j writes, encoded here by hand from its codec rules -----------------------------
# (codec/ListType, MapType, StringType, SymbolType, UnsignedIntegerType, IntegerType, BooleanType:
# the short forms list8 0xc0 / map8 0xc1 / str8 0xa1 / sym8 0xa3 / smallint 0x54 when they fit)
def _str(v: str) -> bytes:
    b = v.encode()
    return b"\xa1" + bytes([len(b)]) + b


def _sym(v: str) -> bytes:
    return b"\xa3" + bytes([len(v)]) + v.encode()


def _int(v: int) -> bytes:
    return b"\x54" + struct.pack(">b", v) if -128 <= v <= 127 else b"\x71" + struct.pack(">i", v)


def _list8(items: list[bytes]) -> bytes:
    body = b"".join(items)
    return b"\xc0" + bytes([len(body) + 1, len(items)]) + body


def _map8(pairs: list[tuple[bytes, bytes]]) -> bytes:
    body = b"".join(k + v for k, v in pairs)
    return b"\xc1" + bytes([len(body) + 1, 2 * len(pairs)]) + body


def _frame(descriptor: int, fields: list[bytes]) -> bytes:
    body = b"\x00\x53" + bytes([descriptor]) + _list8(fields)
    return struct.pack(">IBBH", 8 + len(body), 2, 0, 0) + body


NULL = b"\x40"
ARTEMIS_FAILED_OPEN_FRAME = _frame(0x10, [
    _str(""), NULL, b"\x70" + struct.pack(">I", 131072), b"\x60\xff\xff", b"\x70" + struct.pack(">I", 30000),
    NULL, NULL, NULL, NULL, _map8([(_sym("amqp:connection-establishment-failed"), b"\x41")])])


def _close_frame(condition: str, description: str, info: list[tuple[bytes, bytes]] | None) -> bytes:
    err = [_sym(condition), _str(description)] + ([_map8(info)] if info is not None else [])
    return _frame(0x18, [b"\x00\x53\x1d" + _list8(err)])


def test_redirect_frames_equal_what_artemis_writes(env):
    router, broker = env
    amqp, _ = _turned_away(router, "first", "c1")
    desc = f"Connection router first redirected this connection to 127.0.0.1:{broker.port}"
    # info: java.util.HashMap order, "port" before "network-host"
    info = [(_sym("port"), _int(broker.port)), (_sym("network-host"), _str("127.0.0.1"))]
    assert amqp == AMQP_HEADER + ARTEMIS_FAILED_OPEN_FRAME + _close_frame("amqp:connection:redirect", desc, info)


def test_refusal_frames_equal_what_artemis_writes(env):
    router, _ = env
    amqp, _ = _turned_away(router, "quorum", "c1")
    assert amqp == AMQP_HEADER + ARTEMIS_FAILED_OPEN_FRAME + _close_frame(
        "amqp:connection:forced", "Connection router quorum is not ready", None)
    amqp, _ = _turned_away(router, "loc", "other")
    assert amqp == AMQP_HEADER + ARTEMIS_FAILED_OPEN_FRAME + _close_frame(
        "amqp:connection:forced", "Connection router loc rejected this connection", None)


def test_redirect_is_artemis_byte_for_byte(env):
    router, broker = env
    amqp, (op, cl) = _turned_away(router, "first", "c1")
    assert op == FAILED_OPEN
    # container-id is the empty AMQP string (str8 0xa1, length 0) right after the list header
    assert amqp[8 + 8:8 + 8 + 3 + 6].startswith(b"\x00\x53\x10")
    assert b"\xa1\x00" in amqp[8:8 + 40]
    assert b"lodestone" not in amqp
    assert isinstance(cl, Close)
    assert cl.error.condition == "amqp:connection:redirect"
    assert cl.error.description == f"Connection router first redirected this connection to 127.0.0.1:{broker.port}"
    assert cl.error.info == {Symbol("network-host"): "127.0.0.1", Symbol("port"): broker.port}


def test_not_ready_refusal_is_artemis_text(env):
    router, _ = env
    _, (op, cl) = _turned_away(router, "quorum", "c1")
    assert op == FAILED_OPEN
    assert cl.error.condition == "amqp:connection:forced"
    assert cl.error.description == "Connection router quorum is not ready"
    assert cl.error.info is None


def test_rejected_refusal_is_artemis_text(env):
    router, _ = env
    _, (op, cl) = _turned_away(router, "loc", "other")
    assert op == FAILED_OPEN
    assert cl.error.condition == "amqp:connection:forced"
    assert cl.error.description == "Connection router loc rejected this connection"
    assert cl.error.info is None


def _explanation_free(body: dict) -> dict:
    body = dict(body)
    assert isinstance(body.pop("explanation"), dict)
    return body


def test_get_target_as_json_remote_connector(env):
    router, broker = env
    body = router.target_for("first", "k1")
    assert _explanation_free(body) == {
        "nodeID": broker.node_id, "local": False,
        "connector": {"name": "b1", "factoryClassName": NETTY,
                      "params": {"host": "127.0.0.1", "port": str(broker.port)}, "extraProps": {}},
        "outcome": "OK",
        "target": {"name": "b1", "node_id": broker.node_id, "host": "127.0.0.1", "port": broker.port,
                   "tls": False}}
    tls = router.target_for("tls", "k1")["connector"]
    assert tls == {"name": "b1", "factoryClassName": NETTY,
                   "params": {"host": "127.0.0.1", "port": str(broker.port), "sslEnabled": "true"},
                   "extraProps": {}}


def test_get_target_as_json_local_and_refused(env):
    router, broker = env
    assert _explanation_free(router.target_for("loc", "Lx")) == {
        "nodeID": "self-node", "local": True, "connector": None, "outcome": "OK",
        "target": {"name": "self", "node_id": "self-node", "host": "127.0.0.1", "port": broker.port,
                   "tls": False}}
    # Artemis returns null here; we answer the same null fields plus why
    refused = router.target_for("loc", "other")
    assert _explanation_free(refused) == {"nodeID": None, "local": False, "connector": None,
                                          "outcome": "REFUSED_USE_ANOTHER", "target": None}
    assert _explanation_free(router.target_for("quorum", "k"))["outcome"] == "REFUSED_UNAVAILABLE"


def test_get_target_as_json_of_an_imported_connector_has_artemis_params(env, tmp_path):
    """A broker.xml connector's URL becomes Artemis's TransportConfiguration: host/port strings
    from the URI, allowable query keys as params, the rest as extraProps (passwords masked)."""
    _, broker = env
    (tmp_path / "broker.xml").write_text(f"""<configuration xmlns="urn:activemq"><core xmlns="urn:activemq:core">
      <connectors><connector name="node1">tcp://127.0.0.1:{broker.port}?sslEnabled=true;trustStorePath=t.jks;trustStorePassword=secret;tcpNoDelay=false;foo=bar</connector></connectors>
      <connection-routers><connection-router name="imp"><key-type>CLIENT_ID</key-type>
        <policy name="FIRST_ELEMENT"/>
        <pool><check-period>200</check-period><static-connectors><connector-ref>node1</connector-ref></static-connectors></pool>
      </connection-router></connection-routers></core></configuration>""")
    text = "\n".join(['import-artemis-xml = "../broker.xml"', "[management]", "port = 0",
                      "[routing-log]", "enabled = false",
                      "[[acceptors]]", 'name = "imp"', "port = 0", 'router = "imp"']) + "\n"
    router = start_router(tmp_path / "r", text, expect=2, auth=None)
    try:
        wait_for(lambda: router.get("/api/v1/routers/imp/pool")[1]["ready"] == 1, 15)
        body = router.target_for("imp", "k")
        assert body["nodeID"] is None and body["local"] is False  # TCP probe: no node id
        assert body["connector"] == {
            "name": "node1", "factoryClassName": NETTY,
            "params": {"host": "127.0.0.1", "port": str(broker.port), "sslEnabled": "true",
                       "trustStorePath": "t.jks", "trustStorePassword": "***", "tcpNoDelay": "false"},
            "extraProps": {"foo": "bar"}}
    finally:
        assert router.terminate() == 0, router.stderr_text()
