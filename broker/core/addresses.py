"""Addresses, routing types and the broker's message core.

Theory of operation
-------------------
The model is Artemis's: an *address* is a name producers send to; *queues* hang off addresses.

* ``anycast`` — the address has one queue of the same name; its consumers compete
  (point-to-point).
* ``multicast`` — every subscriber gets its own queue (publish-subscribe). A non-durable
  subscriber's queue is temporary: it is deleted when the consumer leaves. A durable
  subscription's queue is named ``<container-id>.<link-name>`` (Artemis style), is persisted, and
  keeps collecting messages while its consumer is away; it is deleted only when the consumer
  closes its link (AMQP 1.0 §2.6.3: closing a link destroys its terminus) or by management.

An address may carry both routing types; a message sent to it reaches the anycast queue and
every multicast queue. Unknown addresses are created on first use when the matching
:class:`AddressSettings` allow it (``auto_create``); otherwise the caller gets
:class:`AddressNotFound` (AMQP ``amqp:not-found``).

Settings are chosen by Artemis-style match (``#`` any number of words, ``*`` exactly one word,
words separated by ``.``); the most specific match wins, by the same rule as permissions
(``broker.wire.wildcards``).

:class:`Broker` is the whole core: addresses, queues, message ids, dead-lettering, and
recovery from the store. It is pure (no clock, no I/O); durability goes through an injected
``store`` object with ``add(queue, msg)``, ``remove(queue, msg)``,
``delivery_count_changed(queue, msg)``, ``queue_created(defn)`` and ``queue_deleted(name)``. A message is written once per durable queue it lands in, so the HA
replication of the journal replays to exactly this state. ``begin_group()`` … ``end_group()``
brackets a transaction's commit (``broker.core.transactions``): the message adds, removes and
count changes in between are written atomically; ``end_group`` says whether anything was.
``add_record(queue, id, body)`` / ``remove_record(queue, id)`` keep broker-internal records (the
duplicate ids of ``broker.core.duplicates``), inside the group when one is open.

Duplicate detection (Artemis): :meth:`Broker.publish_once` routes a message carrying an
``_AMQ_DUPL_ID`` only if its address has not seen the id (``Broker.duplicates``), and writes the
message and its id in one store group.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Protocol

from broker.core.balancing import (
    Forward,
    LoadBalancing,
    RedistributionSchedule,
    Rotation,
    redistribution_binding,
    redistribution_target,
    route,
)
from broker.core.bindings import Bindings, ClusterBindings, ConsumersChanged, RemoteBinding
from broker.core.deliveries import DEFAULT_PRIORITY, Message
from broker.core.duplicates import MISSING, DuplicateIds
from broker.core.queues import ANYCAST, MULTICAST, Queue, QueueHost, Subscription
from broker.wire.wildcards import match_specificity, wildcard_match
from broker.wire.errors import LodestoneError

__all__ = [
    "ANYCAST", "MULTICAST", "Address", "AddressSettings", "AddressNotFound", "Broker", "Store",
    "NullStore", "SettingsResolver", "WildcardSettings", "match_address",
]

ROUTING_TYPES = (ANYCAST, MULTICAST)


class AddressNotFound(LodestoneError):
    """The address does not exist and may not be auto-created (AMQP ``amqp:not-found``)."""

    condition = "amqp:not-found"


class Store(Protocol):
    """What the core asks of durable storage (the shell adapts the journal to this)."""

    def add(self, queue: str, msg: Message) -> None: ...
    def remove(self, queue: str, msg: Message) -> None: ...
    def delivery_count_changed(self, queue: str, msg: Message) -> None: ...
    def queue_created(self, definition: dict) -> None: ...
    def queue_deleted(self, name: str) -> None: ...
    def begin_group(self) -> None: ...
    def end_group(self) -> bool: ...
    def add_record(self, queue: str, message_id: int, body: bytes) -> None: ...
    def remove_record(self, queue: str, message_id: int) -> None: ...


class NullStore:
    """A store that forgets everything (non-persistent brokers, unit tests)."""

    def add(self, queue: str, msg: Message) -> None:
        pass

    def remove(self, queue: str, msg: Message) -> None:
        pass

    def delivery_count_changed(self, queue: str, msg: Message) -> None:
        pass

    def queue_created(self, definition: dict) -> None:
        pass

    def queue_deleted(self, name: str) -> None:
        pass

    def begin_group(self) -> None:
        pass

    def end_group(self) -> bool:
        return False

    def add_record(self, queue: str, message_id: int, body: bytes) -> None:
        pass

    def remove_record(self, queue: str, message_id: int) -> None:
        pass


@dataclass(frozen=True)
class AddressSettings:
    """Per-address behaviour, chosen by match (Artemis ``address-setting``)."""

    default_routing_type: str = ANYCAST
    auto_create: bool = True
    max_delivery_count: int = 10  # 0 = unlimited
    dead_letter_address: str | None = "DLQ"
    expiry_address: str | None = "ExpiryQueue"  # expired messages go here (None: dropped, counted)
    #: Artemis ``redistribution-delay``: -1 never redistribute, 0 at once (broker.core.balancing)
    redistribution_delay_ms: int = -1
    #: Artemis ``id-cache-size`` address-setting (2.28): duplicate ids remembered for this address;
    #: None: the node's ``id-cache-size`` (broker.core.duplicates)
    id_cache_size: int | None = None


@dataclass(frozen=True)
class WildcardSettings:
    """Artemis ``wildcard-addresses``: routing to wildcard subscriptions, and the three characters."""

    routing_enabled: bool = True
    delimiter: str = "."
    any_words: str = "#"
    single_word: str = "*"

    def is_wildcard(self, address: str) -> bool:
        if not self.routing_enabled:
            return False
        words = address.split(self.delimiter)
        return self.any_words in words or self.single_word in words

    def match(self, pattern: str, address: str) -> bool:
        return wildcard_match(pattern, address, self.delimiter, self.any_words, self.single_word)


@dataclass(frozen=True)
class SettingsResolver:
    """Chooses the AddressSettings for an address: the most specific matching pattern wins."""

    default: AddressSettings = field(default_factory=AddressSettings)
    rules: tuple[tuple[str, AddressSettings], ...] = ()

    def for_address(self, address: str) -> AddressSettings:
        """The settings of the most specific matching pattern (the same rule as permissions,
        ``broker.wire.wildcards``); the first in the file wins among equal patterns."""
        best = None
        best_key = None
        for pattern, settings in self.rules:
            if wildcard_match(pattern, address):
                key = match_specificity(pattern)
                if best_key is None or key > best_key:
                    best, best_key = settings, key
        return best if best is not None else self.default


match_address = wildcard_match  # the name the broker core has used


class Address:
    """One address: its routing types and the queues bound to it."""

    __slots__ = ("name", "routing_types", "queues", "auto_created")

    def __init__(self, name: str, routing_types: Iterable[str], auto_created: bool = False):
        self.name = name
        self.routing_types = set(routing_types)
        self.queues: dict[str, Queue] = {}
        self.auto_created = auto_created

    def __repr__(self) -> str:
        return f"Address({self.name!r}, {sorted(self.routing_types)}, queues={list(self.queues)})"


class Broker:
    """The message core of one node. See the module docstring."""

    def __init__(self, settings: SettingsResolver | None = None, store: Store | None = None, *,
                 clock: Callable[[], float] | None = None, wildcards: WildcardSettings | None = None,
                 duplicates: DuplicateIds | None = None):
        self.settings = settings or SettingsResolver()
        #: the duplicate-id caches (Artemis duplicate detection; the cluster bridge's too)
        self.duplicates = duplicates or DuplicateIds()
        if self.duplicates.size_for is None:
            self.duplicates.size_for = lambda address: self.settings.for_address(address).id_cache_size
        self.duplicates.next_mid = self.next_mid
        self.queues: dict[str, Queue] = {}
        #: what every queue of this broker is given instead of a back-pointer (see QueueHost);
        #: ``store`` and ``clock`` below read and replace it
        self.host = QueueHost(store or NullStore(), clock or (lambda: 0.0), self.dead_letter, self.expire,
                              self.delete_queue, self._consumers_changed)
        self.duplicates.store = self.host.store
        #: the cluster (broker.core.bindings, broker.core.balancing): remote bindings the bridge
        #: maintains, the load-balancing mode, the rotation, redistribution deadlines. With no
        #: remote binding ``publish`` takes the single-node path.
        self.cluster = ClusterBindings()
        self.cluster.on_consumer_added = self._remote_consumer_added
        self.load_balancing = LoadBalancing.ON_DEMAND
        self.rotation = Rotation()
        self.redistribution = RedistributionSchedule()
        #: the bridge's hook for a message's remote part: ``on_forward(forward, msg) -> stored``
        #: (True when it wrote the store, so the producer is answered after the fsync)
        self.on_forward: Callable[[Forward, Message], bool] | None = None
        self.forwarded = 0
        self.forwards_unsent = 0  # remote copies decided with no on_forward to take them
        self._consumer_listeners: list[Callable[[ConsumersChanged], None]] = []
        #: told ``fn(queue, created)`` when a queue is created (True) or deleted (False): the bridge
        #: turns these into binding notifications
        self._queue_listeners: list[Callable[[Queue, bool], None]] = []
        self.wildcards = wildcards or WildcardSettings()
        self.addresses: dict[str, Address] = {}
        self._next_mid = 1
        self.dropped_unrouted = 0
        self.dropped_expired = 0
        self.temp_counter = 0
        #: events captured by sync mirrors so far: a send or commit that adds some is answered
        #: only once they reached the target (the shell compares it before and after)
        self.sync_events = 0
        #: wildcard addresses (``events.stock.*``) whose queues also get matching addresses' messages
        self.wildcard_addresses: dict[str, Address] = {}
        self._routes: dict[str, tuple[Address, ...]] = {}  # address -> wildcard addresses matching it
        self._wild_version = 0        # changes when a local wildcard address comes or goes
        self._remote_wild_version: tuple[int, int] | None = None
        self._remote_wild_names: tuple[str, ...] = ()
        self._remote_wild_cache: dict[str, tuple[str, ...]] = {}
        #: text -> predicate, for queue filters recovered from the store (the shell injects the
        #: selector compiler); None: a recovered queue filter is kept as text only
        self.compile_filter: Callable[[str], Callable[[Message], bool]] | None = None
        #: queues per creating user (Artemis ``max-queues`` counts these)
        self.owned: Counter = Counter()

    @property
    def store(self) -> Store:
        """Durable storage (see the module docstring)."""
        return self.host.store

    @store.setter
    def store(self, store: Store) -> None:
        self._set_host(replace(self.host, store=store))

    @property
    def clock(self) -> Callable[[], float]:
        """Milliseconds since the epoch, asked only about messages that can expire (the shell
        injects the wall clock; without one nothing expires)."""
        return self.host.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._set_host(replace(self.host, clock=clock))

    def _set_host(self, host: QueueHost) -> None:
        self.host = host
        self.duplicates.store = host.store
        for q in self.queues.values():
            q.host = host

    # -- ids -------------------------------------------------------------------------------
    def next_mid(self) -> int:
        mid = self._next_mid
        self._next_mid = mid + 1
        return mid

    def bump_mid(self, seen: int) -> None:
        """Recovery: message ids continue above every id found in the store."""
        if seen >= self._next_mid:
            self._next_mid = seen + 1

    # -- addresses ---------------------------------------------------------------------------
    def declare_address(self, name: str, routing_types: Iterable[str], *, auto_created: bool = False,
                        owner: str | None = None) -> Address:
        """Create an address (or add routing types to an existing one). Anycast gets its queue."""
        types = set(routing_types)
        bad = types - set(ROUTING_TYPES)
        if bad:
            raise ValueError(f"unknown routing type {sorted(bad)[0]!r}")
        addr = self.addresses.get(name)
        if addr is None:
            addr = self._new_address(name, types, auto_created)
        else:
            addr.routing_types |= types
        if ANYCAST in addr.routing_types and name not in addr.queues:
            self._create_queue(name, addr, ANYCAST, durable=True, owner=owner)
        return addr

    def _new_address(self, name: str, types: Iterable[str], auto_created: bool) -> Address:
        addr = Address(name, types, auto_created)
        self.addresses[name] = addr
        if self.wildcards.is_wildcard(name):
            self.wildcard_addresses[name] = addr
            self._wild_version += 1
        if self.wildcard_addresses:
            self._routes.clear()
        return addr

    def resolve(self, name: str, routing_type: str | None, *, may_create: bool, owner: str | None = None) -> Address:
        """The address a link names, auto-creating it (or a missing routing type) when allowed.

        ``routing_type`` None means "whatever the address has" (the settings' default for a new
        one). ``may_create`` is the caller's createAddress permission; the settings decide too.
        """
        addr = self.addresses.get(name)
        if addr is not None and (routing_type is None or routing_type in addr.routing_types):
            return addr
        settings = self.settings.for_address(name)
        if not (may_create and settings.auto_create):
            raise AddressNotFound(f"address {name!r} does not exist"
                                  + (f" with routing type {routing_type}" if addr else ""))
        return self.declare_address(name, [routing_type or settings.default_routing_type], auto_created=True,
                                    owner=owner)

    def needs_create(self, name: str, routing_type: str | None) -> bool:
        """Would :meth:`resolve` have to create something? (The caller checks createAddress.)"""
        addr = self.addresses.get(name)
        return addr is None or (routing_type is not None and routing_type not in addr.routing_types)

    def creates_queue(self, name: str, routing_type: str | None) -> bool:
        """Would :meth:`resolve` create a queue (an anycast one)? For ``max-queues``."""
        addr = self.addresses.get(name)
        if addr is None:
            return (routing_type or self.settings.for_address(name).default_routing_type) == ANYCAST
        return routing_type == ANYCAST and ANYCAST not in addr.routing_types

    def subscription_creates_queue(self, sub_name: str | None, *, durable: bool) -> bool:
        """Would :meth:`subscription_queue` create a queue? (A durable one may exist already.)"""
        return not durable or sub_name not in self.queues

    def delete_address(self, name: str) -> None:
        addr = self.addresses.pop(name, None)
        if addr is None:
            raise AddressNotFound(f"address {name!r} does not exist")
        if self.wildcard_addresses.pop(name, None) is not None or self.wildcard_addresses:
            self._routes.clear()
            self._wild_version += 1
        for qname in list(addr.queues):
            self.delete_queue(qname)

    # -- queues ----------------------------------------------------------------------------
    def _create_queue(self, name: str, addr: Address, routing_type: str, *, durable: bool,
                      subscription: bool = False, temporary: bool = False, owner: str | None = None,
                      filter: Callable[[Message], bool] | None = None, filter_text: str | None = None) -> Queue:
        settings = self.settings.for_address(addr.name)
        q = Queue(self.host, name, addr.name, routing_type, durable=durable,
                  max_delivery_count=settings.max_delivery_count,
                  dead_letter_address=settings.dead_letter_address,
                  expiry_address=settings.expiry_address,
                  subscription=subscription, temporary=temporary, filter=filter, filter_text=filter_text)
        if owner is not None:
            q.owner = owner
            self.owned[owner] += 1
        addr.queues[name] = q
        self.queues[name] = q
        if durable:
            self.store.queue_created(q.definition())
        for fn in self._queue_listeners:
            fn(q, True)
        return q

    def delete_queue(self, name: str) -> None:
        q = self.queues.pop(name, None)
        if q is None:
            return
        q.deleted = True
        self.redistribution.cancel(name)
        self.rotation.forget((q.address, name))
        addr0 = self.addresses.get(q.address)
        if q.temporary and addr0 is not None and addr0.auto_created and len(addr0.queues) <= 1 \
                and q.address == name and q.routing_type == ANYCAST:
            # a dynamic node's address goes with its queue
            self.addresses.pop(name, None)
            if self.wildcard_addresses.pop(name, None) is not None or self.wildcard_addresses:
                self._routes.clear()
                self._wild_version += 1
        if q.owner is not None:
            left = self.owned[q.owner] - 1
            if left > 0:
                self.owned[q.owner] = left
            else:
                del self.owned[q.owner]
        q.drain_all()
        addr = self.addresses.get(q.address)
        if addr is not None:
            addr.queues.pop(name, None)
        if addr is None or not addr.queues:
            # Artemis PostOfficeImpl.removeBinding: the address's last binding takes its
            # duplicate-id cache with it
            self.duplicates.forget_address(q.address)
        if q.durable:
            self.store.queue_deleted(name)
        for fn in self._queue_listeners:
            fn(q, False)

    def add_queue_listener(self, fn: Callable[[Queue, bool], None]) -> None:
        """Call ``fn(queue, created)`` when a queue is created or deleted (not on recovery)."""
        self._queue_listeners.append(fn)

    def remove_queue_listener(self, fn: Callable[[Queue, bool], None]) -> None:
        try:
            self._queue_listeners.remove(fn)
        except ValueError:
            pass

    def anycast_queue(self, address: str) -> Queue:
        """The competing-consumer queue of an anycast address."""
        return self.addresses[address].queues[address]

    def set_queue_filter(self, name: str, accepts: Callable[[Message], bool] | None, text: str | None) -> None:
        """Give a queue a filter (configured queues, and a subscription queue's selector)."""
        q = self.queues[name]
        q.filter = accepts
        q.filter_text = text

    def temporary_queue(self, name: str, *, owner: str | None = None) -> Queue:
        """A dynamic node (AMQP 1.0 §3.5.3 ``dynamic``): an anycast address with one non-durable
        queue, both named ``name``, deleted when its last consumer leaves (see Queue)."""
        if name in self.addresses or name in self.queues:
            raise ValueError(f"address {name!r} exists")
        addr = self._new_address(name, [ANYCAST], True)
        return self._create_queue(name, addr, ANYCAST, durable=False, temporary=True, owner=owner)

    def subscription_queue(self, address: str, sub_name: str | None, *, durable: bool,
                           owner: str | None = None) -> Queue:
        """The queue of one multicast subscriber.

        Durable: named ``sub_name`` (``<container-id>.<link-name>``), reused if it exists.
        Non-durable: a fresh temporary queue deleted when its consumer leaves.
        """
        addr = self.addresses[address]
        if durable:
            assert sub_name
            q = self.queues.get(sub_name)
            if q is not None:
                if q.address != address:
                    raise AddressNotFound(f"subscription {sub_name!r} belongs to address {q.address!r}")
                return q
            return self._create_queue(sub_name, addr, MULTICAST, durable=True, subscription=True, owner=owner)
        self.temp_counter += 1
        name = f"{sub_name or 'sub'}.{self.temp_counter}"
        return self._create_queue(name, addr, MULTICAST, durable=False, subscription=True, temporary=True,
                                  owner=owner)

    def create_queue_as(self, name: str, address: str, routing_type: str, filter_text: str | None = None
                        ) -> Queue | None:
        """Create (or find) the queue another broker describes — a queue moved here by a scale-down,
        a mirror's ``createQueue`` — as this broker would have made it: an anycast queue only
        when it carries its address's name, a durable subscription queue for multicast, then its
        filter if it has none yet. None: no equivalent here (an anycast queue named otherwise, an
        unknown routing type); ``ValueError``/``KeyError``: refused (an address of the other type)."""
        if routing_type == ANYCAST:
            if name != address:
                return None
            self.declare_address(address, [ANYCAST])
            q = self.queues.get(name)
        elif routing_type == MULTICAST:
            self.declare_address(address, [MULTICAST])
            q = self.subscription_queue(address, name, durable=True)
        else:
            return None
        if q is not None and filter_text and q.filter_text is None and self.compile_filter is not None:
            self.set_queue_filter(name, self.compile_filter(filter_text), filter_text)
        return q

    def subscribe(self, queue: Queue, sub: Subscription) -> None:
        queue.add_subscription(sub)

    # -- routing ---------------------------------------------------------------------------
    def publish(self, address: str, body: bytes, durable: bool, priority: int = DEFAULT_PRIORITY,
                expires: float = 0, origin: object = None, into: list | None = None, *,
                local_only: bool = False) -> bool:
        """Route one message to every queue of ``address`` (and of the wildcard addresses that
        match it). True when the store was written. ``into``: the names of the local queues that
        got a copy are appended to it.

        The address must exist (the driver resolved it when the producer attached). A message
        that reaches no queue (a multicast address without subscribers) is dropped, as in Artemis;
        so is one that a queue's filter does not accept, for that queue.

        When other nodes have bindings for the address (or a wildcard address matching it) the
        message is load-balanced instead (:meth:`_publish_clustered`); otherwise this loop is all
        there is, as on a single node. ``local_only``: this loop even then (a shared queue's
        root with messages waiting: a new one joins them, ``broker.cluster.shared``).
        """
        remote = self.cluster.by_address
        if remote and not local_only and (address in remote or self._remote_wild(address) or (
                self.wildcard_addresses and any(w.name in remote for w in self._targets(address)))):
            return self._publish_clustered(address, body, durable, priority, expires, origin, into)
        targets = self._targets(address)
        stored = False
        routed = False
        for a in targets:
            for q in a.queues.values():
                msg = Message(self.next_mid(), body, durable, address, 0, priority, expires, origin)
                if q.filter is not None and not q.filter(msg):
                    continue
                routed = True
                if into is not None:
                    into.append(q.name)
                if q.enqueue(msg):
                    stored = True
        if not routed:
            self.dropped_unrouted += 1
        return stored

    def publish_once(self, address: str, key: bytes, body: bytes, durable: bool, priority: int = DEFAULT_PRIORITY,
                     expires: float = 0, origin: object = None, *, local_only: bool = False) -> tuple[bool, bool]:
        """``publish`` for a message carrying the duplicate id ``key`` (``broker.core.duplicates``):
        ``(duplicate, sync)``.

        A duplicate is not routed (Artemis ``PostOfficeImpl.checkDuplicateID``); ``sync`` then
        says whether the first copy's id was journaled — it may still wait for its fsync, so the
        resend is answered after the journal catches up too. Otherwise the message is routed and
        its id remembered, both in one store group (a crash keeps both or neither); ``sync`` is
        whether that group was written (answer after the fsync).
        """
        dups = self.duplicates
        token = dups.lookup(address, key)
        if token is not MISSING:
            dups.duplicate(address)
            return True, token is not None
        store = self.store
        store.begin_group()
        held: list[str] = []
        try:
            stored = self.publish(address, body, durable, priority, expires, origin, held, local_only=local_only)
            dups.remember(address, key, persist=stored, held=held)
        finally:
            wrote = store.end_group()
        return False, wrote

    def _targets(self, address: str) -> tuple[Address, ...]:
        """The address and the wildcard addresses matching it (cached), as ``publish`` routes."""
        addr = self.addresses.get(address)
        if not self.wildcard_addresses:
            return (addr,) if addr is not None else ()
        wild = self._routes.get(address)
        if wild is None:
            match = self.wildcards.match
            wild = tuple(w for name, w in self.wildcard_addresses.items() if name != address and match(name, address))
            if len(self._routes) > 10_000:
                self._routes.clear()
            self._routes[address] = wild
        return ((addr,) if addr is not None else ()) + wild

    def _remote_wild(self, address: str) -> tuple[str, ...]:
        """Wildcard addresses that only other nodes have (a wildcard subscription over there)
        matching ``address``: their remote bindings take part in routing it, as Artemis's
        wildcard address manager binds remote queue bindings too. Cached per address until an
        address enters or leaves the remote table, or a local wildcard address comes or goes."""
        cluster = self.cluster
        version = (cluster.addresses_version, self._wild_version)
        if self._remote_wild_version != version:
            self._remote_wild_version = version
            self._remote_wild_cache.clear()
            ws = self.wildcards
            self._remote_wild_names = tuple(n for n in cluster.by_address
                                            if n not in self.wildcard_addresses and ws.is_wildcard(n))
        names = self._remote_wild_names
        if not names:
            return ()
        hit = self._remote_wild_cache.get(address)
        if hit is None:
            match = self.wildcards.match
            hit = tuple(n for n in names if n != address and match(n, address))
            if len(self._remote_wild_cache) > 10_000:
                self._remote_wild_cache.clear()
            self._remote_wild_cache[address] = hit
        return hit

    def _publish_clustered(self, address: str, body: bytes, durable: bool, priority: int, expires: float,
                           origin: object, into: list | None = None) -> bool:
        """``publish`` with remote bindings: per target address, ``balancing.route`` decides; the
        local part is applied here, each remote copy goes to ``on_forward`` (the bridge)."""
        cluster = self.cluster
        views = [Bindings(a.name, a.queues, cluster.remote(a.name)) for a in self._targets(address)]
        if address not in self.addresses and address in cluster.by_address:
            views.insert(0, cluster.bindings(address))  # only other nodes have this address
        views += [cluster.bindings(name) for name in self._remote_wild(address)]
        probe = Message(0, body, durable, address, 0, priority, expires, origin)  # filters decode it once
        stored = False
        routed = False
        forwards = []
        for view in views:
            decision = route(view, probe, self.load_balancing, self.rotation, explain=False)
            for name in decision.local:
                msg = Message(self.next_mid(), body, durable, address, 0, priority, expires, origin)
                msg.view = probe.view
                routed = True
                if into is not None:
                    into.append(name)
                if view.local[name].enqueue(msg):
                    stored = True
            forwards += decision.forwards
        if len(views) > 1 and len(forwards) > 1:
            # several addresses (wildcard ones) chose queues on one neighbour: one copy crosses the
            # bridge for all of them, as Artemis routes one message per store-and-forward queue
            by_via: dict[str, list] = {}
            for fwd in forwards:
                by_via.setdefault(fwd.via, []).extend(fwd.targets)
            forwards = [Forward(via, tuple(targets)) for via, targets in by_via.items()]
        for fwd in forwards:
            routed = True
            self.forwarded += 1
            if self.on_forward is None:
                self.forwards_unsent += 1
            elif self.on_forward(fwd, Message(self.next_mid(), body, durable, address, 0, priority, expires,
                                               origin)):
                stored = True
        if not routed:
            self.dropped_unrouted += 1
        return stored

    def bindings(self, address: str) -> Bindings:
        """The bindings view of ``address``: its local queues and the remote bindings known."""
        addr = self.addresses.get(address)
        return self.cluster.bindings(address, addr.queues if addr is not None else None)

    # -- consumers, listeners, redistribution --------------------------------------------------
    def add_consumer_listener(self, fn: Callable[[ConsumersChanged], None]) -> None:
        """Call ``fn(event)`` synchronously whenever a local queue gains or loses a competing
        consumer (browsers are not consumers, see ``broker.core.bindings``)."""
        self._consumer_listeners.append(fn)

    def remove_consumer_listener(self, fn: Callable[[ConsumersChanged], None]) -> None:
        self._consumer_listeners.remove(fn)

    def _consumers_changed(self, q: Queue, sub: Subscription, added: bool) -> None:
        listeners = self._consumer_listeners
        if listeners:
            ev = ConsumersChanged(q.name, q.address, q.routing_type, len(q.subs), sub.filter_text, added)
            for fn in list(listeners):
                fn(ev)
        if not self.load_balancing.redistributes:
            return
        if q.subs:
            self.redistribution.cancel(q.name)  # QueueImpl.addConsumer: cancelRedistributor
        elif not added:
            # PostOfficeImpl, CONSUMER_CLOSED with no consumer left: addRedistributor(delay)
            delay = self.settings.for_address(q.address).redistribution_delay_ms
            if delay >= 0:
                self.redistribution.start(q.name, self.clock(), delay)

    def _remote_consumer_added(self, b: RemoteBinding) -> None:
        """PostOfficeImpl, CONSUMER_CREATED at distance > 0: a local queue of the same name with
        no consumer (re)starts its redistribution delay."""
        q = self.queues.get(b.queue)
        if q is None or q.subs or q.address != b.address or not self.load_balancing.redistributes:
            return
        delay = self.settings.for_address(q.address).redistribution_delay_ms
        if delay >= 0:
            self.redistribution.start(q.name, self.clock(), delay)

    def redistributions_due(self, now_ms: float) -> list[tuple[Queue, str]]:
        """The local queues whose redistribution delay has passed and whose first waiting message
        has a target, with that target (``balancing.redistribution_target``; the rotation
        advances). Moving the messages is the bridge's; ``next_redistribution_ms`` says when to
        ask again."""
        out = []
        sched = self.redistribution
        for name in sched.due(now_ms):
            q = self.queues.get(name)
            if q is None:
                sched.cancel(name)
                continue
            head = next(iter(q.messages), None)
            if head is None:
                continue
            delay = self.settings.for_address(q.address).redistribution_delay_ms
            target = redistribution_target(self.bindings(q.address), name, head, left_at_ms=sched.left_at[name],
                                           delay_ms=delay, now_ms=now_ms, mode=self.load_balancing,
                                           rotation=self.rotation)
            if target is not None:
                out.append((q, target))
        return out

    def take_for_redistribution(self, q: Queue, now_ms: float, limit: int) -> list[tuple[Message, RemoteBinding]]:
        """Take up to ``limit`` waiting messages of ``q`` that may move now, each with the remote
        binding it goes to (``balancing.redistribution_binding``), in queue order; a message
        nothing else wants stays. The caller forwards them (in one store group with the takes,
        so each moves exactly once)."""
        sched = self.redistribution
        left = sched.left_at.get(q.name)
        if left is None or q.deleted:
            return []
        delay = self.settings.for_address(q.address).redistribution_delay_ms
        bindings = self.bindings(q.address)
        picked: list[tuple[Message, RemoteBinding]] = []
        for msg in q.messages:
            if len(picked) >= limit:
                break
            b = redistribution_binding(bindings, q.name, msg, left_at_ms=left, delay_ms=delay, now_ms=now_ms,
                                       mode=self.load_balancing, rotation=self.rotation)
            if b is None:
                if q.has_matching_consumer(msg):
                    break  # a local consumer is back: nothing moves
                continue
            picked.append((msg, b))
        for msg, _b in picked:
            q.take(msg)
        return picked

    def next_redistribution_ms(self, now_ms: float) -> float | None:
        """When the next queue's redistribution delay ends (None: none pending)."""
        return self.redistribution.next_deadline_ms(now_ms)

    def expire(self, queue: Queue, msg: Message) -> None:
        """Move an expired message to its expiry address (dropped and counted if none)."""
        ea = queue.expiry_address
        if not ea:
            self.dropped_expired += 1
            return
        addr = self.addresses.get(ea)
        if addr is None:
            addr = self.declare_address(ea, [ANYCAST], auto_created=True)
        for q in addr.queues.values():
            q.enqueue(Message(self.next_mid(), msg.body, msg.durable, msg.address, 0, msg.priority, 0))

    def dead_letter(self, queue: Queue, msg: Message) -> None:
        """Move an exhausted or rejected message to its dead-letter address (dropped if none)."""
        dla = queue.dead_letter_address
        if not dla or dla == queue.address:
            self.dropped_unrouted += 1
            return
        addr = self.addresses.get(dla)
        if addr is None:
            addr = self.declare_address(dla, [ANYCAST], auto_created=True)
        for q in addr.queues.values():
            q.enqueue(Message(self.next_mid(), msg.body, msg.durable, msg.address, 0, msg.priority, msg.expires))

    # -- recovery ----------------------------------------------------------------------------
    def restore_queue(self, definition: dict) -> Queue:
        """Recreate a durable queue from its store record (no store write)."""
        name = definition["name"]
        address = definition["address"]
        rtype = definition["routing_type"]
        addr = self.addresses.get(address)
        if addr is None:
            addr = self._new_address(address, [rtype], True)
        else:
            addr.routing_types.add(rtype)
        q = self.queues.get(name)
        if q is not None:
            return q
        settings = self.settings.for_address(address)
        q = Queue(self.host, name, address, rtype, durable=True,
                  max_delivery_count=settings.max_delivery_count,
                  dead_letter_address=settings.dead_letter_address,
                  expiry_address=settings.expiry_address,
                  subscription=bool(definition.get("subscription")))
        text = definition.get("filter")
        if isinstance(text, str) and text:
            q.filter_text = text
            if self.compile_filter is not None:
                q.filter = self.compile_filter(text)
        owner = definition.get("owner")
        if isinstance(owner, str):
            q.owner = owner
            self.owned[owner] += 1
        addr.queues[name] = q
        self.queues[name] = q
        return q

    def restore_message(self, queue: str, mid: int, body: bytes, address: str, delivery_count: int = 0,
                        priority: int = DEFAULT_PRIORITY, expires: float = 0, origin: object = None) -> bool:
        """Put a recovered durable message back in its queue. False if the queue is unknown."""
        self.bump_mid(mid)
        q = self.queues.get(queue)
        if q is None:
            return False
        q.restore(Message(mid, body, True, address, delivery_count, priority, expires, origin))
        return True


def with_overrides(base: AddressSettings, **kw) -> AddressSettings:
    """A copy of ``base`` with some fields replaced (config layering)."""
    return replace(base, **kw)
