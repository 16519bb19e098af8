"""The mirror's wire format (broker/connections/mirror_wire.py), checked against python-qpid-proton
as an independent codec: what we encode proton reads as Artemis's annotations, and what proton
builds (as an Artemis source would send it) we decode."""

from __future__ import annotations

import json

import pytest
from proton import Message, symbol, ubyte, ulong

from broker.connections.mirror_wire import (MirrorFormatError, decode_event, encode_control, encode_send,
                                            mirror_address)


def _proton(data: bytes) -> Message:
    m = Message()
    m.decode(data)
    return m


def _encode(m: Message) -> bytes:
    return m.encode()


def test_the_link_address():
    assert mirror_address("dr") == "$ACTIVEMQ_ARTEMIS_MIRROR_dr"


def test_a_send_carries_the_annotations_proton_reads_and_the_message_untouched():
    original = _encode(Message(address="orders", body="hello", durable=True, priority=7, id="m-1",
                               properties={"k": 1}, annotations={symbol("x-opt-user"): "u"}))
    data = encode_send(original, 42, trg_queue="orders", address="orders", origin="node-a")
    m = _proton(data)
    assert m.instructions == {symbol("x-opt-amq-mr-id"): 42, symbol("x-opt-amq-mr-trg-q"): "orders",
                              symbol("x-opt-amq-mr-dst"): "orders", symbol("x-opt-amq-bkr-id"): "node-a"}
    assert (m.body, m.address, m.durable, m.priority, m.id, m.properties) == ("hello", "orders", True, 7, "m-1",
                                                                             {"k": 1})
    assert m.annotations == {symbol("x-opt-user"): "u"}
    ev = decode_event(data)
    assert (ev.kind, ev.message_id, ev.origin, ev.queue, ev.address) == ("send", 42, "node-a", "orders", "orders")
    assert ev.message == original          # byte for byte


def test_a_send_replaces_the_producer_s_delivery_annotations_and_names_its_address():
    original = _encode(Message(address="elsewhere", body=b"x", instructions={symbol("x-opt-hop"): 1}))
    data = encode_send(original, 7, trg_queue="q1", address="topic.a")
    m = _proton(data)
    assert m.instructions == {symbol("x-opt-amq-mr-id"): 7, symbol("x-opt-amq-mr-trg-q"): "q1",
                              symbol("x-opt-amq-mr-dst"): "topic.a"}
    ev = decode_event(data)
    assert ev.address == "topic.a" and ev.origin is None and ev.queue == "q1"
    assert _proton(ev.message).instructions is None and _proton(ev.message).body == b"x"


@pytest.mark.parametrize("kind,kw,body", [
    ("postAck", {"address": "orders", "queue": "orders", "message_id": 99}, 99),
    ("postAck", {"address": "orders", "queue": "orders", "message_id": 5, "reason": 2}, 5),
    ("createQueue", {"address": "orders", "queue": "orders",
                     "definition": {"name": "orders", "address": "orders", "routing-type": "ANYCAST"}}, None),
    ("addAddress", {"address": "t", "definition": {"name": "t", "routing-types": ["MULTICAST"]}}, None),
    ("deleteQueue", {"address": "orders", "queue": "orders"}, "orders"),
    ("deleteAddress", {"address": "t"}, "t"),
])
def test_control_events_read_by_proton_and_back(kind, kw, body):
    data = encode_control(kind, origin="node-a", **kw)
    m = _proton(data)
    assert m.durable is True
    assert m.annotations[symbol("x-opt-amq-mr-ev-type")] == kind
    assert m.annotations[symbol("x-opt-amq-bkr-id")] == "node-a"
    if body is not None:
        assert m.body == body
    else:
        assert json.loads(m.body) == kw["definition"]
    if kw.get("reason"):
        assert m.annotations[symbol("x-opt-amq-mr-ack-reason")] == kw["reason"]
    else:
        assert symbol("x-opt-amq-mr-ack-reason") not in m.annotations
    ev = decode_event(data)
    assert ev.kind == kind and ev.origin == "node-a"
    assert ev.address == kw.get("address") and ev.queue == kw.get("queue")
    assert ev.message_id == kw.get("message_id") and ev.reason == kw.get("reason", 0)
    assert ev.definition == kw.get("definition")


def test_an_event_built_by_proton_as_artemis_sends_it():
    m = Message(body=1234, durable=True,
                annotations={symbol("x-opt-amq-mr-ev-type"): symbol("postAck"), symbol("x-opt-amq-mr-adr"): "a",
                             symbol("x-opt-amq-mr-qu"): "q", symbol("x-opt-amq-bkr-id"): "artemis-1",
                             symbol("x-opt-amq-mr-ack-reason"): ubyte(1)})
    ev = decode_event(m.encode())
    assert (ev.kind, ev.message_id, ev.address, ev.queue, ev.origin, ev.reason) == ("postAck", 1234, "a", "q",
                                                                                  "artemis-1", 1)
    send = Message(address="orders", body="b",
                   instructions={symbol("x-opt-amq-mr-id"): ulong(8), symbol("x-opt-amq-bkr-id"): "artemis-1"})
    ev = decode_event(send.encode())
    assert (ev.kind, ev.message_id, ev.address, ev.origin, ev.queue) == ("send", 8, "orders", "artemis-1", None)


@pytest.mark.parametrize("build,condition,why", [
    (lambda: b"\x00\x53\x77", "amqp:decode-error", "cannot be read"),
    (lambda: Message(body="plain").encode(), "amqp:decode-error", "neither"),
    (lambda: Message(body="x", annotations={symbol("x-opt-amq-mr-ev-type"): symbol("explode"),
                                            symbol("x-opt-amq-bkr-id"): "n"}).encode(),
     "amqp:not-implemented", "unknown mirror event"),
    (lambda: Message(body="not a long", annotations={symbol("x-opt-amq-mr-ev-type"): symbol("postAck"),
                                                     symbol("x-opt-amq-bkr-id"): "n", symbol("x-opt-amq-mr-adr"): "a",
                                                     symbol("x-opt-amq-mr-qu"): "q"}).encode(),
     "amqp:invalid-field", "non-negative"),
    (lambda: Message(body=1, annotations={symbol("x-opt-amq-mr-ev-type"): symbol("postAck"),
                                                 symbol("x-opt-amq-mr-adr"): "a", symbol("x-opt-amq-mr-qu"): "q"}).encode(),
     "amqp:invalid-field", "x-opt-amq-bkr-id"),
    (lambda: Message(body="{not json", annotations={symbol("x-opt-amq-mr-ev-type"): symbol("createQueue"),
                                                    symbol("x-opt-amq-bkr-id"): "n"}).encode(),
     "amqp:invalid-field", "not JSON"),
    (lambda: Message(body="b", instructions={symbol("x-opt-amq-mr-id"): "seven"}).encode(),
     "amqp:invalid-field", "non-negative"),
    (lambda: Message(body="b", instructions={symbol("x-opt-amq-mr-id"): ulong(1)}).encode(),
     "amqp:invalid-field", "neither its address"),
])
def test_garbage_is_refused_with_a_condition(build, condition, why):
    with pytest.raises(MirrorFormatError) as e:
        decode_event(build())
    assert e.value.condition == condition and why in e.value.description


@pytest.mark.parametrize("message", [
    Message(body="no header"),                                              # no header section
    Message(body="x", durable=True, instructions={symbol("a"): "b" * 300}),  # a large old DA (map32)
    Message(body=b"\x00" * 5000, durable=True, ttl=5, annotations={symbol("m"): 1}),
])
def test_a_send_keeps_every_other_section_byte_for_byte(message):
    original = message.encode()
    ev = decode_event(encode_send(original, 2 ** 40, trg_queue="q", address="a"))
    stripped = Message()
    stripped.decode(ev.message)
    assert ev.message_id == 2 ** 40 and stripped.instructions is None
    assert (stripped.body, stripped.durable, stripped.annotations) == (message.body, message.durable, message.annotations)


def test_ack_prefixes_are_cached_but_each_event_is_its_own():
    a = encode_control("postAck", origin="n", address="a", queue="q", message_id=1)
    b = encode_control("postAck", origin="n", address="a", queue="q", message_id=2)
    assert a != b and decode_event(a).message_id == 1 and decode_event(b).message_id == 2


# -- batches (Lodestone to Lodestone) ------------------------------------------------------------
from broker.connections.mirror_wire import batch_count, encode_batch, split_batch  # noqa: E402


def _events(n: int) -> list[bytes]:
    sends = [encode_send(_encode(Message(address="orders", body=f"b-{i}")), i, trg_queue="orders", address="orders")
             for i in range(n)]
    acks = [encode_control("postAck", origin="node-a", address="orders", queue="orders", message_id=i)
            for i in range(n)]
    return [e for pair in zip(sends, acks) for e in pair]


def test_a_batch_is_an_amqp_message_proton_reads_as_a_list_of_the_events():
    events = _events(3)
    data = encode_batch(events)
    m = _proton(data)
    assert m.annotations == {symbol("x-opt-lodestone-mirror-batch"): True}
    assert [bytes(b) for b in m.body] == events
    assert split_batch(data) == events and batch_count(data) == 6
    assert [decode_event(e).kind for e in split_batch(data)] == ["send", "postAck"] * 3


def test_a_single_event_is_not_a_batch():
    (one, _ack) = _events(1)
    assert split_batch(one) is None and batch_count(one) == 1


@pytest.mark.parametrize("mangle,reason", [
    (lambda d: d[:-1], "does not match"),
    (lambda d: d[:d.index(b"\xb0")] + b"\xb0\x7f\xff\xff\xff" + d[d.index(b"\xb0") + 5:], "runs past"),
    (lambda d: d + b"\x00", "does not match"),
    (lambda d: d.replace(b"\xb0", b"\xa0", 1), "binaries"),
])
def test_a_batch_that_is_not_the_format_is_refused(mangle, reason):
    data = mangle(encode_batch(_events(2)))
    with pytest.raises(MirrorFormatError, match=reason):
        split_batch(data)


def test_a_batch_over_the_limit_is_refused():
    with pytest.raises(MirrorFormatError, match="1 to 4096"):
        split_batch(encode_batch([b"x"] * 4097))
