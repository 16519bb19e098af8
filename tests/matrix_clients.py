"""Client programs of the failover matrix (tests/integration/test_failover_matrix.py, docs/ha.md
"Failover matrix"): one producer or one consumer per process, each as an ordinary application of
its kind would be written.

    python -m tests.matrix_clients '{"kind": "container", "role": "producer", "url": "amqp://…",
                                     "address": "matrix.x", "container_id": "…", "interval_s": 0.05}'

``kind``:

* ``container`` — unmodified python-qpid-proton ``Container`` + ``MessagingHandler``, proton's
  default reconnect (``container.connect(url)``, nothing else);
* ``blocking`` — a plain program on proton's ``BlockingConnection``, which has no reconnect of
  its own: on ``ConnectionException`` (or a detached link, or a send without an outcome within
  10 s) it opens a new connection and its link again, and a producer sends the message whose send
  failed again (it sends no duplicate id, so that copy may be stored twice);
* ``failover`` — ``router.client.FailoverConnection`` (reconnects, re-creates its links, resends
  with ``_AMQ_DUPL_ID``).

A producer sends durable message ``i`` = 0, 1, 2, … (application property ``i``) every
``interval_s``; a consumer accepts every message. Both write one JSON line to stdout per thing
that happens, with a wall-clock time ``t`` (``time.time()``, comparable across processes):

    {"k": "open", "t": …, "g": <connection generation, 1 = the first connection>}
    {"k": "ack", "t": …, "i": <i>}                 producer: the broker accepted message i
    {"k": "recv", "t": …, "i": <i>, "g": <gen>}    consumer: message i arrived on connection g
    {"k": "lost", "t": …, "why": "…"}              the connection (or a link) was lost
    {"k": "done", "t": …, …counts}                 after SIGTERM: a producer stops sending,
                                                   waits up to 3 s for outstanding outcomes
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from proton import ConnectionException, LinkException, Message, Timeout

STOP_DRAIN_S = 3.0
_stopping = False


def emit(k: str, /, **fields) -> None:
    sys.stdout.write(json.dumps({"k": k, "t": time.time(), **fields}) + "\n")
    sys.stdout.flush()


def _on_term(signum, frame) -> None:
    global _stopping
    _stopping = True


def _message(i: int, cfg: dict) -> Message:
    return Message(body=f"{cfg['address']}-{i}", durable=True, properties={"i": i})


def _creds(cfg: dict) -> dict:
    return {"user": cfg.get("user", "app"), "password": cfg.get("password", "app"), "allowed_mechs": "PLAIN"}


# -- proton Container + MessagingHandler, unmodified (proton's default reconnect) ------------------

def run_container(cfg: dict) -> None:
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    producer = cfg["role"] == "producer"

    class App(MessagingHandler):
        def __init__(self):
            super().__init__(prefetch=10)
            self.conn = None
            self.sender = None
            self.next_i = 0
            self.unsettled: dict = {}   # delivery -> i
            self.gen = 0
            self.acked = 0
            self.stop_at = None

        def on_start(self, event):
            self.conn = event.container.connect(cfg["url"], container_id=cfg["container_id"], **_creds(cfg))
            if producer:
                self.sender = event.container.create_sender(self.conn, cfg["address"])
            else:
                event.container.create_receiver(self.conn, cfg["address"])
            event.container.schedule(cfg.get("interval_s", 0.05), self)

        def on_connection_opened(self, event):
            self.gen += 1
            emit("open", g=self.gen)

        def on_disconnected(self, event):
            emit("lost", why="disconnected")

        def on_connection_error(self, event):
            emit("lost", why=f"connection error {event.connection.remote_condition}")

        def on_link_error(self, event):
            emit("lost", why=f"link error {event.link.remote_condition}")

        def on_timer_task(self, event):
            if _stopping and self.stop_at is None:
                self.stop_at = time.monotonic() + (STOP_DRAIN_S if producer else 0)
            if self.stop_at is not None and (not self.unsettled or time.monotonic() >= self.stop_at):
                emit("done", acked=self.acked, sent=self.next_i, generations=self.gen)
                self.conn.close()
                event.container.stop()
                return
            if producer and self.stop_at is None and self.sender is not None and self.sender.credit > 0:
                i = self.next_i
                self.next_i += 1
                self.unsettled[self.sender.send(_message(i, cfg))] = i
            event.container.schedule(cfg.get("interval_s", 0.05), self)

        def on_accepted(self, event):
            i = self.unsettled.pop(event.delivery, None)
            if i is not None:
                self.acked += 1
                emit("ack", i=i)

        def on_rejected(self, event):
            self.unsettled.pop(event.delivery, None)

        def on_released(self, event):
            self.unsettled.pop(event.delivery, None)

        def on_message(self, event):
            emit("recv", i=event.message.properties["i"], g=self.gen)

    Container(App()).run()


# -- BlockingConnection: a plain program that reconnects on ConnectionException ---------------------

def run_blocking(cfg: dict) -> None:
    from proton.utils import BlockingConnection, LinkDetached

    producer = cfg["role"] == "producer"
    gen = 0
    conn = link = None

    def connect():
        nonlocal conn, link, gen
        while not _stopping:
            try:
                conn = BlockingConnection(cfg["url"], timeout=10, container_id=cfg["container_id"], **_creds(cfg))
                link = (conn.create_sender(cfg["address"]) if producer
                        else conn.create_receiver(cfg["address"], credit=10))
                gen += 1
                emit("open", g=gen)
                return True
            except (ConnectionException, LinkException, Timeout) as exc:
                emit("lost", why=f"connect: {exc!r}"[:200])
                _close(conn)
                time.sleep(0.1)   # the client program under test: its reconnect back-off
        return False

    def _close(c):
        try:
            if c is not None:
                c.close()
        except Exception:   # the connection is gone already: nothing to close
            pass

    sent = acked = resent = 0
    if not connect():
        emit("done", acked=0, sent=0, generations=0)
        return
    i = 0
    while not _stopping:
        try:
            if producer:
                link.send(_message(i, cfg), timeout=10)
                emit("ack", i=i)
                acked += 1
                i += 1
                sent = i
                time.sleep(cfg.get("interval_s", 0.05))   # pacing the producer, not a wait
            else:
                try:
                    m = link.receive(timeout=0.5)
                except Timeout:
                    continue
                emit("recv", i=m.properties["i"], g=gen)
                link.accept()
        except (ConnectionException, LinkDetached, LinkException, Timeout) as exc:
            # the plain program's reconnect: a new connection and link; a producer sends the
            # message whose outcome it did not get again (it has no duplicate id)
            emit("lost", why=repr(exc)[:200])
            resent += producer
            _close(conn)
            if not connect():
                break
    emit("done", acked=acked, sent=sent, generations=gen, resent=resent)
    _close(conn)


# -- router.client.FailoverConnection -----------------------------------------------------------------

def run_failover(cfg: dict) -> None:
    from router.client import DeliveryLost, FailoverConnection

    producer = cfg["role"] == "producer"
    conn = FailoverConnection(cfg["url"], reconnect_timeout_s=120, container_id=cfg["container_id"], timeout=10,
                              **_creds(cfg))
    emit("open", g=1)
    seen = conn.failovers
    link = conn.sender(cfg["address"]) if producer else conn.receiver(cfg["address"], credit=10)
    acked = i = 0

    def gen() -> int:
        nonlocal seen
        if conn.failovers != seen:
            seen = conn.failovers
            emit("open", g=seen + 1)
        return seen + 1

    while not _stopping:
        if producer:
            link.send(_message(i, cfg), timeout=10)
            gen()
            emit("ack", i=i)
            acked += 1
            i += 1
            time.sleep(cfg.get("interval_s", 0.05))   # pacing the producer, not a wait
        else:
            try:
                m = link.receive(timeout=0.5)
            except Timeout:
                gen()
                continue
            emit("recv", i=m.properties["i"], g=gen())
            try:
                link.accept()
            except DeliveryLost:
                emit("lost", why="accept after a failover: delivered again")
    emit("done", acked=acked, sent=i, generations=conn.failovers + 1,
         resent=getattr(link, "resent", 0))
    conn.close()


RUNNERS = {"container": run_container, "blocking": run_blocking, "failover": run_failover}


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[1])
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, _on_term)
    emit("start", kind=cfg["kind"], role=cfg["role"], pid=os.getpid())
    RUNNERS[cfg["kind"]](cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
