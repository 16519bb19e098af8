"""Resource limits on a real broker process: per user ``max-connections`` and ``max-queues``
(``[resource-limits."<user>"]`` over ``[resource-limit-defaults]``), per connection
``[amqp] max-sessions`` and ``max-links``. Each limit hit is answered with
``amqp:resource-limit-exceeded`` (on the connection, the session or the link) naming the limit and
its value, counted in ``/metrics`` and logged once, while a bystander of another user keeps working.
"""

from __future__ import annotations

import re
import socket
import time

import pytest
from proton import Message
from proton.reactor import DurableSubscription
from proton.utils import BlockingConnection, LinkDetached

from broker.wire.codec import Described, UInt, ULong
from broker.wire.frames import (
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    Close,
    FrameReader,
    Open,
    SaslInit,
    decode_performative,
    encode_frame,
)
from tests.brokerproc import start_broker, write_users_file
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"]), "other": ("other", ["app"])}
LIMIT = "amqp:resource-limit-exceeded"


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("limits")
    users = write_users_file(tmp / "users.toml", USERS)
    b = start_broker(tmp, users_file=users, config={
        "amqp": {"max-sessions": 3, "max-links": 4},
        "resource-limit-defaults": {"max-connections": 50},
        'resource-limits.app': {"max-connections": 2, "max-queues": 3},
        "addresses.mq-topic": {"routing-types": ["multicast"]},
    })
    yield b
    b.terminate()


@pytest.fixture(scope="module")
def bystander(broker):
    c = connect(broker, "other")
    s = c.create_sender("bystander")
    r = c.create_receiver("bystander", credit=10)
    n = [0]

    def check():
        n[0] += 1
        s.send(Message(body=n[0]))
        assert r.receive(timeout=10).body == n[0]
        r.accept()
    yield check
    c.close()


def connect(b, user: str, **kw) -> BlockingConnection:
    return BlockingConnection(b.amqp_url.replace("amqp://", f"amqp://{user}:{user}@"), timeout=10,
                              allowed_mechs="PLAIN", **kw)


def limit_count(b, limit: str) -> int:
    status, text = b.management_get("/metrics")
    assert status == 200
    m = re.search(rf'^lodestone_broker_resource_limit_exceeded_total\{{limit="{limit}"\}} (\d+)', text, re.M)
    return int(m.group(1))


def raw_session(b, user: str, frames: list[bytes], wait_s: float = 1.0) -> list:
    """SASL PLAIN + our frames on a raw socket; the performatives the broker answered with."""
    sasl = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", f"\x00{user}\x00{user}".encode()))
    with socket.create_connection((b.host, b.port), timeout=5) as s:
        s.sendall(sasl + AMQP_HEADER + b"".join(frames))
        data = bytearray()
        deadline = time.monotonic() + wait_s
        s.settimeout(0.2)
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                continue
            if not chunk:
                break
            data += chunk
    r = FrameReader(1 << 20)
    r.receive_data(bytes(data))
    out = []
    while True:
        if r.next_protocol_header() is NEED_DATA:
            break
        while True:
            f = r.next_event()
            if f is NEED_DATA:
                break
            if f.body:
                p = decode_performative(f.body)
                if not type(p).__name__.startswith("Sasl"):
                    out.append((f.channel, p))
                if type(p).__name__ == "SaslOutcome":
                    break
    return out


def error_of(p) -> tuple[str, str] | None:
    """(condition, description) of an End/Detach/Close performative."""
    if isinstance(p, Close):
        return (str(p.error.condition), p.error.description) if p.error else None
    fields = p.value
    err = fields[0] if int(p.descriptor) == 0x17 else (fields[2] if len(fields) > 2 else None)
    if not isinstance(err, Described):
        return None
    return str(err.value[0]), err.value[1]


def test_max_connections_per_user(broker, bystander):
    before = limit_count(broker, "max-connections")
    a, b = connect(broker, "app"), connect(broker, "app")
    try:
        got = raw_session(broker, "app", [encode_frame(FRAME_AMQP, 0, Open("third"))])
        perf = [p for _ch, p in got]
        assert isinstance(perf[0], Open) and isinstance(perf[-1], Close), perf
        cond, desc = error_of(perf[-1])
        assert cond == LIMIT and "max-connections 2" in desc and "app" in desc, desc
        assert limit_count(broker, "max-connections") == before + 1
        bystander()  # another user is not affected
        other = connect(broker, "other")
        other.close()
    finally:
        a.close()
    # one closed: the user may connect again (once the broker has seen that close)
    def reconnects() -> bool:
        try:
            connect(broker, "app").close()
        except Exception:
            return False
        return True
    wait_for(reconnects, 10)
    b.close()
    assert "condition=amqp:resource-limit-exceeded" in broker.stderr_text()


def test_max_queues_per_user_counts_auto_created_queues_and_durable_subscriptions(broker, bystander):
    before = limit_count(broker, "max-queues")
    c = connect(broker, "app", container_id="limits-app")
    try:
        c.create_sender("mq-1")
        c.create_sender("mq-2")
        c.create_receiver("mq-topic", name="sub-1", options=DurableSubscription())  # multicast durable queue
        with pytest.raises(LinkDetached) as exc:
            c.create_sender("mq-4")
        assert exc.value.condition == LIMIT
        assert "max-queues 3" in str(exc.value)
        with pytest.raises(LinkDetached) as exc:
            c.create_receiver("mq-topic", name="sub-2", options=DurableSubscription())
        assert exc.value.condition == LIMIT
        # queues that exist already are not created again: attaching to them is fine
        c.create_sender("mq-1", name="mq-1-again")
        # another user is not limited by app's count
        bystander()
        o = connect(broker, "other")
        o.create_sender("other-queue")
        o.close()
    finally:
        c.close()
    assert limit_count(broker, "max-queues") == before + 2
    assert broker.stderr_text().count("limit=max-queues") >= 2


def test_max_links_per_connection(broker, bystander):
    before = limit_count(broker, "max-links")
    c = connect(broker, "other")
    try:
        for i in range(4):
            c.create_sender("bystander", name=f"link-{i}")
        with pytest.raises(LinkDetached) as exc:
            c.create_sender("bystander", name="link-4")
        assert exc.value.condition == LIMIT and "max-links 4" in str(exc.value)
    finally:
        c.close()
    assert limit_count(broker, "max-links") == before + 1
    bystander()


def begin(channel: int) -> bytes:
    return encode_frame(FRAME_AMQP, channel, Described(ULong(0x11), [None, UInt(0), UInt(100), UInt(100)]))


def test_max_sessions_per_connection(broker, bystander):
    before = limit_count(broker, "max-sessions")
    got = raw_session(broker, "other", [encode_frame(FRAME_AMQP, 0, Open("sessions"))] +
                      [begin(ch) for ch in range(4)])
    opened = [p for _ch, p in got if isinstance(p, Open)]
    assert opened and opened[0].channel_max == 3  # negotiated: channels 0..max-sessions
    ends = [(ch, error_of(p)) for ch, p in got if isinstance(p, Described) and int(p.descriptor) == 0x17]
    assert len(ends) == 1, got
    ch, (cond, desc) = ends[0]
    assert cond == LIMIT and "max-sessions 3" in desc, desc
    assert not any(isinstance(p, Close) for _ch, p in got)  # the connection itself goes on
    assert limit_count(broker, "max-sessions") == before + 1
    bystander()


def attach(handle: int, name: str, target: str) -> bytes:
    tgt = Described(ULong(0x29), [target])
    return encode_frame(FRAME_AMQP, 0, Described(ULong(0x12), [name, UInt(handle), False, None, None,
                                                               Described(ULong(0x28), [None]), tgt]))


def test_a_client_ignoring_link_refusals_is_closed(broker, bystander):
    # 4 links fill max-links; every further attach is refused, and proton keeps a refused link
    # until the client answers its detach. This client never does: past max-links refused links
    # the whole connection is closed
    frames = [encode_frame(FRAME_AMQP, 0, Open("stubborn")), begin(0)]
    frames += [attach(h, f"l{h}", "bystander") for h in range(4 + 6)]
    got = raw_session(broker, "other", frames)
    detaches = [error_of(p) for _ch, p in got if isinstance(p, Described) and int(p.descriptor) == 0x16]
    assert len([d for d in detaches if d and d[0] == LIMIT]) >= 5, detaches
    closes = [error_of(p) for _ch, p in got if isinstance(p, Close)]
    assert len(closes) == 1 and closes[0][0] == LIMIT and "refused links" in closes[0][1], closes
    bystander()
