"""The recommendation heuristic (spark/placement.py, pure Python): the cost model by hand, the
hand-worked instance of tests/spark/gravity_logs.py, and the heuristic against exhaustive search
on seeded random small instances."""

from __future__ import annotations

import math
import random

import pytest

from spark.placement import KeyLoad, address_cross, evaluate, exhaustive, recommend, skew
from spark.report import local_target_filter
from tests.spark.gravity_logs import HAND, N1, N2, N3

BROKERS = [N1, N2, N3]


@pytest.mark.parametrize("produced, consumed, cross", [
    ([700, 0, 0], [0, 500, 0], 700),          # producer alone, consumer elsewhere: all of it
    ([0, 300, 0], [0, 150, 150], 150),        # round-robin over the two consuming brokers: half crosses
    # round-robin sends 150 to n3, whose consumers take 100: the other 50 are redistributed to n2
    ([0, 300, 0], [0, 200, 100], 150 + 50),
    # the workload's ledger split over two brokers: 2 producers + 1 consumer on n1, 1 + 2 on n2 (100
    # each): each receives 150 by round-robin (100 + 50 forwarded), n1 redistributes its 50 surplus
    ([200, 100, 0], [100, 200, 0], 100 + 50 + 50),
    ([100, 100, 100], [1, 1, 1], 200),        # everyone everywhere: 2/3 crosses; no demand to redistribute to
    ([0, 0, 300], [100, 200, 0], 300 + 50),   # all forwarded (no consumer at home), then n1's surplus to n2
    ([500, 0, 0], [9, 0, 0], 0),              # co-located
    ([500, 0, 0], [0, 0, 0], 0),              # no consumer: it stays (backlog)
])
def test_address_cross(produced, consumed, cross):
    assert math.isclose(address_cross(produced, consumed), cross)


def test_skew():
    assert skew([3, 3, 2]) == pytest.approx(3 / (8 / 3) - 1)
    assert skew([0, 0]) == 0.0 and skew([]) == 0.0
    assert skew([5, 5, 5]) == 0.0


def _hand_keys() -> list[KeyLoad]:
    use = {"xp": {"x": (700, 0)}, "xc": {"x": (0, 500)}, "yp": {"y": (300, 0)}, "yc": {"y": (0, 300)},
           "zp": {"z": (100, 0)}, "zc": {"z": (0, 100)}}
    return [KeyLoad(k, HAND["connections"][k], use[k], HAND["current"][k]) for k in use]


@pytest.mark.parametrize("case", ["tight", "loose"])
def test_hand_instance(case):
    want = HAND[case]
    for solve in (recommend, exhaustive):
        got = solve(BROKERS, _hand_keys(), want["max_skew"])
        assert dict(got.assignment) == want["assignment"], solve.__name__
        assert math.isclose(got.cross_bytes, want["cross"])
        assert list(got.moved) == want["moved"]
        assert got.skew_connections == pytest.approx(want["skew"]["connections"])
        assert got.skew_bytes == pytest.approx(want["skew"]["bytes"])
        assert got.within_bound


def test_today_evaluated_by_the_model():
    today = evaluate(BROKERS, _hand_keys(), HAND["current"])
    # the model charges all of x (no consumer on n1) and, with yc wholly on n2 now, nothing for y
    assert today.cross_bytes == 700 and today.moved == ()


def test_immovable_traffic_stays_and_counts():
    keys = [KeyLoad("a", 1, {"q": (100, 0)}, N1), KeyLoad("b", 1, {"q": (0, 100)}, N2),
            KeyLoad("(no key) on n3", 4, {"q": (0, 50)}, N3, movable=False)]
    got = recommend(BROKERS, keys, 10.0)
    assert "(no key) on n3" not in got.assignment
    assert got.connections[N3] >= 4
    # with a consumer stuck on n3, a and b go there too: nothing crosses
    assert dict(got.assignment) == {"a": N3, "b": N3} and got.cross_bytes == 0


def test_an_impossible_bound_gives_the_least_violation():
    keys = [KeyLoad("big", 1, {"q": (1000, 0)}, N1), KeyLoad("s1", 1, {"r": (10, 0)}, N2),
            KeyLoad("s2", 1, {"s": (10, 0)}, N3)]
    got = recommend(BROKERS, keys, 0.1)
    best = exhaustive(BROKERS, keys, 0.1)
    assert not got.within_bound and got.violation == pytest.approx(best.violation)


def _random_instance(rng: random.Random) -> tuple[list[KeyLoad], float]:
    nk, ng = rng.randint(4, 8), rng.randint(1, 4)
    keys = []
    for i in range(nk):
        g = rng.randrange(ng)
        use = {f"a{g}": (rng.choice([0, rng.randint(1, 100) * 100]), rng.choice([0, rng.randint(1, 100) * 100]))}
        if rng.random() < 0.2:
            use[f"a{rng.randrange(ng)}"] = (rng.randint(0, 50) * 100, rng.randint(0, 50) * 100)
        keys.append(KeyLoad(f"k{i}", rng.randint(1, 3), use, rng.choice(BROKERS)))
    return keys, rng.choice([0.1, 0.3, 1.0])


def test_heuristic_against_exhaustive_search_on_small_inputs():
    """400 seeded random instances (4–8 keys, 1–4 address groups, 3 brokers, bounds 0.1/0.3/1.0)
    against the exhaustive optimum: the heuristic always reaches the optimum's violation (within
    bound whenever any assignment is); within bound it finds the optimum's cross-broker bytes in
    at least 99 % of instances and is never more than 5 % above it (measured: all 400 here, and
    1,200 of 1,200 on four other seeds)."""
    rng = random.Random(20260102)
    exact, near = 0, []
    for i in range(400):
        keys, s = _random_instance(rng)
        h, e = recommend(BROKERS, keys, s), exhaustive(BROKERS, keys, s)
        assert math.isclose(h.violation, e.violation, abs_tol=1e-9), (i, h, e)
        if not e.within_bound or math.isclose(h.cross_bytes, e.cross_bytes, abs_tol=1e-6):
            exact += 1
        else:
            near.append(h.cross_bytes / e.cross_bytes)
    assert exact >= 396, (exact, near)
    assert all(r <= 1.05 for r in near), near


def test_heuristic_scales_to_many_keys():
    """5,000 keys in 1,000 groups over 3 brokers: within bound, and far below today's random
    placement (exact optimum unknown; every group fits whole, so 0 is a lower bound)."""
    rng = random.Random(7)
    keys = []
    for g in range(1000):
        size = rng.choice([2, 4, 8])
        for j in range(size):
            prod = j % 2 == 0
            b = rng.randint(1, 20) * 1000
            keys.append(KeyLoad(f"g{g}-{j}", 1, {f"a{g}": (b, 0) if prod else (0, b)}, rng.choice(BROKERS)))
    today = evaluate(BROKERS, keys, {k.key: k.current for k in keys})
    got = recommend(BROKERS, keys, 0.1)
    assert got.within_bound
    assert got.cross_bytes <= 0.05 * today.cross_bytes


def test_local_target_filter_escapes_keys():
    rx = local_target_filter(["a.b", "c+d", "(e)"])
    import re
    assert all(re.fullmatch(rx, k) for k in ["a.b", "c+d", "(e)"])
    assert not any(re.fullmatch(rx, k) for k in ["aXb", "ccd", "e", "a.bc"])
    assert local_target_filter([]) is None
