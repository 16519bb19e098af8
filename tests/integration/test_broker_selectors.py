"""Selectors (``apache.org:selector-filter:string``), no-local and queue filters against a real
broker process with unmodified python-qpid-proton clients.

The expected message sets are worked out by hand from the five messages below (the oracle is
this table, not the broker's own evaluation).
"""

from __future__ import annotations

import pytest
from proton import Described, Message, symbol
from proton.reactor import Container, Copy, DurableSubscription, Filter, LinkOption, Selector
from proton.utils import BlockingConnection, LinkDetached

from tests.brokerproc import BrokerProcess, start_broker, write_users_file
from tests.integration.test_broker_durability import journal_synced
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"])}

MESSAGES = [
    dict(body="m0", properties={"color": "red", "weight": 10, "price": 2.5, "name": "apple", "flag": True}),
    dict(body="m1", properties={"color": "green", "weight": 25, "price": 10.0, "name": "a_b%c", "flag": False}),
    dict(body="m2", properties={"color": "blue", "weight": -3, "name": "banana"}),
    dict(body="m3", properties={"weight": 100}, priority=9, durable=True),
    dict(body="m4", properties={"color": "red", "weight": 7, "price": 0.5, "name": "o'neil"}),
]

# (selector, indices of the messages it selects), worked out by hand
TABLE = [
    ("color = 'red'", {0, 4}),
    ("color <> 'red'", {1, 2}),  # m3 has no color: UNKNOWN, not selected
    ("weight > 9", {0, 1, 3}),
    ("weight >= 10", {0, 1, 3}),
    ("weight < 10", {2, 4}),
    ("weight <= 7", {2, 4}),
    ("weight + 5 = 15", {0}),
    ("weight - 5 = 20", {1}),
    ("weight * 2 = 14", {4}),
    ("weight / 2 = 5", {0}),
    ("-weight = 3", {2}),
    ("price BETWEEN 1 AND 10", {0, 1}),
    ("price NOT BETWEEN 1 AND 10", {4}),
    ("color IN ('red', 'blue')", {0, 2, 4}),
    ("color NOT IN ('red', 'blue')", {1}),
    ("name LIKE 'a%'", {0, 1}),
    ("name LIKE 'a\\_b\\%c' ESCAPE '\\'", {1}),
    ("name LIKE '_pple'", {0}),
    ("name NOT LIKE 'a%'", {2, 4}),
    ("name = 'o''neil'", {4}),
    ("price IS NULL", {2, 3}),
    ("price IS NOT NULL", {0, 1, 4}),
    ("flag", {0}),
    ("flag = FALSE", {1}),
    ("color = 'red' AND weight > 8", {0}),
    ("color = 'red' OR weight > 50", {0, 3, 4}),
    ("NOT (color = 'red')", {1, 2}),
    ("(weight > 5 AND weight < 20) OR color = 'blue'", {0, 2, 4}),
    ("weight > 5 AND NOT (price IS NULL)", {0, 1, 4}),
    ("JMSPriority = 9", {3}),
    ("JMSDeliveryMode = 'PERSISTENT'", {3}),
    ("JMSDeliveryMode = 'NON_PERSISTENT'", {0, 1, 2, 4}),
]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broker-selectors")
    users = write_users_file(tmp / "users.toml", USERS)
    b = start_broker(tmp, users_file=users, config={
        "address-settings.news.#": {"default-routing-type": "multicast"},
        "addresses.bigorders": {"routing-types": ["anycast"], "filter": "weight > 50"},
    })
    yield b
    b.terminate()


def connect(b, container_id=None):
    container = Container()
    if container_id:
        container.container_id = container_id
    return BlockingConnection(b.amqp_url.replace("amqp://", "amqp://app:app@"), timeout=10,
                              container=container, allowed_mechs="PLAIN")


def send_all(c, address):
    s = c.create_sender(address)
    for m in MESSAGES:
        s.send(Message(**m))
    s.close()


def bodies(r, timeout=0.3, *, accept=True):
    out = []
    while True:
        try:
            m = r.receive(timeout=timeout)
        except Exception:  # noqa: BLE001 - proton's Timeout: nothing more
            return out
        if accept:  # a browser's deliveries come settled: nothing to accept
            r.accept()
        out.append(m.body)


@pytest.fixture(scope="module")
def loaded(broker):
    c = connect(broker)
    send_all(c, "sel.table")
    yield c
    c.close()


@pytest.mark.parametrize("selector,expected", TABLE, ids=[t[0] for t in TABLE])
def test_every_operator_selects_what_was_worked_out_by_hand(broker, loaded, selector, expected):
    # a browser with the selector: the table's queue is read, never consumed
    r = loaded.create_receiver("sel.table", name=f"b-{selector}", options=[Copy(), Selector(selector)])
    got = bodies(r, accept=False)
    r.close()
    assert got == [f"m{i}" for i in sorted(expected, key=lambda i: (-MESSAGES[i].get("priority", 4), i))]
    assert broker.queue("sel.table")["depth"] == len(MESSAGES)


def test_attach_reply_echoes_the_selector_in_force(broker):
    c = connect(broker)
    r = c.create_receiver("sel.echo", options=Selector("color = 'red'"))
    f = r.link.remote_source.filter
    f.rewind()
    assert f.next()
    got = f.get_object()
    (value,) = got.values()
    assert str(value.descriptor) == "apache.org:selector-filter:string" and value.value == "color = 'red'"
    c.close()


@pytest.mark.parametrize("bad", ["color = ", "a = 'x' AND AND b", "weight >> 2", "", "name LIKE 3"])
def test_a_bad_selector_is_refused_with_invalid_field(broker, bad):
    c = connect(broker)
    with pytest.raises(LinkDetached) as info:
        c.create_receiver("sel.bad", options=Selector(bad))
    assert "amqp:invalid-field" in str(info.value)
    c.close()


def test_competing_consumers_with_selectors_split_the_queue_and_the_rest_waits(broker):
    c = connect(broker)
    send_all(c, "sel.split")
    reds = c.create_receiver("sel.split", name="reds", options=Selector("color = 'red'"))
    heavy = c.create_receiver("sel.split", name="heavy", options=Selector("weight > 20"))
    assert sorted(bodies(reds)) == ["m0", "m4"]
    assert sorted(bodies(heavy)) == ["m1", "m3"]
    assert broker.queue("sel.split")["depth"] == 1  # m2 matches nobody: it waits
    everyone = c.create_receiver("sel.split", name="all")
    assert bodies(everyone) == ["m2"]
    c.close()


def test_multicast_subscriber_selector_keeps_messages_out_of_its_queue(broker):
    c = connect(broker)
    r = c.create_receiver("news.sel", name="greens", options=Selector("color = 'green'"))
    q = next(q for q in broker.management_get("/api/v1/queues")[1] if q["address"] == "news.sel")
    assert q["filter"] == "color = 'green'"
    send_all(c, "news.sel")
    assert bodies(r) == ["m1"]
    assert broker.queue(q["name"])["enqueued"] == 1
    c.close()


class NoLocal(LinkOption):
    def apply(self, link):
        link.source.filter.put_dict({symbol("no-local"): Described(symbol("apache.org:no-local-filter:list"), [])})


def test_no_local_consumer_does_not_get_its_own_connections_messages(broker):
    mine = connect(broker)
    r = mine.create_receiver("news.nolocal", name="nl", options=NoLocal())
    s = mine.create_sender("news.nolocal")
    s.send(Message(body="own"))
    other = connect(broker)
    os_ = other.create_sender("news.nolocal")
    os_.send(Message(body="theirs"))
    assert bodies(r) == ["theirs"]
    mine.close()
    other.close()


def test_configured_queue_filter(broker):
    c = connect(broker)
    send_all(c, "bigorders")
    assert broker.queue("bigorders")["filter"] == "weight > 50"
    r = c.create_receiver("bigorders")
    assert bodies(r) == ["m3"]
    c.close()


def test_durable_subscription_selector_survives_a_restart(tmp_path):
    users = write_users_file(tmp_path / "users.toml", USERS)
    b = start_broker(tmp_path, users_file=users,
                     config={"address-settings.news.#": {"default-routing-type": "multicast"}})
    try:
        c = connect(b, container_id="durable-sel")
        r = c.create_receiver("news.durable", name="reds", options=[DurableSubscription(), Selector("color = 'red'")])
        r.link.detach()  # a detach (not a close) keeps the durable subscription
        c.close()
        # a queue definition is durable once the group commit after it ran (docs/broker.md)
        wait_for(lambda: journal_synced(b), 10)
        b.kill()  # SIGKILL: the subscription's definition (and its selector) must be in the journal
        b = BrokerProcess(b.workdir, b.config_path)
        b.start()
        p = connect(b)
        send_all(p, "news.durable")  # the subscription filters while nobody is attached
        p.close()
        wait_for(lambda: b.queue("durable-sel.reds") is not None and b.queue("durable-sel.reds")["depth"] == 2, 10)
        c = connect(b, container_id="durable-sel")
        r = c.create_receiver("news.durable", name="reds", options=[DurableSubscription(), Selector("color = 'red'")])
        assert bodies(r) == ["m0", "m4"]
        c.close()
    finally:
        b.kill()
