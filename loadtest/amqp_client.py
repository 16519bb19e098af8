#!/usr/bin/env python3
"""One producer → one consumer over AMQP 1.0 with python-qpid-proton; prints one JSON line.

Used by ``bench_broker.py`` against every broker under test, so all see the same client.
The producer sends ``--n`` messages unsettled (at most ``--window`` awaiting a disposition); the
consumer grants ``--prefetch`` credit, accepts and settles each message and tops the credit up.
The message (one data section of ``--size`` bytes, header durable per ``--durable``) is encoded
once; the consumer does not decode bodies. Both keep the client's own CPU low so that the broker
sets the pace. Socket reads are greedy: proton's stock Container reads at most one
``capacity()`` (8 KiB) per select pass, which throttles 4 KiB messages; we read until the socket
would block.

``--broker-pid``: the broker's utime+stime from /proc over the measured interval → µs per message;
a comma list (several brokers, e.g. the nodes of a cluster) gives their sum and, in
``broker_cpu_us_per_msg_each``, each one's share. Time: first send → last receipt.
``client_cpu_us_per_msg``: this client's own CPU over the same interval.

``--rx-url``: the consumer connects there instead of ``--url`` (producer on one cluster node,
consumer on another). ``--go-file PATH``: once both links are attached, print ``links-up`` and
wait until PATH exists before sending (the caller checks meanwhile that the producer's node knows
the consumer). ``--tail-s``: after the last receipt and the last settlement, wait this long and
read the brokers' CPU again (``broker_cpu_tail_us_per_msg_each``: work the brokers still did for
the run after the last receipt, e.g. acknowledgements between nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from proton import Delivery, Message
from proton import _handlers
from proton.handlers import IncomingMessageHandler, MessagingHandler
from proton.reactor import Container, Selector

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> float | None:
    """utime+stime of a process (all threads) in seconds."""
    if not pid:
        return None
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    fields = s[s.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def own_cpu() -> float:
    """This process's user+system CPU seconds."""
    t = os.times()
    return t.user + t.system


def procs_cpu(pids: list[int]) -> list[float] | None:
    """utime+stime of each process, or None when no pid was given."""
    if not pids:
        return None
    return [proc_cpu(p) for p in pids]


def _greedy_readable(self, event):
    """Read the socket until it would block (instead of one recv per select pass)."""
    s = event.selectable
    t = s._transport
    if not t:
        return
    for _ in range(64):
        capacity = t.capacity()
        if capacity <= 0:
            break
        try:
            b = s.recv(capacity)
        except BlockingIOError:
            break
        except socket.error:
            t.close_tail()
            break
        if not b:
            self.on_selectable_error(event)
            break
        t.push(b)
        if len(b) < capacity:
            break
    self.update(t, s, s._reactor.now)


class OneToOne(MessagingHandler):
    def __init__(self, a):
        super().__init__(prefetch=0, auto_accept=False, auto_settle=True)
        self.handlers = [h for h in self.handlers if not isinstance(h, IncomingMessageHandler)]
        self.a = a
        # with a selector, the message carries the property it tests (every message matches)
        props = {"color": "red"} if a.selector else None
        self.payload = Message(body=os.urandom(a.size), durable=a.durable, properties=props).encode()
        self.txn = None  # --tx-batch: the open transaction
        self.in_txn = 0  # messages sent in it
        self.sender = self.receiver = None
        self.sconn = self.rconn = None
        self.s_up = self.r_up = False
        self.sent = self.settled = self.accepted = self.received = 0
        self.t0 = self.t_last = None
        self.pids = [int(p) for p in str(a.broker_pid).split(",") if int(p)]
        self.cpu0 = self.cpu1 = self.cpu2 = None
        self.own0 = self.own1 = None  # this client's own CPU
        self.go = not a.go_file  # --go-file: hold the first send until that file exists
        self.go_poller = None
        self.tail = None
        self.error = None
        self.done = False

    def on_start(self, event):
        c = self.container = event.container
        self.rconn = c.connect(self.a.rx_url or self.a.url)
        self.receiver = c.create_receiver(self.rconn, self.a.address, name="bench-rx",
                                          options=Selector(self.a.selector) if self.a.selector else None)
        self.sconn = c.connect(self.a.url)
        self.sender = c.create_sender(self.sconn, self.a.address, name="bench-tx")
        if self.a.tx_batch:
            c.declare_transaction(self.sconn, handler=self)
        self.timer = c.schedule(self.a.timeout, self)

    def on_timer_task(self, event):
        if not self.done:
            self.error = f"timeout: sent={self.sent} settled={self.settled} received={self.received}"
            self.finish()

    def on_link_opened(self, event):
        if event.link.is_receiver:
            self.r_up = True
            event.link.flow(self.a.prefetch)
        else:
            self.s_up = True
        self.pump()

    def on_sendable(self, event):
        self.pump()

    # -- transactions (--tx-batch): send a batch in one transaction, commit, declare the next --
    def on_transaction_declared(self, event):
        self.txn = event.transaction
        self.in_txn = 0
        self.pump()

    def on_transaction_committed(self, event):
        self.settled += self.in_txn
        self.accepted += self.in_txn
        self.txn = None
        if self.sent < self.a.n:
            event.container.declare_transaction(self.sconn, handler=self)
        self.check()

    def on_transaction_declare_failed(self, event):
        self.error = "transaction declare failed"
        self.finish()

    def on_transaction_commit_failed(self, event):
        self.error = "transaction commit failed"
        self.finish()

    def on_transaction_aborted(self, event):
        self.error = "transaction aborted"
        self.finish()

    def pump(self):
        if not (self.s_up and self.r_up):
            return
        if not self.go:
            self._await_go()
            return
        snd = self.sender
        if self.a.tx_batch:
            self.pump_txn(snd)
            return
        if self.t0 is None and snd.credit > 0:
            self.cpu0 = procs_cpu(self.pids)
            self.own0 = own_cpu()
            self.t0 = time.monotonic()
        limit = min(self.a.n, self.settled + self.a.window)
        while self.sent < limit and snd.credit > 0:
            self.sent += 1
            snd.delivery(str(self.sent))
            snd.stream(self.payload)
            snd.advance()

    def pump_txn(self, snd):
        txn = self.txn
        if txn is None or self.in_txn == self.a.tx_batch:
            return
        if self.t0 is None and snd.credit > 0:
            self.cpu0 = procs_cpu(self.pids)
            self.own0 = own_cpu()
            self.t0 = time.monotonic()
        batch_end = min(self.a.n, self.sent - self.in_txn + self.a.tx_batch)
        while self.sent < batch_end and snd.credit > 0:
            self.sent += 1
            self.in_txn += 1
            dlv = snd.delivery(str(self.sent))
            snd.stream(self.payload)
            dlv.local.data = [txn.id]  # TransactionalState(txn-id), as proton's Transaction.send
            dlv.update(0x34)
            snd.advance()
        if self.sent == batch_end:
            txn.commit()

    def _await_go(self):
        if self.go_poller is None:
            print("links-up", flush=True)
            self.go_poller = _GoPoller(self)
            self.container.schedule(0, self.go_poller)

    def on_accepted(self, event):
        self.accepted += 1
        self._settled()

    def on_rejected(self, event):
        self._settled()

    def on_released(self, event):
        self._settled()

    def _settled(self):
        self.settled += 1
        if self.sent < self.a.n:
            self.pump()
        self.check()

    def on_delivery(self, event):
        dlv = event.delivery
        link = dlv.link
        if not link.is_receiver or dlv.partial:
            return
        link.recv(dlv.pending)
        link.advance()
        dlv.update(Delivery.ACCEPTED)
        dlv.settle()
        self.received += 1
        want = self.a.prefetch - link.credit
        if want > 0:
            link.flow(want)
        if self.received == self.a.n:
            self.t_last = time.monotonic()
            self.cpu1 = procs_cpu(self.pids)
            self.own1 = own_cpu()
        self.check()

    def check(self):
        if self.received == self.a.n and self.settled == self.a.n:
            if self.a.tail_s > 0 and self.cpu1 is not None and not self.done:
                if self.tail is None:
                    self.tail = _Tail(self)
                    self.container.schedule(self.a.tail_s, self.tail)
                return
            self.finish()

    def finish(self):
        if self.done:
            return
        self.done = True
        self.timer.cancel()
        for c in (self.sconn, self.rconn):
            if c is not None:
                c.close()

    def on_transport_error(self, event):
        if not self.done:
            cond = event.transport.condition
            self.error = f"transport error: {cond.name if cond else ''} {cond.description if cond else ''}"
            self.finish()

    def on_link_error(self, event):
        cond = event.link.remote_condition
        self.error = f"link error: {cond.name if cond else ''} {cond.description if cond else ''}"
        self.finish()

    def result(self) -> dict:
        a = self.a
        r = {"n": a.n, "size": a.size, "durable": a.durable, "sent": self.sent, "accepted": self.accepted,
             "received": self.received, "error": self.error}
        if self.error is None and self.t_last is not None:
            secs = self.t_last - self.t0
            r["secs"] = round(secs, 4)
            r["msgs_per_s"] = round(a.n / secs, 1)
            if self.own0 is not None:
                r["client_cpu_us_per_msg"] = round((self.own1 - self.own0) / a.n * 1e6, 1)
            if self.cpu0 is not None:
                each = [(c1 - c0) / a.n * 1e6 for c0, c1 in zip(self.cpu0, self.cpu1)]
                r["broker_cpu_us_per_msg"] = round(sum(each), 1)
                r["broker_cpu_us_per_msg_each"] = [round(e, 1) for e in each]
            if self.cpu2 is not None:
                r["broker_cpu_tail_us_per_msg_each"] = [round((c2 - c1) / a.n * 1e6, 1)
                                                        for c1, c2 in zip(self.cpu1, self.cpu2)]
        return r


class _GoPoller:
    """--go-file: poll for the file every 10 ms, then start sending."""

    def __init__(self, h: OneToOne):
        self.h = h

    def on_timer_task(self, event):
        h = self.h
        if h.done:
            return
        if os.path.exists(h.a.go_file):
            h.go = True
            h.pump()
        else:
            h.container.schedule(0.01, self)


class _Tail:
    """--tail-s: read the brokers' CPU once more, then close."""

    def __init__(self, h: OneToOne):
        self.h = h

    def on_timer_task(self, event):
        h = self.h
        h.cpu2 = procs_cpu(h.pids)
        h.finish()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--n", type=int, default=50000)
    p.add_argument("--size", type=int, default=100)
    p.add_argument("--durable", action="store_true")
    p.add_argument("--selector", default="", help="the consumer attaches with this selector (messages carry color='red')")
    p.add_argument("--tx-batch", type=int, default=0, help="send in transactions of this many messages")
    p.add_argument("--prefetch", type=int, default=1000)
    p.add_argument("--window", type=int, default=1000)
    p.add_argument("--broker-pid", default="0", help="a pid, or a comma list of pids (their CPU is summed)")
    p.add_argument("--rx-url", default="", help="the consumer connects here (default: --url)")
    p.add_argument("--go-file", default="", help="once both links are up, print links-up and wait for this file")
    p.add_argument("--tail-s", type=float, default=0.0,
                   help="after the end, wait this long and read the brokers' CPU again")
    p.add_argument("--timeout", type=float, default=300)
    a = p.parse_args()
    _handlers.IOHandler.on_selectable_readable = _greedy_readable
    h = OneToOne(a)
    Container(h).run()
    r = h.result()
    print(json.dumps(r), flush=True)
    return 0 if r["error"] is None and "secs" in r else 1


if __name__ == "__main__":
    sys.exit(main())
