"""The discovery announcement and a discovery group's table (broker.wire.discovery), pure."""

import hashlib
import hmac
import re
import struct

import pytest

from broker.wire.discovery import (MAX_BACKUPS, MAX_PACKET, Announcement, DiscoveryError, DiscoveryGroup,
                                      decode_announcement, encode_announcement)

A = Announcement("node-a", "c1", "http://127.0.0.1:8161", ("amqp://127.0.0.1:5672", "amqps://127.0.0.1:5671"), 7)


def test_round_trip_plain_and_signed():
    assert decode_announcement(encode_announcement(A)) == A
    signed = encode_announcement(A, key="k")
    assert decode_announcement(signed, key="k") == A
    assert decode_announcement(signed) == A  # a keyless group reads signed packets too


def test_golden_bytes():
    data = encode_announcement(Announcement("n", "c", "", ("amqp://h:1",), 1))
    assert data.hex() == ("4c445363" "01" "00" "0000000000000001" "0001" "6e" "0001" "63" "0000" "01"
                          "000a" + b"amqp://h:1".hex())


@pytest.mark.parametrize("data, says", [
    (b"", "too short"),
    (b"XXXX\x01\x00" + bytes(8), "magic"),
    (b"LDSc\x02\x00" + bytes(8), "version"),
    (b"LDSc\x01\x04" + bytes(8), "unknown flags 0x4"),
    (b"LDSc\x01\x83" + bytes(8), "unknown flags 0x83"),
    (encode_announcement(A)[:-3], "truncated"),
    (encode_announcement(A) + b"x", "trailing"),
    (b"x" * (MAX_PACKET + 1), "over"),
])
def test_garbage_is_a_discovery_error(data, says):
    with pytest.raises(DiscoveryError) as e:
        decode_announcement(data)
    assert says in str(e.value)


def test_bad_fields():
    for bad in (Announcement("", "c", "", ("amqp://h:1",)), Announcement("n", "c", "ftp://x", ("amqp://h:1",)),
                Announcement("n", "c", "", ("tcp://h:1",))):
        with pytest.raises(DiscoveryError):
            decode_announcement(encode_announcement(bad))
    with pytest.raises(ValueError):
        encode_announcement(Announcement("n", "c", "", ()))
    with pytest.raises(ValueError):
        encode_announcement(Announcement("n" * 2000, "c", "", ("amqp://h:1",)))


def test_a_key_refuses_unsigned_and_wrongly_signed_packets():
    for data in (encode_announcement(A), encode_announcement(A, key="other")):
        with pytest.raises(DiscoveryError):
            decode_announcement(data, key="k")
    tampered = bytearray(encode_announcement(A, key="k"))
    tampered[20] ^= 1
    with pytest.raises(DiscoveryError):
        decode_announcement(bytes(tampered), key="k")


def ann(node, seq=1, connectors=("amqp://h:1",), cluster="c1"):
    return encode_announcement(Announcement(node, cluster, "", connectors, seq))


def test_the_group_adds_refreshes_changes_and_expires():
    g = DiscoveryGroup("me", refresh_timeout_s=10, cluster="c1")
    assert g.receive(ann("b", 1), now=0)[0] == "added"
    assert g.receive(ann("b", 2), now=5)[0] == "refreshed"
    assert g.receive(ann("b", 3, ("amqp://h:2",)), now=6)[0] == "changed"
    assert g.receive(ann("b", 2), now=7) is None and g.counters["stale"] == 1  # a replay
    assert g.expire(15) == [] and g.next_expiry(15) == 1
    (gone,) = g.expire(16.5)
    assert gone.node_id == "b" and g.entries == {}


def test_the_group_ignores_its_own_node_other_clusters_and_garbage():
    g = DiscoveryGroup("me", cluster="c1")
    assert g.receive(ann("me"), 0) is None and g.counters["own"] == 1
    assert g.receive(ann("x", cluster="c2"), 0) is None and g.counters["other_cluster"] == 1
    assert g.receive(b"junk", 0) is None and g.counters["garbage"] == 1
    assert g.entries == {}


def test_a_full_table_keeps_its_members():
    g = DiscoveryGroup("me", max_entries=3)
    for n in ("a", "b", "c"):
        g.receive(ann(n), 0)
    assert g.receive(ann("d"), 1) is None and g.counters["full"] == 1
    assert g.receive(ann("a", 2), 1)[0] == "refreshed"
    assert set(g.entries) == {"a", "b", "c"}


# -- HA backups (flag bit 1) -----------------------------------------------------------------------
def s16(text) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack(">H", len(raw)) + raw


def packet(flags: int, body: bytes, seq: int = 7, key: str | None = None) -> bytes:
    """A packet built by hand from the format in the module docstring."""
    data = b"LDSc" + bytes((1, flags)) + struct.pack(">Q", seq) + body
    return data + (hmac.new(key.encode(), data, hashlib.sha256).digest() if key else b"")


# the body of A up to its connectors, in the format nodes without backups have always sent
A_BODY = (s16("node-a") + s16("c1") + s16("http://127.0.0.1:8161") + b"\x02" + s16("amqp://127.0.0.1:5672")
          + s16("amqps://127.0.0.1:5671"))
BACKUPS = (("amqp://127.0.0.1:15675", "http://127.0.0.1:18164", True), ("amqps://10.0.0.2:5671", "", False),
           ("amqp://b3:1", "https://b3:8443", False), ("amqp://b4:1", "http://b4:1", True))


@pytest.mark.parametrize("key", [None, "k"])
def test_without_backups_the_packet_is_the_old_format_byte_for_byte(key):
    flags = 1 if key else 0
    assert encode_announcement(A, key=key) == packet(flags, A_BODY, key=key)
    assert A.backups == () and decode_announcement(packet(flags, A_BODY, key=key), key=key) == A


@pytest.mark.parametrize("n", range(1, MAX_BACKUPS + 1))
@pytest.mark.parametrize("key", [None, "k"])
def test_backups_round_trip(n, key):
    a = Announcement("node-a", "c1", "http://127.0.0.1:8161", ("amqp://127.0.0.1:5672",), 9, BACKUPS[:n])
    data = encode_announcement(a, key=key)
    assert data[5] == (0x02 | (0x01 if key else 0))  # the backups flag, and the signature's
    assert decode_announcement(data, key=key) == a
    if key:
        assert decode_announcement(data) == a  # a keyless group reads it too


def test_backups_golden_bytes():
    a = Announcement("n", "c", "", ("amqp://h:1",), 1, (("amqp://b:2", "http://b:3", True), ("amqps://d:4", "", False)))
    assert encode_announcement(a) == packet(
        0x02, s16("n") + s16("c") + s16("") + b"\x01" + s16("amqp://h:1")
        + b"\x02" + s16("amqp://b:2") + s16("http://b:3") + b"\x01" + s16("amqps://d:4") + s16("") + b"\x00", seq=1)


ONE = s16("amqp://b:2") + s16("http://b:3") + b"\x01"


@pytest.mark.parametrize("flags, tail, says", [
    (0x02, b"", "backups: truncated"),
    (0x02, b"\x00", "0 backups (1..4 when the backups flag is set)"),
    (0x02, b"\x05" + ONE * 5, "5 backups (1..4"),
    (0x02, b"\x02" + ONE, "backup 1 connector: truncated"),
    (0x02, b"\x01\x00", "backup 0 connector: truncated"),
    (0x02, b"\x01\x00\x20amqp://b:2", "backup 0 connector: truncated"),
    (0x02, b"\x01" + s16("") + s16("") + b"\x01", "backup 0 connector: empty"),
    (0x02, b"\x01" + s16(b"amqp://\xff:2") + s16("") + b"\x01", "backup 0 connector: not UTF-8"),
    (0x02, b"\x01" + s16("tcp://b:2") + s16("") + b"\x01", "backup 0 connector is not an amqp:// or amqps:// URL"),
    (0x02, b"\x01" + s16("amqp://b:2"), "backup 0 management URL: truncated"),
    (0x02, b"\x01" + s16("amqp://b:2") + b"\x00\x09http", "backup 0 management URL: truncated"),
    (0x02, b"\x01" + s16("amqp://b:2") + s16("ftp://b:3") + b"\x01", "backup 0 management URL is not http(s)://"),
    (0x02, b"\x01" + s16("amqp://b:2") + s16("http://b:3"), "backup 0 in-sync flag: truncated"),
    (0x02, b"\x01" + s16("amqp://b:2") + s16("http://b:3") + b"\x02", "backup 0 in-sync flag is 2 (0 or 1)"),
    (0x02, b"\x02" + ONE + s16("amqp://d:4") + s16("") + b"\xff", "backup 1 in-sync flag is 255 (0 or 1)"),
    (0x02, b"\x01" + ONE + b"x", "1 trailing bytes"),
    (0x00, b"\x01" + ONE, "trailing bytes"),   # a backups section without the flag
])
def test_a_bad_backups_section_is_a_discovery_error(flags, tail, says):
    body = s16("n") + s16("c") + s16("") + b"\x01" + s16("amqp://h:1") + tail
    for key in (None, "k"):  # the same check whether signed or not (the signature is good)
        with pytest.raises(DiscoveryError) as e:
            decode_announcement(packet(flags | (1 if key else 0), body, key=key), key=key)
        assert says in str(e.value)


def test_the_signature_covers_the_backups():
    a = Announcement("n", "c", "", ("amqp://h:1",), 1, (("amqp://b:2", "http://b:3", True),))
    data = bytearray(encode_announcement(a, key="k"))
    i = data.index(b"amqp://b:2")
    data[i + 9] ^= 1                          # another backup port
    with pytest.raises(DiscoveryError, match="signature does not match"):
        decode_announcement(bytes(data), key="k")
    data = bytearray(encode_announcement(a, key="k"))
    data[-33] = 0                             # the in-sync byte, just before the HMAC
    with pytest.raises(DiscoveryError, match="signature does not match"):
        decode_announcement(bytes(data), key="k")


def test_encoding_refuses_too_many_backups_and_oversized_packets():
    with pytest.raises(ValueError, match="at most 4 backups"):
        encode_announcement(Announcement("n", "c", "", ("amqp://h:1",), 1, BACKUPS + BACKUPS[:1]))
    big = (("amqp://" + "b" * 400 + ":1", "http://" + "m" * 400 + ":2", True),) * 2
    with pytest.raises(ValueError, match="over 1400"):
        encode_announcement(Announcement("n", "c", "", ("amqp://h:1",), 1, big))


def test_the_group_reports_changed_backups():
    def heard(seq, backups):
        return encode_announcement(Announcement("b", "c1", "http://b:1", ("amqp://h:1",), seq, backups))

    g = DiscoveryGroup("me", cluster="c1")
    assert g.receive(heard(1, ()), 0)[0] == "added"
    kind, e = g.receive(heard(2, (("amqp://x:1", "", False),)), 1)   # a backup connected
    assert kind == "changed" and e.announcement.backups == (("amqp://x:1", "", False),)
    assert g.receive(heard(3, (("amqp://x:1", "", False),)), 2)[0] == "refreshed"
    assert g.receive(heard(4, (("amqp://x:1", "", True),)), 3)[0] == "changed"    # it got in sync
    assert g.receive(heard(5, (("amqp://x:1", "http://x:2", True),)), 4)[0] == "changed"
    assert g.receive(heard(6, ()), 5)[0] == "changed"                              # it was lost
    assert g.receive(heard(7, ()), 6)[0] == "refreshed"


async def test_a_broadcast_too_big_with_its_backups_announces_the_node_without_them():
    """broker.wire.io.udp.broadcast on a real UDP socket (unicast to a receiver here): backups
    whose URLs do not fit in one datagram are left out, the node is still announced."""
    import socket as pysocket

    import trio

    from broker.wire.discovery import decode_announcement
    from broker.wire.io.udp import broadcast

    rx = trio.socket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM)
    await rx.bind(("127.0.0.1", 0))
    port = rx.getsockname()[1]
    big = tuple((f"amqp://{'h' * 400}{i}.example:5672", "", True) for i in range(4))
    counters: dict = {}
    with rx:
        async with trio.open_nursery() as n:
            n.start_soon(lambda: broadcast("127.0.0.1", port,
                                           lambda seq: Announcement("node-a", "c", "http://h:1",
                                                                    ("amqp://h:5672",), seq, big),
                                           period_s=0.05, bind_address="127.0.0.1", key="k", counters=counters))
            with trio.fail_after(5):
                data, _ = await rx.recvfrom(2048)
            n.cancel_scope.cancel()
    a = decode_announcement(data, "k")
    assert (a.node_id, a.connectors, a.backups) == ("node-a", ("amqp://h:5672",), ())
    assert counters["backups_left_out"] >= 1 and counters["sent"] >= 1


@pytest.mark.parametrize("backup, says", [
    (("tcp://h:1", "", True), "is not an amqp:// or amqps:// URL"),
    (("amqp://h:1", "ftp://h:2", True), "is not http(s)://"),
])
def test_a_backup_listeners_would_refuse_is_not_encoded(backup, says):
    # every listener would drop the whole packet (the node with it): the broadcaster sends the
    # node without its backups instead (broker.wire.io.udp.broadcast)
    with pytest.raises(ValueError, match=re.escape(says)):
        encode_announcement(Announcement("n", "c", "", ("amqp://h:5672",), 1, (backup,)))
