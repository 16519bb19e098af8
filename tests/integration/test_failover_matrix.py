"""The failover matrix (issue 19, part 4; docs/ha.md "Failover matrix"): every kind of client
against every kind of broker loss, real processes in the local deployment's shape.

The deployment is etc/ as ``bash etc/run-local.sh`` runs it — broker-1 (a replication primary)
and its backup broker-1-backup, broker-2 and broker-3 (live-only, one cluster), the router with
its ``auto``, ``proxy`` and ``redirect`` acceptors over the cluster pool (CLIENT_ID,
CONSISTENT_HASH, sticky cache) — from a private copy of etc/ on free ports, each process started
here the way ``lodestone-local`` starts it (same argv; ``router.local.cluster_discovery_args``),
so that the test, not a supervisor, decides when a broker comes back. One change to the copy:
broker-3 gets ``[ha] scale-down = true`` (a live-only node that scales down on SIGTERM).

The clients (tests/matrix_clients.py, tests/matrix_client.js), each a producer process and a
consumer process on an address of its own, both placed on the broker the event hits (their
container ids are chosen so that the router's own placement puts them there, asked through the
management API's ``target?key=``, which fills the sticky cache as a connection would):

=================  ======================================================  =============
client             what it is                                              front door
=================  ======================================================  =============
container          unmodified proton Container, proton's default reconnect auto (proxied)
blocking           proton BlockingConnection; the program reconnects on    proxy
                   ConnectionException (it has no reconnect of its own)
                   and sends a failed send again (no duplicate id)
rhea               unmodified rhea, rhea's default reconnect               auto (proxied)
failover           router.client.FailoverConnection (``_AMQ_DUPL_ID``)     redirect
rhea-helper        clients/node/lodestone-redirect.js; the program stamps  auto (redirected)
                   ``_AMQ_DUPL_ID`` and sends again what a lost connection
                   left without an outcome
=================  ======================================================  =============

The events, one after the other on the same deployment, each with a fresh set of clients:

* ``kill-primary`` — SIGKILL of broker-1; its backup takes the node id over;
* ``failback`` — broker-1 restarted; it copies the backup's journal and takes its id back;
* ``kill-no-backup`` — SIGKILL of broker-2, restarted by the test 1 s later (as lodestone-local
  does) — its acknowledged messages count once it is back;
* ``scale-down`` — SIGTERM of broker-3 (live-only, scale-down): its messages move to another node.

Per cell: **silence** — the longest time the consumer received nothing, from the event on (for
the kills and the scale-down the time from the signal to the first message after it; at a
failback, whose moment of handover no client can see coming, the gap around it); **lost** —
messages the producer saw accepted (all durable) that neither its consumer nor a final drain of
every live broker got; **dup** — a message received twice on one consumer connection (stored
twice); **redeliv** — received again on a later connection (an acceptance in flight when the
connection was lost: at least once, as documented). Per event, 100 durable messages sent straight
to the member the event hits and consumed by nobody must all be found afterwards (on the backup,
back on the primary, on the restarted broker-2, on the scale-down's target). Goals: silence ≤ 3 s
everywhere, lost = 0 everywhere, dup = 0 for the clients that send ``_AMQ_DUPL_ID`` (failover,
rhea-helper). A cell still silent 20 s after its event is cut off there ("> N s").

``pytest -s`` prints the table in the docs/ha.md form. ``LODESTONE_MATRIX_OUT=<file>`` appends the
run as one JSON line; ``python -m tests.integration.test_failover_matrix <file>`` prints the runs
in it as one table (min–max per cell). ``LODESTONE_MATRIX_EVENTS=failback,scale-down`` runs some
events only. Each client's JSON lines and stderr are kept under the test's tmp dir
(``clients/<event>/``), each process's log under ``logs/``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.brokerproc import ADMIN, BrokerProcess
from tests.integration.test_local_deployment import FIXED_PORTS, REPO
from tests.nodeclients import node_executable
from tests.routerproc import RouterProcess
from tests.serverproc import free_ports, http_json
from tests.waiting import RESTARTING, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLIENTS = ("container", "blocking", "rhea", "failover", "rhea-helper")
ACCEPTOR = {"container": "auto", "blocking": "proxy", "rhea": "auto", "failover": "redirect", "rhea-helper": "auto"}
SENDS_DUPLICATE_ID = {"failover", "rhea-helper"}
EVENTS = ("kill-primary", "failback", "kill-no-backup", "scale-down")
GOAL_SILENCE_S = 3.0
WATCH_CAP_S = 20.0          # a cell still silent this long after its event is reported as "> 20 s"
INTERVAL_S = 0.05           # each producer sends every 50 ms


# -- the deployment ----------------------------------------------------------------------------------

@dataclass(eq=False)
class EtcBroker(BrokerProcess):
    """A broker of the etc/ copy, started with lodestone-local's argv (``args``); ready once it
    printed the ``want`` listening lines (a passive backup: management only)."""

    args: list = field(default_factory=list)
    want: tuple = ("amqp", "management")

    def start(self) -> "EtcBroker":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._spawn(["broker", "run", str(self.config_path), *self.args], lambda urls: set(self.want) <= set(urls),
                    60.0, self.workdir.name)
        return self

    def spawn_nowait(self) -> threading.Thread:
        """Start in a thread (a restarted primary listens only once it has failed back)."""
        t = threading.Thread(target=self.start, daemon=True)
        t.start()
        return t


class Deployment:
    """etc/ on free ports: broker-1, broker-1-backup, broker-2, broker-3 (scale-down) and the router."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        etc = tmp_path / "etc"
        etc.mkdir()
        self.ports = dict(zip(FIXED_PORTS, free_ports(len(FIXED_PORTS))))
        for f in (REPO / "etc").glob("*.toml"):
            text = f.read_text()
            for old, new in self.ports.items():
                text = re.sub(rf"(?<![0-9]){old}(?![0-9])", str(new), text)
            if f.name == "broker-3.toml":
                assert "[ha]" not in text
                text += '\n[ha]\npolicy = "live-only"\nscale-down = true\n'
            (etc / f.name).write_text(text)
        from router.local import cluster_discovery_args

        self.discovery_args, self.discovery_line = cluster_discovery_args(etc, 3, "auto")
        logs = tmp_path / "logs"
        self.brokers = {name: EtcBroker(logs / name, etc / f"{name}.toml", args=list(self.discovery_args),
                                        want=("management",) if name == "broker-1-backup" else ("amqp", "management"))
                        for name in ("broker-1", "broker-2", "broker-3", "broker-1-backup")}
        self.router = RouterProcess(logs / "router", etc / "router.toml")
        self.node_ids: dict[str, str] = {}

    def start(self) -> None:
        threads = [b.spawn_nowait() for b in self.brokers.values()]
        for t in threads:
            t.join(90)
        for name, b in self.brokers.items():
            assert b.proc is not None and set(b.want) <= set(b.urls), f"{name} did not start:\n{b.stderr_text()}"
        (self.tmp / "logs" / "router").mkdir(parents=True, exist_ok=True)
        self.router.start(expect=4)
        self.node_ids = {name: self.ha(name)["node_id"] for name in ("broker-1", "broker-2", "broker-3")}
        wait_for(lambda: self.ha("broker-1-backup")["phase"] == "in-sync", 60, ignore=RESTARTING,
                 what="broker-1's backup in sync")
        wait_for(lambda: self.pool_ready() == {"broker-1": True, "broker-2": True, "broker-3": True}, 60,
                 ignore=RESTARTING, what="the router's pool: three ready brokers")

    # etc/'s ports (README "The local deployment"), mapped to this copy's by ``self.ports``
    AMQP_PORT = {"broker-1": 15672, "broker-2": 15673, "broker-3": 15674, "broker-1-backup": 15675}
    MGMT_PORT = {"broker-1": 18161, "broker-2": 18162, "broker-3": 18163, "broker-1-backup": 18164}
    FRONT_PORT = {"auto": 5672, "proxy": 5673, "redirect": 5674}

    def mgmt(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[self.MGMT_PORT[name]]}"

    def amqp(self, name: str) -> str:
        return f"amqp://127.0.0.1:{self.ports[self.AMQP_PORT[name]]}"

    def front(self, acceptor: str) -> tuple[str, int]:
        return "127.0.0.1", self.ports[self.FRONT_PORT[acceptor]]

    def ha(self, name: str) -> dict:
        status, body = http_json(self.mgmt(name) + "/api/v1/ha", auth=ADMIN, timeout_s=5)
        assert status == 200, body
        return body

    def pool_ready(self) -> dict:
        status, body = self.router.get("/api/v1/routers/main/pool")
        assert status == 200, body
        names = {v: k for k, v in self.node_ids.items()}
        out: dict = {}
        for t in body["targets"]:
            name = names.get(t["node_id"], t["name"])
            out[name] = out.get(name, False) or t["ready"]
        return out

    def place(self, prefix: str, broker: str) -> str:
        """A container id the router places on ``broker``'s node id (and now keeps there: the
        lookup fills the sticky cache as a connection would)."""
        want = self.node_ids[broker]
        for n in range(200):
            key = f"{prefix}-{n}"
            body = self.router.target_for("main", key)
            if body.get("outcome") == "OK" and body.get("nodeID") == want:
                return key
        raise AssertionError(f"no key of {prefix}-* lands on {broker}: last answer {body}")

    def stop(self) -> None:
        try:
            if self.router.proc is not None:
                self.router.terminate()
        finally:
            for b in self.brokers.values():
                if b.proc is not None and b.proc.poll() is None:
                    try:
                        b.terminate(30)
                    except subprocess.TimeoutExpired:
                        pass
                b._release()


# -- the clients ---------------------------------------------------------------------------------------

class ClientProc:
    """One client program (a producer or a consumer) and the JSON lines it printed so far."""

    def __init__(self, client: str, role: str, cfg: dict, logdir: Path):
        self.client, self.role = client, role
        arg = json.dumps({"kind": client, "role": role, **cfg})
        if client.startswith("rhea"):
            argv = [shutil.which("node") or "node", str(REPO / "tests" / "matrix_client.js"), arg]
        else:
            argv = [sys.executable, "-m", "tests.matrix_clients", arg]
        logdir.mkdir(parents=True, exist_ok=True)
        with (logdir / f"{client}-{role}.stderr.log").open("ab") as err:
            self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.events: list[dict] = []
        self._log = (logdir / f"{client}-{role}.jsonl").open("ab")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self._log.write(raw)
            try:
                self.events.append(json.loads(raw))
            except ValueError:
                self.events.append({"k": "garbage", "t": time.time(), "line": raw.decode(errors="replace")[:200]})

    def of(self, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e["k"] == kind]

    def last(self, kind: str) -> float | None:
        for e in reversed(list(self.events)):
            if e["k"] == kind:
                return e["t"]
        return None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        self.proc.stdout.close()
        self._log.close()


@dataclass
class Cell:
    event: str
    client: str
    silence_s: float            # longest time without a message, from the event on
    first_s: float | None       # from the event to the first message received after it
    resumed: bool               # messages came again after the longest silence (not still silent at the end)
    acked: int
    lost: int
    dup: int
    redeliv: int
    generations: int            # consumer connections (1 = never reconnected)
    notes: str = ""

    @property
    def ok(self) -> bool:
        return (self.resumed and self.silence_s <= GOAL_SILENCE_S and self.lost == 0
                and (self.client not in SENDS_DUPLICATE_ID or self.dup == 0))


def silence(recv_times: list[float], t_event: float, t_end: float) -> tuple[float, bool]:
    """The longest time without a receipt in [t_event, t_end] (the first gap starts at the
    event, the last ends at ``t_end``), and whether the consumer resumed after it (False when the
    longest gap is the one still open at ``t_end``)."""
    after = sorted(t for t in recv_times if t_event < t <= t_end)
    points = [t_event, *after, t_end]
    gaps = [b - a for a, b in zip(points, points[1:])]
    longest = max(gaps)
    return longest, gaps.index(longest) != len(gaps) - 1


def count_receipts(recvs: list[dict]) -> tuple[set, int, int]:
    """(ids received, dup: extra receipts on one connection, redeliv: receipts again on a later
    connection)."""
    seen: dict[int, set] = {}
    dup = redeliv = 0
    for e in recvs:
        gens = seen.setdefault(e["i"], set())
        if e["g"] in gens:
            dup += 1
        elif gens:
            redeliv += 1
        gens.add(e["g"])
    return set(seen), dup, redeliv


# -- the events ----------------------------------------------------------------------------------------

EVENT_TARGET = {"kill-primary": "broker-1", "failback": "broker-1", "kill-no-backup": "broker-2",
                "scale-down": "broker-3"}
RESTART_AFTER_S = 1.0       # lodestone-local's first restart back-off


def _kill_primary(dep: Deployment) -> tuple[float, threading.Event, dict]:
    done, info = threading.Event(), {}
    t = time.time()
    dep.brokers["broker-1"].kill()

    def settle():
        wait_for(lambda: dep.ha("broker-1-backup")["active"], 60, ignore=RESTARTING, what="the backup active")
        info["settled"] = time.time()
        done.set()
    threading.Thread(target=settle, daemon=True).start()
    return t, done, info


def _failback(dep: Deployment) -> tuple[float, threading.Event, dict]:
    done, info = threading.Event(), {}
    t = time.time()

    def settle():
        dep.brokers["broker-1"].start()          # listens (amqp) once it has the node id back
        info["settled"] = time.time()
        wait_for(lambda: not dep.ha("broker-1-backup")["active"], 30, ignore=RESTARTING,
                 what="the backup passive again")
        done.set()
    threading.Thread(target=settle, daemon=True).start()
    return t, done, info


def _kill_no_backup(dep: Deployment) -> tuple[float, threading.Event, dict]:
    done, info = threading.Event(), {}
    t = time.time()
    dep.brokers["broker-2"].kill()

    def settle():
        time.sleep(RESTART_AFTER_S)   # the thing under test: broker-2 stays down this long
        dep.brokers["broker-2"].start()
        info["settled"] = time.time()
        done.set()
    threading.Thread(target=settle, daemon=True).start()
    return t, done, info


def _scale_down(dep: Deployment) -> tuple[float, threading.Event, dict]:
    done, info = threading.Event(), {}
    b = dep.brokers["broker-3"]
    t = time.time()
    b.proc.send_signal(signal.SIGTERM)

    def settle():
        info["exit"] = b.proc.wait(60)
        info["settled"] = time.time()
        b._release()
        done.set()
    threading.Thread(target=settle, daemon=True).start()
    return t, done, info


ACTIONS = {"kill-primary": _kill_primary, "failback": _failback, "kill-no-backup": _kill_no_backup,
           "scale-down": _scale_down}


def serving(dep: Deployment, broker: str) -> str:
    """The member serving ``broker``'s node id now."""
    if broker == "broker-1" and dep.ha("broker-1-backup")["active"]:
        return "broker-1-backup"
    return broker


def live_members(dep: Deployment) -> list[str]:
    return [n for n, b in dep.brokers.items() if b.proc is not None and b.proc.poll() is None and "amqp" in b.urls
            and (n != "broker-1-backup" or dep.ha(n)["active"])]


def drain(dep: Deployment, addresses: dict[str, set], timeout_s: float = 20.0) -> dict[str, set]:
    """Receive what is left on ``addresses`` (address → ids still missing) straight from the live
    brokers whose queues hold some (``GET /api/v1/queues``), until every missing id came or
    ``timeout_s`` passed."""
    from proton import Timeout
    from proton.utils import BlockingConnection

    got: dict[str, set] = {a: set() for a in addresses}

    def one_round() -> bool:   # True once every missing id came
        if all(addresses[a] <= got[a] for a in addresses):
            return True
        for name in live_members(dep):
            status, qs = http_json(dep.mgmt(name) + "/api/v1/queues", auth=ADMIN, timeout_s=5)
            depth = {q["name"]: q["depth"] for q in qs} if status == 200 else {}
            todo = [a for a in addresses if not addresses[a] <= got[a] and depth.get(a, 0) > 0]
            if not todo:
                continue
            conn = BlockingConnection(dep.amqp(name), timeout=10, user="app", password="app", allowed_mechs="PLAIN")
            try:
                for a in todo:
                    r = conn.create_receiver(a, credit=200)
                    while True:
                        try:
                            m = r.receive(timeout=0.5)
                        except Timeout:
                            break
                        got[a].add(m.properties["i"])
                        r.accept()
                    r.close()
            finally:
                conn.close()
        return all(addresses[a] <= got[a] for a in addresses)
    wait_for(one_round, timeout_s, interval_s=0.2, raise_on_timeout=False, what="the missing ids")
    return got


@dataclass
class EventReport:
    event: str
    member: str                 # the member serving the clients' broker before the event
    parked: int                 # durable messages stored there before the event, consumed by nobody
    parked_back: int            # of those, drained from the live brokers after the event
    settled_s: float            # event → backup active / primary failed back / restarted / exited


PARKED = 100


def park(url: str, address: str, n: int) -> None:
    """Send ``n`` durable messages (``i`` = 0 … n-1) straight to a broker; returns once all are
    accepted."""
    from proton import Message
    from proton.utils import BlockingConnection

    conn = BlockingConnection(url, timeout=10, user="app", password="app", allowed_mechs="PLAIN")
    try:
        snd = conn.create_sender(address)
        for i in range(n):
            snd.send(Message(body=f"{address}-{i}", durable=True, properties={"i": i}))
    finally:
        conn.close()


def run_event(dep: Deployment, event: str, tag: str, logdir: Path, procs: list) -> tuple[list[Cell], EventReport]:
    broker = EVENT_TARGET[event]
    pairs: dict[str, tuple[ClientProc, ClientProc, str]] = {}
    keys = []
    for client in CLIENTS:
        address = f"matrix.{tag}.{event}.{client}"
        host, port = dep.front(ACCEPTOR[client])
        made = {}
        for role in ("consumer", "producer"):
            key = dep.place(f"{tag}-{event}-{client}-{role[0]}", broker)
            keys.append(key)
            cfg = {"address": address, "container_id": key, "url": f"amqp://{host}:{port}", "host": host,
                   "port": port, "interval_s": INTERVAL_S, "interval_ms": int(INTERVAL_S * 1000)}
            made[role] = ClientProc(client, role, cfg, logdir / event)
            procs.append(made[role])
        pairs[client] = (made["producer"], made["consumer"], address)

    # every pair flows, every client is on the broker the event hits
    member = serving(dep, broker)

    def placed():
        dead = [f"{p.client}-{p.role}" for pc in pairs.values() for p in pc[:2] if p.proc.poll() is not None]
        if dead:
            raise RuntimeError(f"client programs exited: {dead} (see {logdir / event})")
        status, conns = http_json(dep.mgmt(member) + "/api/v1/connections", auth=ADMIN, timeout_s=5)
        return status == 200 and set(keys) <= {c["container_id"] for c in conns}
    wait_for(placed, 40, interval_s=0.2, ignore=RESTARTING, what=f"every client of {event} connected to {member}")
    wait_for(lambda: all(len(c.of("recv")) >= 10 for _, c, _ in pairs.values()), 40, interval_s=0.1,
             ignore=RESTARTING, what=f"every pair of {event} flowing")

    # messages nobody consumes before the event: stored on the member the event hits, they must
    # all be there afterwards (on the backup, moved by the scale-down, after the restart)
    parked = f"matrix.{tag}.{event}.parked"
    park(dep.amqp(member), parked, PARKED)

    t_event, settled, info = ACTIONS[event](dep)

    def recovered():   # settled 2 s ago, and every consumer received within the last second
        now = time.time()
        return settled.is_set() and now >= info["settled"] + 2.0 and \
            all((c.last("recv") or 0) > max(now - 1.0, t_event) for _, c, _ in pairs.values())
    wait_for(recovered, max(0.0, t_event + WATCH_CAP_S - time.time()), interval_s=0.1, raise_on_timeout=False,
             what=f"{event}: the deployment recovered")
    assert settled.wait(60), f"{event}: the deployment did not settle"
    t_end = time.time()
    for p, _, _ in pairs.values():
        p.proc.send_signal(signal.SIGTERM)
    for p, _, _ in pairs.values():
        p.stop()
    acked = {client: {e["i"] for e in p.of("ack")} for client, (p, _, _) in pairs.items()}
    all_in = lambda: all(acked[cl] <= {e["i"] for e in c.of("recv")} for cl, (_, c, _) in pairs.items())  # noqa: E731
    # a stalled consumer: what it did not get is drained below
    wait_for(all_in, 5, interval_s=0.1, ignore=RESTARTING, raise_on_timeout=False,
             what="every acknowledged message consumed")
    for _, c, _ in pairs.values():
        c.stop()
    missing = {a: acked[cl] - {e["i"] for e in c.of("recv")} for cl, (_, c, a) in pairs.items()}
    missing[parked] = set(range(PARKED))
    drained = drain(dep, {a: m for a, m in missing.items() if m})
    report = EventReport(event, member, PARKED, len(drained[parked]), info["settled"] - t_event)
    cells = []
    for client, (p, c, address) in pairs.items():
        recvs = c.of("recv")
        ids, dup, redeliv = count_receipts(recvs)
        quiet, resumed = silence([e["t"] for e in recvs], t_event, t_end)
        lost = acked[client] - ids - drained.get(address, set())
        notes = []
        resent = sum(e.get("resent", 0) for e in p.of("done"))
        if resent:
            notes.append(f"{resent} send{'s' if resent > 1 else ''} resent")
        if drained.get(address):
            notes.append(f"{len(drained[address] & acked[client])} only by the final drain")
        if lost:
            notes.append(f"lost ids {sorted(lost)[:5]}")
        first = min((e["t"] for e in recvs if e["t"] > t_event), default=None)
        cells.append(Cell(event, client, quiet, None if first is None else first - t_event, resumed,
                          len(acked[client]), len(lost), dup, redeliv,
                          max((e["g"] for e in c.of("open")), default=0), "; ".join(notes)))
    if event == "scale-down":
        assert info.get("exit") == 0, f"broker-3 scale-down exit status {info.get('exit')}"
    return cells, report


# -- the table -----------------------------------------------------------------------------------------

def render(cells: list[Cell], reports: list[EventReport]) -> str:
    """The matrix in docs/ha.md's form: one row per event, one column per client; each cell
    ``silence s / lost / dup``, ✗ where a goal is missed."""
    head = "| event | " + " | ".join(CLIENTS) + " |"
    out = [head, "|---" * (len(CLIENTS) + 1) + "|"]
    by = {(c.event, c.client): c for c in cells}
    for ev in EVENTS:
        row = [ev]
        for cl in CLIENTS:
            c = by.get((ev, cl))
            if c is None:
                row.append("–")
                continue
            s = f"{c.silence_s:.2f} s" if c.resumed else f"> {c.silence_s:.0f} s"
            row.append(f"{s} / {c.lost} / {c.dup}{'' if c.ok else ' ✗'}")
        out.append("| " + " | ".join(row) + " |")
    detail = ["", "| event | client | silence s | first s | acked | lost | dup | redeliv | consumer conns | notes |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        first = "–" if c.first_s is None else f"{c.first_s:.2f}"
        detail.append(f"| {c.event} | {c.client} | {'' if c.resumed else '> '}{c.silence_s:.2f} | {first} | {c.acked} | "
                      f"{c.lost} | {c.dup} | {c.redeliv} | {c.generations} | {c.notes} |")
    events = ["", "| event | clients on | settled after s | parked durable messages back |", "|---|---|---|---|"]
    events += [f"| {r.event} | {r.member} | {r.settled_s:.2f} | {r.parked_back}/{r.parked} |" for r in reports]
    return "\n".join(out + detail + events)


@pytest.fixture
def node():
    """Without node the matrix is skipped, loudly; rhea is installed (npm ci) when missing."""
    return node_executable("failover matrix (rhea clients)")


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path)
    try:
        dep.start()
        yield dep
    finally:
        dep.stop()


def test_failover_matrix(node, deployment, tmp_path):
    started = time.monotonic()
    procs: list[ClientProc] = []
    cells: list[Cell] = []
    reports: list[EventReport] = []
    tag = f"r{os.getpid()}"
    try:
        for event in os.environ.get("LODESTONE_MATRIX_EVENTS", ",".join(EVENTS)).split(","):
            t0 = time.monotonic()
            more, report = run_event(deployment, event, tag, tmp_path / "clients", procs)
            cells += more
            reports.append(report)
            print(f"\n{event}: {time.monotonic() - t0:.1f} s", flush=True)
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.kill()
            p.stop()
        table = render(cells, reports)
        print(f"\nfailover matrix ({time.monotonic() - started:.0f} s; cell: silence / lost / dup)\n{table}",
              flush=True)
        out = os.environ.get("LODESTONE_MATRIX_OUT")
        if out:
            with open(out, "a") as f:
                f.write(json.dumps({"cells": [c.__dict__ for c in cells],
                                    "events": [r.__dict__ for r in reports]}) + "\n")
    bad = [f"{c.event}/{c.client}: silence {'' if c.resumed else 'still at the end, '}{c.silence_s:.2f} s, "
           f"lost {c.lost}, dup {c.dup}" for c in cells if not c.ok]
    bad += [f"{r.event}: {r.parked - r.parked_back} of {r.parked} parked durable messages lost" for r in reports
            if r.parked_back != r.parked]
    assert not bad, "cells missing a goal:\n" + "\n".join(bad)


@pytest.mark.parametrize("times, expect", [
    ([9.0, 10.2, 10.9, 11.6, 11.95], (0.7, True)),  # messages every 0.7 s from 0.2 s after the event
    ([10.1, 10.2, 11.7, 11.9], (1.5, True)),        # a later gap (a failback's hand-over) counts
    ([10.1, 10.2], (1.8, False)),                   # still silent at the end
    ([], (2.0, False)),                             # nothing after the event
])
def test_silence_is_the_longest_gap_from_the_event(times, expect):
    quiet, resumed = silence(times, 10.0, 12.0)
    assert (round(quiet, 6), resumed) == expect


def test_receipts_on_one_connection_are_duplicates_on_another_redeliveries():
    recvs = [{"i": 1, "g": 1}, {"i": 2, "g": 1}, {"i": 2, "g": 2}, {"i": 3, "g": 2}, {"i": 3, "g": 2}]
    assert count_receipts(recvs) == ({1, 2, 3}, 1, 1)


def summarize(runs: list[dict]) -> str:
    """Several runs (the ``LODESTONE_MATRIX_OUT`` lines) as one docs/ha.md table: each cell's
    silence min–max over the runs, the lost and dup totals, ✗ where a run missed a goal."""
    cells: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        for c in run["cells"]:
            cells.setdefault((c["event"], c["client"]), []).append(c)
    out = [f"| event ({len(runs)} runs) | " + " | ".join(CLIENTS) + " |", "|---" * (len(CLIENTS) + 1) + "|"]
    for ev in EVENTS:
        row = [ev]
        for cl in CLIENTS:
            cs = cells.get((ev, cl), [])
            if not cs:
                row.append("–")
                continue
            lo, hi = min(c["silence_s"] for c in cs), max(c["silence_s"] for c in cs)
            still = any(not c["resumed"] for c in cs)
            span = f"{lo:.2f}–{hi:.2f} s" if hi - lo >= 0.005 else f"{lo:.2f} s"
            if still:
                span = f"{lo:.2f} s – > {hi:.0f} s" if lo < hi and any(c["resumed"] for c in cs) else f"> {lo:.0f} s"
            lost, dup = sum(c["lost"] for c in cs), sum(c["dup"] for c in cs)
            ok = all(Cell(**{**c, "notes": ""}).ok for c in cs)
            row.append(f"{span} / {lost} / {dup}{'' if ok else ' ✗'}")
        out.append("| " + " | ".join(row) + " |")
    parked = {}
    for run in runs:
        for r in run["events"]:
            parked.setdefault(r["event"], []).append(r)
    out += ["", "| event | settled after (s) | parked durable messages found afterwards |", "|---|---|---|"]
    for ev, rs in parked.items():
        out.append(f"| {ev} | {min(r['settled_s'] for r in rs):.2f}–{max(r['settled_s'] for r in rs):.2f} | "
                   f"{sum(r['parked_back'] for r in rs)} of {sum(r['parked'] for r in rs)} |")
    return "\n".join(out)


if __name__ == "__main__":
    # python -m tests.integration.test_failover_matrix <LODESTONE_MATRIX_OUT file>: the runs' table
    with open(sys.argv[1]) as f:
        print(summarize([json.loads(line) for line in f if line.strip()]))
