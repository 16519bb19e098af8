"""The node process and its roles (broker.lifecycle, broker.role), in one process: a toy role that
serves twice (the first activation ends by a hand-over it asks for) and a toy component beside it.
Real sockets (ports from the OS), the real management API read over HTTP; no broker subprocess."""

from __future__ import annotations

import base64
import json
import socket

import pytest
import trio

from broker.config import load_config
from broker.lifecycle import NodeProcess
from broker.node import Node
from broker.role import Component, Role
from broker.store.datadir import open_data_dir
from broker.wire.io.http import http_request
from broker.wire.io.users import load_users
from tests.brokerproc import ADMIN, write_config
from tests.waiting import wait_for_async

AMQP_SASL_HEADER = b"AMQP\x03\x01\x00\x00"


class TwoActivations(Role):
    """Serves, hands over when ``hand_over`` is set, serves again until stopped; exit status 7."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.hand_over = trio.Event()
        self.reasons: list[str] = []
        self.nodes: list[Node] = []

    async def run(self, proc) -> int:
        datadir = open_data_dir(self.cfg.data_dir)
        try:
            self.reasons.append(await proc.serve(self, datadir, deactivate=self.hand_over))
            proc.passive(self, datadir.node_id)
            self.reasons.append(await proc.serve(self, datadir))
        finally:
            datadir.close()
        return 7

    def activated(self, node, nursery) -> None:
        self.nodes.append(node)

    def describe(self, node) -> dict:
        return {"toy": True, "activations": len(self.nodes), "active": node.active}

    def backups(self):
        return (("amqp://10.0.0.9:5672", "", True), ("amqp://10.0.0.8:5672", "", False))


class Recorder(Component):
    """Records its calls; one task per activation, which must be cancelled when it ends."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.tasks_ended = 0

    def activated(self, node, nursery) -> None:
        self.calls.append(("activated", node.active))
        nursery.start_soon(self._task)

    async def _task(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.tasks_ended += 1

    async def deactivating(self, node, reason, close_listeners) -> None:
        self.calls.append(("deactivating", reason, node.active))

    def stop(self) -> None:
        self.calls.append(("stop",))


async def _get(url: str, path: str, auth=None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    headers = [("Host", f"{host}:{port}"), ("Connection", "close")]
    if auth is not None:
        headers.append(("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode()))
    status, body = await http_request(host, int(port), "GET", path, headers=headers)
    return status, json.loads(body)


async def _amqp_answers(url: str) -> bool:
    """Does an AMQP listener answer the SASL protocol header at ``url``?"""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    try:
        stream = await trio.open_tcp_stream(host, int(port))
    except OSError:
        return False
    async with stream:
        await stream.send_all(AMQP_SASL_HEADER)
        with trio.fail_after(5):
            return (await stream.receive_some(8)) == AMQP_SASL_HEADER


def test_a_role_serves_twice_and_its_component_follows_each_activation(tmp_path, capsys):
    cfg = load_config(write_config(tmp_path))
    security = load_users(cfg.users_file)
    role, comp = TwoActivations(cfg), Recorder()
    proc = NodeProcess(cfg, security, components=[comp], signals=False)
    seen: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            async def run() -> None:
                seen["code"] = await proc.run(role)
            n.start_soon(run)
            await wait_for_async(lambda: len(role.nodes) == 1 and role.nodes[0].active, timeout_s=10)
            first = role.nodes[0]
            out = capsys.readouterr().out
            amqp_url = next(line.split()[2] for line in out.splitlines() if line.startswith("listening amqp "))
            mgmt = proc.management.url
            seen["first_health"] = await _get(mgmt, "/health")
            seen["first_ha"] = await _get(mgmt, "/api/v1/ha", ADMIN)
            seen["first_answers"] = await _amqp_answers(amqp_url)
            seen["fsl"] = first.server_open_properties.get("failover-server-list")

            role.hand_over.set()
            await wait_for_async(lambda: len(role.nodes) == 2 and role.nodes[1].active, timeout_s=10)
            seen["first_closed"] = not await _amqp_answers(amqp_url)   # the first activation's listener is gone
            seen["tasks_ended_between"] = comp.tasks_ended
            seen["second_health"] = await _get(mgmt, "/health")
            seen["lines"] = capsys.readouterr().out

            proc.stop(role)
    trio.run(main)

    status, health = seen["first_health"]
    assert status == 200 and health["active"] is True and health["node_id"] == role.nodes[0].node_id
    assert seen["first_ha"] == (200, {"toy": True, "activations": 1, "active": True})
    assert seen["first_answers"] and seen["first_closed"]
    # the node asks its role for its backups: only the in-sync one is a failover target
    fsl = seen["fsl"]
    assert len(fsl) == 1 and "10.0.0.9" in repr(fsl) and "10.0.0.8" not in repr(fsl)
    assert role.reasons == ["deactivate", "stop"] and seen["code"] == 7
    # one node per activation, both on the data directory's node id; each inactive once it ended
    assert role.nodes[0] is not role.nodes[1] and role.nodes[0].node_id == role.nodes[1].node_id
    assert not role.nodes[0].active and not role.nodes[1].active
    # the component: activated before the node serves, told why each activation ended, its
    # task cancelled with its activation, stopped with the role
    assert comp.calls == [("activated", False), ("deactivating", "deactivate", False),
                          ("activated", False), ("stop",), ("deactivating", "stop", False)]
    assert seen["tasks_ended_between"] == 1 and comp.tasks_ended == 2
    assert seen["second_health"][0] == 200
    # the second activation printed its listener again; the management server was opened once
    assert seen["lines"].count("listening amqp ") == 1 and "listening management" not in seen["lines"]


def test_a_node_without_a_role_has_no_backups_and_no_failover_list(tmp_path):
    cfg = load_config(write_config(tmp_path))
    node = Node(cfg, None, "0123456789abcdef", None)
    assert node.backups() == () and node.replication is None
    assert "failover-server-list" not in node.server_open_properties


def test_a_role_must_say_how_it_runs(tmp_path):
    cfg = load_config(write_config(tmp_path))
    proc = NodeProcess(cfg, None, signals=False)

    async def main() -> None:
        await proc.run(Role(cfg))
    with pytest.raises(BaseExceptionGroup) as raised:
        trio.run(main)
    matched, _rest = raised.value.split(NotImplementedError)
    assert matched is not None and "Role does not say how it runs" in repr(matched.exceptions)


def test_the_listening_port_is_free_after_the_process_ends(tmp_path, capsys):
    cfg = load_config(write_config(tmp_path))
    role = TwoActivations(cfg)
    proc = NodeProcess(cfg, load_users(cfg.users_file), signals=False)

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(proc.run, role)
            await wait_for_async(lambda: role.nodes and role.nodes[-1].active, timeout_s=10)
            role.hand_over.set()
            await wait_for_async(lambda: len(role.nodes) == 2 and role.nodes[1].active, timeout_s=10)
            proc.stop(role)
    trio.run(main)
    ports = [int(line.rsplit(":", 1)[1]) for line in capsys.readouterr().out.splitlines()
             if line.startswith("listening amqp ")]
    assert len(ports) == 2
    for port in ports:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_connection_that_never_ends_does_not_hold_the_stop(tmp_path, capsys):
    """A client that opened a socket and said nothing (its handshake deadline is 10 s away) is
    cancelled once the shutdown grace (2 s) has passed: the stop does not wait for it."""
    cfg = load_config(write_config(tmp_path))
    assert cfg.handshake_timeout_s >= 10
    role = TwoActivations(cfg)
    proc = NodeProcess(cfg, load_users(cfg.users_file), signals=False)
    took: dict = {}

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(proc.run, role)
            await wait_for_async(lambda: role.nodes and role.nodes[-1].active, timeout_s=10)
            url = next(line.split()[2] for line in capsys.readouterr().out.splitlines()
                       if line.startswith("listening amqp "))
            host, port = url.split("://", 1)[1].rsplit(":", 1)
            silent = await trio.open_tcp_stream(host, int(port))
            await wait_for_async(lambda: role.nodes[-1].acceptor_active["amqp"] == 1, timeout_s=10)
            role.hand_over.set()
            t0 = trio.current_time()
            await wait_for_async(lambda: len(role.nodes) == 2, timeout_s=9)
            took["s"] = trio.current_time() - t0
            proc.stop(role)
            await silent.aclose()
    trio.run(main)
    assert took["s"] < 5.0, took   # the grace, not the handshake deadline


@pytest.mark.parametrize("mgmt,connector,told", [
    ("http://0.0.0.0:8161", "amqp://10.0.0.5:5672", "http://10.0.0.5:8161"),
    ("http://[::]:8161", "amqps://[fd00::5]:5671", "http://[fd00::5]:8161"),
    ("http://127.0.0.1:8161", "amqp://10.0.0.5:5672", "http://127.0.0.1:8161"),   # bound to one address: as is
    ("http://0.0.0.0:8161", "amqp://0.0.0.0:5672", "http://0.0.0.0:8161"),        # nothing better to say (warned)
], ids=["any-v4", "any-v6", "one-address", "no-better"])
def test_a_management_api_on_every_address_is_announced_at_the_connectors_host(mgmt, connector, told):
    from broker.lifecycle import reachable_management_url

    assert reachable_management_url(mgmt, connector) == told
