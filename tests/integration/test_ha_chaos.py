"""The HA chaos test (issue 12): producers and consumers through the router (proxy mode) at load,
the active primary SIGKILLed, then exact counts — for a replicated pair and for a shared-store pair.

Real processes only: the pair (tests/haproc.py), a router with the pair as its pool (the backup
a target with ``backup-of`` the primary: one routing identity served by its active member, re-probed
at once when a proxied upstream fails — docs/router.md "HA pairs"), and unmodified python-qpid-proton
clients wrapped in ``router.client.FailoverConnection`` (reconnects through the router, re-creates
its links, resends an unconfirmed send with its ``_AMQ_DUPL_ID``).

What is counted, with oracles outside the router and the brokers:

* **acknowledged**: the bodies whose ``send`` returned (the producer's own record);
* **consumed**: every receipt, with the consumer's connection generation (it changes at a
  failover). A body received twice **across** generations is a redelivery of an acknowledgement
  in flight at the kill (counted and reported); twice **within** one generation would be a
  message stored twice (asserted never);
* every acknowledged body is consumed;
* the time from the kill to the completion of the first send begun after it (printed; goal < 2 s).
"""

from __future__ import annotations

import collections
import threading
import time

import pytest
from proton import Message

from router.client import DeliveryLost, FailoverConnection
from tests.brokerproc import USERS_FILE
from tests.haproc import start_pair, start_replica, wait_active, wait_phase
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

CLIENT = {"user": "app", "password": "app", "allowed_mechs": "PLAIN", "timeout": 10}
PRODUCERS, CONSUMERS, PER_PRODUCER = 2, 2, 400
ADDRESS = "chaos"


def router_toml(members) -> str:
    lines = ['name = "chaos"', f"users-file = {toml_str(USERS_FILE)}",
             "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
             "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "pair"', 'mode = "proxy"',
             "[routers.pair]", 'key-type = "CLIENT_ID"',
             "[routers.pair.policy]", 'name = "FIRST_ELEMENT"',
             "[routers.pair.pool]", "check-period = 2000", "quorum-timeout = 10000",
             'username = "admin"', 'password = "admin"']
    primary, *backups = members
    lines += ["[[routers.pair.pool.targets]]", f"name = {toml_str(primary.workdir.name)}", 'host = "127.0.0.1"',
              f"port = {primary.port}", f"management-url = {toml_str(primary.management_url)}",
              f"node-id = {toml_str(primary.node_id)}"]
    for m in backups:   # the pair: one routing identity served by its active member (docs/router.md)
        lines += ["[[routers.pair.pool.targets]]", f"name = {toml_str(m.workdir.name)}",
                  f"backup-of = {toml_str(primary.workdir.name)}", 'host = "127.0.0.1"',
                  f"port = {m.port}", f"management-url = {toml_str(m.management_url)}"]
    return "\n".join(lines) + "\n"


class Load:
    """Producers and consumers through the router, counting everything."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.acked: set[str] = set()
        self.ack_times: list[float] = []
        self.receipts: list[tuple[str, int, int]] = []     # (body, consumer, generation)
        self.lost_accepts = 0
        self.resent = 0
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.producers_done = threading.Event()
        self.stop = threading.Event()

    def produce(self, p: int) -> None:
        try:
            conn = FailoverConnection(self.url, reconnect_timeout_s=60, container_id=f"producer-{p}", **CLIENT)
            snd = conn.sender(ADDRESS)
            for i in range(PER_PRODUCER):
                body = f"p{p}-{i}"
                started = time.monotonic()
                snd.send(Message(body=body, durable=True))
                with self.lock:
                    self.acked.add(body)
                    self.ack_times.append((started, time.monotonic()))
                time.sleep(0.002)        # pacing, not a wait: a steady stream rather than one burst
            with self.lock:
                self.resent += snd.resent
            conn.close()
        except BaseException as exc:      # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def consume(self, c: int) -> None:
        try:
            conn = FailoverConnection(self.url, reconnect_timeout_s=60, container_id=f"consumer-{c}", **CLIENT)
            rcv = conn.receiver(ADDRESS, credit=20)
            while not self.stop.is_set():
                try:
                    m = rcv.receive(timeout=0.5)
                except Exception as exc:   # proton Timeout: nothing now
                    if type(exc).__name__ == "Timeout":
                        continue
                    raise
                with self.lock:
                    self.receipts.append((m.body, c, rcv.generation))
                try:
                    rcv.accept()
                except DeliveryLost:
                    with self.lock:
                        self.lost_accepts += 1
            conn.close()
        except BaseException as exc:      # noqa: BLE001
            self.errors.append(exc)


def run_chaos(kill, router, survivor) -> dict:
    load = Load(router.url("proxy"))
    threads = [threading.Thread(target=load.produce, args=(p,)) for p in range(PRODUCERS)] + \
              [threading.Thread(target=load.consume, args=(c,)) for c in range(CONSUMERS)]
    for t in threads:
        t.start()
    total = PRODUCERS * PER_PRODUCER

    def kill_point():
        assert not load.errors, load.errors
        return len(load.acked) >= total * 0.4
    wait_for(kill_point, 60, interval_s=0.01, what="40 % of the messages acknowledged")
    acked_at_kill = len(load.acked)
    t_kill = time.monotonic()
    kill()
    for t in threads[:PRODUCERS]:
        t.join(120)
    assert not load.errors, load.errors
    # consumers drain until every acknowledged body has been received
    wait_for(lambda: {b for b, _, _ in load.receipts}, 60, until=lambda got: got >= load.acked,
             what="every acknowledged body received")
    time.sleep(0.5)      # the thing under test: anything still arriving is a duplicate, and is counted
    load.stop.set()
    for t in threads[PRODUCERS:]:
        t.join(30)
    assert not load.errors, load.errors
    # the first send begun after the kill that completed: traffic has resumed
    resumed = min((end for start, end in load.ack_times if start > t_kill), default=float("nan")) - t_kill
    seen: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
    for body, c, gen in load.receipts:
        seen[body].append((c, gen))
    within = [b for b, rs in seen.items() if len(rs) != len({(c, g) for c, g in rs})]
    redelivered = sum(len(rs) - 1 for rs in seen.values())
    from tests.serverproc import http_json
    status, addresses = http_json(survivor.management_url + "/api/v1/addresses", auth=("admin", "admin"))
    dropped = next((a.get("duplicates_dropped", 0) for a in addresses if a["name"] == ADDRESS), 0)
    out = {"acknowledged": len(load.acked), "acked_at_kill": acked_at_kill, "consumed_unique": len(seen),
           "duplicates_dropped_by_the_broker": dropped,
           "receipts": len(load.receipts), "redelivered": redelivered, "stored_twice": within,
           "resent_sends": load.resent, "lost_accepts": load.lost_accepts, "resumed_s": round(resumed, 3)}
    print(f"chaos: {out}")
    assert len(load.acked) == total
    assert load.acked <= set(seen), "an acknowledged message was never consumed"
    assert set(seen) <= load.acked | set(seen)
    assert not within, f"stored twice: {within[:5]}"
    assert dropped <= load.resent      # only resends can be duplicates, and the broker dropped those it had
    return out


@pytest.fixture
def procs():
    made = []
    yield made
    for p in made:
        if p.proc is not None and p.proc.poll() is None:
            p.kill()


def test_replicated_pair_under_load_through_the_router(tmp_path, procs):
    primary = start_replica(tmp_path, "primary", "primary")
    procs.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url],
                           ha={"vote-retries": 2, "vote-retry-wait-ms": 200, "quorum-vote-wait-s": 5})
    procs.append(backup)
    wait_phase(backup, "in-sync")
    router = start_router(tmp_path / "router", router_toml([primary, backup]), expect=2)
    procs.append(router)
    run_chaos(primary.kill, router, backup)


def test_shared_store_pair_under_load_through_the_router(tmp_path, procs):
    primary, backup = start_pair(tmp_path)
    procs += [primary, backup]
    router = start_router(tmp_path / "router", router_toml([primary, backup]), expect=2)
    procs.append(router)
    run_chaos(primary.kill, router, backup)
