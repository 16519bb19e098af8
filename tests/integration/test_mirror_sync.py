"""Sync mirrors (``[broker-connections.<name>.mirror] sync = true``, docs/broker-connections.md
"Sync mirrors") between real broker processes: a send to A is answered only once B has it. B is
frozen with SIGSTOP (a target that is up but does not answer) while unmodified
python-qpid-proton producers send to A; what they are told, and when, is the oracle."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN
from tests.haproc import send
from tests.integration.test_broker_connections import depth, view as source_view
from tests.integration.test_mirror import mirrored_pair
from tests.serverproc import http_json, metric_by_label
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Producer(threading.Thread):
    """Sends one message and waits (up to a minute) for A's answer."""

    def __init__(self, node, body: str, durable: bool) -> None:
        super().__init__(daemon=True)
        self.node, self.body, self.durable = node, body, durable
        self.answered = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            c = BlockingConnection(self.node.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=60)
            try:
                c.create_sender("orders").send(Message(body=self.body, durable=self.durable))
                self.answered.set()
            finally:
                c.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def held_metric(node) -> float:
    status, text = http_json(node.management_url + "/metrics", auth=ADMIN)
    assert status == 200
    return sum(metric_by_label(text, "lodestone_broker_mirror_sync_held").values())


def test_a_sync_mirror_answers_a_send_only_once_the_target_has_it(tmp_path, procs):
    a, b = mirrored_pair(tmp_path, procs, sync=True)
    send(a, "orders", ["before"])                         # B answers: A answers at once
    assert depth(b, "orders") == 1                         # it was on B before A answered
    os.kill(b.pid, signal.SIGSTOP)
    try:
        durable = _Producer(a, "during-durable", True)
        fleeting = _Producer(a, "during-non-durable", False)
        wait_for(lambda: source_view(a)["mirror"]["held"] == 2, 30, what="A holds both sends")
        assert held_metric(a) == 2
        assert not durable.answered.is_set() and not fleeting.answered.is_set()
        assert depth(a, "orders") == 3                     # stored on A, only the answer waits
    finally:
        os.kill(b.pid, signal.SIGCONT)
    assert durable.answered.wait(30) and fleeting.answered.wait(30), (durable.error, fleeting.error)
    wait_for(lambda: source_view(a)["mirror"]["held"] == 0, 30, what="nothing held")
    assert depth(b, "orders") == 3 and held_metric(a) == 0


def test_initial_sync_copies_what_a_broker_already_holds_once_then_what_follows(tmp_path, procs):
    from tests.integration.test_mirror import browse, mirror, start, target_events

    b = start(tmp_path, "b")
    procs.append(b)
    a = start(tmp_path, "a")                               # no mirror yet
    procs.append(a)
    old = [f"old-{i}" for i in range(500)]
    send(a, "orders", old)
    a.stop()
    a.config_path.write_text(a.config_path.read_text() + "\n" + mirror(b.amqp_url, initial_sync=True))
    a.start()                                              # the mirror's first start: the 500 are copied
    new = [f"new-{i}" for i in range(50)]
    send(a, "orders", new)                                 # while the copy may still be on its way
    wait_for(lambda: source_view(a)["mirror"]["pending"] == 0 and depth(b, "orders") == 550, 60,
             what="550 on B")
    assert browse(b, "orders") == old + new                # each once, in order
    a.kill()                                               # a restart does not copy them again
    a.start()
    send(a, "orders", ["after"])
    wait_for(lambda: source_view(a)["mirror"]["pending"] == 0 and depth(b, "orders") == 551, 60,
             what="551 on B")
    ev = target_events(b)
    assert (ev["sends"], ev["duplicates"]) == (551, 0)
    assert browse(b, "orders") == old + new + ["after"]
