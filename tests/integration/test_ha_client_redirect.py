"""Failback tells the backup's clients where to go (docs/ha.md, "Telling clients where to go").

A replicated pair (real processes): the primary is SIGKILLed, the backup serves, clients connect
straight to the backup; the primary restarts (check-for-live-server) and asks for its node id
back. The backup closes its clients:

* an unmodified python-qpid-proton Container consumer (reconnect on, URLs [backup, primary]) has
  its connection ended without a Close, reconnects by itself and resumes on the primary —
  measured from its disconnect to the first message after it (goal < 3 s);
* a client whose Open desired ``lodestone:follows-redirect`` gets ``amqp:connection:redirect``
  naming the primary's acceptor, with the backup (which follows the primary again) as its
  ``failover-server-list``.

The backup runs with the default ``[amqp] idle-timeout-s`` (60 s). A proton reactor client stops
reading at a Close and, on ``amqp:connection:forced`` (which it does not answer), would see the
closed socket only when its next heartbeat fails, 30 s later; an end of stream it sees at once
(broker.core.departures).
"""

from __future__ import annotations

import threading
import time

import pytest
from proton import symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container

from broker.wire.frames import FOLLOWS_REDIRECT
from tests.haproc import CLIENT, ha_view, receive_all, send, start_replica, wait_active, wait_phase
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

FAST_VOTES = {"vote-retries": 2, "vote-retry-wait-ms": 200, "quorum-vote-wait-s": 5}
MESSAGES = 400
PULL_EVERY_S = 0.04   # the consumer takes one message per interval: the queue outlasts the failback


class SlowConsumer(MessagingHandler):
    """Takes one message every PULL_EVERY_S (credit 1 at a time), reconnecting as proton does."""

    def __init__(self, urls: list[str], address: str) -> None:
        super().__init__(prefetch=0)
        self.urls, self.address = urls, address
        self.got: list[tuple[float, str]] = []
        self.closes: list[tuple[float, str | None]] = []
        self.disconnects: list[float] = []
        self.receiver = None
        self.stopping = False

    def on_start(self, event) -> None:
        conn = event.container.connect(urls=self.urls, user=CLIENT["user"], password=CLIENT["password"],
                                       allowed_mechs="PLAIN")
        self.receiver = event.container.create_receiver(conn, self.address)

    def on_link_opened(self, event) -> None:
        if event.receiver is not None and event.receiver.credit == 0:
            event.receiver.flow(1)   # (again after each reconnect: the new attach has no credit)

    def on_message(self, event) -> None:
        self.got.append((time.monotonic(), event.message.body))
        if not self.stopping:
            event.container.schedule(PULL_EVERY_S, self)

    def on_timer_task(self, event) -> None:
        if self.receiver is not None and not self.stopping:
            self.receiver.flow(1)

    def on_connection_remote_close(self, event) -> None:
        cond = event.connection.remote_condition
        self.closes.append((time.monotonic(), cond.name if cond else None))

    def on_disconnected(self, event) -> None:
        self.disconnects.append(time.monotonic())


class RedirectWatcher(MessagingHandler):
    """A client that offers to follow redirects (or not: ``follows``); records the Close it gets
    (no reconnect)."""

    def __init__(self, url: str, follows: bool = True) -> None:
        super().__init__()
        self.url, self.follows = url, follows
        self.close = None
        self.disconnected = threading.Event()
        self.opened = threading.Event()

    def on_start(self, event) -> None:
        event.container.connect(self.url, user=CLIENT["user"], password=CLIENT["password"], allowed_mechs="PLAIN",
                                reconnect=False,
                                desired_capabilities=[symbol(FOLLOWS_REDIRECT)] if self.follows else None)

    def on_connection_opened(self, event) -> None:
        self.opened.set()

    def on_connection_remote_close(self, event) -> None:
        cond = event.connection.remote_condition
        self.close = (cond.name, cond.description, {str(k): v for k, v in (cond.info or {}).items()})

    def on_connection_error(self, event) -> None:
        pass

    def on_transport_closed(self, event) -> None:
        self.disconnected.set()


def run_in_thread(handler) -> tuple[Container, threading.Thread]:
    c = Container(handler)
    t = threading.Thread(target=c.run, daemon=True)
    t.start()
    return c, t


def test_failback_redirects_followers_and_ends_the_others_who_resume_on_the_primary(tmp_path, procs):
    backup = start_replica(tmp_path, "backup", "backup", ha=FAST_VOTES, start=False)
    primary = start_replica(tmp_path, "primary", "primary", static=[backup.amqp_url],
                            ha={"check-for-live-server": True})
    procs.append(primary)
    wait_active(primary)
    text = backup.config_path.read_text().replace("static-connectors = []",
                                                  f'static-connectors = ["{primary.amqp_url}"]')
    backup.config_path.write_text(text)
    backup.start()
    procs.append(backup)
    wait_phase(backup, "in-sync")
    primary.kill()
    wait_active(backup)
    bodies = [f"m{i}" for i in range(MESSAGES)]
    send(backup, "fb", bodies)

    consumer = SlowConsumer([backup.amqp_url, primary.amqp_url], "fb")
    watcher = RedirectWatcher(backup.amqp_url)
    containers = [run_in_thread(consumer), run_in_thread(watcher)]
    try:
        wait_for(lambda: len(consumer.got) >= 5 and watcher.opened.is_set(), 20, interval_s=0.02,
                 what="the clients on the backup")
        primary.start()
        wait_for(lambda: consumer.disconnects, 60, interval_s=0.02,
                 what="the backup to end the consumer's connection (failback)")
        closed_at = consumer.disconnects[0]
        assert consumer.closes == []   # an end of stream, no Close
        first_after = wait_for(lambda: next((t for t, _b in consumer.got if t > closed_at), None), 30,
                               interval_s=0.02, what="a message on the primary")
        resumed_s = first_after - closed_at
        assert ha_view(primary)["active"] is True
        print(f"failback: the consumer resumed on the primary {resumed_s:.3f} s after the backup ended its connection")
        assert resumed_s < 3.0
        wait_for(lambda: watcher.close is not None, 10, interval_s=0.02, what="the redirect")
    finally:
        consumer.stopping = True
        for c, t in containers:
            c.stop()
            t.join(10)
    name, description, info = watcher.close
    assert name == "amqp:connection:redirect", watcher.close
    assert info["network-host"] == "127.0.0.1" and info["port"] == primary.fixed_port
    assert [dict((str(k), v) for k, v in m.items()) for m in info["failover-server-list"]] == [
        {"network-host": "127.0.0.1", "scheme": "amqp", "hostname": "127.0.0.1", "port": backup.fixed_port}]
    wait_phase(backup, "in-sync", 60)          # the backup follows the primary again
    # nothing lost: what the consumer took, plus what is left on the primary, is every message
    left = receive_all(primary, "fb", quiet_s=0.5)
    assert set(b for _t, b in consumer.got) | set(left) == set(bodies)


def test_scale_down_redirects_followers_to_the_node_the_messages_go_to(tmp_path, procs):
    """A live-only node with scale-down, stopped with SIGTERM: a client that follows redirects
    is sent to the scale-down target (C, named first in scale-down-connectors, not B), an
    unmodified one has its connection ended without a Close; the messages land on C."""
    from tests.clusterproc import start_node, wait_mesh

    b = start_node(tmp_path, "b", mode="OFF")
    c = start_node(tmp_path, "c", static=[b.amqp_url], mode="OFF")
    a = start_node(tmp_path, "a", static=[b.amqp_url], mode="OFF",
                   config={"ha": {"scale-down": True, "scale-down-connectors": [c.amqp_url]}})
    procs += [a, b, c]
    wait_mesh([a, b, c])
    send(a, "sd", ["one", "two"])
    follower, plain = RedirectWatcher(a.amqp_url), RedirectWatcher(a.amqp_url, follows=False)
    containers = [run_in_thread(follower), run_in_thread(plain)]
    try:
        wait_for(lambda: follower.opened.is_set() and plain.opened.is_set(), 20, interval_s=0.02,
                 what="the clients on A")
        assert a.terminate() == 0
        wait_for(lambda: follower.close is not None and plain.disconnected.is_set(), 10, interval_s=0.02,
                 what="the closes")
    finally:
        for ct, t in containers:
            ct.stop()
            t.join(10)
    name, _description, info = follower.close
    assert name == "amqp:connection:redirect", follower.close
    assert (info["network-host"], info["port"]) == ("127.0.0.1", c.port)
    assert plain.close is None   # an end of stream, no Close
    assert receive_all(c, "sd", quiet_s=0.5) == ["one", "two"]
