"""The mirror's wire format (pure): Artemis's AMQP mirror as its source and target speak it
(docs/broker-connections.md "Mirror"; ``../shared/artemis-mirror-notes.md`` for where each name
comes from in Artemis).

A mirror is one sending link from the source to the target, target address
``$ACTIVEMQ_ARTEMIS_MIRROR_<connection name>``, with the desired capability ``amq.mirror`` and
the attach property ``x-opt-amq-bkr-id`` (the source's node id); the target answers offering
``amq.mirror`` and its own id. Each transfer on it is one **event**:

* a **send** — the message as its producer sent it, with *delivery annotations* added (any the
  producer set are replaced; they are per hop anyway): ``x-opt-amq-mr-id`` (long, the source's
  id of the message, unique per origin node), ``x-opt-amq-bkr-id`` (string, the origin node;
  Artemis omits it when the sender is the origin — then the link's id is the origin),
  ``x-opt-amq-mr-dst`` (string, the address, when it differs from the properties' ``to``) and
  ``x-opt-amq-mr-trg-q`` (string, the queue it was stored in: the target stores it there);
* a **control event** — a message with the message annotation ``x-opt-amq-mr-ev-type`` (symbol:
  ``addAddress``, ``deleteAddress``, ``createQueue``, ``deleteQueue``, ``postAck``),
  ``x-opt-amq-mr-adr`` (the address), ``x-opt-amq-mr-qu`` (the queue), ``x-opt-amq-bkr-id``
  and, for ``postAck``, ``x-opt-amq-mr-ack-reason`` (byte; left out for NORMAL = 0, KILLED = 1,
  EXPIRED = 2, REPLACED = 3); its body an amqp-value: the address or queue definition as JSON
  text (``addAddress``, ``createQueue``), the name (``deleteAddress``, ``deleteQueue``), or the
  acknowledged message's ``x-opt-amq-mr-id`` (long, ``postAck``).

:func:`decode_event` reads either; anything else raises :class:`MirrorFormatError` with the AMQP
condition the target closes the link with.

**Batches** (beyond Artemis): when the source's attach desires ``x-opt-lodestone-mirror-batch``
and the target's answer offers it, a transfer may carry several events, in order
(:func:`encode_batch`, :func:`split_batch`): a message whose annotations hold
``x-opt-lodestone-mirror-batch = true`` and whose amqp-value body is a list of binaries, each one
event above. One disposition then answers them all. A peer that does not name the capability
(Artemis) gets one event per transfer, as above.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

from broker.amqp.message import message_sections, message_to, section_code, value_end
from broker.wire.codec import Described, Long, Symbol, UByte, ULong, decode as amqp_decode, encode as amqp_encode
from broker.wire.errors import DecodeError
from broker.wire.frames import MIRROR_PREFIX

__all__ = ["MIRROR_CAPABILITY", "MIRROR_PREFIX", "BROKER_ID", "MirrorEvent", "MirrorFormatError", "mirror_address",
           "encode_send", "encode_control", "decode_event", "EVENT_TYPES", "ACK_REASONS", "BATCH_CAPABILITY",
           "BATCH_EVENTS", "encode_batch", "split_batch", "batch_count"]

MIRROR_CAPABILITY = "amq.mirror"
BROKER_ID = "x-opt-amq-bkr-id"
MESSAGE_ID = "x-opt-amq-mr-id"
DESTINATION = "x-opt-amq-mr-dst"
TARGET_QUEUE = "x-opt-amq-mr-trg-q"
EVENT_TYPE = "x-opt-amq-mr-ev-type"
ADDRESS = "x-opt-amq-mr-adr"
QUEUE = "x-opt-amq-mr-qu"
ACK_REASON = "x-opt-amq-mr-ack-reason"
EVENT_TYPES = ("addAddress", "deleteAddress", "createQueue", "deleteQueue", "postAck")
ACK_REASONS = {"normal": 0, "killed": 1, "expired": 2, "replaced": 3}

BATCH_CAPABILITY = "x-opt-lodestone-mirror-batch"   # several events per transfer (Lodestone to Lodestone)
BATCH_EVENTS = 256                  # events in one batch transfer at most (a reader refuses more than 4096)
_BATCH_LIMIT = 4096

_DELIVERY_ANNOTATIONS = 0x71
_MESSAGE_ANNOTATIONS = 0x72
_AMQP_VALUE = 0x77
_NAME_LIMIT = 4096


def mirror_address(connection: str) -> str:
    """The mirror link's target address for a broker connection named ``connection``."""
    return f"{MIRROR_PREFIX}_{connection}"


class MirrorFormatError(Exception):
    """A mirror transfer that is not the format; ``condition`` is the AMQP error for the link."""

    def __init__(self, description: str, condition: str = "amqp:decode-error"):
        super().__init__(description)
        self.condition = condition
        self.description = description


@dataclass(frozen=True)
class MirrorEvent:
    """One decoded event. ``kind``: ``send`` or one of :data:`EVENT_TYPES`. For a send,
    ``message`` is the producer's message without the mirror's delivery annotations and
    ``address`` where it was sent; ``definition`` the decoded JSON of ``addAddress`` and
    ``createQueue``; ``message_id`` the source's id of the message (``send``, ``postAck``)."""

    kind: str
    origin: str | None = None
    message_id: int | None = None
    address: str | None = None
    queue: str | None = None
    message: bytes = b""
    definition: dict | None = None
    reason: int = 0


def _sections(data: bytes) -> list[tuple[int | None, int, int]]:
    """``(code, start, end)`` of each section, sizes read from the constructors only."""
    try:
        return message_sections(data)
    except DecodeError as exc:
        raise MirrorFormatError(f"message sections cannot be read: {exc.description}") from None


def _annotation_map(data: bytes, start: int) -> dict[str, Any]:
    try:
        value, _end = amqp_decode(data, start)
    except DecodeError as exc:
        raise MirrorFormatError(f"annotations cannot be read: {exc.description}") from None
    if not isinstance(value, Described) or not isinstance(value.value, dict):
        raise MirrorFormatError("annotations are not a map")
    return {str(k): v for k, v in value.value.items()}


_DA_HEAD = b"\x00\x53\x71"            # a described delivery-annotations section (small descriptor)
_HEADER_HEAD = b"\x00\x53\x70"


def _da_template(trg_queue: str, address: str, origin: str | None) -> tuple[bytes, bytes]:
    """The delivery-annotations section of a send as (bytes before the message id, bytes after):
    only the id's 8 bytes change from one message to the next (the map's last entry)."""
    ann: dict = {Symbol(TARGET_QUEUE): trg_queue, Symbol(DESTINATION): address}
    if origin is not None:
        ann[Symbol(BROKER_ID)] = origin
    ann[Symbol(MESSAGE_ID)] = Long(0x0102030405060708)
    whole = amqp_encode(Described(ULong(_DELIVERY_ANNOTATIONS), ann))
    marker = b"\x81\x01\x02\x03\x04\x05\x06\x07\x08"
    at = whole.rindex(marker) + 1
    return whole[:at], whole[at + 8:]


_DA_CACHE: dict[tuple, tuple[bytes, bytes]] = {}


def encode_send(message: bytes, message_id: int, *, trg_queue: str, address: str,
                origin: str | None = None) -> bytes:
    """A mirrored send: ``message`` (as its producer sent it) with the mirror's delivery
    annotations in place of any it had. ``x-opt-amq-mr-dst`` is always written (Artemis writes
    it only when the address differs from the properties' ``to``; readers take it either way),
    so the message's properties need not be read. Only the header, when there is one, and a
    delivery-annotations section after it are looked at."""
    key = (trg_queue, address, origin)
    tpl = _DA_CACHE.get(key)
    if tpl is None:
        if len(_DA_CACHE) > 4096:
            _DA_CACHE.clear()
        tpl = _DA_CACHE[key] = _da_template(trg_queue, address, origin)
    da = tpl[0] + _LONG.pack(message_id) + tpl[1]
    pos = 0
    try:
        if message.startswith(_HEADER_HEAD):
            pos = value_end(message, 3)
        if message.startswith(_DA_HEAD, pos):
            rest = value_end(message, pos + 3)
        elif message.startswith(b"\x00", pos) and section_code(message, pos)[0] == _DELIVERY_ANNOTATIONS:
            rest = value_end(message, section_code(message, pos)[1])
        else:
            rest = pos
    except (IndexError, struct.error, DecodeError) as exc:
        raise MirrorFormatError(f"message sections cannot be read: {exc}") from None
    return b"".join((message[:pos], da, message[rest:]))


_LONG = struct.Struct(">q")
_ACK_CACHE: dict[tuple, bytes] = {}


def encode_control(kind: str, *, origin: str, address: str | None = None, queue: str | None = None,
                   definition: dict | None = None, message_id: int | None = None, reason: int = 0) -> bytes:
    """A control event (see the module doc). Durable, as Artemis sends them. A ``postAck`` is
    a cached prefix (header and annotations, the same for every acknowledgement of a queue)
    and its body."""
    if kind == "postAck":
        key = (origin, address, queue, reason)
        prefix = _ACK_CACHE.get(key)
        if prefix is None:
            if len(_ACK_CACHE) > 4096:
                _ACK_CACHE.clear()
            prefix = _ACK_CACHE[key] = _control_prefix(kind, origin, address, queue, reason)
        return prefix + b"\x00\x53\x77\x81" + _LONG.pack(message_id)
    if kind not in EVENT_TYPES:
        raise ValueError(f"unknown mirror event {kind!r}")
    if kind in ("addAddress", "createQueue"):
        body: Any = json.dumps(definition, separators=(",", ":"))
    else:
        body = queue if kind == "deleteQueue" else address
    return _control_prefix(kind, origin, address, queue, 0) + amqp_encode(Described(ULong(_AMQP_VALUE), body))


def _control_prefix(kind: str, origin: str, address: str | None, queue: str | None, reason: int) -> bytes:
    ann: dict = {Symbol(EVENT_TYPE): Symbol(kind), Symbol(BROKER_ID): origin}
    if address is not None:
        ann[Symbol(ADDRESS)] = address
    if queue is not None:
        ann[Symbol(QUEUE)] = queue
    if reason:
        ann[Symbol(ACK_REASON)] = UByte(reason)
    header = amqp_encode(Described(ULong(0x70), [True]))
    return header + amqp_encode(Described(ULong(_MESSAGE_ANNOTATIONS), ann))


# -- batches (a Lodestone extension, only on a link where both sides named BATCH_CAPABILITY) ---------
_BATCH_HEAD = amqp_encode(Described(ULong(_MESSAGE_ANNOTATIONS), {Symbol(BATCH_CAPABILITY): True})) + b"\x00\x53\x77"
_U32 = struct.Struct(">I")
_LIST32 = struct.Struct(">BII")


def encode_batch(events: list[bytes]) -> bytes:
    """Several encoded events as one message: the message annotation ``x-opt-lodestone-mirror-batch``
    (true) and an amqp-value body that is a list of binaries, one event each, in order."""
    parts = [b""]
    size = 4
    for ev in events:
        parts.append(b"\xb0" + _U32.pack(len(ev)))
        parts.append(ev)
        size += 5 + len(ev)
    parts[0] = _BATCH_HEAD + _LIST32.pack(0xD0, size, len(events))
    return b"".join(parts)


def batch_count(data: bytes) -> int:
    """How many events ``data`` holds (a batch's count, or 1), without reading them."""
    if data.startswith(_BATCH_HEAD) and len(data) >= len(_BATCH_HEAD) + 9:
        return _LIST32.unpack_from(data, len(_BATCH_HEAD))[2]
    return 1


def split_batch(data: bytes) -> list[bytes] | None:
    """The events of a batch transfer (:func:`encode_batch`), or None when ``data`` is a single
    event; raises :class:`MirrorFormatError` for a batch that is not the format."""
    if not data.startswith(_BATCH_HEAD):
        return None
    pos = len(_BATCH_HEAD)
    end = len(data)
    if pos + 9 > end or data[pos] != 0xD0:
        raise MirrorFormatError("a mirror batch's body must be a list32 of binaries")
    _c, size, count = _LIST32.unpack_from(data, pos)
    pos += 9
    if pos - 4 + size != end:
        raise MirrorFormatError("a mirror batch's list size does not match the transfer")
    if not 0 < count <= _BATCH_LIMIT:
        raise MirrorFormatError(f"a mirror batch holds 1 to {_BATCH_LIMIT} events, not {count}",
                                "amqp:invalid-field")
    out = []
    for _ in range(count):
        if pos + 5 > end or data[pos] != 0xB0:
            raise MirrorFormatError("a mirror batch's events must be binaries (vbin32)")
        n = _U32.unpack_from(data, pos + 1)[0]
        pos += 5
        if pos + n > end:
            raise MirrorFormatError("a mirror batch's event runs past the transfer")
        out.append(data[pos:pos + n])
        pos += n
    if pos != end:
        raise MirrorFormatError("a mirror batch has bytes after its last event")
    return out


def _name(ann: dict, key: str, *, required: bool) -> str | None:
    v = ann.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v or len(v) > _NAME_LIMIT:
        raise MirrorFormatError(f"{key} must be a string of 1 to {_NAME_LIMIT} characters",
                                "amqp:invalid-field")
    return str(v)


def _id(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise MirrorFormatError(f"{what} must be a non-negative integer", "amqp:invalid-field")
    return int(v)


def decode_event(data: bytes) -> MirrorEvent:
    """One mirror transfer as an event; raises :class:`MirrorFormatError`."""
    secs = _sections(data)
    da = ma = body = None
    for code, start, end in secs:
        if code == _DELIVERY_ANNOTATIONS:
            da = (start, end)
        elif code == _MESSAGE_ANNOTATIONS:
            ma = (start, end)
        elif code == _AMQP_VALUE:
            body = start
    mann = _annotation_map(data, ma[0]) if ma is not None else {}
    kind = mann.get(EVENT_TYPE)
    if kind is not None:
        kind = str(kind)
        if kind not in EVENT_TYPES:
            raise MirrorFormatError(f"unknown mirror event type {kind!r}", "amqp:not-implemented")
        if body is None:
            raise MirrorFormatError(f"a {kind} event needs an amqp-value body")
        try:
            value = amqp_decode(data, body)[0].value
        except (DecodeError, AttributeError) as exc:
            raise MirrorFormatError(f"the {kind} event's body cannot be read: {exc}") from None
        origin = _name(mann, BROKER_ID, required=True)
        address = _name(mann, ADDRESS, required=kind in ("deleteAddress", "postAck"))
        queue = _name(mann, QUEUE, required=kind in ("deleteQueue", "postAck"))
        if kind == "postAck":
            reason = mann.get(ACK_REASON, 0)
            if not isinstance(reason, int) or isinstance(reason, bool) or reason not in ACK_REASONS.values():
                raise MirrorFormatError(f"{ACK_REASON} must be 0-3", "amqp:invalid-field")
            return MirrorEvent(kind, origin, _id(value, "a postAck's body"), address, queue, reason=int(reason))
        if kind in ("addAddress", "createQueue"):
            if not isinstance(value, str):
                raise MirrorFormatError(f"a {kind} event's body must be JSON text", "amqp:invalid-field")
            try:
                definition = json.loads(value)
            except ValueError as exc:
                raise MirrorFormatError(f"a {kind} event's body is not JSON: {exc}", "amqp:invalid-field") from None
            if not isinstance(definition, dict):
                raise MirrorFormatError(f"a {kind} event's body must be a JSON object", "amqp:invalid-field")
            name = definition.get("name")
            if not isinstance(name, str) or not name or len(name) > _NAME_LIMIT:
                raise MirrorFormatError(f"a {kind} event's definition needs a name", "amqp:invalid-field")
            if kind == "createQueue":
                queue = queue or name
                address = address or definition.get("address")
                if not isinstance(address, str) or not address:
                    raise MirrorFormatError("a createQueue event needs an address", "amqp:invalid-field")
            else:
                address = address or name
            return MirrorEvent(kind, origin, None, address, queue, definition=definition)
        if not isinstance(value, str) or not value:
            raise MirrorFormatError(f"a {kind} event's body must be the name", "amqp:invalid-field")
        return MirrorEvent(kind, origin, None, address or (value if kind == "deleteAddress" else None),
                           queue or (value if kind == "deleteQueue" else None))
    if da is None:
        raise MirrorFormatError("neither a mirrored send (delivery annotations) nor a control event")
    dann = _annotation_map(data, da[0])
    if MESSAGE_ID not in dann:
        raise MirrorFormatError(f"a mirrored send needs {MESSAGE_ID}", "amqp:invalid-field")
    message_id = _id(dann[MESSAGE_ID], MESSAGE_ID)
    origin = _name(dann, BROKER_ID, required=False)
    queue = _name(dann, TARGET_QUEUE, required=False)
    message = data[:da[0]] + data[da[1]:]
    address = _name(dann, DESTINATION, required=False)
    if address is None:
        try:
            address = message_to(message)
        except DecodeError as exc:
            raise MirrorFormatError(f"the message's properties cannot be read: {exc.description}") from None
    if not address and not queue:
        raise MirrorFormatError("a mirrored send names neither its address nor its queue", "amqp:invalid-field")
    return MirrorEvent("send", origin, message_id, address or None, queue, message=message)
