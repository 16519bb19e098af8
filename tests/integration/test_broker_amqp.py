"""A real broker process and unmodified python-qpid-proton clients over real sockets (plain and TLS)."""

from __future__ import annotations

import json
import re
import time

import pytest
import trustme
from proton import Message, SSLDomain, Terminus, symbol
from proton.reactor import Container, DurableSubscription, LinkOption
from proton import ConnectionException
from proton.utils import BlockingConnection, LinkDetached

from tests.brokerproc import start_broker, write_users_file
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"]), "reader": ("reader", ["reader"])}
PERMISSIONS = [
    {"match": "#", "send": ["admin", "app"], "consume": ["admin", "app", "reader"],
     "create-address": ["admin", "app"], "delete-address": ["admin"], "manage": ["admin"]},
    {"match": "secret.#", "send": ["admin"], "consume": ["admin"], "create-address": ["admin"]},
]


class Capability(LinkOption):
    """Ask for a routing type the Artemis/Qpid way: a 'queue' or 'topic' terminus capability."""

    def __init__(self, cap: str):
        self.cap = cap

    def apply(self, link):
        term = link.source if link.is_receiver else link.target
        term.capabilities.put_object(symbol(self.cap))


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def broker(tmp_path_factory, ca):
    tmp = tmp_path_factory.mktemp("broker-amqp")
    users = write_users_file(tmp / "users.toml", USERS, permissions=PERMISSIONS)
    b = start_broker(tmp, users_file=users, tls=ca,
                     config={"address-settings.events.#": {"default-routing-type": "multicast"},
                             "address-settings.poison": {"max-delivery-count": 2}})
    yield b
    b.terminate()


def url(b, user="app", password=None, scheme="amqp"):
    base = b.amqp_url if scheme == "amqp" else b.amqps_url
    return base.replace(f"{scheme}://", f"{scheme}://{user}:{password or user}@")


def connect(b, user="app", password=None, container_id=None, **kw):
    container = Container()
    if container_id:
        container.container_id = container_id
    return BlockingConnection(url(b, user, password), timeout=10, container=container,
                              allowed_mechs="PLAIN", **kw)


def drain(receiver, n, timeout=10):
    out = []
    for _ in range(n):
        m = receiver.receive(timeout=timeout)
        receiver.accept()
        out.append(m.body)
    return out


def test_anycast_send_receive(broker):
    c = connect(broker)
    s = c.create_sender("orders")
    for i in range(10):
        s.send(Message(body=f"o{i}"))
    r = c.create_receiver("orders", credit=10)
    assert drain(r, 10) == [f"o{i}" for i in range(10)]
    c.close()
    q = broker.queue("orders")
    assert q["routing_type"] == "anycast" and q["depth"] == 0 and q["acked"] == 10


def test_competing_consumers_share_a_queue(broker):
    c1, c2, p = connect(broker), connect(broker), connect(broker)
    r1 = c1.create_receiver("work", credit=10)
    r2 = c2.create_receiver("work", credit=10)
    wait_for(lambda: (broker.queue("work") or {}).get("consumers") == 2)
    s = p.create_sender("work")
    for i in range(20):
        s.send(Message(body=i))
    a, b = drain(r1, 10), drain(r2, 10)
    assert sorted(a + b) == list(range(20))
    assert set(a) & set(b) == set()
    for c in (c1, c2, p):
        c.close()


def test_multicast_every_subscriber_gets_a_copy(broker):
    subs = [connect(broker) for _ in range(3)]
    rs = [c.create_receiver("events.orders", credit=10) for c in subs]
    rt = subs[0].create_receiver("news", credit=10, options=Capability("topic"))
    wait_for(lambda: len([q for q in broker.management_get("/api/v1/queues")[1]
                          if q["address"] == "events.orders"]) == 3)
    p = connect(broker)
    s = p.create_sender("events.orders")
    for i in range(5):
        s.send(Message(body=i))
    p.create_sender("news", options=Capability("topic")).send(Message(body="hello"))
    for r in rs:
        assert drain(r, 5) == list(range(5))
    assert drain(rt, 1) == ["hello"]
    status, addrs = broker.management_get("/api/v1/addresses")
    assert {"name": "news", "routing_types": ["multicast"]}.items() <= next(
        a for a in addrs if a["name"] == "news").items()
    for c in subs + [p]:
        c.close()
    # non-durable subscription queues go away with their consumers
    wait_for(lambda: not [q for q in broker.management_get("/api/v1/queues")[1]
                          if q["address"] == "events.orders"])


def test_durable_subscription_survives_reconnect_and_restart(tmp_path):
    users = write_users_file(tmp_path / "users.toml", USERS, permissions=PERMISSIONS)
    b = start_broker(tmp_path, users_file=users,
                     config={"address-settings.events.#": {"default-routing-type": "multicast"}})
    try:
        c = connect(b, container_id="client-7")
        r = c.create_receiver("events.prices", name="sub-1", credit=10, options=DurableSubscription())
        p = connect(b)
        s = p.create_sender("events.prices")
        s.send(Message(body="first", durable=True))
        assert drain(r, 1) == ["first"]
        c.close()  # connection gone, link only detached: the subscription stays
        assert b.queue("client-7.sub-1")["consumers"] == 0
        for i in range(3):
            s.send(Message(body=f"away-{i}", durable=True))
        p.close()
        assert b.queue("client-7.sub-1")["depth"] == 3

        b.terminate()
        b.restart()
        c = connect(b, container_id="client-7")
        r = c.create_receiver("events.prices", name="sub-1", credit=10, options=DurableSubscription())
        assert drain(r, 3) == ["away-0", "away-1", "away-2"]
        r.close()  # closing (not detaching) the link ends the durable subscription
        wait_for(lambda: b.queue("client-7.sub-1") is None)
        c.close()
    finally:
        b.kill()


def test_send_permission_denied(broker):
    c = connect(broker, "reader")
    with pytest.raises(LinkDetached) as ei:
        c.create_sender("orders")
    assert "amqp:unauthorized-access" in str(ei.value)
    c.close()
    c = connect(broker, "app")
    with pytest.raises(LinkDetached) as ei:
        c.create_receiver("secret.plans")
    assert "amqp:unauthorized-access" in str(ei.value)
    # the connection is still usable after a refused link
    c.create_sender("orders").send(Message(body="still-fine"))
    c.close()


def test_wrong_password_and_unknown_user_are_refused(broker):
    for user, password in (("app", "wrong"), ("nobody", "x")):
        with pytest.raises(ConnectionException) as ei:
            connect(broker, user, password)
        assert "amqp:unauthorized-access" in str(ei.value)
    # and ANONYMOUS is not offered by this node
    with pytest.raises(ConnectionException):
        BlockingConnection(broker.amqp_url, timeout=10, allowed_mechs="ANONYMOUS")


def test_tls_plain_and_external(broker, ca, tmp_path):
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    dom = SSLDomain(SSLDomain.MODE_CLIENT)
    dom.set_trusted_ca_db(str(tmp_path / "ca.pem"))
    dom.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
    # proton checks the peer name against DNS names only: connect by name (the cert has both)
    tls_url = url(broker, scheme="amqps").replace("127.0.0.1", "localhost")
    c = BlockingConnection(tls_url, timeout=10, ssl_domain=dom, allowed_mechs="PLAIN")
    c.create_sender("tls-q").send(Message(body="over-tls"))
    r = c.create_receiver("tls-q", credit=1)
    assert drain(r, 1) == ["over-tls"]
    c.close()

    client_cert = ca.issue_cert("app@example", common_name="app")
    client_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "client.pem"))
    client_cert.private_key_pem.write_to_path(str(tmp_path / "client.key"))
    dom = SSLDomain(SSLDomain.MODE_CLIENT)
    dom.set_trusted_ca_db(str(tmp_path / "ca.pem"))
    dom.set_peer_authentication(SSLDomain.VERIFY_PEER_NAME)
    dom.set_credentials(str(tmp_path / "client.pem"), str(tmp_path / "client.key"), None)
    c = BlockingConnection(broker.amqps_url.replace("127.0.0.1", "localhost"), timeout=10, ssl_domain=dom,
                           allowed_mechs="EXTERNAL")
    c.create_sender("tls-q").send(Message(body="external"))
    conns = broker.management_get("/api/v1/connections")[1]
    assert any(x["user"] == "app" and x["tls"] for x in conns)
    c.close()


def test_unacked_messages_return_when_consumer_goes_away(broker):
    p = connect(broker)
    s = p.create_sender("returns")
    for i in range(4):
        s.send(Message(body=i))
    c = connect(broker)
    r = c.create_receiver("returns", credit=4)
    got = [r.receive(timeout=10).body for _ in range(4)]  # received, never settled
    assert got == [0, 1, 2, 3]
    c.close()
    c2 = connect(broker)
    r2 = c2.create_receiver("returns", credit=4)
    msgs = []
    for _ in range(4):
        msgs.append(r2.receive(timeout=10))
        r2.accept()
    assert [m.body for m in msgs] == [0, 1, 2, 3]
    assert all(m.delivery_count == 1 for m in msgs)
    c2.close()
    p.close()


def test_release_reject_and_dead_letter(broker):
    p = connect(broker)
    s = p.create_sender("poison")
    s.send(Message(body="bad", durable=True))
    c = connect(broker)
    r = c.create_receiver("poison", credit=1)
    # released: back at the head, delivery count unchanged
    assert r.receive(timeout=10).body == "bad"
    r.release(delivered=False)
    # modified without delivery-failed (what proton's release(delivered=True) sends): not counted
    assert r.receive(timeout=10).body == "bad"
    r.release(delivered=True)
    # modified(delivery-failed) twice: max-delivery-count 2 → DLQ
    for _ in range(2):
        m = r.receive(timeout=10)
        assert m.body == "bad"
        d = r.fetcher.unsettled[0]
        d.local.failed = True
        r.release(delivered=True)
    dlq = c.create_receiver("DLQ", credit=1)
    assert drain(dlq, 1) == ["bad"]
    assert broker.queue("poison")["dead_lettered"] == 1
    # rejected → dead-lettered at once
    s.send(Message(body="rejected"))
    assert r.receive(timeout=10).body == "rejected"
    r.reject()
    assert drain(dlq, 1) == ["rejected"]
    c.close()
    p.close()


def test_at_most_once_consumer_and_producer(broker):
    from proton.reactor import AtMostOnce
    c = connect(broker)
    s = c.create_sender("amo", options=AtMostOnce())
    for i in range(3):
        s.send(Message(body=i))
    r = c.create_receiver("amo", credit=3, options=AtMostOnce())
    assert [r.receive(timeout=10).body for _ in range(3)] == [0, 1, 2]
    wait_for(lambda: broker.queue("amo")["depth"] == 0 and broker.queue("amo")["acked"] == 3)
    c.close()


def test_management_api_and_activity_log(broker):
    status, health = broker.management_get("/health", auth=None)
    assert status == 200 and health == {"status": "ok", "active": True, "node_id": broker.node_id}
    assert broker.management_get("/api/v1/broker", auth=None)[0] == 401
    assert broker.management_get("/api/v1/broker", auth=("app", "app"))[0] == 403
    c = connect(broker, container_id="mgmt-client")
    s = c.create_sender("activity")
    for _ in range(7):
        s.send(Message(body="x" * 100))
    status, info = broker.management_get("/api/v1/broker")
    assert status == 200 and info["node_id"] == broker.node_id and info["active"] is True
    assert info["connection_count"] >= 1 and set(info) == {
        "node_id", "name", "active", "version", "connection_count", "uptime_s", "journal_error"}
    assert info["journal_error"] is None   # a healthy journal
    conns = broker.management_get("/api/v1/connections")[1]
    me = next(x for x in conns if x["container_id"] == "mgmt-client")
    assert me["user"] == "app" and me["source"].startswith("127.0.0.1:") and me["opened_at"]
    q = broker.queue("activity")
    assert set(q) == {"name", "address", "routing_type", "durable", "depth", "consumers", "enqueued",
                      "acked", "dead_lettered", "expired", "temporary", "filter", "remote_bindings"}
    assert q["remote_bindings"] == []  # a single node
    c.close()
    status, text = broker.management_get("/metrics")  # [management] metrics-auth = true by default
    assert status == 200 and 'lodestone_broker_queue_depth{queue="activity",address="activity"} 7' in text
    status, doc = broker.management_get("/openapi.json", auth=None)
    assert status == 200 and "/api/v1/queues" in doc["paths"]

    log = broker.data_dir / "activity.jsonl"

    def records():
        if not log.exists():
            return []
        return [r for r in map(json.loads, log.read_text().splitlines())
                if r["container_id"] == "mgmt-client"]
    recs = wait_for(records)
    total = sum(r["messages"] for r in recs if r["address"] == "activity" and r["direction"] == "produce")
    assert total == 7
    r = recs[-1]
    assert r["node_id"] == broker.node_id and r["user"] == "app" and r["bytes"] > 700
    assert r["window_start"] <= r["window_end"] and r["final"] is True


def test_connection_open_close_logged(broker):
    c = connect(broker, container_id="log-me")
    c.close()

    def lines(what):
        return [line for line in broker.stderr_text().splitlines()
                if f" {what} " in line and "container_id=log-me " in line]
    wait_for(lambda: len(lines("connection close")) == 1)
    for what in ("connection open", "connection close"):
        (line,) = lines(what)  # exactly one line each, with container-id, user and source
        assert " user=app " in line and re.search(r" source=127\.0\.0\.1:\d+( |$)", line), line
