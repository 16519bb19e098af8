"""Discovery packets: any bytes decode or raise DiscoveryError (never another exception); a
group fed any bytes only counts them."""

from hypothesis import given
from hypothesis import strategies as st

from broker.cluster.discovery import Announcement, DiscoveryError, DiscoveryGroup, decode_announcement, encode_announcement

texts = st.text(min_size=1, max_size=30)
announcements = st.builds(Announcement, texts, texts, st.just("http://h:1") | st.just(""),
                          st.lists(st.sampled_from(["amqp://h:1", "amqps://h:2"]), min_size=1, max_size=8).map(tuple),
                          st.integers(0, 2**64 - 1))


@given(a=announcements, key=st.none() | st.text(min_size=1, max_size=10))
def test_valid_announcements_round_trip(a, key):
    assert decode_announcement(encode_announcement(a, key), key) == a


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


@given(data=st.binary(max_size=1500))
def test_random_bytes_are_counted_not_raised(data):
    g = DiscoveryGroup("me")
    g.receive(data, 0.0)
    assert g.counters["received"] == 1
