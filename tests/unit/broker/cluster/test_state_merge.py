"""The replicated cluster state's merge rule (broker.cluster.state): every order of arrival
converges on the same state; the cap refuses growth and says so."""

import itertools

from broker.wire.cluster import AddressNote
from broker.cluster.state import ClusterState, merge


def note(name="a", types=("anycast",), ftext=None, version=1, origin="n1", deleted=False):
    return AddressNote(name, tuple(types), ftext, version, origin, deleted)


def test_the_later_declaration_wins():
    old = note(ftext="x = 1", version=5)
    new = note(ftext="x = 2", version=6)
    assert merge(old, new) == new
    assert merge(new, old) == new


def test_ties_in_time_go_to_the_greater_node_id():
    a = note(ftext="x = 1", version=5, origin="n1")
    b = note(ftext="x = 2", version=5, origin="n2")
    assert merge(a, b) == b and merge(b, a) == b


def test_declaring_again_with_the_same_filter_adds_routing_types():
    st = ClusterState(1 << 20)
    st.offer(note(types=("anycast",), version=5))
    d = st.declaration(note(types=("multicast",), version=6, origin="n2"))
    assert d.routing_types == ("anycast", "multicast") and d.version == 6
    # another filter replaces the entry instead
    assert st.declaration(note(types=("multicast",), ftext="x = 1", version=7)).routing_types == ("multicast",)


def test_a_shared_address_stays_shared_when_declared_again():
    st = ClusterState(1 << 20)
    st.offer(AddressNote("work", ("anycast",), None, 5, "n1", False, True))
    d = st.declaration(note(name="work", types=("multicast",), version=6, origin="n2"))
    assert d.shared and d.routing_types == ("anycast", "multicast")


def test_merge_is_last_writer_wins():
    a = note(types=("anycast",), version=5)
    b = note(types=("multicast",), version=3, origin="n2")
    assert merge(a, b) == a and merge(b, a) == a


def test_a_later_tombstone_wins_and_a_later_declaration_revives():
    live = note(version=5)
    dead = note(version=6, deleted=True)
    assert merge(live, dead) == dead
    again = note(version=7, types=("multicast",))
    assert merge(dead, again) == again


def test_config_declarations_lose_to_the_management_api():
    config = note(ftext="x = 1", version=0, origin="zz")
    api = note(ftext="x = 2", version=1700000000000, origin="aa")
    assert merge(config, api) == api


def test_every_order_of_arrival_converges():
    notes = [note(ftext="x = 1", version=3, origin="n1"), note(ftext="x = 2", version=3, origin="n2"),
             note(types=("multicast",), ftext="x = 2", version=2, origin="n3"),
             note(version=4, origin="n1", deleted=True), note(ftext="x = 3", version=1, origin="n4"),
             note(name="b", version=9, origin="n2"), note(name="b", types=("multicast",), version=5, origin="n3"),
             note(name="b", types=("anycast", "multicast"), ftext="y = 1", version=8, origin="n1")]
    results = set()
    for order in itertools.permutations(notes):
        st = ClusterState(1 << 20)
        for n in order:
            st.offer(n)
        results.add(tuple(sorted((e.name, e.routing_types, e.filter_text, e.version, e.origin, e.deleted)
                                 for e in st)))
    assert len(results) == 1


def test_offer_reports_only_changes():
    st = ClusterState(1 << 20)
    n = note()
    assert st.offer(n) == n
    assert st.offer(n) is None
    assert len(st) == 1


def test_the_cap_refuses_growth():
    st = ClusterState(1024)
    made = 0
    for i in range(100):
        if st.offer(note(name=f"address-{i:04d}-" + "x" * 40)) is None:
            break
        made += 1
    assert 0 < made < 100 and st.bytes <= 1024 and st.refused == 1
    # replacing an entry with one of the same size still works at the cap
    assert st.offer(note(name="address-0000-" + "x" * 40, version=2)) is not None
    assert not st.would_fit(note(name="another-" + "y" * 60))
