"""The discovery announcement and a discovery group's table (broker.cluster.discovery), pure."""

import pytest

from broker.cluster.discovery import (MAX_PACKET, Announcement, DiscoveryError, DiscoveryGroup, decode_announcement,
                                      encode_announcement)

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
    (b"LDSc\x01\x02" + bytes(8), "flags"),
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
