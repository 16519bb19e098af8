"""The router's dashboard (``GET /`` on the management port, router/dashboard) in a real browser:
Debian's chromium driven through chromedriver (selenium), in front of a real three-node broker
cluster and the real router process with two workers.

The page is checked against oracles outside it: which brokers run (the test kills one), the
container ids the test's own proton clients used, and the brokers' own management APIs. The
screenshots go to ``var/test-artifacts/dashboard/`` (and the test's tmp dir) for a person to look at.
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import USERS_FILE
from tests.clusterproc import start_cluster, wait_mesh
from tests.haproc import start_pair
from tests.paths import REPO
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHECK_PERIOD_MS = 300
ARTIFACTS = REPO / "var" / "test-artifacts" / "dashboard"
KEYS = [f"shop-{i}" for i in range(6)]


def _config(brokers, *, workers: int, pair=None) -> str:
    lines = [f"users-file = {toml_str(str(USERS_FILE))}", f"workers = {workers}",
             "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
             "[routing-log]", "enabled = false",
             "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
             "[routers.main]", 'key-type = "CLIENT_ID"', 'key-filter = "^[a-z]+-[0-9]+"',
             "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
             "[routers.main.cache]", "timeout = 0",
             "[routers.main.pool]", f"check-period = {CHECK_PERIOD_MS}", 'username = "admin"', 'password = "admin"',
             "drain-rate-per-s = 50"]
    for b in brokers:
        lines += ["[[routers.main.pool.targets]]", f"name = {toml_str(b.workdir.name)}", 'host = "127.0.0.1"',
                  f"port = {b.port}", f"management-url = {toml_str(b.management_url)}"]
    if pair is not None:   # a shared-store HA pair: the backup has no AMQP listener until it serves
        primary, backup = pair
        lines += ["[[routers.main.pool.targets]]", 'name = "primary"', 'host = "127.0.0.1"',
                  f"port = {primary.fixed_port}", f"management-url = {toml_str(primary.management_url)}",
                  "[[routers.main.pool.targets]]", 'name = "backup"', 'host = "127.0.0.1"', 'backup-of = "primary"',
                  f"port = {backup.fixed_port}", f"management-url = {toml_str(backup.management_url)}"]
    return "\n".join(lines) + "\n"


def _browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1500,2000", "--hide-scrollbars", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})   # the page's console, checked at the end
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def _with_basic_auth(driver, user: str, password: str) -> None:
    """Every request of the page (the document, its script, its fetch calls) carries the
    credentials, as after a person typed them into the browser's prompt."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})


def _text(driver, selector: str) -> str | None:
    """The text of the first element ``selector`` matches, read in one step of the page (the
    page redraws every second, so a held element reference goes stale)."""
    return driver.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : null;",
                                 selector)


def _row(driver, target: str) -> dict:
    return driver.execute_script(
        "const r = document.querySelector(arguments[0]);"
        "return r ? {ready: r.dataset.ready, draining: r.dataset.draining, text: r.innerText} : {};",
        f'tr[data-target="{target}"]')


def _click(driver, selector: str) -> None:
    """A real click (selenium's: the pointer events a person's click makes), retried when the
    page redrew the element between finding and clicking it."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(20):
        try:
            driver.find_element("css selector", selector).click()
            return
        except StaleElementReferenceException:
            time.sleep(0.05)
    raise AssertionError(f"could not click {selector}")


def _shot(driver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    # the whole page: chromium's screenshot is of the window, so grow it to the document first
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1500, max(1000, min(int(height) + 40, 6000)))
    driver.save_screenshot(str(path))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, ARTIFACTS / path.name)
    assert path.stat().st_size > 10_000, f"{name}: an empty screenshot"
    return path


def _connect_and_send(url: str, key: str) -> None:
    conn = BlockingConnection(url, timeout=10, container_id=key, user="app", password="app",
                              allowed_mechs="PLAIN")
    try:
        conn.create_sender("dash.q").send(Message(body=key, durable=True))
    finally:
        conn.close()


def _broker_containers(broker) -> set[str]:
    status, conns = broker.management_get("/api/v1/connections")
    assert status == 200, conns
    return {c.get("container_id") for c in conns if not c.get("internal")}


def test_dashboard_in_chromium_shows_readiness_decisions_brokers_and_drains(tmp_path):
    assert os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER), \
        "Debian's chromium and chromium-driver are missing (etc/run-tests.sh installs them)"
    nodes = start_cluster(tmp_path, 3)
    pair = ()
    router = None
    driver = None
    try:
        pair = start_pair(tmp_path)
        wait_mesh(nodes)
        router = start_router(tmp_path / "router", _config(nodes, workers=2, pair=pair), expect=2)
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 4, 20,
                 what="3 targets and the pair ready")

        # without credentials: the browser's login prompt (401 with a Basic challenge)
        with pytest.raises(urllib.request.HTTPError) as no_auth:
            urllib.request.urlopen(router.management_url + "/", timeout=5)
        assert no_auth.value.code == 401 and "Basic" in no_auth.value.headers.get("WWW-Authenticate", "")

        # traffic with known keys: each key twice (the second time a cache hit), with a suffix
        # the key filter cuts off
        for key in KEYS:
            _connect_and_send(router.url("proxy"), key + ".a")
            _connect_and_send(router.url("proxy"), key + ".b")

        driver = _browser()
        _with_basic_auth(driver, "admin", "admin")
        driver.get(router.management_url + "/")
        wait_for(lambda: all(_row(driver, n).get("ready") == "true" for n in ["node0", "node1", "node2", "primary"]), 15,
                 what="every target shown ready")
        backup_row = _row(driver, "backup")   # a passive backup takes no connection: shown as a standby
        assert backup_row.get("ready") == "false" and "standby" in backup_row["text"], backup_row
        assert "serving" in _text(driver, 'tr[data-pair="primary"]') and "primary" in _text(driver, 'tr[data-pair="primary"]')
        assert "Lodestone router" in _text(driver, "body")
        # the last decisions: every key of the test, with its filtered form and a cache hit
        decisions = _text(driver, "#decisions")
        for key in KEYS:
            assert f"{key}.a → {key}" in decisions and f"{key}.b → {key}" in decisions, decisions[:2000]
        assert "hit" in decisions and "CONSISTENT_HASH" in decisions
        cache_total = _text(driver, '[data-tile="cache-total"] .value')
        assert cache_total == "50 %", cache_total   # 6 misses, then 6 hits
        # the brokers as their own APIs describe them: all three, each with its two cluster peers
        wait_for(lambda: driver.execute_script("return document.querySelectorAll('#cluster .card').length") == 5, 10,
                 what="five broker cards")
        for b in nodes:
            card = _text(driver, f'#cluster .card[data-broker="{b.workdir.name}"]')
            assert b.node_id in card and "2 other members, 2 connected" in card, card
        assert "active" in _text(driver, '#cluster .card[data-broker="primary"] h3')
        assert "passive" in _text(driver, '#cluster .card[data-broker="backup"] h3')
        # rates are differences between two polls: wait for the second one before the picture
        wait_for(lambda: _text(driver, '[data-tile="rate-ok"] .value') not in (None, "–"), 5, what="a second poll")
        _shot(driver, tmp_path, "1-all-ready")

        # a broker stops: its row turns not ready within a few check periods (+ one page poll)
        victim = nodes[2]
        victim.kill()
        killed = time.monotonic()
        wait_for(lambda: _row(driver, victim.workdir.name).get("ready") == "false", 10, interval_s=0.05,
                 what=f"{victim.workdir.name} shown not ready")
        seen_after = time.monotonic() - killed
        bound = 4 * CHECK_PERIOD_MS / 1000 + 1.0 + 0.5
        assert seen_after <= bound, f"the page showed {victim.workdir.name} down {seen_after:.2f} s after the kill (bound {bound} s)"
        wait_for(lambda: "unreachable" in (_text(driver, f'#cluster .card[data-broker="{victim.workdir.name}"]') or ""),
                 10, what="its broker card unreachable")
        _shot(driver, tmp_path, "2-one-broker-down")

        # drain a broker with its button: the page and the router say so, and a client whose key
        # the hash gave that broker now goes to the other one (the brokers' own view)
        drained = nodes[0]
        keys_on = {k: router.target_for("main", k)["target"]["name"] for k in KEYS}
        mine = [k for k, t in keys_on.items() if t == drained.workdir.name]
        _click(driver, f'tr[data-target="{drained.workdir.name}"] button[data-op="drain"]')
        wait_for(lambda: _row(driver, drained.workdir.name).get("draining") == "true", 10, what="the row shows draining")
        pool = router.get("/api/v1/routers/main/pool")[1]
        assert pool["draining"] == [drained.workdir.name], pool
        probe_key = (mine[0] if mine else KEYS[0]) + ".c"
        conn = BlockingConnection(router.url("proxy"), timeout=10, container_id=probe_key, user="app",
                                  password="app", allowed_mechs="PLAIN")
        try:
            assert probe_key not in _broker_containers(drained)
            assert sum(probe_key in _broker_containers(b) for b in (nodes[1], pair[0])) == 1
        finally:
            conn.close()
        wait_for(lambda: _text(driver, f'tr[data-drain="{drained.workdir.name}"]'), 10, what="the drain's row")
        _shot(driver, tmp_path, "3-draining")
        _click(driver, f'tr[data-target="{drained.workdir.name}"] button[data-op="undrain"]')
        wait_for(lambda: _row(driver, drained.workdir.name).get("draining") == "false", 10, what="the row shows undrained")
        assert "draining" not in router.get("/api/v1/routers/main/pool")[1]
        assert driver.execute_script("return document.getElementById('error').hidden") is True
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors   # no script error, no failed request, no blocked resource
    finally:
        if driver is not None:
            driver.quit()
        if router is not None:
            router.terminate()
        for n in [*nodes, *pair]:
            n.kill()


def test_dashboard_api_answers_for_the_whole_router_and_refuses_cross_site_posts(tmp_path):
    """``GET /api/v1/dashboard`` of a one-process router: the decisions the test's clients caused
    (their container ids, filtered keys, cache), and a drain ``POST`` a browser sends from
    another site is refused (403) while one from the page's origin or a non-browser client works."""
    nodes = start_cluster(tmp_path, 2)
    router = None
    try:
        router = start_router(tmp_path / "router", _config(nodes, workers=1), expect=2)
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 2, 20, what="2 targets ready")
        for key in KEYS[:3]:
            _connect_and_send(router.url("proxy"), key + ".x")
        status, snap = router.get("/api/v1/dashboard")
        assert status == 200, snap
        got = [(d["container_id"], d["key_filtered"], d["cache"], d["outcome"], d["action"]) for d in snap["decisions"]]
        assert got == [(f"{k}.x", k, "miss", "OK", "proxied") for k in KEYS[:3]], got
        assert snap["edge"]["cache_miss"] == 3 and snap["edge"]["cache_hit"] == 0
        assert {b["name"] for b in snap["cluster"]} == {n.workdir.name for n in nodes}
        assert all(b["reachable"] and b["active"] for b in snap["cluster"])
        assert snap["routers"][0]["pool"]["ready"] == 2

        def post(path: str, headers: dict) -> int:
            req = urllib.request.Request(router.management_url + path, data=b"", method="POST")
            req.add_header("Authorization", "Basic " + base64.b64encode(b"admin:admin").decode())
            for k, v in headers.items():
                req.add_header(k, v)
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status
            except urllib.request.HTTPError as exc:
                return exc.code

        drain = f"/api/v1/routers/main/targets/{nodes[0].workdir.name}/drain"
        assert post(drain, {"Origin": "http://evil.example"}) == 403
        assert post(drain, {"Sec-Fetch-Site": "cross-site"}) == 403
        assert "draining" not in router.get("/api/v1/routers/main/pool")[1]
        host = router.management_url.split("://", 1)[1]
        assert post(drain, {"Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}) == 200
        assert post(f"/api/v1/routers/main/targets/{nodes[0].workdir.name}/undrain", {}) == 200
        status, page = router.get("/")
        assert status == 200 and "<title>Lodestone router</title>" in page
        # a target that goes down and comes back is logged once each way, with why
        gone = nodes[1]
        name = gone.workdir.name
        gone.proc.send_signal(signal.SIGSTOP)      # its probe times out: down, then back on SIGCONT
        try:
            wait_for(lambda: f"target {name} is not ready: " in router.stderr_text(), 15, what="the not-ready line")
            assert router.get("/api/v1/dashboard")[1]["routers"][0]["pool"]["ready"] == 1
        finally:
            gone.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: f"target {name} is ready again" in router.stderr_text(), 20, what="the ready-again line")
        assert router.stderr_text().count(f"target {name} is not ready: ") == 1
    finally:
        if router is not None:
            router.terminate()
        for n in nodes:
            n.kill()
