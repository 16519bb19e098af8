"""Discovery packets: any bytes decode or raise DiscoveryError (never another exception); a
group fed any bytes only counts them. Announcements with HA backups round-trip, and packets
whose backups section is mutated or cut anywhere still decode or raise DiscoveryError."""

import hashlib
import hmac

from hypothesis import given
from hypothesis import strategies as st

from broker.wire.discovery import (FLAG_BACKUPS, MAX_BACKUPS, Announcement, DiscoveryError, DiscoveryGroup,
                                      decode_announcement, encode_announcement)

texts = st.text(min_size=1, max_size=30)
backup_connectors = st.builds(lambda scheme, rest: f"{scheme}://{rest}", st.sampled_from(["amqp", "amqps"]),
                              st.text(max_size=20))
backup_mgmt = st.just("") | st.builds(lambda scheme, rest: f"{scheme}://{rest}", st.sampled_from(["http", "https"]),
                                      st.text(max_size=20))
backups = st.lists(st.tuples(backup_connectors, backup_mgmt, st.booleans()), max_size=MAX_BACKUPS).map(tuple)
announcements = st.builds(Announcement, texts, texts, st.just("http://h:1") | st.just(""),
                          st.lists(st.sampled_from(["amqp://h:1", "amqps://h:2"]), min_size=1, max_size=8).map(tuple),
                          st.integers(0, 2**64 - 1), backups)


@given(a=announcements, key=st.none() | st.text(min_size=1, max_size=10))
def test_valid_announcements_round_trip(a, key):
    data = encode_announcement(a, key)
    assert bool(data[5] & FLAG_BACKUPS) == bool(a.backups)
    assert decode_announcement(data, key) == a


@given(a=announcements, cut=st.integers(0, 200), flip=st.integers(0, 255), at=st.integers(0, 300))
def test_mutated_packets_decode_or_raise_discovery_error(a, cut, flip, at):
    data = bytearray(encode_announcement(a))
    if at < len(data):
        data[at] ^= flip
    data = bytes(data[:len(data) - cut % (len(data) + 1)])
    try:
        decode_announcement(data)
    except DiscoveryError:
        pass


@given(a=announcements, tail=st.binary(max_size=200), key=st.none() | st.just("k"))
def test_any_backups_section_decodes_or_raises_discovery_error(a, tail, key):
    """Whatever follows the connectors with the backups flag set (signed, so only the section
    is wrong, not the signature)."""
    body = bytearray(encode_announcement(Announcement(a.node_id, a.cluster, a.management_url, a.connectors,
                                                      a.sequence)))
    body[5] |= FLAG_BACKUPS | (1 if key else 0)
    data = bytes(body) + tail
    if key:
        data += hmac.new(key.encode(), data, hashlib.sha256).digest()
    try:
        got = decode_announcement(data, key)
    except DiscoveryError:
        return
    assert 1 <= len(got.backups) <= MAX_BACKUPS


@given(data=st.binary(max_size=1500))
def test_random_bytes_are_counted_not_raised(data):
    g = DiscoveryGroup("me")
    g.receive(data, 0.0)
    assert g.counters["received"] == 1


@given(data=st.binary(max_size=1500))
def test_random_bytes_after_a_valid_header_are_counted_not_raised(data):
    g = DiscoveryGroup("me")
    g.receive(b"LDSc\x01" + data, 0.0)
    assert g.counters["received"] == 1 and g.counters["garbage"] + g.counters["own"] + len(g.entries) == 1


@given(a=announcements, data=st.binary(min_size=1, max_size=200))
def test_feeding_a_packet_byte_by_byte_only_ever_raises_discovery_error(a, data):
    packet = encode_announcement(a) + data
    for n in range(len(packet)):     # every prefix: as if the datagram were cut there
        try:
            decode_announcement(packet[:n])
        except DiscoveryError:
            pass
