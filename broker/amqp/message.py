"""Reading a message's sections from its encoded bytes (AMQP 1.0 §3.2), without decoding it.

The engine peeks at a transfer's header, expiry, ``to`` and Artemis's duplicate-id property;
the sections it needs are found by walking the encoded values by their sizes, so a large body
is never decoded (nor copied).
"""

from __future__ import annotations

import struct
import time

from broker.core.deliveries import DEFAULT_PRIORITY
from broker.core.duplicates import DUPLICATE_ID_PROPERTY, InvalidDuplicateId, duplicate_key
from broker.wire.codec import Described, UInt, ULong, decode as amqp_decode, encode as amqp_encode
from broker.wire.errors import DecodeError

def message_header(data: bytes) -> tuple[bool, int, int | None]:
    """``(durable, priority, ttl)`` from a message's header section (§3.2.1), reading only it.

    Defaults when absent: not durable, priority 4, no ttl. The common encodings are read in
    place; anything else goes through the codec; an undecodable header gives the defaults.
    """
    if len(data) < 4 or data[0] != 0x00 or data[1] != 0x53 or data[2] != 0x70:
        if len(data) > 10 and data[0] == 0x00 and data[1] == 0x80 and data[2:10] == b"\x00" * 7 + b"\x70":
            return _header_slow(data)
        return False, DEFAULT_PRIORITY, None
    code = data[3]
    if code == 0x45:  # list0
        return False, DEFAULT_PRIORITY, None
    if code != 0xC0 or len(data) < 6:
        return _header_slow(data)
    count = data[5]
    i = 6
    durable = False
    priority = DEFAULT_PRIORITY
    ttl = None
    try:
        if count >= 1:
            b = data[i]
            if b == 0x41:
                durable = True
                i += 1
            elif b in (0x42, 0x40):
                i += 1
            elif b == 0x56:
                durable = data[i + 1] == 0x01
                i += 2
            else:
                return _header_slow(data)
        if count >= 2:
            b = data[i]
            if b == 0x50:
                priority = data[i + 1]
                i += 2
            elif b == 0x40:
                i += 1
            else:
                return _header_slow(data)
        if count >= 3:
            b = data[i]
            if b == 0x70:
                ttl = int.from_bytes(data[i + 1:i + 5], "big")
            elif b == 0x52:
                ttl = data[i + 1]
            elif b == 0x43:
                ttl = 0
            elif b != 0x40:
                return _header_slow(data)
    except IndexError:
        return False, DEFAULT_PRIORITY, None
    return durable, priority, ttl


def _header_slow(data: bytes) -> tuple[bool, int, int | None]:
    try:
        first, _ = amqp_decode(data, 0)
    except DecodeError:
        return False, DEFAULT_PRIORITY, None
    if not (isinstance(first, Described) and isinstance(first.value, list)):
        return False, DEFAULT_PRIORITY, None
    f = list(first.value[:3]) + [None] * 3
    durable = f[0] is True
    priority = f[1] if isinstance(f[1], int) and not isinstance(f[1], bool) else DEFAULT_PRIORITY
    ttl = f[2] if isinstance(f[2], int) and not isinstance(f[2], bool) else None
    return durable, priority, ttl


def message_absolute_expiry(data: bytes) -> int | None:
    """The properties' ``absolute-expiry-time`` (§3.2.4, ms since the epoch), or None.

    Sections before the properties are skipped by their size; the properties list is decoded
    only when it is long enough to hold the field (index 8), which most messages' are not.
    """
    pos = 0
    n = len(data)
    try:
        while pos < n:
            code, vstart = _section_code(data, pos)
            if code == 0x73:
                c = data[vstart]
                if c == 0xC0:
                    count = data[vstart + 2]
                elif c == 0xD0:
                    count = struct.unpack_from(">I", data, vstart + 5)[0]
                else:
                    return None
                if count <= 8:
                    return None
                value, _ = amqp_decode(data, vstart)
                t = value[8] if isinstance(value, list) and len(value) > 8 else None
                return int(t) if isinstance(t, int) and not isinstance(t, bool) and t > 0 else None
            if code in (0x70, 0x71, 0x72):
                pos = _skip_value(data, vstart)
                continue
            return None
    except (IndexError, struct.error, DecodeError):
        return None
    return None


def message_meta(data: bytes) -> tuple[bool, int, float]:
    """``(durable, priority, expires)`` of a message arriving now: ``expires`` in ms since the
    epoch (0: never), from ``absolute-expiry-time``, else the header's ``ttl`` counted from now
    (§3.2.1; Artemis sets the expiration on arrival)."""
    durable, priority, ttl = message_header(data)
    expires = message_absolute_expiry(data) or 0
    if ttl is not None and not expires:
        expires = time.time() * 1000.0 + ttl
    return durable, priority, expires


_HEADER_CODE = 0x70
_HEADER_SYMBOL = "amqp:header:list"


def with_delivery_count(data: bytes, count: int) -> bytes:
    """The message with the header's delivery-count set (redeliveries only, §3.2.1).

    Only the header section is decoded and re-encoded; every other section passes through
    byte for byte, so a section we cannot (or need not) read — a string that is not valid
    UTF-8, say — reaches the consumer as the producer sent it.
    """
    try:
        first, end = amqp_decode(data, 0)
    except DecodeError:
        first, end = None, 0
    if (isinstance(first, Described) and isinstance(first.value, list)
            and (first.descriptor == _HEADER_CODE or first.descriptor == _HEADER_SYMBOL)):
        fields = list(first.value[:5]) + [None] * (5 - min(len(first.value), 5))
        rest = data[end:]
    else:
        fields = [None] * 5
        rest = data
    fields[3] = False  # first-acquirer
    fields[4] = UInt(count)
    return amqp_encode(Described(ULong(_HEADER_CODE), fields)) + rest


_SECTION_SYMBOLS = {"amqp:header:list": 0x70, "amqp:delivery-annotations:map": 0x71,
                    "amqp:message-annotations:map": 0x72, "amqp:properties:list": 0x73}


def _section_code(data: bytes, pos: int) -> tuple[int | None, int]:
    """The descriptor code of the section at ``pos`` (a described value) and where its value starts."""
    if data[pos] != 0x00:
        raise DecodeError(f"no section at offset {pos}")
    c = data[pos + 1]
    if c == 0x53:
        return data[pos + 2], pos + 3
    if c == 0x80:
        return int.from_bytes(data[pos + 2:pos + 10], "big"), pos + 10
    if c in (0xA3, 0xB3):
        desc, end = amqp_decode(data, pos + 1)
        return _SECTION_SYMBOLS.get(str(desc)), end
    raise DecodeError(f"bad section descriptor at offset {pos}")


def _skip_value(data: bytes, pos: int) -> int:
    """Where the encoded value at ``pos`` ends, reading only its size (strings inside unread)."""
    c = data[pos]
    if c in (0x40, 0x45):
        return pos + 1
    if c in (0xC0, 0xC1):
        return pos + 2 + data[pos + 1]
    if c in (0xD0, 0xD1):
        return pos + 5 + struct.unpack_from(">I", data, pos + 1)[0]
    return amqp_decode(data, pos)[1]


def message_to(data: bytes) -> str | None:
    """The properties ``to`` of a message (anonymous-relay producers, §3.2.4).

    Only the properties section is decoded (header and annotations are skipped by their
    size); a ``to`` that is not a valid string raises ``DecodeError``.
    """
    pos = 0
    n = len(data)
    try:
        while pos < n:
            code, vstart = _section_code(data, pos)
            if code == 0x73:
                value, _ = amqp_decode(data, vstart)
                if not isinstance(value, list):
                    raise DecodeError("properties section is not a list")
                to = value[2] if len(value) > 2 else None
                if to is not None and not isinstance(to, str):
                    raise DecodeError("properties 'to' is not a string")
                return to
            if code in (0x70, 0x71, 0x72):
                pos = _skip_value(data, vstart)
                continue
            return None  # application-properties, body or footer: no properties section
    except (IndexError, struct.error):
        raise DecodeError("message sections are truncated") from None
    return None


#: the key of Artemis's duplicate-id application property, as it is encoded (a str8 key's bytes);
#: a message without these bytes anywhere cannot carry the property, so only the others are parsed
DUPLICATE_ID_NEEDLE = DUPLICATE_ID_PROPERTY.encode()

# AMQP 1.0 §1.6: the size of an encoded value follows from its constructor's subcategory
_FIXED_WIDTH = {0x4: 0, 0x5: 1, 0x6: 2, 0x7: 4, 0x8: 8, 0x9: 16}
_TYPE_NAMES = {0x40: "null", 0x41: "boolean", 0x42: "boolean", 0x56: "boolean", 0x50: "ubyte", 0x51: "byte",
               0x60: "ushort", 0x61: "short", 0x70: "uint", 0x52: "uint", 0x43: "uint", 0x71: "int", 0x54: "int",
               0x80: "ulong", 0x53: "ulong", 0x44: "ulong", 0x81: "long", 0x55: "long", 0x72: "float",
               0x82: "double", 0x74: "decimal32", 0x84: "decimal64", 0x94: "decimal128", 0x73: "char",
               0x83: "timestamp", 0x98: "uuid", 0xA3: "symbol", 0xB3: "symbol", 0x45: "list", 0xC0: "list",
               0xD0: "list", 0xC1: "map", 0xD1: "map", 0xE0: "array", 0xF0: "array", 0x00: "described value"}


def _value_end(data: bytes, pos: int) -> int:
    """Where the encoded value at ``pos`` ends, from its constructor alone (nothing inside is
    decoded, so a string that is not valid UTF-8 is skipped like any other)."""
    left = 1  # values still to skip: a described value is two (its descriptor, then itself)
    n = len(data)
    while left:
        c = data[pos]
        if c == 0x00:
            pos += 1
            left += 1
            continue
        sub = c >> 4
        width = _FIXED_WIDTH.get(sub)
        if width is not None:
            pos += 1 + width
        elif sub in (0xA, 0xC, 0xE):
            pos += 2 + data[pos + 1]
        elif sub in (0xB, 0xD, 0xF):
            pos += 5 + struct.unpack_from(">I", data, pos + 1)[0]
        else:
            raise DecodeError(f"unknown constructor 0x{c:02x}")
        if pos > n:
            raise DecodeError("a value runs past the end of the message")
        left -= 1
    return pos


def message_sections(data: bytes) -> list[tuple[int | None, int, int]]:
    """``(descriptor code, start, end)`` of each section of an encoded message, read from the
    constructors alone (nothing inside is decoded); raises ``DecodeError``."""
    out = []
    pos, n = 0, len(data)
    try:
        while pos < n:
            code, vstart = _section_code(data, pos)
            end = _value_end(data, vstart)
            out.append((code, pos, end))
            pos = end
    except (IndexError, struct.error) as exc:
        raise DecodeError(f"message sections are truncated ({exc})") from None
    return out


#: the section walkers under public names, for the formats built on messages (the mirror's)
section_code = _section_code
value_end = _value_end

_SEARCH_WHOLE_UP_TO = 4096  # bytes: up to this, one search of the whole message costs less than a walk


def may_carry_duplicate_id(data: bytes) -> bool:
    """Whether the message may carry ``_AMQ_DUPL_ID``: its key's bytes appear in it — for a large
    message, in its application properties (found by skipping the sections before them by their
    size), so the body is not searched. Only these messages pay for :func:`message_duplicate_id`."""
    n = len(data)
    if n <= _SEARCH_WHOLE_UP_TO:
        return DUPLICATE_ID_NEEDLE in data
    pos = 0
    try:
        while pos < n:
            code, vstart = _section_code(data, pos)
            end = _value_end(data, vstart)
            if code == 0x74:
                return data.find(DUPLICATE_ID_NEEDLE, vstart, end) >= 0
            if code not in (0x70, 0x71, 0x72, 0x73):
                return False  # the body: no application properties
            pos = end
    except (IndexError, struct.error, DecodeError):
        return DUPLICATE_ID_NEEDLE in data  # not walkable: as a small one (the reader says why)
    return False


def body_duplicate_key(data: bytes) -> bytes | None:
    """The duplicate-cache key (``broker.core.duplicates.duplicate_key``) of a stored message's
    ``_AMQ_DUPL_ID``, or None when it has none or it cannot be read (a stored message was checked
    when it came in; one whose id is unreadable is simply not tracked)."""
    if not may_carry_duplicate_id(data):
        return None
    try:
        found = message_duplicate_id(data)
    except (InvalidDuplicateId, DecodeError):
        return None
    return None if found is None else duplicate_key(found[0], string=found[1])


def message_duplicate_id(data: bytes) -> tuple[bytes, bool] | None:
    """The application property ``_AMQ_DUPL_ID`` (§3.2.5) of a message: ``(raw bytes, is_string)``,
    or None when the message has none (or it is null). Artemis reads a string or binary id;
    any other type raises :class:`~broker.core.duplicates.InvalidDuplicateId` (Artemis's cast of
    it fails, and so does the send); sections that cannot be walked raise ``DecodeError``.

    The sections before the application properties are skipped by their size; in the map, only
    the keys are compared (as bytes) and only the value of ``_AMQ_DUPL_ID`` is read."""
    pos = 0
    n = len(data)
    try:
        while pos < n:
            code, vstart = _section_code(data, pos)
            if code in (0x70, 0x71, 0x72, 0x73):
                pos = _value_end(data, vstart)
                continue
            if code != 0x74:
                return None  # body or footer: no application properties
            c = data[vstart]
            if c == 0xC1:
                count, p, end = data[vstart + 2], vstart + 3, vstart + 2 + data[vstart + 1]
            elif c == 0xD1:
                size, count = struct.unpack_from(">II", data, vstart + 1)
                p, end = vstart + 9, vstart + 5 + size
            elif c == 0x40:
                return None
            else:
                raise DecodeError("application-properties is not a map")
            if end > n:
                raise DecodeError("application-properties runs past the end of the message")
            klen = len(DUPLICATE_ID_NEEDLE)
            for _ in range(count // 2):
                kc = data[p]
                if kc == 0xA1:
                    kl, ks = data[p + 1], p + 2
                elif kc == 0xB1:
                    kl, ks = struct.unpack_from(">I", data, p + 1)[0], p + 5
                else:  # §3.2.5: the keys are strings; Artemis's decoder would fail on it too
                    raise DecodeError("an application-properties key is not a string")
                vpos = ks + kl
                p = _value_end(data, vpos)
                if p > end:
                    raise DecodeError("application-properties is truncated")
                if kl == klen and data.startswith(DUPLICATE_ID_NEEDLE, ks):
                    vc = data[vpos]
                    if vc in (0xA1, 0xA0):    # str8-utf8, vbin8
                        return data[vpos + 2:p], vc == 0xA1
                    if vc in (0xB1, 0xB0):    # str32-utf8, vbin32
                        return data[vpos + 5:p], vc == 0xB1
                    if vc == 0x40:
                        return None
                    raise InvalidDuplicateId(f"{DUPLICATE_ID_PROPERTY} must be a string or binary, "
                                             f"not {_TYPE_NAMES.get(vc, f'type 0x{vc:02x}')}")
            return None
    except (IndexError, struct.error):
        raise DecodeError("message sections are truncated") from None
    return None
