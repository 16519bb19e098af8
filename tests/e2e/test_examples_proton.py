"""Apache Qpid Proton's own Python example programs (``tests/e2e/examples/proton/``, copied unmodified
from tag 0.40.0) against a real broker node, each run as a separate process with only the URL
(``-a amqp://app:app-pw@127.0.0.1:PORT/examples``) and a count given through its own options.

What each must print is what proton's ``python/examples/test_examples.py`` and README say:

* ``client.py`` / ``sync_client.py`` with ``server.py``: the requests and the upper-cased replies,
  received on a temporary queue (dynamic source) named in ``reply_to``; ``server.py`` needs the
  broker to offer ANONYMOUS-RELAY (it replies by each message's ``to``).
* ``colour_send.py`` then ``selected_recv.py`` (selector ``colour = 'green'``): only the green ones;
  the rest stay queued.
* ``queue_browser.py`` (distribution-mode copy): every waiting message, nothing consumed. It takes
  no options and connects to ``localhost:5672``, so it runs in a network namespace the test
  creates (root and ``ip`` needed; skipped loudly otherwise) with a broker on 127.0.0.1:5672 in it.
  It stops once its local queue is empty — ``event.receiver.drained`` is a *method* in proton
  0.40.0, always true, so it never waits for the broker to drain its credit (our broker drains only
  when asked) — i.e. after the broker's first burst of deliveries; the queue is kept under its
  prefetch of 10 so that burst is all of it.

Not here: tx_send.py, tx_recv.py and server_tx.py (transactions) — they are run by the
transactions branch's own tests.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import sys
import threading
import uuid

import pytest
from proton import Message

from example_programs import (ADDRESS, APP, CLIENT_OUTPUT, REQUESTS, depth, drain, examples_broker, lines,
                              proton_cmd, proton_url, run, running, send, wait_consumers)
from tests.brokerproc import BrokerProcess, write_config, write_users_file, ADMIN

pytestmark = pytest.mark.slow

RECEIVED = re.compile(r"^Received Message\((?P<fields>.*)\)$")


@pytest.fixture
def broker(tmp_path):
    b = examples_broker(tmp_path)
    try:
        yield b
    finally:
        b.kill()


def temporary_queues(broker) -> list[dict]:
    status, qs = broker.management_get("/api/v1/queues")
    assert status == 200, qs
    return [q for q in qs if q["temporary"]]


@pytest.mark.parametrize("client", ["client.py", "sync_client.py"])
def test_client_and_server_request_response_over_a_temporary_queue(broker, client):
    url = proton_url(broker)
    with running(proton_cmd("server.py", "-a", url)) as server:
        wait_consumers(broker, ADDRESS, 1)
        out = lines(run(proton_cmd(client, "-a", url)))
        assert out == CLIENT_OUTPUT
        assert temporary_queues(broker) == []  # the client's reply queue went with its link
    assert server.stop() == 0, server.stderr  # exit status 1 = "needs ANONYMOUS-RELAY"
    got = server.stdout.splitlines()
    assert got[0] == f"Listening on {url}", server.stdout
    received = [RECEIVED.match(x) for x in got[1:]]
    assert all(received) and len(received) == len(REQUESTS), server.stdout
    reply_to = {re.search(r"reply_to='([^']*)'", m["fields"])[1] for m in received}
    assert len(reply_to) == 1 and re.fullmatch(r"temp\.[0-9a-f-]{36}", reply_to.pop()), server.stdout
    assert [re.search(r"body='([^']*)'", m["fields"])[1] for m in received] == REQUESTS
    assert depth(broker) == 0


def test_selected_recv_takes_only_the_green_messages(broker):
    url = proton_url(broker)
    assert lines(run(proton_cmd("colour_send.py", "-a", url, "-m", "10"))) == ["all messages confirmed"]
    # and a few more the selector must not take: other colours, no property, another property, case
    send(broker, [Message(body="blue 11", properties={"colour": "blue"}),
                  Message(body="no colour 12"),
                  Message(body="GREEN 13", properties={"colour": "GREEN"}),
                  Message(body="green 14", properties={"colour": "green"}),
                  Message(body="color 15", properties={"color": "green"})])
    assert depth(broker) == 15
    out = lines(run(proton_cmd("selected_recv.py", "-a", url, "-m", "6")))
    assert out == ["green 1", "green 3", "green 5", "green 7", "green 9", "green 14"]
    assert depth(broker) == 9
    assert [m.body for m in drain(broker)] == ["red 2", "red 4", "red 6", "red 8", "red 10", "blue 11",
                                              "no colour 12", "GREEN 13", "color 15"]


# -- queue_browser.py, inside a network namespace ------------------------------------------------

_CLONE_NEWNET = 0x40000000


def _enter_netns(name: str) -> None:
    """Move the calling thread (or a freshly forked child) into network namespace ``name``."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if hasattr(os, "setns"):  # Python >= 3.12
            os.setns(fd, _CLONE_NEWNET)
        else:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def in_netns(name: str, fn):
    """``fn()`` on a thread inside the namespace (so its sockets are), returning its result."""
    result: dict = {}

    def target():
        try:
            _enter_netns(name)
            result["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join(60)
    assert not t.is_alive(), f"{fn} did not return inside netns {name}"
    if "error" in result:
        raise result["error"]
    return result["value"]


@pytest.fixture
def netns():
    ip = shutil.which("ip")
    why = None
    if os.geteuid() != 0:
        why = "not root"
    elif ip is None:
        why = "no `ip` command"
    if why is None:
        name = f"lodestone-ex-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        made = run([ip, "netns", "add", name], timeout_s=15)
        if made.returncode != 0:
            why = f"`ip netns add` failed: {made.stderr.strip()}"
    if why is not None:
        msg = f"proton queue_browser.py needs a network namespace ({why}): SKIPPED"
        print("\n" + "!" * 20 + " " + msg + " " + "!" * 20, file=sys.stderr)
        pytest.skip(msg)
    try:
        up = run([ip, "netns", "exec", name, "ip", "link", "set", "lo", "up"], timeout_s=15)
        assert up.returncode == 0, up.stderr
        yield name
    finally:
        run([ip, "netns", "delete", name], timeout_s=15)


def test_queue_browser_shows_every_message_and_consumes_none(tmp_path, netns):
    users = write_users_file(tmp_path / "users.toml", {ADMIN[0]: (ADMIN[1], ["admin"]), APP[0]: (APP[1], ["app"])},
                             anonymous_roles=["app"])
    workdir = tmp_path / "broker"
    path = write_config(workdir, users_file=users, mechanisms=("PLAIN", "ANONYMOUS"),
                        config={"acceptors.amqp": {"port": 5672}})  # fixed: queue_browser.py's address
    broker = BrokerProcess(workdir, path)
    broker._spawn(["broker", "run", str(path)], lambda urls: {"amqp", "management"} <= set(urls),
                  broker.start_timeout_s, "broker", preexec_fn=lambda: _enter_netns(netns))
    try:
        assert broker.amqp_url == "amqp://127.0.0.1:5672"
        ns = ["ip", "netns", "exec", netns]
        sent = lines(run([*ns, *proton_cmd("colour_send.py", "-a", f"amqp://{APP[0]}:{APP[1]}@localhost:5672/{ADDRESS}",
                                           "-m", "8")]))
        assert sent == ["all messages confirmed"]
        colours = ["green" if i % 2 else "red" for i in range(1, 9)]
        expected = [f"Message(priority=4, id={i}, properties={{'colour': '{c}'}}, body='{c} {i}')"
                    for i, c in enumerate(colours, 1)]
        for _ in range(2):  # browsing twice shows the same messages: nothing was acquired
            assert lines(run([*ns, *proton_cmd("queue_browser.py")], timeout_s=20)) == expected
        q = in_netns(netns, lambda: broker.queue(ADDRESS))
        assert (q["depth"], q["acked"], q["consumers"]) == (8, 0, 0), q
    finally:
        broker.kill()
