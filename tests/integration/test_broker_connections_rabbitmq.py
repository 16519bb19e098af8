"""Broker connections to a third-party broker: a Lodestone node's sender and receiver against a real
RabbitMQ (Debian's rabbitmq-server with its AMQP 1.0 plugin, tests/rabbitproc.py), which names its
queues ``/amq/queue/<q>`` (``remote-address``). Counted with unmodified proton clients on both
sides; RabbitMQ restarted in the middle of a stream."""

from __future__ import annotations

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.haproc import receive_all, send
from tests.integration.test_broker_connections import connection, depth, start, view
from tests.rabbitproc import RabbitMQ
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def rabbit(tmp_path):
    r = RabbitMQ(tmp_path).start()
    for q in ("to-rabbit", "from-rabbit"):
        r.declare(q)
    try:
        yield r
    finally:
        r.stop()


def rabbit_send(r: RabbitMQ, queue: str, bodies) -> None:
    c = BlockingConnection(r.client_url, timeout=30, allowed_mechs="PLAIN")
    try:
        s = c.create_sender(r.address(queue))
        for body in bodies:
            s.send(Message(body=body, durable=True))
    finally:
        c.close()


def rabbit_receive_all(r: RabbitMQ, queue: str, *, quiet_s: float = 2.0) -> list:
    c = BlockingConnection(r.client_url, timeout=30, allowed_mechs="PLAIN")
    try:
        rcv = c.create_receiver(r.address(queue), credit=200)
        out = []
        while True:
            try:
                m = rcv.receive(timeout=quiet_s)
            except Exception:  # proton.Timeout: nothing more
                return out
            out.append(m.body)
            rcv.accept()
    finally:
        c.close()


def rabbit_connection(r: RabbitMQ) -> str:
    return connection(r.url, senders=[{"queue-name": "orders", "remote-address": r.address("to-rabbit")}],
                      receivers=[{"queue-name": "inbound", "remote-address": r.address("from-rabbit")}]
                      ).replace('user = "app"\npassword = "app"', 'user = "guest"\npassword = "guest"')


def test_messages_go_to_rabbitmq_and_come_back_from_it(tmp_path, rabbit):
    a = start(tmp_path, "a", extra=rabbit_connection(rabbit))
    try:
        wait_for(lambda: view(a)["connected"], 30, what="A connected to RabbitMQ")
        send(a, "orders", [f"o-{i}" for i in range(200)])
        rabbit_send(rabbit, "from-rabbit", [f"r-{i}" for i in range(150)])
        wait_for(lambda: depth(a, "orders") == 0, 30, what="A's orders all at RabbitMQ")
        wait_for(lambda: depth(a, "inbound") == 150, 30, what="RabbitMQ's messages on A")
        got_rabbit = rabbit_receive_all(rabbit, "to-rabbit")
        got_a = receive_all(a, "inbound", quiet_s=2.0)
        assert got_rabbit == [f"o-{i}" for i in range(200)]
        assert sorted(got_a) == sorted(f"r-{i}" for i in range(150)) and len(got_a) == 150
        assert rabbit_receive_all(rabbit, "from-rabbit", quiet_s=1.0) == []   # RabbitMQ let go of each
        v = view(a)
        assert v["senders"][0]["acknowledged"] == 200 and v["receivers"][0]["stored"] == 150
    finally:
        a.stop()


def test_rabbitmq_restarted_mid_stream_loses_nothing(tmp_path, rabbit):
    a = start(tmp_path, "a", extra=rabbit_connection(rabbit))
    n = 600
    try:
        wait_for(lambda: view(a)["connected"], 30, what="A connected to RabbitMQ")
        send(a, "orders", [f"o-{i}" for i in range(n // 2)])
        rabbit_send(rabbit, "from-rabbit", [f"r-{i}" for i in range(n // 2)])
        wait_for(lambda: view(a)["senders"][0]["acknowledged"] > 20, 30, what="some orders at RabbitMQ")
        rabbit.restart()
        send(a, "orders", [f"o-{i}" for i in range(n // 2, n)])
        rabbit_send(rabbit, "from-rabbit", [f"r-{i}" for i in range(n // 2, n)])
        wait_for(lambda: depth(a, "orders") == 0, 60, what="A's orders all at RabbitMQ")
        wait_for(lambda: depth(a, "inbound") >= n, 60, what="RabbitMQ's messages all on A")
        got_rabbit = rabbit_receive_all(rabbit, "to-rabbit")
        got_a = receive_all(a, "inbound", quiet_s=2.0)
        for got, prefix in ((got_rabbit, "o"), (got_a, "r")):
            missing = {f"{prefix}-{i}" for i in range(n)} - set(got)
            dup = len(got) - len(set(got))
            assert not missing and dup <= 100, (prefix, len(missing), dup)
            print(f"\n{prefix}: {n} through a RabbitMQ restart: {len(set(got))} arrived, {dup} twice")
        assert view(a)["connections"] >= 2
    finally:
        a.stop()


def test_a_refused_attach_is_retried_until_rabbitmq_has_the_queue(tmp_path, rabbit):
    extra = connection(rabbit.url, receivers=[{"queue-name": "inbound", "remote-address": rabbit.address("later")}]
                       ).replace('user = "app"\npassword = "app"', 'user = "guest"\npassword = "guest"')
    a = start(tmp_path, "a", extra=extra)
    try:
        # RabbitMQ refuses a link to a queue it does not have: the connection starts over, with back-off
        v = wait_for(lambda: view(a), 30, until=lambda v: v["connections"] >= 2, what="retried after the refusal")
        assert not v["receivers"][0]["attached"]
        rabbit.declare("later")
        wait_for(lambda: view(a)["receivers"][0]["attached"], 30, what="attached once the queue exists")
        rabbit_send(rabbit, "later", [f"l-{i}" for i in range(50)])
        wait_for(lambda: depth(a, "inbound") == 50, 30, what="the 50 on A")
        assert sorted(receive_all(a, "inbound", quiet_s=2.0)) == sorted(f"l-{i}" for i in range(50))
    finally:
        a.stop()
