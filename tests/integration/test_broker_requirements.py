"""Issue #2 requirements that the other broker test files do not show on their own, each against
a real broker process and real sockets: SIGINT/SIGTERM shutdown as seen by a client, the sample
users' warning and their loopback-only rule over the network, auto-create off, a non-durable
subscriber queue on detach, multicast and competing consumers over TLS, the activity log schema
against docs/broker.md, /metrics as Prometheus text, JSON-lines logs."""

from __future__ import annotations

import json
import re
import signal
import socket
from pathlib import Path

import pytest
import trustme
from prometheus_client.parser import text_string_to_metric_families
from proton import ConnectionException, Message, SSLDomain, symbol
from proton.reactor import LinkOption
from proton.utils import BlockingConnection, LinkDetached

from broker.activity import CLUSTER_FIELDS, SCHEMA_FIELDS
from broker.wire.frames import AMQP_HEADER, FRAME_AMQP, FRAME_SASL, SASL_HEADER, Open, SaslInit, encode_frame
from tests.brokerproc import REPO, USERS_FILE, start_broker, write_users_file
from tests.integration.test_broker_badinput import parse_reply
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"])}


class Capability(LinkOption):
    """A 'queue' or 'topic' terminus capability (the routing type, Artemis/Qpid style)."""

    def __init__(self, cap: str):
        self.cap = cap

    def apply(self, link):
        (link.source if link.is_receiver else link.target).capabilities.put_object(symbol(self.cap))


@pytest.fixture(scope="module")
def users(tmp_path_factory):
    return write_users_file(tmp_path_factory.mktemp("users") / "users.toml", USERS)


def connect(b, user="app", password=None, url=None, **kw):
    base = url or b.amqp_url
    scheme = base.split("://", 1)[0]
    return BlockingConnection(base.replace(f"{scheme}://", f"{scheme}://{user}:{password or user}@"),
                              timeout=10, allowed_mechs=kw.pop("allowed_mechs", "PLAIN"), **kw)


def _recv_until_closed(s: socket.socket) -> bytes:
    out = bytearray()
    while True:
        try:
            b = s.recv(65536)
        except ConnectionResetError:
            break
        if not b:
            return bytes(out)
        out += b
    return bytes(out)


# -- CLI: shutdown on SIGTERM and SIGINT --------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_closes_clients_with_forced_and_exits_0(tmp_path, users, sig):
    b = start_broker(tmp_path, users_file=users)
    try:
        # a raw client that opened its connection: it must see Close(amqp:connection:forced)
        s = socket.create_connection((b.host, b.port), timeout=30)
        s.sendall(SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\x00app\x00app"))
                  + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open("sig-client")))
        wait_for(lambda: any(c["container_id"] == "sig-client"
                             for c in b.management_get("/api/v1/connections")[1]), timeout_s=30)
        b.proc.send_signal(sig)
        reply = parse_reply(_recv_until_closed(s))
        s.close()
        assert b.proc.wait(30) == 0
        b.terminate()
        assert reply["closed"] and reply["close_error"] == "amqp:connection:forced", reply
        err = b.stderr_text()
        assert f"signal {sig.name}: shutting down" in err and "node stopped" in err
        assert "Traceback" not in err
    finally:
        b.kill()


# -- security --------------------------------------------------------------------------------

def test_sample_users_warning_at_start(tmp_path):
    b = start_broker(tmp_path, users_file=USERS_FILE)  # etc/users.toml: admin/app are samples
    try:
        err = b.stderr_text()
        for user in ("admin", "app"):
            assert re.search(rf"WARNING .*user '{user}' has sample credentials; accepted from loopback only",
                             err), err
    finally:
        b.terminate()


def _non_loopback_ipv4() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks a route
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_sample_user_is_refused_from_a_non_loopback_address(tmp_path):
    ip = _non_loopback_ipv4()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    b = start_broker(tmp_path, users_file=USERS_FILE,
                     config={"acceptors.amqp": {"host": "0.0.0.0"}, "management": {"host": "0.0.0.0"}})
    try:
        # the same sample user and password: accepted over loopback ...
        loop_url = b.amqp_url.replace("0.0.0.0", "127.0.0.1")
        connect(b, url=loop_url).close()
        # ... refused from the network (the source address is this host's non-loopback address)
        with pytest.raises(ConnectionException) as ei:
            connect(b, url=b.amqp_url.replace("0.0.0.0", ip))
        assert "amqp:unauthorized-access" in str(ei.value)
        b.urls["management"] = b.management_url.replace("0.0.0.0", ip)
        assert b.management_get("/api/v1/broker")[0] == 401
        b.urls["management"] = b.management_url.replace(ip, "127.0.0.1")
        assert b.management_get("/api/v1/broker")[0] == 200
    finally:
        b.terminate()


def test_anonymous_is_refused_unless_configured(tmp_path, users):
    b = start_broker(tmp_path, users_file=users, mechanisms=("PLAIN",))
    try:
        with pytest.raises(ConnectionException):
            BlockingConnection(b.amqp_url, timeout=10, allowed_mechs="ANONYMOUS")
        connect(b).close()
    finally:
        b.terminate()
    anon_users = write_users_file(tmp_path / "anon.toml", USERS, anonymous_roles=["app"])
    b = start_broker(tmp_path, name="anon", users_file=anon_users, mechanisms=("PLAIN", "ANONYMOUS"))
    try:
        c = BlockingConnection(b.amqp_url, timeout=10, allowed_mechs="ANONYMOUS")
        c.create_sender("anon-q").send(Message(body="hi"))
        c.close()
    finally:
        b.terminate()


# -- address model ------------------------------------------------------------------------------

def test_auto_create_off_gives_not_found(tmp_path, users):
    b = start_broker(tmp_path, users_file=users, config={
        "address-defaults": {"auto-create": False}, "addresses.known": {"routing-types": ["anycast"]}})
    try:
        c = connect(b)
        for make in (lambda: c.create_sender("unknown"), lambda: c.create_receiver("unknown")):
            with pytest.raises(LinkDetached) as ei:
                make()
            assert "amqp:not-found" in str(ei.value)
        # declared addresses work, and so does the connection after the refusals
        c.create_sender("known").send(Message(body="k"))
        assert c.create_receiver("known", credit=1).receive(timeout=10).body == "k"
        c.close()
        assert b.queue("unknown") is None
    finally:
        b.terminate()


def test_non_durable_subscriber_queue_is_deleted_on_detach(tmp_path, users):
    b = start_broker(tmp_path, users_file=users)
    try:
        c = connect(b)
        r = c.create_receiver("ticks", credit=5, options=Capability("topic"))

        def sub_queues():
            return [q for q in b.management_get("/api/v1/queues")[1] if q["address"] == "ticks"]
        qs = wait_for(lambda: [q for q in sub_queues() if q["consumers"] == 1])
        assert len(qs) == 1 and qs[0]["routing_type"] == "multicast" and qs[0]["durable"] is False
        r.close()  # the connection stays open: only the link goes
        wait_for(lambda: sub_queues() == [], timeout_s=30)
        c.create_sender("ticks", options=Capability("topic")).send(Message(body="nobody listens"))
        assert sub_queues() == []
        c.close()
    finally:
        b.terminate()


def test_multicast_and_competing_consumers_over_tls(tmp_path, users):
    ca = trustme.CA()
    b = start_broker(tmp_path, users_file=users, tls=ca)
    try:
        ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
        dom = SSLDomain(SSLDomain.MODE_CLIENT)
        dom.set_trusted_ca_db(str(tmp_path / "ca.pem"))
        dom.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
        tls_url = b.amqps_url.replace("127.0.0.1", "localhost")
        conns = [connect(b, url=tls_url, ssl_domain=dom) for _ in range(3)]
        subs = [c.create_receiver("tls.news", credit=10, options=Capability("topic")) for c in conns[:2]]
        workers = [c.create_receiver("tls.work", credit=10) for c in conns[1:]]
        wait_for(lambda: (b.queue("tls.work") or {}).get("consumers") == 2)
        wait_for(lambda: len([q for q in b.management_get("/api/v1/queues")[1]
                              if q["address"] == "tls.news"]) == 2)
        p = connect(b, url=tls_url, ssl_domain=dom)
        news = p.create_sender("tls.news", options=Capability("topic"))
        work = p.create_sender("tls.work")
        for i in range(4):
            news.send(Message(body=f"n{i}"))
            work.send(Message(body=i))
        for r in subs:  # every subscriber gets every message
            got = []
            for _ in range(4):
                got.append(r.receive(timeout=10).body)
                r.accept()
            assert got == ["n0", "n1", "n2", "n3"]
        got = []
        for r in workers:  # the two workers share the queue, round-robin
            for _ in range(2):
                got.append(r.receive(timeout=10).body)
                r.accept()
        assert sorted(got) == [0, 1, 2, 3]
        assert all(x["tls"] for x in b.management_get("/api/v1/connections")[1])
        for c in conns + [p]:
            c.close()
    finally:
        b.terminate()


# -- observability -----------------------------------------------------------------------------

def _documented_activity_fields() -> list[str]:
    text = (REPO / "docs" / "broker.md").read_text()
    section = text.split("## Activity log schema", 1)[1].split("\n## ", 1)[0]
    fields: list[str] = []
    for line in section.splitlines():
        if line.startswith("| `"):
            fields += re.findall(r"`([a-z_]+)`", line.split("|")[1])
    return fields


def test_activity_log_records_match_the_documented_schema(tmp_path, users):
    assert _documented_activity_fields() == list(CLUSTER_FIELDS)  # cluster records add the last one
    b = start_broker(tmp_path, users_file=users, config={"activity-log": {"flush-interval-s": 0.2}})
    try:
        c = connect(b, container=None)
        s = c.create_sender("act")
        for _ in range(3):
            s.send(Message(body="y" * 50))
        r = c.create_receiver("act", credit=3)
        for _ in range(3):
            r.receive(timeout=10)
            r.accept()
        c.close()
        log = b.data_dir / "activity.jsonl"

        def complete_records():
            # Every message is recorded once the connection is gone. A `final: true` record exists
            # only if the last window had traffic (docs/broker.md): with a 0.2 s flush interval a
            # periodic flush may take all of it first, so completeness is what we wait for.
            if not log.exists() or b.management_get("/api/v1/connections")[1]:
                return None
            recs = [json.loads(line) for line in log.read_text().splitlines()]
            done = all(sum(r["messages"] for r in recs if r["direction"] == d) == 3 for d in ("produce", "consume"))
            return recs if done else None
        recs = wait_for(complete_records, timeout_s=30)
        iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
        for rec in recs:
            assert list(rec) == list(SCHEMA_FIELDS)
            assert rec["node_id"] == b.node_id and rec["node"] == "broker" and rec["user"] == "app"
            assert rec["address"] == "act" and rec["direction"] in ("produce", "consume")
            assert isinstance(rec["messages"], int) and isinstance(rec["bytes"], int)
            assert re.match(r"^127\.0\.0\.1:\d+$", rec["source"]) and rec["connection_id"].startswith(b.node_id[:8])
            assert all(iso.match(rec[k]) for k in ("ts", "window_start", "window_end"))
            assert rec["window_start"] <= rec["window_end"] and isinstance(rec["final"], bool)
        for d in ("produce", "consume"):
            assert sum(r["messages"] for r in recs if r["direction"] == d) == 3
    finally:
        b.terminate()


def test_metrics_parse_as_prometheus_text(tmp_path, users):
    b = start_broker(tmp_path, users_file=users)
    try:
        c = connect(b)
        c.create_sender("metered").send(Message(body="m", durable=True))
        status, text = b.management_get("/metrics")  # [management] metrics-auth = true by default
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(text)}
        assert families["lodestone_broker_up"].samples[0].value == 1
        assert families["lodestone_broker_connections"].samples[0].value >= 1
        depth = [s for s in families["lodestone_broker_queue_depth"].samples if s.labels["queue"] == "metered"]
        assert len(depth) == 1 and depth[0].value == 1 and depth[0].labels["address"] == "metered"
        assert families["lodestone_broker_queue_enqueued"].type == "counter"  # *_total counters
        for f in families.values():
            assert f.documentation, f"{f.name} has no HELP"
        c.close()
    finally:
        b.terminate()


def test_json_lines_logs(tmp_path, users):
    b = start_broker(tmp_path, users_file=users, config={"logging": {"json": True}})
    try:
        c = connect(b, container=None)
        mine = c.container.container_id
        c.close()

        def records():
            lines = [line for line in b.stderr_text().splitlines() if line.strip()]
            recs = [json.loads(line) for line in lines]  # every line is one JSON object
            closes = [r for r in recs if r.get("msg") == "connection close" and r.get("container_id") == mine]
            return recs if closes else None
        recs = wait_for(records, timeout_s=30)
        for r in recs:
            assert {"ts", "level", "logger", "msg"} <= set(r)
        for what in ("connection open", "connection close"):
            (rec,) = [r for r in recs if r["msg"] == what and r.get("container_id") == mine]
            assert rec["user"] == "app" and re.match(r"^127\.0\.0\.1:\d+$", rec["source"]) and rec["conn"]
    finally:
        b.terminate()
