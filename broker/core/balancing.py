"""Server-side message load balancing and redistribution over a cluster: pure decisions.

Theory of operation
-------------------
Given an address's :class:`~broker.core.bindings.Bindings` (local queues and remote bindings,
grouped by routing name), a message, the cluster's :class:`LoadBalancing` mode and a
:class:`Rotation` (one position per routing name), :func:`route` returns a :class:`RouteDecision`:
the local queues to enqueue the message in and, per neighbour node, the remote queues to forward
it to. The ``Broker`` applies the local part; the forwarding is the bridge's.

For every routing name, :func:`next_binding` picks at most one binding of its group. It is
Artemis's ``BindingsImpl.getNextBinding`` line for line:

* start at the group's rotation position; walk the group once;
* a binding *matches* when its queue filter accepts the message — except that under ``OFF`` a
  remote binding never matches, and under ``OFF_WITH_REDISTRIBUTION`` only a remote *multicast*
  binding does (``matchBinding``; ARTEMIS-3608: subscription queues have unique names, so
  redistribution could never save their messages);
* a group of one takes its only matching binding, consumers or not, connected or not;
* otherwise the first matching binding that is connected and either ``STRICT`` is in force or it
  has a consumer that would take the message (``isHighAcceptPriority``) is chosen;
* failing that, the *low-priority* fallback: the first matching binding — under ``ON_DEMAND`` the
  local queue if it matches. So with no consumer anywhere the message stays local;
* the rotation moves to just past the chosen binding.

Hence, per mode, for an anycast queue present on several nodes: ``OFF`` local only; ``STRICT``
round-robin over every node with a matching queue; ``ON_DEMAND`` round-robin over the nodes whose
queue has a matching consumer, local when nobody consumes; ``OFF_WITH_REDISTRIBUTION`` as
``OFF`` (messages move later, by redistribution). For multicast, every matching local
subscription and one copy per neighbour that has matching subscriptions (the copy names all of
that neighbour's queues, as Artemis's ``HDR_ROUTE_TO_IDS`` does).

Where Artemis differs from its docs we follow its source and say so: under ``OFF`` current
Artemis (since ARTEMIS-4196 changed an operator precedence) lets a message whose routing type is
multicast through to remote bindings; its documentation and the release before say ``OFF`` never
forwards, and so do we.

**Redistribution** (``QueueImpl.addRedistributor``, ``Redistributor``, ``BindingsImpl.redistribute``):
when the last consumer of a local queue leaves (or a remote consumer arrives for a queue here
that has none), messages may move to another node of the same routing name that has a matching
consumer, after the address's ``redistribution-delay`` (-1 never, the default; 0 at once). A
consumer coming back within the delay cancels it. Only ``ON_DEMAND`` and
``OFF_WITH_REDISTRIBUTION`` redistribute (``allowRedistribute``). :func:`redistribution_target`
decides for one message; :class:`RedistributionSchedule` keeps the deadlines and reports the
queues that are due and the next deadline, so the shell sleeps until then (proton's
``Transport.tick``).

Everything takes what it needs as arguments (``now_ms``, a seeded ``random.Random``); no clock,
no global state.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Sequence

from broker.core.bindings import Bindings
from broker.core.deliveries import Message
from broker.core.queues import MULTICAST

__all__ = ["LoadBalancing", "Rotation", "Pick", "Forward", "RouteDecision", "next_binding", "route",
           "redistribution_deadline", "redistribution_target", "redistribution_binding", "RedistributionSchedule", "LOCAL"]

LOCAL = None  # the node id of a local binding in a Pick


class LoadBalancing(enum.Enum):
    """Artemis ``message-load-balancing`` (``MessageLoadBalancingType``); the default is ON_DEMAND."""

    OFF = "OFF"
    STRICT = "STRICT"
    ON_DEMAND = "ON_DEMAND"
    OFF_WITH_REDISTRIBUTION = "OFF_WITH_REDISTRIBUTION"

    @property
    def redistributes(self) -> bool:
        """``BindingsImpl.allowRedistribute``."""
        return self is LoadBalancing.ON_DEMAND or self is LoadBalancing.OFF_WITH_REDISTRIBUTION


class Rotation:
    """The next position in each group (Artemis ``CopyOnWriteBindings.BindingIndex``), keyed by
    (address, routing name). A new group starts at 0 — the local queue — as in Artemis; with a
    seeded ``rng`` it starts at a random position instead (spreads the first messages when many
    nodes start together). Only groups of two or more are remembered (a group of one is always at
    0), so the many one-queue groups of multicast subscriptions cost nothing; ``forget`` drops a
    group whose queue went."""

    __slots__ = ("positions", "rng")

    def __init__(self, rng: random.Random | None = None):
        self.positions: dict[tuple[str, str], int] = {}
        self.rng = rng

    def get(self, key: tuple[str, str], size: int) -> int:
        pos = self.positions.get(key)
        if pos is None:
            pos = self.rng.randrange(size) if self.rng is not None and size > 1 else 0
        return pos

    def set(self, key: tuple[str, str], pos: int, size: int = 2) -> None:
        if size > 1:
            self.positions[key] = pos

    def forget(self, key: tuple[str, str]) -> None:
        self.positions.pop(key, None)


@dataclass(frozen=True)
class Pick:
    """Why one binding of a group was chosen: ``node_id`` None is the local queue; ``why`` is
    ``only`` (a group of one), ``strict``, ``consumer`` (it has a matching consumer) or
    ``fallback`` (nobody has one)."""

    routing_name: str
    node_id: str | None
    why: str


@dataclass(frozen=True)
class Forward:
    """One copy of the message for neighbour ``via``, for these (node id, queue) targets."""

    via: str
    targets: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class RouteDecision:
    """Where one message goes: ``local`` queue names, ``forwards`` per neighbour, and the picks
    (the explanation)."""

    local: tuple[str, ...] = ()
    forwards: tuple[Forward, ...] = ()
    picks: tuple[Pick, ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        """The neighbours the message is forwarded to."""
        return tuple(f.via for f in self.forwards)

    @property
    def routed(self) -> bool:
        return bool(self.local or self.forwards)


def _matches(b, msg: Message, mode: LoadBalancing) -> bool:
    """``BindingsImpl.matchBinding`` (see the module doc for OFF)."""
    if b.node_id is not None:
        if mode is LoadBalancing.OFF:
            return False
        if mode is LoadBalancing.OFF_WITH_REDISTRIBUTION and b.routing_type != MULTICAST:
            return False
    f = b.filter
    return f is None or f(msg)


def next_binding(group: Sequence, msg: Message, mode: LoadBalancing, start: int) -> tuple[int, int, str] | None:
    """Artemis ``getNextBinding``: (chosen index, next rotation position, why), or None.

    ``group`` holds local queues and remote entries (``node_id`` None / set, ``connected``,
    ``filter``, ``has_matching_consumer(msg)``); see the module doc for the rules.
    """
    n = len(group)
    pos = start if 0 <= start < n else 0
    low = -1
    strict = mode is LoadBalancing.STRICT
    on_demand = mode is LoadBalancing.ON_DEMAND
    for _ in range(n):
        b = group[pos]
        if _matches(b, msg, mode):
            if n == 1:
                return pos, 0, "only"
            if b.connected and (strict or b.has_matching_consumer(msg)):
                return pos, (pos + 1) % n, "strict" if strict else "consumer"
            if low == -1 or (on_demand and b.node_id is None):
                low = pos
        pos = (pos + 1) % n
    if low != -1:
        return low, (low + 1) % n, "fallback"
    return None


def route(bindings: Bindings, msg: Message, mode: LoadBalancing, rotation: Rotation, *,
          explain: bool = True) -> RouteDecision:
    """Decide where ``msg``, sent to ``bindings.address``, goes (see the module doc).

    ``explain`` False leaves ``picks`` empty (the broker's per-message path: a pick is only an
    explanation). A routing name with only a local queue is decided without the rotation (a
    group of one takes its only matching binding)."""
    local: list[str] = []
    picks: list[Pick] | None = [] if explain else None
    forwards: dict[str, list[tuple[str, str]]] | None = None
    address = bindings.address
    local_queues = bindings.local
    remote = bindings.remote
    for name in bindings.routing_names():
        r = remote.get(name)
        q = local_queues.get(name)
        if not r:  # a group of one, local
            f = q.filter
            if f is None or f(msg):
                local.append(name)
                if picks is not None:
                    picks.append(Pick(name, None, "only"))
            continue
        group = [q, *r.values()] if q is not None else list(r.values())
        key = (address, name)
        chosen = next_binding(group, msg, mode, rotation.get(key, len(group)))
        if chosen is None:
            continue
        i, nxt, why = chosen
        rotation.set(key, nxt, len(group))
        b = group[i]
        if b.node_id is None:
            local.append(b.name)
        else:
            rb = b.binding
            if forwards is None:
                forwards = {}
            forwards.setdefault(rb.next_hop, []).append((rb.node_id, rb.queue))
        if picks is not None:
            picks.append(Pick(name, b.node_id, why))
    return RouteDecision(tuple(local),
                         tuple(Forward(via, tuple(t)) for via, t in forwards.items()) if forwards else (),
                         tuple(picks) if picks else ())


# -- redistribution ----------------------------------------------------------------------------
def redistribution_deadline(left_at_ms: float, delay_ms: int) -> float | None:
    """When a queue whose consumers left at ``left_at_ms`` may redistribute (None: never)."""
    if delay_ms < 0:
        return None
    return left_at_ms + delay_ms


def redistribution_target(bindings: Bindings, queue: str, msg: Message | None, *, left_at_ms: float,
                          delay_ms: int, now_ms: float, mode: LoadBalancing,
                          rotation: Rotation) -> str | None:
    """The neighbour to move ``msg`` to (see :func:`redistribution_binding`), or None."""
    b = redistribution_binding(bindings, queue, msg, left_at_ms=left_at_ms, delay_ms=delay_ms, now_ms=now_ms,
                               mode=mode, rotation=rotation)
    return b.next_hop if b is not None else None


def redistribution_binding(bindings: Bindings, queue: str, msg: Message | None, *, left_at_ms: float,
                           delay_ms: int, now_ms: float, mode: LoadBalancing,
                           rotation: Rotation):
    """The remote binding to move ``msg`` of local queue ``queue`` to, or None (Artemis
    ``BindingsImpl.redistribute``).

    None when the mode does not redistribute, the delay is -1 or has not passed since
    ``left_at_ms``, the local queue has a consumer for the message again, or no other binding of
    the routing name has a matching consumer and a filter that accepts it. Otherwise the next
    such binding in the group's rotation (which it advances: routing and redistribution share
    it, as in Artemis). ``msg`` None asks for any message (filters are not consulted).
    """
    if not mode.redistributes:
        return None
    deadline = redistribution_deadline(left_at_ms, delay_ms)
    if deadline is None or now_ms < deadline:
        return None
    group = bindings.group(queue)
    if not group:
        return None
    origin = bindings.local.get(queue)
    if origin is not None and origin.has_matching_consumer(msg):
        return None
    key = (bindings.address, queue)
    n = len(group)
    pos = rotation.get(key, n)
    pos = pos if 0 <= pos < n else 0
    for _ in range(n):
        b = group[pos]
        pos = (pos + 1) % n
        if b is origin or b.node_id is None:
            continue
        if b.has_matching_consumer(msg) and (msg is None or b.filter is None or b.filter(msg)):
            rotation.set(key, pos, n)
            return b.binding
    return None


class RedistributionSchedule:
    """When each local queue may start redistributing (Artemis's delayed ``addRedistributor``).

    ``start(queue, now_ms, delay_ms)`` (re)starts a queue's delay — its last consumer left, or a
    remote consumer arrived for it; ``cancel(queue)`` — a local consumer came back, or the queue
    went. ``due(now_ms)`` lists the queues whose delay has passed (they stay due until
    cancelled, like Artemis's redistributor, which stays until a consumer arrives);
    ``next_deadline_ms()`` is when the next one becomes due (None: none pending).
    """

    def __init__(self):
        self.deadlines: dict[str, float] = {}
        self.left_at: dict[str, float] = {}

    def start(self, queue: str, now_ms: float, delay_ms: int) -> bool:
        deadline = redistribution_deadline(now_ms, delay_ms)
        if deadline is None:
            self.cancel(queue)
            return False
        self.deadlines[queue] = deadline
        self.left_at[queue] = now_ms
        return True

    def cancel(self, queue: str) -> None:
        self.deadlines.pop(queue, None)
        self.left_at.pop(queue, None)

    def due(self, now_ms: float) -> list[str]:
        return [q for q, d in self.deadlines.items() if d <= now_ms]

    def next_deadline_ms(self, now_ms: float) -> float | None:
        """The earliest deadline still ahead of ``now_ms`` (None: nothing pending)."""
        ahead = [d for d in self.deadlines.values() if d > now_ms]
        return min(ahead) if ahead else None

    def __contains__(self, queue: str) -> bool:
        return queue in self.deadlines

    def __len__(self) -> int:
        return len(self.deadlines)
