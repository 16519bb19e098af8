"""Real broker clusters for tests: N broker processes joined by ``[cluster]`` (ports from the OS).

    from tests.clusterproc import start_cluster, wait_mesh

    nodes = start_cluster(tmp_path, 3, mode="ON_DEMAND")     # node 0 first, the others dial it
    wait_mesh(nodes)                                         # every bridge connected both ways
    wait_remote_consumers(nodes[0], "orders", 1)             # a consumer elsewhere is known

Every node starts on port 0 and names node 0 (or ``static=`` indexes) as its static connector;
the others learn each other from the cluster (``allow-direct-connections-only = false``), as
Artemis nodes do from the topology. ``chain=True`` gives node i only node i+1 and sets
``allow-direct-connections-only`` (Artemis's one-way chain tests), so nodes are started from the
last to the first. Clients use python-qpid-proton's BlockingConnection, unmodified.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN, BrokerProcess, write_config, write_users_file
from tests.serverproc import http_json
from tests.waiting import RESTARTING, wait_for

CLUSTER_PASSWORD = "test-cluster-secret"


def cluster_config(*, mode: str = "ON_DEMAND", static: list[str] = (), extra: dict[str, Any] | None = None,
                   config: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    cfg = {"cluster": {"name": "test-cluster", "connector": "amqp://127.0.0.1:0", "static-connectors": list(static),
                       "user": "cluster-user", "password": CLUSTER_PASSWORD, "message-load-balancing": mode,
                       "retry-interval-ms": 100, "max-retry-interval-ms": 500, **(extra or {})},
           "journal": {"sync": "batch"}}
    for k, v in (config or {}).items():
        cfg.setdefault(k, {}).update(v)
    return cfg


def start_node(tmp_path: Path, name: str, *, static: list[str] = (), mode: str = "ON_DEMAND",
               extra: dict[str, Any] | None = None, config: dict[str, dict[str, Any]] | None = None,
               tls=None, net=None) -> BrokerProcess:
    """One cluster node. ``tls`` (a trustme CA): an amqps acceptor too, and the cluster runs over
    it (connector ``amqps://…``, ``ca-file`` the CA). ``net``: a :class:`tests.netns.Network`
    with a member of this name: the node runs in that member's namespace, on its address, with
    users that may log in from anywhere (etc/users.toml's samples are for loopback only)."""
    workdir = Path(tmp_path) / name
    if tls is not None:
        extra = {"connector": "amqps://127.0.0.1:0", "ca-file": str(workdir / "ca.pem"), **(extra or {})}
    kw: dict[str, Any] = {}
    if net is not None:
        host = net.host(name)
        extra = {"connector": f"amqp://{host}:0", **(extra or {})}
        config = {"acceptors.amqp": {"host": host}, "management": {"host": host}, **(config or {})}
        kw["users_file"] = write_users_file(Path(tmp_path) / "users.toml",
                                            {ADMIN[0]: (ADMIN[1], ["admin", "amq"]), "app": ("app", ["app"])})
    path = write_config(workdir, name=name, tls=tls,
                        config=cluster_config(mode=mode, static=static, extra=extra, config=config), **kw)
    node = BrokerProcess(workdir, path)
    if net is not None:
        node.preexec = net.enter(name)
    return node.start()


def start_cluster(tmp_path: Path, n: int, *, mode: str = "ON_DEMAND", extra: dict[str, Any] | None = None,
                  config: dict[str, dict[str, Any]] | None = None, chain: bool = False) -> list[BrokerProcess]:
    if chain:
        nodes: list[BrokerProcess | None] = [None] * n
        for i in reversed(range(n)):
            static = [nodes[i + 1].amqp_url] if i + 1 < n else []
            nodes[i] = start_node(tmp_path, f"node{i}", static=static, mode=mode,
                                  extra={"allow-direct-connections-only": True, **(extra or {})}, config=config)
        return nodes  # type: ignore[return-value]
    first = start_node(tmp_path, "node0", mode=mode, extra=extra, config=config)
    return [first] + [start_node(tmp_path, f"node{i}", static=[first.amqp_url], mode=mode, extra=extra, config=config)
                      for i in range(1, n)]


def restart_same_port(node: BrokerProcess) -> BrokerProcess:
    """Start a stopped (or killed) node again on the same data dir and the same AMQP port, as an
    operator restarts a broker (its peers keep dialling that address)."""
    port = node.port
    text = node.config_path.read_text()
    lines = text.splitlines()
    out, section = [], None
    for line in lines:
        if line.startswith("["):
            section = line
        if section == "[acceptors.amqp]" and line.startswith("port = "):
            line = f"port = {port}"
        out.append(line)
    node.config_path.write_text("\n".join(out) + "\n")
    if node.proc is not None and node.proc.poll() is None:
        node.terminate()
    return node.start()


def cluster_view(node: BrokerProcess) -> dict:
    status, body = http_json(node.management_url + "/api/v1/cluster", auth=ADMIN, timeout_s=10)
    assert status == 200, body
    return body


def wait_until(pred, timeout_s: float = 30.0, what: str = "condition"):
    """:func:`tests.waiting.wait_for` for cluster nodes: a node restarting (OSError, an asserted
    status) counts as "not yet"."""
    return wait_for(pred, timeout_s, what=what, ignore=RESTARTING)


def wait_mesh(nodes: list[BrokerProcess], timeout_s: float = 30.0) -> None:
    """Every node has a connected bridge to every other node."""
    ids = [n.node_id for n in nodes]

    def meshed():
        for n, me in zip(nodes, ids):
            up = {b["to"] for b in cluster_view(n)["bridges"] if b["connected"]}
            if not set(ids) - {me} <= up:
                return False
        return True
    wait_until(meshed, timeout_s, "a full mesh of bridges")


def remote_consumers(node: BrokerProcess, queue: str) -> dict[str, int]:
    q = node.queue(queue)
    if q is None:
        return {}
    return {r["node_id"]: r["consumers"] for r in q["remote_bindings"]}


def known_bindings(node: BrokerProcess, address: str | None = None) -> list[dict]:
    """Every remote binding ``node`` knows (``GET /api/v1/cluster``), optionally of one address."""
    return [b for b in cluster_view(node)["remote_bindings"] if address is None or b["address"] == address]


def wait_known_consumers(node: BrokerProcess, address: str, total: int, timeout_s: float = 30.0) -> None:
    """``node`` knows ``total`` consumers on remote queues of ``address``."""
    wait_until(lambda: sum(b["consumers"] for b in known_bindings(node, address)) == total, timeout_s,
               f"{total} remote consumers on {address} known to {node.workdir.name}")


def wait_remote_consumers(node: BrokerProcess, queue: str, total: int, timeout_s: float = 30.0) -> None:
    wait_until(lambda: sum(remote_consumers(node, queue).values()) == total, timeout_s,
               f"{total} remote consumers of {queue} known to {node.workdir.name}")


def wait_remote_bindings(node: BrokerProcess, queue: str, count: int, timeout_s: float = 30.0) -> None:
    wait_until(lambda: len(remote_consumers(node, queue)) == count, timeout_s,
               f"{count} remote bindings of {queue} known to {node.workdir.name}")


def connect(node: BrokerProcess, *, user: str = "app", password: str = "app") -> BlockingConnection:
    return BlockingConnection(node.amqp_url, timeout=20, user=user, password=password, allowed_mechs="PLAIN")


def send(node: BrokerProcess, address: str, bodies, *, durable: bool = True, properties=None) -> None:
    c = connect(node)
    try:
        s = c.create_sender(address)
        for b in bodies:
            s.send(Message(body=b, durable=durable, properties=properties))
    finally:
        c.close()


def receive(node: BrokerProcess, address: str, n: int, *, timeout_s: float = 20.0) -> list:
    """Receive exactly ``n`` messages (accepting each); fails if they do not come in time."""
    c = connect(node)
    try:
        r = c.create_receiver(address, credit=min(max(n, 1), 500))
        out = []
        deadline = time.monotonic() + timeout_s
        while len(out) < n:
            left = deadline - time.monotonic()
            assert left > 0, f"received {len(out)} of {n} from {address} on {node.workdir.name}"
            m = r.receive(timeout=left)
            out.append(m.body)
            r.accept()
        return out
    finally:
        c.close()


def assert_forwards(a: BrokerProcess, b: BrokerProcess, address: str = "orders", n: int = 20) -> None:
    """The cluster serves: ``n`` durable messages sent on A reach a consumer on B, in order, once."""
    cb = connect(b)
    try:
        r = cb.create_receiver(address, credit=max(n, 1))
        wait_known_consumers(a, address, 1)
        bodies = [f"{address}-{i}" for i in range(n)]
        send(a, address, bodies)
        got = []
        for _ in range(n):
            got.append(r.receive(timeout=20).body)
            r.accept()
        assert got == bodies
    finally:
        cb.close()


def drain(node: BrokerProcess, address: str, *, quiet_s: float = 1.0) -> list:
    """Everything that arrives until ``quiet_s`` passes with nothing."""
    from proton import Timeout
    c = connect(node)
    try:
        r = c.create_receiver(address, credit=500)
        out = []
        while True:
            try:
                m = r.receive(timeout=quiet_s)
            except Timeout:
                return out
            out.append(m.body)
            r.accept()
    finally:
        c.close()
