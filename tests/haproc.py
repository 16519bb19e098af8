"""Real HA pairs for tests: a primary and its backup(s) as broker processes on one shared data
directory (``[ha] policy = "shared-store"``).

    from tests.haproc import start_pair, wait_active, ha_view

    primary, backup = start_pair(tmp_path)            # the primary active, the backup waiting
    primary.kill()
    wait_active(backup)                               # GET /api/v1/ha says active

Each member has its own config (``<tmp>/<name>/broker.toml``) and fixed AMQP and management
ports chosen free up front, so a member that activates again (after a failback) listens where
it did before and a router can list the pair's addresses. A backup prints its ``listening
amqp`` line only when it activates: :class:`HaMember` is started once its management API
listens, and ``amqp_url`` follows the latest ``listening`` line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.brokerproc import ADMIN, BrokerProcess, write_config, write_users_file
from tests.serverproc import free_ports, http_json
from tests.waiting import wait_for


class HaMember(BrokerProcess):
    """A pair member: started once its management API listens (a backup has no AMQP listener
    until it activates)."""

    fixed_host = "127.0.0.1"

    def start(self) -> "HaMember":
        self._spawn(["broker", "run", str(self.config_path)], lambda urls: "management" in urls,
                    self.start_timeout_s, "HA member", preexec_fn=self.preexec)
        return self

    @property
    def data_dir(self) -> Path:
        return self.shared_dir

    @property
    def amqp_url(self) -> str:
        return f"amqp://{self.fixed_host}:{self.fixed_port}"

    @property
    def port(self) -> int:
        return self.fixed_port


def start_member(tmp_path: Path, name: str, shared: Path, role: str, *, ha: dict[str, Any] | None = None,
                 config: dict[str, dict[str, Any]] | None = None, cluster: dict[str, Any] | None = None,
                 start: bool = True) -> HaMember:
    """One member of a shared-store pair; ``cluster``: its ``[cluster]`` table, with the
    ``connector`` set to this member's own AMQP port."""
    amqp, mgmt = free_ports(2)
    workdir = Path(tmp_path) / name
    tables = {"node": {"data-dir": str(shared)},
              "acceptors.amqp": {"port": amqp},
              "management": {"port": mgmt},
              "journal": {"sync": "batch"},
              "ha": {"policy": "shared-store", "role": role, **({"wait-for-activation": False}
                                                                 if role == "primary" else {}), **(ha or {})}}
    if cluster is not None:
        tables["cluster"] = {**cluster, "connector": f"amqp://127.0.0.1:{amqp}"}
    for k, v in (config or {}).items():
        tables.setdefault(k, {}).update(v)
    path = write_config(workdir, name=name, config=tables)
    m = HaMember(workdir, path)
    m.shared_dir = shared
    m.fixed_port = amqp
    if start:
        m.start()
    return m


def start_clustered_primary(tmp_path: Path, made: list) -> tuple:
    """A live cluster member (``other``, a replication primary on its own) and an active
    shared-store primary in its cluster, each appended to ``made`` as it starts. Returns
    ``(other, primary, cluster, shared)``: start its backup with ``start_member(tmp_path,
    "backup", shared, "backup", cluster=cluster)``."""
    other = start_replica(tmp_path, "other", "primary", ha={"group-name": "gx"})
    made.append(other)
    wait_active(other)
    cluster = {"name": "test-cluster", "static-connectors": [other.amqp_url], "user": "cluster-user",
               "password": CLUSTER_PASSWORD, "retry-interval-ms": 100, "max-retry-interval-ms": 500}
    shared = Path(tmp_path) / "shared-store"
    primary = start_member(tmp_path, "primary", shared, "primary", cluster=cluster)
    made.append(primary)
    wait_active(primary)
    return other, primary, cluster, shared


def start_pair(tmp_path: Path, *, primary_ha: dict | None = None, backup_ha: dict | None = None,
               config: dict | None = None) -> tuple[HaMember, HaMember]:
    shared = Path(tmp_path) / "shared-store"
    primary = start_member(tmp_path, "primary", shared, "primary", ha=primary_ha, config=config)
    wait_active(primary)
    backup = start_member(tmp_path, "backup", shared, "backup", ha=backup_ha, config=config)
    wait_phase(backup, "waiting-for-live-lock")
    return primary, backup


CLIENT = {"user": "app", "password": "app", "allowed_mechs": "PLAIN", "timeout": 20}


def send(member, address: str, bodies) -> None:
    """Send durable messages with an unmodified proton client; returns once each is accepted."""
    from proton import Message
    from proton.utils import BlockingConnection

    conn = BlockingConnection(member.amqp_url, **CLIENT)
    try:
        snd = conn.create_sender(address)
        for b in bodies:
            snd.send(Message(body=b, durable=True))
    finally:
        conn.close()


def acknowledges(member, timeout_s: float = 1.0) -> bool:
    """Does ``member`` acknowledge a durable send right now (a new connection, address "probe")?"""
    from proton import Message
    from proton.utils import BlockingConnection

    try:
        conn = BlockingConnection(member.amqp_url, **{**CLIENT, "timeout": timeout_s})
    except Exception:
        return False
    try:
        conn.create_sender("probe").send(Message(body="probe", durable=True))
        return True
    except Exception:
        return False
    finally:
        try:
            conn.close()
        except Exception:
            pass


def receive_all(member, address: str, *, quiet_s: float = 1.0) -> list:
    """Receive and accept until nothing arrives for ``quiet_s``; the bodies, in order."""
    from proton.utils import BlockingConnection

    conn = BlockingConnection(member.amqp_url, **CLIENT)
    got = []
    try:
        rcv = conn.create_receiver(address, credit=500)
        while True:
            try:
                m = rcv.receive(timeout=quiet_s)
            except Exception:   # proton's Timeout: nothing more within quiet_s
                break
            got.append(m.body)
            rcv.accept()
    finally:
        conn.close()
    return got


def broker_info(member) -> dict:
    status, body = http_json(member.management_url + "/api/v1/broker", auth=ADMIN, timeout_s=10)
    assert status == 200, body
    return body


def ha_view(m: BrokerProcess) -> dict:
    status, body = http_json(m.management_url + "/api/v1/ha", auth=ADMIN, timeout_s=10)
    assert status == 200, body
    return body


def wait_phase(m: BrokerProcess, phase: str, timeout_s: float = 30.0) -> dict:
    return wait_for(lambda: ha_view(m), timeout_s, interval_s=0.02, until=lambda v: v["phase"] == phase,
                    what=f"{m.workdir.name} to reach phase {phase!r}", ignore=OSError)


def wait_active(m: BrokerProcess, timeout_s: float = 30.0) -> dict:
    return wait_phase(m, "active", timeout_s)


def wait_replication(m: BrokerProcess, state: str, timeout_s: float = 20.0) -> dict:
    """Wait until the primary ``m`` reports its replication link in ``state`` (e.g. "in-sync")."""
    return wait_for(lambda: ha_view(m), timeout_s, until=lambda v: v["replication"]["state"] == state,
                    what=f"{m.workdir.name}'s replication to be {state!r}")


# -- replicated pairs ([ha] policy = "replication"; docs/ha.md "Replication") -------------------------

CLUSTER_PASSWORD = "test-cluster-secret"


def start_replica(tmp_path: Path, name: str, role: str, *, static: list[str] = (), ha: dict[str, Any] | None = None,
                  config: dict[str, dict[str, Any]] | None = None, start: bool = True, net=None) -> HaMember:
    """One member of a replicated pair (its own data dir), in a cluster named ``test-cluster``
    with ``static`` connectors; fixed free ports, so it listens where it said it would when it
    activates. ``net``: a :class:`tests.netns.Network` with a member of this name: the broker
    runs in that member's namespace, on its address, with users that may log in from anywhere
    (the sample users of etc/users.toml are for loopback only)."""
    amqp, mgmt = free_ports(2)
    workdir = Path(tmp_path) / name
    host = net.host(name) if net is not None else "127.0.0.1"
    tables = {"acceptors.amqp": {"host": host, "port": amqp},
              "management": {"host": host, "port": mgmt},
              "journal": {"sync": "batch"},
              "cluster": {"name": "test-cluster", "connector": f"amqp://{host}:{amqp}",
                          "static-connectors": list(static), "user": "cluster-user",
                          "password": CLUSTER_PASSWORD, "retry-interval-ms": 100, "max-retry-interval-ms": 500},
              "ha": {"policy": "replication", "role": role, **(ha or {})}}
    for k, v in (config or {}).items():
        tables.setdefault(k, {}).update(v)
    users = {}
    if net is not None:
        users["users_file"] = write_users_file(Path(tmp_path) / "users.toml",
                                               {ADMIN[0]: (ADMIN[1], ["admin", "amq"]), "app": ("app", ["app"])})
    path = write_config(workdir, name=name, config=tables, **users)
    m = HaMember(workdir, path)
    m.shared_dir = workdir / "data"
    m.fixed_port = amqp
    m.fixed_host = host
    if net is not None:
        m.preexec = net.enter(name)
    if start:
        m.start()
    return m
