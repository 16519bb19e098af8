"""Invalid UTF-8 on the wire: a string in a performative closes that connection with
``amqp:decode-error`` (one log line, no traceback), straight to a broker and through a real router
in proxy mode; a string in a message section the broker does not need passes through untouched
(also on redelivery), one it must read (the anonymous relay's ``to``) gets the delivery
``rejected`` with ``amqp:decode-error``. A bystander proton client keeps working throughout.

Frames are hand-built with ``broker.wire.codec``/``frames``: a placeholder string of the same
length is encoded and its bytes replaced by invalid UTF-8.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from proton import Delivery, Handler, Message
from proton.reactor import Container
from proton.utils import BlockingConnection

from broker.wire.codec import Described, UInt, ULong, decode
from broker.wire.frames import AMQP_HEADER, FRAME_AMQP, FRAME_SASL, SASL_HEADER, Open, SaslInit, encode_frame
from tests.brokerproc import start_broker, write_users_file
from tests.integration.test_broker_badinput import exchange, parse_reply
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

BAD = b"\xff\xfe\xc0\x80"  # not UTF-8 in any position
PLACEHOLDER = "QQQQ"
USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"])}
SASL_APP = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\x00app\x00app", "localhost"))


def bad(frame: bytes) -> bytes:
    assert frame.count(PLACEHOLDER.encode()) == 1
    return frame.replace(PLACEHOLDER.encode(), BAD)


def open_frame(container_id: str = "bad-strings", hostname: str | None = None) -> bytes:
    return encode_frame(FRAME_AMQP, 0, Open(container_id, hostname=hostname))


BEGIN = encode_frame(FRAME_AMQP, 0, Described(ULong(0x11), [None, UInt(0), UInt(100), UInt(100)]))


def attach_frame(name: str, *, source: str | None, target: str | None, receiver: bool) -> bytes:
    """§2.7.3 attach on channel 0, handle 0 (role true = the client receives)."""
    src = Described(ULong(0x28), [source])
    tgt = Described(ULong(0x29), [target])
    return encode_frame(FRAME_AMQP, 0, Described(ULong(0x12), [name, UInt(0), receiver, None, None, src, tgt]))


def close_condition(server, frames: list[bytes]) -> str | None:
    reply = parse_reply(exchange(server, [SASL_APP + AMQP_HEADER, *frames]))
    assert reply["headers"][:2] == [SASL_HEADER, AMQP_HEADER], reply
    assert reply["closed"] and isinstance(reply["amqp"][0], Open), reply
    assert reply["trailing"] == b"", reply
    return reply["close_error"]


CASES = {
    "container-id": lambda: [bad(open_frame(PLACEHOLDER))],
    "hostname": lambda: [bad(open_frame(hostname=PLACEHOLDER))],
    "link name": lambda: [open_frame(), BEGIN, bad(attach_frame(PLACEHOLDER, source=None, target="q1",
                                                                 receiver=False))],
    "target address": lambda: [open_frame(), BEGIN, bad(attach_frame("l1", source=None, target=PLACEHOLDER,
                                                                      receiver=False))],
    "source address": lambda: [open_frame(), BEGIN, bad(attach_frame("l1", source=PLACEHOLDER, target=None,
                                                                      receiver=True))],
}


class Host:
    """What ``exchange`` needs: where to connect."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad-strings")
    users = write_users_file(tmp / "users.toml", USERS)
    broker = start_broker(tmp, users_file=users)
    text = "\n".join([
        f"users-file = {toml_str(users)}",
        "[management]", "port = 0",
        "[routing-log]", "enabled = false",
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", "check-period = 300", 'username = "admin"', 'password = "admin"',
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {broker.port}",
        f"management-url = {toml_str(broker.management_url)}",
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        'sasl-mechanisms = ["PLAIN"]',
    ]) + "\n"
    router = start_router(tmp / "router", text, expect=2, auth=("admin", "admin"))
    wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 1, 15)
    bystander = BlockingConnection(broker.amqp_url.replace("amqp://", "amqp://app:app@"), timeout=10,
                                   allowed_mechs="PLAIN")
    snd, rcv = bystander.create_sender("bystander"), bystander.create_receiver("bystander", credit=10)
    n = [0]

    def check():
        n[0] += 1
        snd.send(Message(body=n[0]))
        assert rcv.receive(timeout=10).body == n[0]
        rcv.accept()
    try:
        yield broker, router, check
    finally:
        bystander.close()
        router.terminate()
        broker.terminate()


def decode_errors(broker) -> int:
    status, text = broker.management_get("/metrics")
    assert status == 200
    return int(re.search(r'^lodestone_broker_decode_errors_total\{where="frame"\} (\d+)', text, re.M).group(1))


@pytest.mark.parametrize("where", list(CASES))
def test_invalid_utf8_in_a_performative_closes_with_decode_error(env, where):
    broker, _router, bystander = env
    before = decode_errors(broker)
    assert close_condition(Host(broker.host, broker.port), CASES[where]()) == "amqp:decode-error"
    assert decode_errors(broker) == before + 1
    bystander()
    log = broker.stderr_text()
    assert "Traceback" not in log and "UnicodeDecodeError" not in log
    assert "condition=amqp:decode-error" in log


@pytest.mark.parametrize("where", list(CASES))
def test_invalid_utf8_through_the_router_proxy(env, where):
    broker, router, bystander = env
    before = decode_errors(broker)
    proto_before = router.counters()["handshake_decode_error"]
    assert close_condition(Host("127.0.0.1", router.port("proxy")), CASES[where]()) == "amqp:decode-error"
    if where in ("container-id", "hostname"):
        # the router's sniffer decodes the Open itself: refused at the edge, counted there
        wait_for(lambda: router.counters()["handshake_decode_error"] == proto_before + 1)
    else:
        # the attach goes through the proxy: the broker closes with decode-error
        assert decode_errors(broker) == before + 1
    bystander()
    assert "Traceback" not in router.stderr_text() + broker.stderr_text()


class RawConsumer(Handler):
    """A proton reactor client that takes transfers as bytes (no message decoding): the first
    ``fail`` deliveries are settled ``modified(delivery-failed)``, the next one accepted."""

    def __init__(self, url: str, address: str, fail: int = 1):
        self.url, self.address, self.fail = url, address, fail
        self.got: list[bytes] = []
        self.done = threading.Event()

    def on_reactor_init(self, event):
        conn = event.container.connect(self.url, allowed_mechs="PLAIN")
        self.link = event.container.create_receiver(conn, self.address)
        self.link.flow(1)

    def on_delivery(self, event):
        d = event.delivery
        if d.partial or not d.readable:
            return
        self.got.append(event.link.recv(d.pending))
        event.link.advance()
        if len(self.got) <= self.fail:
            d.local.failed = True
            d.update(Delivery.MODIFIED)
            d.settle()
            event.link.flow(1)
        else:
            d.update(Delivery.ACCEPTED)
            d.settle()
            event.connection.close()
            self.done.set()

    def run(self, timeout: float = 15.0) -> list[bytes]:
        c = Container(self)
        t = threading.Thread(target=c.run, daemon=True)
        t.start()
        ok = self.done.wait(timeout)
        if not ok:
            c.stop()
        t.join(5)
        assert ok, f"raw consumer got {len(self.got)} deliveries"
        return self.got


def raw_message(**kw) -> bytes:
    return bad(Message(**kw).encode())


def send_raw(conn: BlockingConnection, address: str | None, data: bytes) -> Delivery:
    snd = conn.create_sender(address)
    d = snd.link.delivery(b"raw-%d" % time.monotonic_ns())
    snd.link.send(data)
    snd.link.advance()
    conn.wait(lambda: d.remote_state or d.settled, timeout=10, msg="no outcome for the raw message")
    return d


def client_url(env, via: str) -> str:
    broker, router, _ = env
    base = broker.amqp_url if via == "broker" else router.url("proxy")
    return base.replace("amqp://", "amqp://app:app@")


@pytest.mark.parametrize("via", ["broker", "router"])
def test_invalid_utf8_in_a_body_passes_through_untouched_even_on_redelivery(env, via):
    broker, _router, bystander = env
    url = client_url(env, via)
    data = raw_message(body=PLACEHOLDER, durable=True, subject="s")
    c = BlockingConnection(url, timeout=10, allowed_mechs="PLAIN")
    try:
        assert send_raw(c, f"bad-body-{via}", data).remote_state == Delivery.ACCEPTED
    finally:
        c.close()
    first, again = RawConsumer(url, f"bad-body-{via}", fail=1).run()
    assert first == data  # byte for byte
    # the redelivery carries delivery-count 1 in its header; every other section is untouched
    assert again[decode(again)[1]:] == data[decode(data)[1]:]  # everything after the header section
    m = Message()
    m.decode(again.replace(BAD, PLACEHOLDER.encode()))
    assert m.delivery_count == 1 and m.durable and m.subject == "s" and m.body == PLACEHOLDER
    bystander()
    assert "Traceback" not in broker.stderr_text()


@pytest.mark.parametrize("via", ["broker", "router"])
def test_invalid_utf8_in_the_relay_to_is_rejected_with_decode_error(env, via):
    broker, _router, bystander = env
    url = client_url(env, via)
    c = BlockingConnection(url, timeout=10, allowed_mechs="PLAIN")
    try:
        d = send_raw(c, None, raw_message(address=PLACEHOLDER, body="b"))
        assert d.remote_state == Delivery.REJECTED
        assert str(d.remote.condition.name) == "amqp:decode-error"
        # the same connection goes on: a good message through the relay is accepted
        ok = send_raw(c, None, Message(address="relay-ok", body="fine").encode())
        assert ok.remote_state == Delivery.ACCEPTED
    finally:
        c.close()
    status, text = broker.management_get("/metrics")
    assert re.search(r'^lodestone_broker_decode_errors_total\{where="message"\} [1-9]', text, re.M)
    bystander()
