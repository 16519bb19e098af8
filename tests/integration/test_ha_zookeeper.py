"""A replicated pair coordinated by a real Apache ZooKeeper ([ha.manager]; docs/ha.md "A pair
coordinated by ZooKeeper"): the lock decides who serves, the activation sequence keeps a stale
copy from serving. Real broker processes (tests/haproc.py), Debian's ZooKeeper
(tests/zkproc.py), faults by SIGKILL, SIGSTOP and cut links in network namespaces
(tests/netns.py). "Serves" is read from AMQP: a durable send acknowledged by the member."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from tests import netns, zkproc
from tests.haproc import acknowledges, ha_view, receive_all, send, start_replica, wait_active, wait_phase
from tests.waiting import wait_for

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(zkproc.available() is not None, reason=str(zkproc.available()))]

TICK_MS = 250
SESSION_MS = 1500
#: the backup tries the lock for longer than a session (seed 001: vote-retry-wait × (vote-retries + 1) > session-ms)
LOCK_HA = {"vote-retries": 5, "vote-retry-wait-ms": 500}


def manager(zk, **extra) -> dict:
    return {"type": "zookeeper", "connect-string": zk.connect_string, "session-ms": SESSION_MS,
            "connection-ms": 2000, "retries-ms": 200, **extra}


def coordinated_pair(tmp_path, procs, zk, *, net=None, primary_ha=None, backup_ha=None, static=None):
    primary = start_replica(tmp_path, "primary", "primary", ha={"manager": manager(zk), **(primary_ha or {})},
                            net=net)
    procs.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=static or [primary.amqp_url],
                           ha={"manager": manager(zk), **LOCK_HA, **(backup_ha or {})}, net=net)
    procs.append(backup)
    wait_phase(backup, "in-sync")
    return primary, backup


def sequences(member) -> tuple:
    m = ha_view(member)["manager"]
    return m["local_activation_sequence"], m["coordinated_activation_sequence"]


def accepts(member, timeout_s: float = 0.5) -> bool:
    return acknowledges(member, timeout_s)


class _Probe:
    """One member's sender, kept open between samples (a new connection costs more than the
    100 ms between samples); reconnected after a failure."""

    def __init__(self, member) -> None:
        self.member = member
        self.conn = None
        self.sender = None
        self.errors: list = []

    def send(self) -> bool:
        from proton import Message
        from proton.utils import BlockingConnection

        try:
            if self.conn is None:
                host, port = self.member.fixed_host, self.member.fixed_port
                socket.create_connection((host, port), timeout=0.5).close()   # refused: at once
                self.conn = BlockingConnection(self.member.amqp_url, user="app", password="app",
                                               allowed_mechs="PLAIN", timeout=3.0)
                self.sender = self.conn.create_sender("probe")
            self.sender.send(Message(body="probe", durable=True))
            return True
        except Exception as exc:
            self.errors.append((time.monotonic(), repr(exc)[:200]))
            self.close()
            return False

    def close(self) -> None:
        conn, self.conn, self.sender = self.conn, None, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


class Sampler:
    """Sends to every member every 100 ms; records which acknowledged at each sample (an
    acknowledgement held up to 3 s, as a primary holds sends while it settles the loss of its
    backup, counts)."""

    def __init__(self, members) -> None:
        self.probes = [_Probe(m) for m in members]
        self.samples: list[tuple[float, tuple[bool, ...]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            got: list = [False] * len(self.probes)

            def one(i, p):
                got[i] = p.send()
            ts = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(self.probes)]
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            self.samples.append((t, tuple(got)))
            self._stop.wait(max(0.0, 0.1 - (time.monotonic() - t)))

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for p in self.probes:
            p.close()

    def both(self) -> int:
        return sum(1 for _t, got in self.samples if all(got))


@pytest.fixture
def zk(tmp_path):
    ens = zkproc.start_ensemble(tmp_path, 1, tick_ms=TICK_MS)
    yield ens
    ens.stop()


def test_a_coordinated_pair_fails_over_on_the_lock_with_every_acknowledged_message(tmp_path, procs, zk):
    primary, backup = coordinated_pair(tmp_path, procs, zk)
    assert sequences(primary) == (1, 1)      # started alone: the first activation
    assert sequences(backup)[0] == 1         # a copy in sync holds the primary's
    view = ha_view(primary)["manager"]
    assert view["holding_lock"] is True and view["session"]["state"] == "connected"
    assert view["lock_holder"].startswith("primary")
    send(primary, "orders", [f"m{i}" for i in range(50)])
    t0 = time.monotonic()
    primary.kill()
    wait_for(lambda: accepts(backup, 0.3), 30, interval_s=0.02, what="the backup to acknowledge a send")
    took = time.monotonic() - t0
    print(f"failover (SIGKILL to the first acknowledged send, session-ms {SESSION_MS}, tickTime {TICK_MS}): "
          f"{took:.2f} s")
    assert sequences(backup) == (2, 2)
    assert receive_all(backup, "orders") == [f"m{i}" for i in range(50)]
    assert "took the lock" in backup.stderr_text()


def test_a_frozen_primary_never_serves_again_after_the_backup_took_its_lock(tmp_path, procs, zk):
    """SIGSTOP past the session: the backup takes the lock and serves. A send the frozen primary
    received before it froze waits in its socket; on SIGCONT the primary finds its lease gone,
    acknowledges nothing (that send included) and exits."""
    from proton import Message
    from proton.utils import BlockingConnection

    ttl = {"cluster": {"connection-ttl-ms": 1000}}
    primary = start_replica(tmp_path, "primary", "primary", ha={"manager": manager(zk)}, config=ttl)
    procs.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url],
                           ha={"manager": manager(zk), **LOCK_HA}, config=ttl)
    procs.append(backup)
    wait_phase(backup, "in-sync")
    send(primary, "orders", [f"before-{i}" for i in range(100)])
    late = BlockingConnection(primary.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=30)
    late_sender = late.create_sender("orders")
    outcome: dict = {}
    with Sampler([primary, backup]) as sampler:
        os.kill(primary.proc.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()

        def send_late() -> None:
            try:
                late_sender.send(Message(body="sent-to-the-frozen-primary", durable=True))
                outcome["acked"] = True
            except Exception as exc:
                outcome["error"] = repr(exc)
        th = threading.Thread(target=send_late, daemon=True)
        th.start()
        wait_active(backup, 30)
        print(f"the backup took over {time.monotonic() - frozen_at:.2f} s after SIGSTOP")
        send(backup, "orders", [f"after-{i}" for i in range(100)])
        resumed_at = time.monotonic()
        os.kill(primary.proc.pid, signal.SIGCONT)
        assert primary.proc.wait(30) == 3, primary.stderr_text()[-3000:]
        th.join(30)
        time.sleep(0.5)    # a few more samples with the old primary gone
    old_after = [got[0] for t, got in sampler.samples if t >= resumed_at]
    assert not any(old_after), "the old primary acknowledged a send after SIGCONT"
    assert sampler.both() == 0
    assert outcome.get("acked") is not True, outcome
    assert "lost the lock" in primary.stderr_text() or "lease" in primary.stderr_text()
    got = receive_all(backup, "orders")
    assert got == [f"before-{i}" for i in range(100)] + [f"after-{i}" for i in range(100)]
    try:
        late.close()
    except Exception:
        pass


def test_a_stale_primary_started_first_does_not_serve_and_the_backup_comes_back_with_its_data(tmp_path, procs, zk):
    primary, backup = coordinated_pair(tmp_path, procs, zk)
    send(primary, "orders", ["one"])
    primary.kill()
    wait_active(backup)
    send(backup, "orders", ["two"])           # only on the backup: the primary's copy is stale now
    assert sequences(backup) == (2, 2)
    backup.kill()
    primary.start()                           # the stale primary first
    wait_for(lambda: "out of date" in primary.stderr_text(), 30, what="the stale primary to say why it waits")
    view = wait_phase(primary, "waiting-for-lock")
    assert view["active"] is False and "activation sequence is 1" in view["last_change"], view
    assert not accepts(primary)
    time.sleep(SESSION_MS / 1000.0 * 2)       # it keeps waiting
    assert ha_view(primary)["active"] is False
    backup.start()
    wait_active(backup)
    assert sequences(backup) == (3, 3)
    assert receive_all(backup, "orders") == ["one", "two"]
    assert ha_view(primary)["active"] is False


def test_a_backup_out_of_sync_when_the_primary_died_does_not_activate(tmp_path, procs, zk):
    """The replication link is cut: the backup cannot take the lock (the primary holds it) and
    the primary, alone, moves the activation sequence on. The primary then dies: the backup
    gets the lock, finds its copy out of date and does not serve."""
    from tests.tcpproxy import TcpProxy

    primary = start_replica(tmp_path, "primary", "primary", ha={"manager": manager(zk)})
    procs.append(primary)
    wait_active(primary)
    link = TcpProxy("127.0.0.1", primary.port).start()
    try:
        backup = start_replica(tmp_path, "backup", "backup", static=[f"amqp://127.0.0.1:{link.port}"],
                               ha={"manager": manager(zk), "vote-retries": 40, "vote-retry-wait-ms": 500})
        procs.append(backup)
        wait_phase(backup, "in-sync")
        link.cut()
        wait_for(lambda: sequences(primary) == (2, 2), 20, what="the primary to move the sequence on",
                 ignore=(OSError, KeyError))
        send(primary, "orders", ["only-on-the-primary"])
        primary.kill()
        wait_for(lambda: "out of date" in backup.stderr_text(), 30, what="the backup to find its copy out of date")
        assert "does not take over" in backup.stderr_text()
        assert ha_view(backup)["active"] is False
        assert not accepts(backup)
    finally:
        link.close()


@pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))
def test_a_lone_pair_with_its_link_cut_never_has_two_members_serving(tmp_path, procs):
    """The split the classic vote cannot prevent in a lone pair
    (test_ha_replication.py::test_a_lone_pair_splits_on_a_cut_link_as_documented): the link
    between the procs is cut in the network while both still reach ZooKeeper. At every
    sample exactly one member acknowledges a send."""
    net = netns.Network(["zk", "primary", "backup"])
    try:
        zk = zkproc.start_ensemble(tmp_path, 1, tick_ms=TICK_MS, hosts=[net.host("zk")], prexecs=[net.enter("zk")])
        try:
            ttl = {"cluster": {"connection-ttl-ms": 1000, "call-timeout-ms": 1000}}
            primary = start_replica(tmp_path, "primary", "primary", ha={"manager": manager(zk)}, config=ttl, net=net)
            procs.append(primary)
            wait_active(primary)
            backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url],
                                   ha={"manager": manager(zk), **LOCK_HA}, config=ttl, net=net)
            procs.append(backup)
            wait_phase(backup, "in-sync")
            with Sampler([primary, backup]) as sampler:
                wait_for(lambda: len(sampler.samples) >= 5, 10, what="samples before the cut")
                net.cut("primary", "backup")
                cut_at = time.monotonic()
                wait_for(lambda: "does not take over" in backup.stderr_text(), 60,
                         what="the backup to give up the lock it cannot get")
                time.sleep(3.0)
            served = [got for _t, got in sampler.samples]
            span = sampler.samples[-1][0] - sampler.samples[0][0]
            print(f"{len(served)} samples over {span:.1f} s around the cut link")
            assert len(served) >= span / 0.2, (len(served), span)
            assert sampler.both() == 0
            assert all(got == (True, False) for got in served), (
                [(round(t - cut_at, 2), g) for t, g in sampler.samples if g != (True, False)][:5],
                [(round(t - cut_at, 2), e) for t, e in sampler.probes[0].errors])
            assert ha_view(primary)["active"] is True and ha_view(backup)["active"] is False
            wait_for(lambda: sequences(primary)[0] == 2, 20, what="the primary alone to move the sequence on")
            net.heal()
            wait_phase(backup, "in-sync", 60)
            assert sequences(backup)[0] == 2
        finally:
            zk.stop()
    finally:
        net.close()


def test_an_ensemble_of_three_keeps_the_pair_with_one_server_lost_and_stops_it_with_two(tmp_path, procs):
    ens = zkproc.start_ensemble(tmp_path, 3, tick_ms=TICK_MS)
    try:
        primary, backup = coordinated_pair(tmp_path, procs, ens)
        send(primary, "orders", ["one"])
        follower = next(s for s in ens.servers if s.mode() == "follower")
        with Sampler([primary]) as sampler:
            follower.kill()
            t_one = time.monotonic()
            time.sleep(3 * SESSION_MS / 1000.0)     # several sessions: nothing changes
        assert all(got == (True,) for t, got in sampler.samples if t >= t_one), sampler.samples
        assert ha_view(primary)["active"] is True and ha_view(backup)["phase"] == "in-sync"
        send(primary, "orders", ["two"])
        second = next(s for s in ens.servers if s.proc.poll() is None)
        second.kill()                               # one server of three left: no quorum
        t_two = time.monotonic()
        assert primary.proc.wait(30) == 3, primary.stderr_text()[-3000:]
        stopped = time.monotonic() - t_two
        print(f"the primary stopped {stopped:.2f} s after ZooKeeper lost its quorum (session-ms {SESSION_MS})")
        assert stopped < SESSION_MS / 1000.0          # within its session: before ZooKeeper could free the lock
        time.sleep(3 * SESSION_MS / 1000.0)         # no failover without ZooKeeper
        assert ha_view(backup)["active"] is False
        assert not accepts(backup)
    finally:
        ens.stop()


def test_the_router_follows_the_pair_to_the_member_holding_the_lock(tmp_path, procs, zk):
    """The router needs nothing new: a static pool with the backup as ``backup-of`` the primary
    sends the pair's keys to whichever member serves, the one holding the lock."""
    from proton.utils import BlockingConnection

    from tests.brokerproc import USERS_FILE
    from tests.routerproc import start_router, toml_str

    primary, backup = coordinated_pair(tmp_path, procs, zk)
    node_id = ha_view(primary)["node_id"]
    rdir = tmp_path / "router"
    toml = "\n".join([
        'name = "r"', f"users-file = {toml_str(USERS_FILE)}",
        "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
        "[routers.main.cache]",
        "[routers.main.pool]", "check-period = 500", "quorum-timeout = 20000", 'username = "admin"',
        'password = "admin"',
        "[[routers.main.pool.targets]]", 'name = "p"', 'host = "127.0.0.1"', f"port = {primary.port}",
        f"management-url = {toml_str(primary.management_url)}",
        "[[routers.main.pool.targets]]", 'name = "p-backup"', 'backup-of = "p"', 'host = "127.0.0.1"',
        f"port = {backup.port}", f"management-url = {toml_str(backup.management_url)}"]) + "\n"
    router = start_router(rdir, toml, expect=2)
    procs.append(router)

    def pair() -> dict:
        status, body = router.get("/api/v1/routers/main/pool")
        assert status == 200, body
        return body["pairs"][0]

    wait_for(lambda: pair()["serving"] == "p", 20, what="the router to serve the pair from its primary")

    def through_router(key: str) -> tuple[str, int]:
        conn = BlockingConnection(router.url("proxy"), container_id=key, timeout=20, user="app", password="app",
                                  allowed_mechs="PLAIN")
        try:
            from proton import Message
            conn.create_sender("orders").send(Message(body=key, durable=True))
            return conn.conn.remote_properties["node-id"], 1
        finally:
            conn.close()

    assert {through_router(f"k{i}")[0] for i in range(5)} == {node_id}
    primary.kill()
    wait_for(lambda: pair()["serving"] == "p-backup", 30, what="the router to follow the lock to the backup")
    assert {through_router(f"k{i}")[0] for i in range(5, 10)} == {node_id}
    assert sorted(receive_all(backup, "orders")) == sorted(f"k{i}" for i in range(10))


def test_the_sample_pair_fails_over_on_a_clean_stop_and_fails_back(tmp_path, procs):
    """etc/zookeeper/ as shipped (ports and folders moved into tmp_path): the primary serves, the
    backup follows; a clean stop releases the lock at once and the backup serves; the primary
    restarted (check-for-live-server) copies the backup, takes the node id back and serves at
    the next activation sequence, with every message."""
    import re

    from tests.haproc import HaMember
    from tests.paths import REPO
    from tests.serverproc import free_ports

    etc = REPO / "etc" / "zookeeper"
    zk_port, pa, pm, ba, bm = free_ports(5)
    ports = {"2181": zk_port, "25672": pa, "28161": pm, "25673": ba, "28162": bm}

    def moved(text: str) -> str:
        for old, new in ports.items():
            text = re.sub(rf"\b{old}\b", str(new), text)
        text = text.replace('"../users.toml"', f'"{REPO / "etc" / "users.toml"}"')
        return re.sub(r'data-dir = "../../var/([^"]+)"', lambda m: f'data-dir = "{tmp_path / m.group(1)}"', text)

    zkdir = tmp_path / "zk1"
    (zkdir / "data").mkdir(parents=True)
    (zkdir / "zoo.cfg").write_text(moved((etc / "zoo.cfg").read_text()).replace(
        "dataDir=var/zookeeper", f"dataDir={zkdir / 'data'}"))
    server = zkproc.ZooKeeperServer(zkdir, 1, "127.0.0.1", zk_port, 0, 0).start()
    ens = zkproc.Ensemble([server])
    try:
        ens.wait_serving()

        def member(name: str, amqp: int) -> HaMember:
            (tmp_path / name).mkdir()
            path = tmp_path / name / "broker.toml"
            path.write_text(moved((etc / f"{name}.toml").read_text()))
            m = HaMember(tmp_path / name, path)
            m.fixed_port, m.fixed_host = amqp, "127.0.0.1"
            procs.append(m)
            return m.start()

        primary = member("primary", pa)
        wait_active(primary)
        assert "sample" in primary.stderr_text().lower()       # the published cluster password is warned about
        backup = member("backup", ba)
        wait_phase(backup, "in-sync", 60)
        assert sequences(primary) == (1, 1) and ha_view(primary)["manager"]["coordination_id"] == "zk-pair"
        send(primary, "orders", ["one"])
        assert primary.terminate() == 0
        wait_active(backup, 30)                    # the lock went with the closed session: no session-ms wait
        send(backup, "orders", ["two"])
        assert sequences(backup) == (2, 2)
        primary.start()
        wait_active(primary, 60)                   # failed back: synced from the backup, then the lock
        wait_phase(backup, "in-sync", 60)          # restart-backup: the backup follows it again
        assert sequences(primary) == (3, 3) and sequences(backup)[0] == 3
        assert receive_all(primary, "orders") == ["one", "two"]
    finally:
        ens.stop()


def test_a_member_started_before_zookeeper_says_so_once_and_serves_when_it_answers(tmp_path, procs):
    from tests.serverproc import free_ports

    port = free_ports(1)[0]

    class NotYet:
        connect_string = f"127.0.0.1:{port}"

    primary = start_replica(tmp_path, "primary", "primary", ha={"manager": manager(NotYet)})
    procs.append(primary)
    view = wait_phase(primary, "waiting-for-lock")
    assert view["active"] is False and "not connected to ZooKeeper" in view["last_change"], view
    wait_for(lambda: ha_view(primary)["manager"]["counters"]["connect_failures"] >= 2, 20,
             what="two failed attempts to reach ZooKeeper (connection-ms 2000, retries-ms 200)")
    err = primary.stderr_text()
    assert err.count("cannot reach ZooKeeper") == 1, err[-3000:]
    assert "Traceback" not in err
    assert len(err.splitlines()) < 30, err[-3000:]      # no line per connection attempt
    # ZooKeeper comes up on that port: the primary takes the lock and serves
    (tmp_path / "zk").mkdir()
    server = zkproc.ZooKeeperServer(tmp_path / "zk", 1, "127.0.0.1", port, 0, 0)
    (tmp_path / "zk" / "data").mkdir()
    (tmp_path / "zk" / "zoo.cfg").write_text(f"tickTime={TICK_MS}\ndataDir={tmp_path / 'zk' / 'data'}\n"
                                            f"clientPort={port}\nclientPortAddress=127.0.0.1\n"
                                            "admin.enableServer=false\n")
    server.start()
    try:
        wait_active(primary, 60)
        assert sequences(primary) == (1, 1)
        assert "Traceback" not in primary.stderr_text()
    finally:
        server.kill()
