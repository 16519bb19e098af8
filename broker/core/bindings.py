"""Bindings: the queues a message sent to an address can reach, on this node and on the others.

Theory of operation
-------------------
The model is Artemis's (``core/postoffice/impl/BindingsImpl.java``,
``core/server/cluster/impl/RemoteQueueBindingImpl.java``). An address's *bindings* are its local
queues and the *remote bindings* the cluster bridge has learned: "node N has queue Q on this
address, with this filter, this many consumers, at this distance". Bindings are grouped by
*routing name* — the queue's name — so the anycast queue ``orders`` on every node forms one
group (a message goes to one of them), while every multicast subscription queue, whose name is
unique, is a group of its own (each gets a copy). A durable subscription with the same name on two
nodes is one group, load-balanced between them, as in Artemis.

This module only keeps the table; :mod:`broker.core.balancing` decides with it.

* :class:`RemoteBinding` — an immutable record, added, replaced and removed by the bridge
  (Artemis BINDING_ADDED / BINDING_REMOVED notifications and CONSUMER_CREATED / CONSUMER_CLOSED,
  which :meth:`ClusterBindings.consumer_added` / :meth:`~ClusterBindings.consumer_removed`
  apply, reference-counting consumer filters as ``RemoteQueueBindingImpl.addConsumer`` does).
* :class:`ClusterBindings` — every remote binding of one node, per address and routing name,
  in arrival order (``CopyOnWriteBindings``); owned by ``Broker`` as ``broker.cluster``. It
  compiles filter texts with an injected compiler (the core's selector by default).
* :class:`Bindings` — the view of one address that the router of messages consults: the
  address's local queues (a live mapping) and its remote bindings. A group lists the local
  queue first, then the remote bindings in arrival order: Artemis's rotation starts with the
  local queue because the local queue is bound before any remote binding arrives.
* :class:`ConsumersChanged` — the event ``Broker`` gives its consumer listeners, synchronously,
  when a local queue gains or loses a competing consumer; the bridge turns it into the
  CONSUMER_CREATED / CONSUMER_CLOSED notification other nodes apply with ``consumer_added`` /
  ``consumer_removed``. Browsers (``distribution-mode copy``) do not count: Artemis neither adds a
  browse-only consumer to its queue nor sends CONSUMER_CREATED for it
  (``ServerConsumerImpl``: ``if (browseOnly) browserDeliverer = … else messageQueue.addConsumer``;
  ``ServerSessionImpl.createConsumer``: ``if (!browseOnly)`` around the notification).

Where we differ from Artemis, on purpose: a remote queue with one consumer without a filter and
another with a filter has a consumer for *every* message here (the unfiltered one takes it);
``RemoteQueueBindingImpl.isHighAcceptPriority`` only looks at the filtered ones once there is one.
Our rule is the one Artemis applies to local queues (``QueueImpl.hasMatchingConsumer``).
A consumer's ``no-local`` cannot be told to another node and is not part of its filter text.

Max hops (``max-hops``): Artemis's bridge only subscribes to notifications with a distance below
``max-hops``; :meth:`ClusterBindings.put` ignores a binding farther than ``max_hops`` the same way.
``via`` is the neighbour a message for the binding is forwarded to (the bridge whose
store-and-forward queue Artemis would use); in a chain A → B → C, A's binding for C's queue has
``node_id`` C, ``distance`` 2 and ``via`` B.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Protocol

from broker.core.deliveries import Message
from broker.core.filters import compile_queue_filter

__all__ = ["RemoteBinding", "RemoteEntry", "ClusterBindings", "Bindings", "ConsumersChanged", "LocalBinding"]

Predicate = Callable[[Message], bool]


@dataclass(frozen=True)
class ConsumersChanged:
    """A local queue gained (``added``) or lost a competing consumer; ``count`` is the number it has
    now and ``filter_text`` the selector of the consumer that came or went (None: none)."""

    queue: str
    address: str
    routing_type: str
    count: int
    filter_text: str | None
    added: bool


@dataclass(frozen=True)
class RemoteBinding:
    """A queue on another node, as this node knows it (Artemis ``RemoteQueueBinding``).

    ``consumer_filters`` holds one selector text per filtered consumer (a multiset, so two
    consumers with the same selector appear twice); ``consumers`` counts every consumer.
    """

    node_id: str
    queue: str
    address: str
    routing_type: str
    consumers: int = 0
    filter_text: str | None = None
    consumer_filters: tuple[str, ...] = ()
    distance: int = 1
    via: str | None = None
    connected: bool = True

    @property
    def next_hop(self) -> str:
        """The node a message for this binding is sent to."""
        return self.via or self.node_id


class LocalBinding(Protocol):
    """What balancing asks of a local queue (``broker.core.queues.Queue`` is one)."""

    name: str
    routing_type: str
    node_id: None
    connected: bool
    filter: Predicate | None

    def has_matching_consumer(self, msg: Message | None) -> bool: ...


class RemoteEntry:
    """A remote binding with its filters compiled: the form balancing reads."""

    __slots__ = ("binding", "name", "routing_type", "node_id", "connected", "filter", "_consumer_filters",
                 "_unfiltered")

    def __init__(self, binding: RemoteBinding, compile_filter: Callable[[str], Predicate]):
        self.binding = binding
        self.name = binding.queue
        self.routing_type = binding.routing_type
        self.node_id = binding.node_id
        self.connected = binding.connected
        self.filter = compile_filter(binding.filter_text) if binding.filter_text else None
        self._consumer_filters = tuple(compile_filter(t) for t in dict.fromkeys(binding.consumer_filters))
        self._unfiltered = binding.consumers > len(binding.consumer_filters)

    def has_matching_consumer(self, msg: Message | None) -> bool:
        """Artemis ``isHighAcceptPriority``: a consumer that would take ``msg`` (None: any consumer)."""
        if self.binding.consumers <= 0:
            return False
        if self._unfiltered or msg is None:
            return True
        return any(f(msg) for f in self._consumer_filters)

    def __repr__(self) -> str:
        return f"RemoteEntry({self.binding!r})"


class Bindings:
    """The bindings of one address (see the module doc): ``local`` queues by name, ``remote``
    entries by routing name then node id."""

    __slots__ = ("address", "local", "remote")

    def __init__(self, address: str, local: Mapping[str, LocalBinding],
                 remote: Mapping[str, Mapping[str, RemoteEntry]]):
        self.address = address
        self.local = local
        self.remote = remote

    def routing_names(self) -> Iterator[str]:
        """Every routing name: the local queues' in creation order, then remote-only ones."""
        local = self.local
        yield from local
        for name in self.remote:
            if name not in local:
                yield name

    def group(self, name: str) -> list:
        """The bindings sharing routing name ``name``: the local queue first, then the remote ones."""
        out: list = []
        q = self.local.get(name)
        if q is not None:
            out.append(q)
        r = self.remote.get(name)
        if r:
            out.extend(r.values())
        return out


class ClusterBindings:
    """Every remote binding this node knows, per address (see the module doc)."""

    def __init__(self, *, max_hops: int = 1, compile_filter: Callable[[str], Predicate] | None = None):
        if compile_filter is None:
            compile_filter = compile_queue_filter
        self.max_hops = max_hops
        self.compile_filter = compile_filter
        self.by_address: dict[str, dict[str, dict[str, RemoteEntry]]] = {}
        self.count = 0  # remote bindings in the table; 0 keeps Broker.publish on its single-node path
        #: changes whenever an address appears in or leaves the table (Broker caches which remote
        #: wildcard addresses match an address against it)
        self.addresses_version = 0
        #: called with the binding when a remote queue gains consumers (Broker: redistribution)
        self.on_consumer_added: Callable[[RemoteBinding], None] | None = None
        self.ignored_too_far = 0

    # -- the bridge's side -------------------------------------------------------------------
    def put(self, binding: RemoteBinding) -> bool:
        """Add a remote binding, or replace the one with the same node and queue (its place in the
        rotation is kept). False, and nothing stored, when it is farther than ``max_hops``."""
        if binding.distance > self.max_hops:
            self.ignored_too_far += 1
            return False
        groups = self.by_address.get(binding.address)
        if groups is None:
            groups = self.by_address[binding.address] = {}
            self.addresses_version += 1
        group = groups.setdefault(binding.queue, {})
        old = group.get(binding.node_id)
        if old is None:
            self.count += 1
        group[binding.node_id] = RemoteEntry(binding, self.compile_filter)
        if binding.consumers > (old.binding.consumers if old is not None else 0) and self.on_consumer_added:
            self.on_consumer_added(binding)
        return True

    def get(self, node_id: str, queue: str) -> RemoteBinding | None:
        for groups in self.by_address.values():
            e = groups.get(queue, {}).get(node_id)
            if e is not None:
                return e.binding
        return None

    def remove(self, node_id: str, queue: str) -> RemoteBinding | None:
        """Forget one remote binding (its queue was deleted); returns it, or None if unknown."""
        for address, groups in self.by_address.items():
            group = groups.get(queue)
            if group is not None and node_id in group:
                entry = group.pop(node_id)
                self.count -= 1
                if not group:
                    del groups[queue]
                if not groups:
                    del self.by_address[address]
                    self.addresses_version += 1
                return entry.binding
        return None

    def remove_node(self, node_id: str) -> list[RemoteBinding]:
        """Forget every binding of ``node_id`` (it left the cluster)."""
        gone = [e.binding for groups in self.by_address.values() for g in groups.values()
                for n, e in g.items() if n == node_id]
        for b in gone:
            self.remove(b.node_id, b.queue)
        return gone

    def set_connected(self, node_id: str, connected: bool) -> int:
        """The bridge to ``node_id`` went down or came back (Artemis ``disconnect``/``connect``):
        a disconnected binding is only chosen when it is the only one of its group. Returns how
        many bindings changed."""
        n = 0
        for b in [e.binding for groups in self.by_address.values() for g in groups.values()
                  for e in g.values() if e.binding.node_id == node_id and e.binding.connected != connected]:
            self.put(replace(b, connected=connected))
            n += 1
        return n

    def consumer_added(self, node_id: str, queue: str, filter_text: str | None = None) -> RemoteBinding | None:
        """A consumer attached to a remote queue (CONSUMER_CREATED). None if the queue is unknown."""
        b = self.get(node_id, queue)
        if b is None:
            return None
        filters = b.consumer_filters + ((filter_text,) if filter_text else ())
        b = replace(b, consumers=b.consumers + 1, consumer_filters=filters)
        self.put(b)  # tells on_consumer_added
        return b

    def consumer_removed(self, node_id: str, queue: str, filter_text: str | None = None) -> RemoteBinding | None:
        """A consumer left a remote queue (CONSUMER_CLOSED); the count never goes below zero."""
        b = self.get(node_id, queue)
        if b is None:
            return None
        filters = list(b.consumer_filters)
        if filter_text and filter_text in filters:
            filters.remove(filter_text)
        b = replace(b, consumers=max(0, b.consumers - 1), consumer_filters=tuple(filters))
        self.put(b)
        return b

    # -- the router's side -------------------------------------------------------------------
    def remote(self, address: str) -> Mapping[str, Mapping[str, RemoteEntry]]:
        return self.by_address.get(address, _EMPTY)

    def bindings(self, address: str, local: Mapping[str, LocalBinding] | None = None) -> Bindings:
        """The view of ``address``: ``local`` (its queues by name) and its remote bindings."""
        return Bindings(address, local if local is not None else _EMPTY, self.by_address.get(address, _EMPTY))

    def __iter__(self) -> Iterator[RemoteBinding]:
        for groups in self.by_address.values():
            for g in groups.values():
                for e in g.values():
                    yield e.binding

    def __len__(self) -> int:
        return self.count


_EMPTY: Mapping = {}
