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

``--broker-pid``: the broker's utime+stime from /proc over the measured interval → µs per message.
Time: first send → last receipt.
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
        self.cpu0 = self.cpu1 = None
        self.error = None
        self.done = False

    def on_start(self, event):
        c = event.container
        self.rconn = c.connect(self.a.url)
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
        snd = self.sender
        if self.a.tx_batch:
            self.pump_txn(snd)
            return
        if self.t0 is None and snd.credit > 0:
            self.cpu0 = proc_cpu(self.a.broker_pid)
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
            self.cpu0 = proc_cpu(self.a.broker_pid)
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
            self.cpu1 = proc_cpu(self.a.broker_pid)
        self.check()

    def check(self):
        if self.received == self.a.n and self.settled == self.a.n:
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
            if self.cpu0 is not None:
                r["broker_cpu_us_per_msg"] = round((self.cpu1 - self.cpu0) / a.n * 1e6, 1)
        return r


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
    p.add_argument("--broker-pid", type=int, default=0)
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
