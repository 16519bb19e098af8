"""A real router process in front of three real brokers, for the client tests.

Routers (one process):

* ``main`` — key CLIENT_ID, CONSISTENT_HASH over b1..b3; acceptors ``redir`` (redirect mode) and
  ``auto`` (auto mode: a client announcing ``lodestone:follows-redirect`` is redirected, any other
  one proxied);
* ``quorum`` — quorum-size 4 of 3 targets, quorum-timeout 0: never ready; acceptor ``q-redir``;
* ``ping`` / ``pong`` — FIRST_ELEMENT, each one's only target is the other's redirect acceptor:
  a client is sent ping → pong → ping … (a loop). Their two ports are reserved up front (bound
  to port 0 by the OS, released, then written into the config), since each must name the other.

The routing log is ``routing.log`` beside each router's config (``Env.route_lines``).
"""

from __future__ import annotations

import socket
import json
from pathlib import Path

from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

USERS = {"admin": ("admin-pw", ["admin"]), "app": ("app-pw", ["app"])}
MGMT = ("ops", "ops-pw")
CHECK_PERIOD_MS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_toml(tmp: Path, brokers, users_file: Path, *, loop_ports: tuple[int, int] | None) -> tuple[str, int]:
    lines = [f"name = {toml_str('clients')}", f"users-file = {toml_str(users_file)}",
             "[management]", "port = 0", f"user = {toml_str(MGMT[0])}", f"password = {toml_str(MGMT[1])}",
             "[routing-log]", 'path = "routing.log"', ""]
    acceptors: list[str] = []

    def pool(router: str, quorum: int = 1) -> list[str]:
        out = [f"[routers.{router}.pool]", f"check-period = {CHECK_PERIOD_MS}", f"quorum-size = {quorum}",
               "quorum-timeout = 0", 'username = "admin"', 'password = "admin-pw"']
        for i, b in enumerate(brokers):
            out += [f"[[routers.{router}.pool.targets]]", f'name = "b{i + 1}"', 'host = "127.0.0.1"',
                    f"port = {b.port}", f"management-url = {toml_str(b.management_url)}"]
        return out

    def acceptor(name: str, router: str, port: int = 0, mode: str = "redirect") -> None:
        acceptors.append("\n".join(["[[acceptors]]", f"name = {toml_str(name)}", f"port = {port}",
                                    f"router = {toml_str(router)}", f"mode = {toml_str(mode)}"]) + "\n")

    lines += ["[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
              *pool("main"), ""]
    acceptor("redir", "main")
    acceptor("auto", "main", mode="auto")
    lines += ["[routers.quorum]", 'key-type = "CLIENT_ID"', "[routers.quorum.policy]", 'name = "FIRST_ELEMENT"',
              *pool("quorum", quorum=4), ""]
    acceptor("q-redir", "quorum")
    if loop_ports is not None:
        for name, other in (("ping", loop_ports[1]), ("pong", loop_ports[0])):
            # no management-url: probed by a TCP connect to the other acceptor
            lines += [f"[routers.{name}]", 'key-type = "CLIENT_ID"', f"[routers.{name}.policy]",
                      'name = "FIRST_ELEMENT"', f"[routers.{name}.pool]", f"check-period = {CHECK_PERIOD_MS}",
                      "quorum-timeout = 0", f"[[routers.{name}.pool.targets]]", f'name = "{name}-next"',
                      'host = "127.0.0.1"', f"port = {other}", ""]
        acceptor("ping", "ping", loop_ports[0])
        acceptor("pong", "pong", loop_ports[1])
    return "\n".join(lines) + "\n" + "\n".join(acceptors), len(acceptors) + 1


class Env:
    """What the tests use: ``router``, ``brokers``, ``node_ids`` (node id → broker), helpers."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.users_file = write_users_file(tmp / "users.toml", USERS)
        self.brokers = [start_broker(tmp, name=f"b{i}", users_file=self.users_file) for i in (1, 2, 3)]
        self.node_ids = {b.node_id: b for b in self.brokers}
        for attempt in range(3):
            self.loop_ports = (free_port(), free_port())
            text, expect = router_toml(tmp, self.brokers, self.users_file, loop_ports=self.loop_ports)
            try:
                self.router = start_router(tmp / f"router-{attempt}", text, expect=expect, auth=MGMT)
                break
            except RuntimeError:  # a reserved port was taken in between: reserve again
                if attempt == 2:
                    raise
        wait_for(lambda: self.router.get("/api/v1/routers/main/pool")[1]["ready"] == 3, 20)
        wait_for(lambda: all(self.router.get(f"/api/v1/routers/{r}/pool")[1]["ready"] == 1
                             for r in ("ping", "pong")), 20)

    def start_second_router(self, name: str):
        """Another router process with the same ``main`` router (same pool and policy)."""
        text, expect = router_toml(self.tmp, self.brokers, self.users_file, loop_ports=None)
        return start_router(self.tmp / name, text, expect=expect, auth=MGMT)

    def front_door(self, acceptor: str = "redir", router=None) -> str:
        return (router or self.router).url(acceptor)

    def broker_for(self, key: str, router: str = "main"):
        """The broker the router's management API names for ``key``."""
        body = self.router.target_for(router, key)
        assert body["outcome"] == "OK", body
        return self.node_ids[body["nodeID"]]

    def redirected(self, acceptor: str = "redir") -> int:
        return self.router.counters(acceptor)["redirected"]

    def auto_counts(self) -> tuple[int, int]:
        """(redirected, proxied) at the ``auto`` acceptor."""
        c = self.router.counters("auto")
        return c["redirected"], c["proxied"]

    def route_lines(self, container_id: str, router=None) -> list[dict]:
        """The routing log's ``route`` lines for ``container_id`` (written every 0.5 s: poll)."""
        path = (router or self.router).workdir / "routing.log"
        if not path.exists():
            return []
        return [r for r in map(json.loads, path.read_text().splitlines())
                if r["event"] == "route" and r.get("container_id") == container_id]

    def route_line(self, container_id: str, timeout_s: float = 5.0) -> dict:
        """The one ``route`` line for ``container_id``."""
        wait_for(lambda: self.route_lines(container_id), timeout_s)
        (line,) = self.route_lines(container_id)
        return line

    def assert_routed(self, k: str, before: tuple[int, int], action: str, target) -> None:
        """The ``auto`` acceptor counted exactly one ``action`` (``redirected`` / ``proxied``) since
        ``before`` (``auto_counts()``), never the other one, and its routing-log line for key ``k``
        says so, naming ``target`` (the broker the management API names)."""
        redirected, proxied = self.auto_counts()
        if action == "redirected":
            assert (redirected, proxied) == (before[0] + 1, before[1]), (before, redirected, proxied)
        else:
            assert (redirected, proxied) == (before[0], before[1] + 1), (before, redirected, proxied)
        line = self.route_line(k)
        assert (line["acceptor"], line["mode"], line["action"]) == ("auto", "auto", action), line
        assert line["target_node_id"] == target.node_id, line
        assert line["target_address"] == f"127.0.0.1:{target.port}", line

    @staticmethod
    def queue(broker, name: str) -> dict | None:
        """``broker``'s management view of queue ``name`` (depth, enqueued, acked, …), or None."""
        status, qs = broker.management_get("/api/v1/queues", auth=("admin", USERS["admin"][0]))
        assert status == 200, qs
        return next((q for q in qs if q["name"] == name), None)

    def brokers_with(self, container_id: str) -> list[str]:
        """Node ids of the brokers whose connection list (management API) holds ``container_id``."""
        out = []
        for b in self.brokers:
            status, conns = b.management_get("/api/v1/connections", auth=("admin", USERS["admin"][0]))
            assert status == 200, conns
            if any(c["container_id"] == container_id for c in conns):
                out.append(b.node_id)
        return out

    def close(self) -> int:
        status = self.router.terminate()
        for b in self.brokers:
            b.kill()
        return status
