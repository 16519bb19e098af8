"""The core's per-user queue count (``Broker.owned``) behind ``max-queues``: created by a user's
links, released on delete, restored from the store with the queue."""

from __future__ import annotations

from broker.core.addresses import ANYCAST, MULTICAST, Broker
from broker.core.queues import Subscription


class ListStore:
    def __init__(self):
        self.defs = {}

    def add(self, queue, msg): pass
    def remove(self, queue, msg): pass
    def delivery_count_changed(self, queue, msg): pass

    def queue_created(self, definition):
        self.defs[definition["name"]] = definition

    def queue_deleted(self, name):
        self.defs.pop(name, None)


def test_owned_queues_are_counted_per_user_and_released():
    store = ListStore()
    core = Broker(store=store)
    assert core.creates_queue("a", None) and core.creates_queue("a", ANYCAST)
    assert not core.creates_queue("t", MULTICAST)
    core.resolve("a", None, may_create=True, owner="alice")
    assert not core.creates_queue("a", None)  # exists now
    core.resolve("t", MULTICAST, may_create=True, owner="alice")  # multicast address: no queue
    assert core.owned == {"alice": 1}
    assert core.subscription_creates_queue("c1.sub", durable=True)
    q = core.subscription_queue("t", "c1.sub", durable=True, owner="alice")
    assert not core.subscription_creates_queue("c1.sub", durable=True)
    tmp = core.subscription_queue("t", "c2.x", durable=False, owner="bob")
    assert core.owned == {"alice": 2, "bob": 1}
    assert store.defs["c1.sub"]["owner"] == "alice"
    # a temporary queue goes when its consumer leaves, and with it the count
    sub = Subscription(lambda s, m: None)
    tmp.add_subscription(sub)
    tmp.remove_subscription(sub)
    assert core.owned == {"alice": 2}
    # restart: the durable queues come back with their owner
    again = Broker(store=ListStore())
    for d in store.defs.values():
        again.restore_queue(d)
    assert again.owned == {"alice": 2}
    core.delete_queue(q.name)
    core.delete_address("a")
    assert core.owned == {}
    # configured (declared) addresses belong to nobody
    core.declare_address("cfg", [ANYCAST])
    assert core.owned == {}
