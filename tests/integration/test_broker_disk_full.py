"""A broker whose disk fills: its journal refuses every write from the failed one on (a restart
recovers from disk), so it must stop looking healthy, and the router must stop sending it
clients. Real broker processes (one on a small tmpfs), the real router, proton clients."""

from __future__ import annotations

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN, USERS_FILE, BrokerProcess, write_config
from tests.integration.conftest import fill_disk
from tests.routerproc import start_router, toml_str
from tests.serverproc import http_json
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CLIENT = {"user": "app", "password": "app", "allowed_mechs": "PLAIN", "timeout": 10}


def _send(url: str, body: str, container_id: str) -> None:
    conn = BlockingConnection(url, container_id=container_id, **CLIENT)
    try:
        conn.create_sender("disk.q").send(Message(body=body, durable=True))
    finally:
        conn.close()


def test_a_broker_whose_journal_failed_says_so_and_the_router_stops_sending_it_clients(tmp_path, mount_tmpfs):
    disk = mount_tmpfs("small", "1m")
    full = BrokerProcess(tmp_path / "full", write_config(tmp_path / "full", name="full",
                                                         config={"node": {"data-dir": str(disk / "data")}})).start()
    other = BrokerProcess(tmp_path / "other", write_config(tmp_path / "other", name="other")).start()
    router = None
    try:
        lines = ["[management]", "port = 0", 'user = "admin"', 'password = "admin"', "[routing-log]",
                 "enabled = false", "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"',
                 'mode = "proxy"', "[routers.main]", 'key-type = "CLIENT_ID"',
                 "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
                 "[routers.main.pool]", "check-period = 200", 'username = "admin"', 'password = "admin"']
        for name, b in (("full", full), ("other", other)):
            lines += ["[[routers.main.pool.targets]]", f"name = {toml_str(name)}", 'host = "127.0.0.1"',
                      f"port = {b.port}", f"management-url = {toml_str(b.management_url)}"]
        router = start_router(tmp_path / "router", f"users-file = {toml_str(str(USERS_FILE))}\n" + "\n".join(lines) + "\n",
                              expect=2)
        wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 2, 20, what="both ready")
        _send(router.url("proxy"), "before", "c-before")          # FIRST_ELEMENT: on "full"
        assert full.queue("disk.q")["depth"] == 1
        fill_disk(disk / "filler")
        with pytest.raises(Exception):
            _send(full.amqp_url, "x" * 200_000, "c-direct")          # its journal cannot write it
        status, health = http_json(full.management_url + "/health", timeout_s=5)
        assert status == 503 and health["status"] == "failed" and "No space left" in health["error"], health
        status, info = http_json(full.management_url + "/api/v1/broker", auth=ADMIN, timeout_s=5)
        assert info["journal_error"] and info["active"] is True
        wait_for(lambda: not next(t for t in router.get("/api/v1/routers/main/pool")[1]["targets"]
                                  if t["name"] == "full")["ready"], 10, what="the router takes it out")
        target = next(t for t in router.get("/api/v1/routers/main/pool")[1]["targets"] if t["name"] == "full")
        assert "journal failed" in target["last_error"], target
        _send(router.url("proxy"), "after", "c-after")              # goes to the other broker
        assert other.queue("disk.q")["depth"] == 1
        assert "Traceback" not in full.stderr_text()
    finally:
        if router is not None:
            router.terminate()
        other.kill()
        full.kill()
