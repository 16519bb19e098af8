"""A synthetic workload for the data-gravity loop (docs/gravity.md, loadtest/README.md).

Applications ("groups") whose keys share an address: each group has producers and consumers,
every one its own AMQP connection with its own container-id (the routing key: the local
deployment's router uses ``key-type = "CLIENT_ID"``), all through the router's front door, so the
router places producers and consumers of one address on different brokers as its policy decides;
the cluster (``ON_DEMAND``) then forwards their messages between brokers.

The parameters are fixed here (``WORKLOAD``) so every run is the same; ``scale`` multiplies the
message counts only. They are chosen so that co-location is not free under a 10 % skew bound over
3 brokers: ``ledger`` carries 40 % of all bytes — more than one broker's share of 1.1 × 1/3 — so it
must be split (cheapest: one of its producers elsewhere, forwarding all it sends), and the others
(2–6 keys each; 512 B to 8 KiB messages; 30 keys in all against 11 connections per broker at most)
must be packed around it.

Every key's traffic is deterministic, so the loads the job predicts are the loads measured after
the change: each group's messages have one size, producers send a fixed count, and each consumer
takes exactly its quota (credit = quota) and then leaves — messages left on its broker follow the
group's remaining consumers by redistribution (``redistribution-delay-ms = 0`` in etc/broker-*.toml).

    python loadtest/gravity_workload.py --url amqp://127.0.0.1:5672 [--scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

from proton import Message
from proton.handlers import MessagingHandler
from proton.reactor import Container


@dataclass(frozen=True)
class Group:
    name: str
    producers: int
    consumers: int
    messages: int      # per producer
    size: int          # message body bytes (one size per group: the byte mix is across groups)

    @property
    def address(self) -> str:
        return f"gravity.{self.name}"

    def producer_keys(self) -> list[str]:
        return [f"{self.name}-p{i}" for i in range(self.producers)]

    def consumer_keys(self) -> list[str]:
        return [f"{self.name}-c{i}" for i in range(self.consumers)]

    def keys(self) -> list[str]:
        return self.producer_keys() + self.consumer_keys()


#: the fixed workload: 30 keys in 8 groups, 1,890 messages, 4.9 MB of bodies produced (as much
#: consumed) per run
WORKLOAD: tuple[Group, ...] = (
    Group("ledger", 3, 3, 80, 8192),     # 40 % of the bytes: too large for one broker at 10 % skew
    Group("orders", 2, 2, 100, 4096),
    Group("billing", 2, 2, 100, 2048),
    Group("audit", 1, 2, 150, 4096),
    Group("search", 2, 1, 100, 1024),
    Group("mail", 1, 1, 200, 2048),
    Group("chat", 2, 2, 200, 512),
    Group("metrics", 3, 1, 100, 1024),
)


def scaled(groups: tuple[Group, ...], scale: float) -> tuple[Group, ...]:
    return tuple(Group(g.name, g.producers, g.consumers, max(1, round(g.messages * scale)), g.size)
                 for g in groups)


class _Run(MessagingHandler):
    """Consumers first (each with credit = its quota); once all their links are attached and the
    cluster has had ``settle_s`` to learn them, the producers send; done when every consumer has
    its quota."""

    def __init__(self, url: str, groups: tuple[Group, ...], user: str, password: str, settle_s: float,
                 timeout_s: float):
        super().__init__(prefetch=0, auto_accept=True)
        self.url, self.groups, self.user, self.password = url, groups, user, password
        self.settle_s, self.timeout_s = settle_s, timeout_s
        self.quota: dict[str, int] = {}   # consumer key (its link's name) → messages still to take
        self.received: dict[str, int] = {}
        self.to_send: dict[str, list] = {}  # producer key → [group, messages left to send]
        self.accepted: dict[str, int] = {}
        self.opened = 0
        self.consumers = sum(g.consumers for g in groups)
        self.open_conns = 0
        self.error: str | None = None
        self.started_producers = False
        self.timer = None

    def _connect(self, container, key: str):
        self.open_conns += 1
        return container.connect(self.url, container_id=key, user=self.user, password=self.password,
                                 allowed_mechs="PLAIN", allow_insecure_mechs=True, reconnect=False)

    def on_start(self, event):
        self.timer = event.container.schedule(self.timeout_s, self)
        for g in self.groups:
            total = g.producers * g.messages
            for i, key in enumerate(g.consumer_keys()):
                quota = total // g.consumers + (1 if i < total % g.consumers else 0)
                conn = self._connect(event.container, key)
                rcv = event.container.create_receiver(conn, g.address, name=key)
                self.quota[key] = quota
                self.received[key] = 0
                if quota == 0:
                    rcv.close()
                    conn.close()

    def on_link_opened(self, event):
        link = event.link
        if link.is_receiver and link.name in self.quota:
            link.flow(self.quota[link.name])
            self.opened += 1
            if self.opened == self.consumers and not self.started_producers:
                self.started_producers = True
                event.container.schedule(self.settle_s, _Later(self._start_producers))

    def _start_producers(self, container):
        for g in self.groups:
            for key in g.producer_keys():
                conn = self._connect(container, key)
                snd = container.create_sender(conn, g.address, name=key)
                self.to_send[key] = [g, g.messages]
                self.accepted[key] = 0

    def on_sendable(self, event):
        st = self.to_send.get(event.sender.name)
        if st is None:
            return
        g = st[0]
        while event.sender.credit and st[1] > 0:
            event.sender.send(Message(body="x" * g.size))
            st[1] -= 1

    def on_accepted(self, event):
        link = event.link
        key = link.name
        self.accepted[key] += 1
        st = self.to_send[key]
        if st[1] == 0 and self.accepted[key] == st[0].messages:
            event.connection.close()

    def on_message(self, event):
        link = event.link
        self.received[link.name] += 1
        self.quota[link.name] -= 1
        if self.quota[link.name] == 0:
            link.close()
            event.connection.close()

    def on_connection_closed(self, event):
        self.open_conns -= 1
        self._maybe_done(event.container)

    def on_transport_error(self, event):
        cond = event.transport.condition
        self.error = f"transport error: {cond.name if cond else '?'}: {cond.description if cond else ''}"
        event.container.stop()

    def _maybe_done(self, container):
        want = {g.name: g.producers * g.messages for g in self.groups}
        got: dict[str, int] = {}
        for g in self.groups:
            got[g.name] = sum(self.received[k] for k in g.consumer_keys())
        if got == want and self.open_conns == 0:
            if self.timer is not None:
                self.timer.cancel()
            container.stop()

    def on_timer_task(self, event):  # the overall timeout
        short = {k: self.received[k] for k, left in self.quota.items() if left > 0}
        self.error = f"timed out after {self.timeout_s:.0f} s; consumers short of their quota: {short}"
        event.container.stop()



class _Later:
    def __init__(self, fn):
        self.fn = fn

    def on_timer_task(self, event):
        self.fn(event.container)


def run_workload(url: str, *, scale: float = 1.0, user: str = "app", password: str = "app",
                 settle_s: float = 1.5, timeout_s: float = 300.0) -> dict:
    """Run ``WORKLOAD`` (scaled) through ``url`` once; the figures of the run. Raises
    RuntimeError when it did not complete."""
    groups = scaled(WORKLOAD, scale)
    h = _Run(url, groups, user, password, settle_s, timeout_s)
    t0 = time.time()
    Container(h).run()
    if h.error:
        raise RuntimeError(h.error)
    messages = sum(g.producers * g.messages for g in groups)
    return {"keys": sum(len(g.keys()) for g in groups), "messages": messages,
            "body_bytes": sum(g.producers * g.messages * g.size for g in groups),
            "seconds": round(time.time() - t0, 3), "started": t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="amqp://127.0.0.1:5672", help="the router's front door")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every group's message count")
    ap.add_argument("--user", default="app")
    ap.add_argument("--password", default="app")
    a = ap.parse_args(argv)
    print(json.dumps(run_workload(a.url, scale=a.scale, user=a.user, password=a.password)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
