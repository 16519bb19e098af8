"""rhea's own example programs (``tests/e2e/examples/rhea/``, copied unmodified from tag 3.0.4; rhea
3.0.5 from npm runs them) with a real ``node`` against a real broker node, each a separate process
given only ``-h 127.0.0.1 -p PORT`` and counts through its own options (``options.js``, which needs
the npm package minimist). rhea and minimist resolve from ``clients/node/node_modules``
(``NODE_PATH``); ``npm ci`` installs them when missing. Without ``node`` the module is skipped,
and says so loudly.

rhea sends no SASL when it is given no user name, so the broker's acceptor allows that
(``allow-no-sasl``, as the anonymous user). What each must print is what rhea's
``examples/test_examples.js`` expects:

* ``client.js`` with proton's ``server.py`` (rhea's ``server.js`` only listens on port 5672): the
  requests and the upper-cased replies, over a temporary queue;
* ``selector/send.js`` then ``selector/recv.js -m 2`` (selector ``colour = 'red'``): the red ones;
  the others stay queued;
* ``queue_browser.js -m 4`` (distribution-mode copy): the four messages, twice; nothing consumed.
"""

from __future__ import annotations

import pytest
from example_programs import (ADDRESS, CLIENT_OUTPUT, RHEA_EXAMPLES, depth, drain, examples_broker,
                              lines, node_env, proton_cmd, proton_url, run, running, wait_consumers)

from tests.nodeclients import node_executable

pytestmark = pytest.mark.slow

SENT = ["sent red-panda", "sent green-grasshopper", "sent red-squirrel", "sent blue-whale"]


@pytest.fixture(scope="module")
def node():
    return node_executable("rhea example tests")


@pytest.fixture
def broker(tmp_path):
    b = examples_broker(tmp_path)
    try:
        yield b
    finally:
        b.kill()


def rhea(node, broker, example: str, *args: str) -> list[str]:
    cp = run([node, str(RHEA_EXAMPLES / example), *args, "-h", broker.host, "-p", str(broker.port)], env=node_env())
    return lines(cp)


def test_client_js_with_proton_server_over_a_temporary_queue(node, broker):
    with running(proton_cmd("server.py", "-a", proton_url(broker))) as server:
        wait_consumers(broker, ADDRESS, 1)
        assert rhea(node, broker, "client.js") == CLIENT_OUTPUT
    assert server.stop() == 0, server.stderr
    received = server.stdout.splitlines()[1:]
    assert len(received) == 4 and all(x.startswith("Received Message(") and "reply_to='temp." in x
                                      for x in received), server.stdout
    status, qs = broker.management_get("/api/v1/queues")
    assert [q["name"] for q in qs if q["temporary"]] == [] and depth(broker) == 0, qs


def test_selector_recv_takes_only_the_red_messages(node, broker):
    assert rhea(node, broker, "selector/send.js") == SENT
    assert depth(broker) == 4
    assert rhea(node, broker, "selector/recv.js", "-m", "2") == ["panda", "squirrel"]
    assert depth(broker) == 2
    assert [m.body for m in drain(broker)] == ["grasshopper", "whale"]


def test_queue_browser_shows_every_message_and_consumes_none(node, broker):
    assert rhea(node, broker, "selector/send.js") == SENT
    for _ in range(2):
        assert rhea(node, broker, "queue_browser.js", "-m", "4") == ['"panda"', '"grasshopper"', '"squirrel"',
                                                                     '"whale"']
        q = broker.queue(ADDRESS)
        assert (q["depth"], q["acked"]) == (4, 0), q
    assert [m.body for m in drain(broker)] == ["panda", "grasshopper", "squirrel", "whale"]
