"""The broker's /metrics cannot be used against the node: it needs the credentials of a user
with ``manage`` (``[management] metrics-auth``, default true; ``/health`` stays open for probes),
and with 20,000 queues a swarm of scrapers neither blocks the event loop (the per-queue series
are rebuilt at most once per ``metrics-cache-ms``, in slices) nor grows its cost with the
scrape rate. Real broker processes, real proton clients."""

from __future__ import annotations

import re
import threading
import time

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import start_broker, write_users_file
from tests.serverproc import http_json

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"])}
QUEUES = 20000


def value(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_metrics_need_manage_credentials_and_health_stays_open(tmp_path):
    users = write_users_file(tmp_path / "users.toml", USERS)
    b = start_broker(tmp_path, users_file=users)
    try:
        status, body = b.management_get("/metrics", auth=None)
        assert status == 401 and "lodestone_broker" not in str(body)
        assert b.management_get("/metrics", auth=("admin", "wrong"))[0] == 401
        assert b.management_get("/metrics", auth=("app", "app"))[0] == 403  # no manage permission
        status, text = b.management_get("/metrics", auth=("admin", "admin"))
        assert status == 200 and "lodestone_broker_up 1" in text
        status, health = b.management_get("/health", auth=None)
        assert status == 200 and health["status"] == "ok"
    finally:
        b.terminate()
    # metrics-auth = false opens it again (for a scraper on a trusted network)
    b = start_broker(tmp_path, name="open", users_file=users, config={"management": {"metrics-auth": False}})
    try:
        status, text = b.management_get("/metrics", auth=None)
        assert status == 200 and "lodestone_broker_up 1" in text
    finally:
        b.terminate()


def test_scraping_20000_queues_does_not_block_the_node(tmp_path):
    users = write_users_file(tmp_path / "users.toml", USERS)
    cfg = {f"addresses.q{i:05d}": {"routing-types": ["anycast"]} for i in range(QUEUES)}
    b = start_broker(tmp_path, users_file=users, config=cfg)
    try:
        url = b.management_url + "/metrics"
        status, text = http_json(url, auth=("admin", "admin"))
        assert status == 200
        assert text.count("\nlodestone_broker_queue_depth{") == QUEUES
        assert value(text, "lodestone_broker_queues") == QUEUES

        stop = threading.Event()
        scrapes = [0]

        def scraper():
            while not stop.is_set():
                assert http_json(url, auth=("admin", "admin"), timeout_s=30)[0] == 200
                scrapes[0] += 1

        c = BlockingConnection(b.amqp_url.replace("amqp://", "amqp://app:app@"), timeout=30,
                               allowed_mechs="PLAIN")
        s, r = c.create_sender("probe"), c.create_receiver("probe", credit=10)
        threads = [threading.Thread(target=scraper) for _ in range(4)]
        for t in threads:
            t.start()
        rtts = []
        started = time.monotonic()
        try:
            while time.monotonic() - started < 4.0:
                t0 = time.perf_counter()
                s.send(Message(body="x"))
                r.receive(timeout=30)
                r.accept()
                rtts.append(time.perf_counter() - t0)
                time.sleep(0.005)   # pacing the round trips, not a wait
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            c.close()
        elapsed = time.monotonic() - started
        status, text = http_json(url, auth=("admin", "admin"))
        rebuilds = value(text, "lodestone_broker_metrics_rebuilds_total")
        answered = value(text, "lodestone_broker_metrics_scrapes_total")
        slice_s = value(text, "lodestone_broker_metrics_rebuild_slice_max_seconds")
        loop_s = value(text, "lodestone_broker_metrics_rebuild_loop_seconds")
        rtts.sort()
        print(f"\n{scrapes[0]} scrapes in {elapsed:.1f} s, {rebuilds:.0f} rebuilds; rebuild loop time "
              f"{loop_s * 1000:.1f} ms, longest slice {slice_s * 1000:.1f} ms; AMQP round trip median "
              f"{rtts[len(rtts) // 2] * 1000:.1f} ms, max {rtts[-1] * 1000:.1f} ms")
        # the cost does not grow with the scrape rate: one rebuild per metrics-cache-ms (1 s) at most
        assert answered >= scrapes[0] > 0
        assert rebuilds <= elapsed / 1.0 + 3, (rebuilds, scrapes[0])
        # and a rebuild never holds the loop for long: producers and consumers keep being served
        assert slice_s < 0.1, slice_s
        assert rtts[len(rtts) // 2] < 0.1 and rtts[-1] < 0.5, rtts[-5:]
    finally:
        b.terminate()
