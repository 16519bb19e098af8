"""The data-gravity job in real PySpark (local[2], one shared session) on small log sets whose
answers were worked out by hand (tests/spark/gravity_logs.py): rotated routing logs, malformed
and unknown-version lines, a key that moved broker mid-log, the recommendation under a tight and
a loose skew bound, and every output file."""

from __future__ import annotations

import json
import math

import pytest

from router.core.filters import Filter
from router.service import load_pins
from spark import transforms as T
from spark.jobs.gravity import UsageError, parse_args, run
from tests.spark.gravity_logs import HAND, N1, N2, N3, act, close, route, write, write_hand_case

pytestmark = pytest.mark.spark


def _job(spark, tmp_path, *flags: str):
    logs = write_hand_case(tmp_path / "logs")
    opts = parse_args([str(logs / "router"), str(logs / "brokers"), "--out", str(tmp_path / "out"),
                       "--bad-lines", str(tmp_path / "bad"), "--quiet", *flags])
    return run(spark, opts)


def _close(a, b):
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


@pytest.fixture(scope="module")
def tight(spark, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tight")
    return tmp, _job(spark, tmp, "--max-skew", str(HAND["tight"]["max_skew"]))


def test_lines_counted_per_file_and_set_aside(tight):
    tmp, s = tight
    assert s["lines_read"] == HAND["lines_read"]
    assert s["lines_malformed"] == HAND["lines_malformed"]
    assert s["lines_unknown_version"] == HAND["lines_unknown_version"]
    per_file = {f["file"].split("/logs/", 1)[1].replace("router/", "").replace("brokers/", ""):
                (f["lines"], f["malformed"]) for f in s["files"]}
    assert per_file == HAND["per_file"]
    bad = [json.loads(line) for p in sorted((tmp / "bad").glob("*.json")) for line in p.read_text().splitlines()]
    reasons = sorted(b["reason"] for b in bad)
    assert reasons == sorted(["invalid JSON or a mistyped field", "invalid JSON or a mistyped field",
                              "unknown routing-log version v=2", "missing or mistyped key_transformed",
                              "unknown direction teleport", "missing or mistyped window_start"])
    assert {b["line"] for b in bad} >= {"{this is not json"}
    assert all(b["file"].startswith(str(tmp)) for b in bad)


def test_measures_match_the_hand_answers(tight):
    _, s = tight
    assert s["router"] == "main" and s["key_type"] == "CLIENT_ID"
    assert s["brokers"] == [N1, N2, N3]
    assert s["broker_names"] == {N1: "broker-1", N2: "broker-2", N3: "broker-3"}
    assert {a["address"]: a["home_node_id"] for a in s["addresses"]} == HAND["homes"]
    rows = {r["key"]: r for r in s["per_key"]}
    assert s["keys"] == len(rows) == 6            # ghost (refused) and qq (malformed) are not keys
    for k, g in HAND["gravity"].items():
        assert _close(rows[k]["gravity_score"], g), (k, rows[k])
        assert rows[k]["bytes"] == HAND["bytes"][k]
        assert rows[k]["current_node_id"] == HAND["current"][k]
        assert rows[k]["connections"] == HAND["connections"][k]
        assert rows[k]["moves"] == HAND["moves"][k]
    assert rows["yc"]["stickiness"] == 0.0 and rows["xp"]["stickiness"] == 1.0
    assert s["stickiness"] == 0.5                 # 2 consecutive pairs (xp, yc), 1 change
    assert s["cross_broker_bytes"] == HAND["cross_broker_bytes"]
    got = {(m["from"], m["to"]): m["bytes"] for m in s["bytes_moved"]}
    assert got == HAND["matrix"]
    assert s["bytes_moved_matrix"] == {"brokers": [N1, N2, N3], "bytes": [[0, 500, 0], [0, 0, 100], [0, 0, 0]]}
    assert _close(s["modelled_cross_broker_bytes"], HAND["modelled_cross_broker_bytes"])
    for what in ("connections", "bytes"):
        assert _close(s["skew"][what], HAND["skew"][what])
    assert [(p["connections"], p["bytes"]) for p in s["per_broker"]] == [(2, 700), (3, 1000), (3, 300)]


def test_tight_bound_splits_the_big_group(tight):
    tmp, s = tight
    want = HAND["tight"]
    rows = {r["key"]: r for r in s["per_key"]}
    assert {k: r["recommended_node_id"] for k, r in rows.items()} == want["assignment"]
    assert sorted(k for k, r in rows.items() if r["moved"]) == want["moved"] and s["keys_moved"] == 1
    assert _close(s["recommended_cross_broker_bytes"], want["cross"])
    for what in ("connections", "bytes"):
        assert _close(s["recommended_skew"][what], want["skew"][what])
    assert s["recommended_within_bound"] is True
    # pins.jsonl is the router's own format: its parser reads it strictly, every key once
    pins = load_pins(tmp / "out" / "pins.jsonl")
    assert pins.exact == want["assignment"] and not pins.patterns
    assert [json.loads(line) for line in (tmp / "out" / "pins.jsonl").read_text().splitlines()][0] == \
        {"key": "xc", "node_id": N3}
    # filters.json: each broker's regex full-matches exactly its keys (the router's Filter)
    flt = json.loads((tmp / "out" / "filters.json").read_text())
    assert sorted(flt) == [N1, N2, N3]
    for node, entry in flt.items():
        f = Filter(entry["local_target_filter"])
        mine = {k for k, n in want["assignment"].items() if n == node}
        assert entry["keys"] == sorted(mine)
        for k in list(want["assignment"]) + ["x", "xpx", "y", ""]:
            assert f.matches(k) == (k in mine), (node, k)
    # summary.json on disk is the summary returned; report.html shows the three PNGs
    on_disk = json.loads((tmp / "out" / "summary.json").read_text())
    assert on_disk["recommended_cross_broker_bytes"] == s["recommended_cross_broker_bytes"]
    assert on_disk["elapsed_s"] > 0
    html = (tmp / "out" / "report.html").read_text()
    for png in ("gravity_scores.png", "bytes_moved.png", "broker_load.png"):
        assert f'src="{png}"' in html
        assert (tmp / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Keys that move (1)" in html


def test_loose_bound_keeps_every_group_whole(spark, tmp_path):
    s = _job(spark, tmp_path, "--max-skew", str(HAND["loose"]["max_skew"]))
    want = HAND["loose"]
    rows = {r["key"]: r for r in s["per_key"]}
    assert {k: r["recommended_node_id"] for k, r in rows.items()} == want["assignment"]
    assert sorted(k for k, r in rows.items() if r["moved"]) == want["moved"]
    assert s["recommended_cross_broker_bytes"] == want["cross"]
    for what in ("connections", "bytes"):
        assert _close(s["recommended_skew"][what], want["skew"][what])


def _parsed(spark, lines):
    return T.parse_lines(spark.createDataFrame([("f", line) for line in lines], ["file", "value"]))


def test_join_by_the_key_field_and_time(spark):
    """USER_NAME keys: the key filter changed mid-log (user u1 → key team-a, later team-b), so the
    same user's records go to the key in force at their window start; a record before any
    decision takes the first one after; a user without a decision is unattributed."""
    lines = [
        route(10, "team-a", N1, user="u1", key_type="USER_NAME", cid="c1"),
        route(100, "team-b", N2, user="u1", key_type="USER_NAME", cid="c2"),
        route(20, "team-c", N3, user="u2", key_type="USER_NAME", cid="c3"),
        act(N1, "c1", "a", "produce", 10, 5, 8, user="u1"),       # before any decision: first after
        act(N1, "c1", "a", "produce", 20, 30, 40, user="u1"),     # team-a
        act(N2, "c2", "a", "consume", 40, 110, 120, user="u1"),   # team-b
        act(N3, "c3", "b", "produce", 80, 30, 40, user="u2"),     # team-c
        act(N3, "c9", "b", "produce", 160, 30, 40, user="u9"),    # no decision: unattributed
    ]
    p = _parsed(spark, lines)
    usage = {(r["key"], r["address"], r["node"]): (r["produce_bytes"], r["consume_bytes"])
             for r in T.key_usage(T.attribute(T.routes(p), T.activity(p), "USER_NAME")).collect()}
    assert usage == {("team-a", "a", N1): (30, 0), ("team-b", "a", N2): (0, 40), ("team-c", "b", N3): (80, 0),
                     (None, "b", N3): (160, 0)}
    # SOURCE_IP: the client host of the record's source (IPv6 in brackets) is the join field
    lines = [route(10, "2001:db8::1", N1, host="2001:db8::1", key_type="SOURCE_IP"),
             act(N1, "c1", "a", "produce", 7, 20, 30, source="[2001:db8::1]:5555")]
    p = _parsed(spark, lines)
    got = [(r["key"], r["produce_bytes"]) for r in T.key_usage(T.attribute(T.routes(p), T.activity(p),
                                                                           "SOURCE_IP")).collect()]
    assert got == [("2001:db8::1", 7)]


def test_since_until_select_decisions_and_windows(spark):
    import datetime as dt

    lines = [route(10, "k1", N1), route(100, "k2", N2),
             act(N1, "k1", "a", "produce", 5, 10, 20), act(N2, "k2", "a", "produce", 9, 100, 110)]
    p = _parsed(spark, lines)
    since = dt.datetime(2026, 1, 2, 0, 1, 0)
    assert [r["key"] for r in T.routes(p, since=since).collect()] == ["k2"]
    assert [r["bytes"] for r in T.activity(p, since=since).collect()] == [9]
    assert [r["bytes"] for r in T.activity(p, until=since).collect()] == [5]


def test_several_routers_in_the_logs_need_a_choice(spark, tmp_path):
    write(tmp_path / "routing.log", [route(1, "k", N1, router="a"), route(2, "k", N2, router="b")])
    opts = parse_args([str(tmp_path / "routing.log"), "--out", str(tmp_path / "out"), "--quiet"])
    with pytest.raises(UsageError, match="routers a, b: choose one with --router"):
        run(spark, opts)
    opts = parse_args([str(tmp_path / "routing.log"), "--out", str(tmp_path / "out"), "--quiet", "--router", "b"])
    s = run(spark, opts)
    assert [(r["key"], r["current_node_id"]) for r in s["per_key"]] == [("k", N2)]


def test_mangled_lines_are_set_aside_never_fatal(spark):
    """600 seeded mutations of good lines of both kinds (cut short, a byte changed, a field's type
    changed, fields dropped): every one is either read as a good line or set aside with a reason,
    and the measures still run over the good ones."""
    import random

    rng = random.Random(13)
    good = [route(1, "k1", N1), route(2, "k2", N2), close(3, "k1", N1, "c"),
            act(N1, "k1", "a", "produce", 10, 0, 10), act(N1, None, "a", "forward", 10, 0, 10, peer=N2)]
    lines = []
    for i in range(600):
        line = rng.choice(good)
        how = i % 4
        if how == 0:
            line = line[:rng.randrange(len(line))]
        elif how == 1:
            j = rng.randrange(len(line))
            line = line[:j] + rng.choice('{}[]":,x0 \\') + line[j + 1:]
        elif how == 2:
            rec = json.loads(line)
            k = rng.choice(sorted(rec))
            rec[k] = rng.choice([None, "text", 12, 1.5, [], {}, True])
            line = json.dumps(rec)
        else:
            rec = json.loads(line)
            for k in rng.sample(sorted(rec), rng.randint(1, 4)):
                rec.pop(k)
            line = json.dumps(rec)
        lines.append(line)
    p = _parsed(spark, lines)
    rows = p.select("reason").collect()
    assert len(rows) == sum(1 for line in lines if line.strip())
    bad = sum(1 for r in rows if r["reason"] is not None)
    assert 0 < bad < len(rows)
    assert all(r["reason"] for r in rows if r["reason"] is not None)
    assert {r["key_type"] for r in T.routes(p).select("key_type").distinct().collect()} <= {"CLIENT_ID"}
    T.key_usage(T.attribute(T.routes(p), T.activity(p), "CLIENT_ID")).collect()
    T.moved_matrix(T.activity(p)).collect()
