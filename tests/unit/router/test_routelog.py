"""router.routelog: JSON lines, buffered flushes, size rotation, per-worker file names."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from router.routelog import RouteLog, utc_timestamp, worker_log_path
from tests.paths import REPO
from tests.waiting import wait_for_async


async def test_lines_are_buffered_until_flush_then_one_json_object_per_line(tmp_path):
    path = tmp_path / "logs" / "routing.log"
    log = RouteLog(path, flush_interval_s=3600)
    log.write({"event": "route", "user": "ålice", "n": 1})
    log.write({"event": "close", "bytes_client_to_broker": 10})
    assert not path.exists() or path.read_text() == ""  # nothing written on the hot path
    await log.flush()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(x) for x in lines] == [{"event": "route", "user": "ålice", "n": 1},
                                              {"event": "close", "bytes_client_to_broker": 10}]
    await log.aclose()
    assert log.lines_written == 2


async def test_periodic_flush_writes_without_an_explicit_flush(tmp_path):
    path = tmp_path / "routing.log"
    log = RouteLog(path, flush_interval_s=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(log.run)
        log.write({"a": 1})
        await wait_for_async(lambda: path.exists() and path.read_text(), 5, interval_s=0.01,
                             what="the line flushed to the file")
        nursery.cancel_scope.cancel()
    await log.aclose()
    assert json.loads(path.read_text()) == {"a": 1}


async def test_rotation_keeps_backup_count_files_and_loses_no_line(tmp_path):
    path = tmp_path / "routing.log"
    log = RouteLog(path, max_bytes=1000, backup_count=3, flush_interval_s=3600)
    for i in range(40):  # ~40 bytes each: 1,600 bytes → two rotations
        log.write({"i": i, "pad": "x" * 20})
        await log.flush()
    await log.aclose()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["routing.log", "routing.log.1"]
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 1000
    # newest lines in routing.log, older ones in .1 — together a contiguous tail of the stream
    seen = [json.loads(x)["i"] for p in (tmp_path / "routing.log.1", path) for x in p.read_text().splitlines()]
    assert seen == list(range(40 - len(seen), 40))

    log = RouteLog(path, max_bytes=200, backup_count=2, flush_interval_s=3600)
    for i in range(100):
        log.write({"i": i, "pad": "y" * 20})
    await log.flush()
    await log.aclose()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routing.log", "routing.log.1", "routing.log.2"]


async def test_a_disabled_log_writes_nothing_and_a_full_buffer_drops_and_counts(tmp_path):
    off = RouteLog(None)
    off.write({"a": 1})
    await off.flush()
    await off.aclose()
    log = RouteLog(tmp_path / "r.log", max_buffered_lines=3, flush_interval_s=3600)
    for i in range(5):
        log.write({"i": i})
    assert log.lines_dropped == 2
    await log.aclose()
    assert len((tmp_path / "r.log").read_text().splitlines()) == 3


def test_worker_file_names_and_timestamps():
    assert worker_log_path(Path("/v/routing.log"), 0, 1) == Path("/v/routing.log")
    assert worker_log_path(Path("/v/routing.log"), 1, 2) == Path("/v/routing-w1.log")
    assert utc_timestamp(0.5) == "1970-01-01T00:00:00.500000Z"


def test_the_documented_schema_is_what_the_builders_write():
    """docs/router.md's routing-log tables name exactly the fields of ``route_line`` and
    ``close_line`` (the schema lives in router/routelog.py), and ``v`` is ``SCHEMA_VERSION``."""
    import re
    from types import SimpleNamespace as NS

    from router.core.decide import Router
    from router.core.keys import ConnectionInfo, KeyResolver, KeyType
    from router.net.proxy import EndReason, PumpStats
    from router.routelog import SCHEMA_VERSION, close_line, route_line

    d = Router("r", KeyResolver(KeyType.CLIENT_ID)).decide(ConnectionInfo("1.2.3.4:5", container_id="k"), 0.0)
    c = NS(id="x", host="1.2.3.4", port=5, sni=None, user="u", roles=("a",), mechanism="PLAIN",
           container_id="k", open_hostname=None)
    route = json.loads(route_line(0.0, 0, "r", "a", "auto", c, d, 7, "refused", 1024))
    stats = PumpStats()
    stats.reason = EndReason.CLOSED
    close = json.loads(close_line(0.0, 0, "r", "a", "auto", c, d, stats, 1.5, 1024))
    assert route["v"] == close["v"] == SCHEMA_VERSION
    assert (route["event"], route["action"], route["decision_us"]) == ("route", "refused", 7)
    doc = (REPO / "docs" / "router.md").read_text()
    sec = doc[doc.index('**`event = "route"`**'):]
    tables = {"route": sec[:sec.index('**`event = "close"`**')],
              "close": sec[sec.index('**`event = "close"`**'):sec.index("A Spark schema")]}

    def documented(text):
        out = []
        for line in text.splitlines():
            if line.startswith("| `"):
                out += re.findall(r"`([a-z_]+)`", line.split("|")[1])
        return out

    assert documented(tables["route"]) == list(route)
    assert sorted(documented(tables["close"])) == sorted(close)
