"""What an :class:`~broker.amqp.engine.AmqpEngine` needs from whatever runs it: the host interface.

Theory of operation
-------------------
The engine is one connection's protocol machine. It does not know the broker node (nor its
config, store or management API); it talks to a *host* through the small interface below, so
the same engine serves a client accepted by a listener (host: :class:`broker.node.Node`) and a
connection this broker dials to a peer (:mod:`broker.amqp.peer`, host: the node, or a test's
fake that records what it is told).

A host offers:

* ``settings`` — the engine's limits and protocol settings, an immutable :class:`EngineSettings`
  (frame size, idle timeout, producer credit window, sessions and links per connection, link
  stealing, the per-user resource limits, the handshake deadline);
* ``core`` — the message core (:class:`broker.core.addresses.Broker`): addresses, queues,
  publish, subscriptions;
* identity — ``container_id`` (our Open's container-id) and ``node_id`` (the Open property
  ``node-id`` that lets a peer tell which node it reached);
* ``authorize(principal, permission, address)`` — the security check (the host counts refusals);
* ``count(event, n=1)`` — one counter per outcome, by name (``decode_error``,
  ``links_stolen``, ``resource_limit_max_links``, ``transactions_committed``, …; plus
  ``messages_in`` and ``links_opened``, which the node shows as its own series);
* ``await_sync(engine, delivery)`` — accept a stored producer delivery once the journal records
  written so far are durable (the host later calls ``engine.synced`` or ``engine.sync_failed``);
* ``services`` — the :class:`~broker.amqp.links.InternalServices` registry: an attach to an
  ``INTERNAL_PREFIX`` address goes to the service registered for its prefix (the cluster's links,
  a backup's replication links), which owns the link through :mod:`broker.amqp.links` or refuses
  it; an address no service claims is refused as not found;
* ``open_properties`` / ``server_open_properties`` — extra properties of our Open on the
  connections we dial (client mode) and on those we accept (a cluster's or an HA pair's
  topology for clients);
* lifecycle callbacks — ``address_created(address)``, ``connection_opened(engine)`` (the peer's
  Open arrived), ``connection_closed(engine)`` (the transport is done; logs the close line).

Nothing here does I/O; the shell (:mod:`broker.amqp.driver`, :mod:`broker.amqp.peer`) owns the
sockets and the clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from broker.config import ResourceLimitSettings
from broker.wire.frames import INTERNAL_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine
    from broker.amqp.links import InternalServices
    from broker.config import BrokerConfig
    from broker.core.addresses import Broker

__all__ = ["EngineSettings", "EngineHost", "INTERNAL_PREFIX"]


@dataclass(frozen=True)
class EngineSettings:
    """The engine's settings (``[amqp]`` and the resource limits of a broker config)."""

    max_frame_bytes: int = 1_048_576
    idle_timeout_s: float = 60.0          # 0: no idle timeout (and no heartbeats asked for)
    producer_window: int = 1000           # link credit granted to each producer
    max_sessions: int = 256               # sessions open at once per connection (channel-max)
    max_links: int = 1000                 # links attached at once per connection
    link_stealing: bool = True            # a durable subscription attached elsewhere moves here
    limits: ResourceLimitSettings = field(default_factory=ResourceLimitSettings)
    handshake_timeout_s: float = 10.0     # SASL, and then the peer's Open, must finish in time

    @classmethod
    def from_config(cls, cfg: "BrokerConfig") -> "EngineSettings":
        return cls(max_frame_bytes=cfg.max_frame_bytes, idle_timeout_s=cfg.idle_timeout_s,
                   producer_window=cfg.producer_window, max_sessions=cfg.max_sessions,
                   max_links=cfg.max_links, link_stealing=cfg.link_stealing, limits=cfg.limits,
                   handshake_timeout_s=cfg.handshake_timeout_s)


class EngineHost(Protocol):
    """The host interface of :class:`~broker.amqp.engine.AmqpEngine` (see the module docstring)."""

    settings: EngineSettings
    core: "Broker"
    container_id: str
    node_id: str

    services: "InternalServices"

    @property
    def open_properties(self) -> dict:
        """Extra properties (name → value) of our Open on connections this host dials."""

    @property
    def server_open_properties(self) -> dict:
        """Extra properties (name → value) of our Open on connections this host accepts."""

    def authorize(self, principal: Any, permission: str, address: str) -> bool:
        """May ``principal`` do ``permission`` (send, consume, createAddress…) on ``address``?"""

    def count(self, event: str, n: int = 1) -> None:
        """Count ``n`` occurrences of the outcome ``event``."""

    def await_sync(self, engine: "AmqpEngine", delivery: Any) -> None:
        """Accept ``delivery`` (a raw ``pn_delivery_t*``) once what was journaled so far is durable."""

    def address_created(self, address: str) -> None:
        """An attach auto-created ``address``."""

    def connection_opened(self, engine: "AmqpEngine") -> None:
        """The peer's Open arrived and ours went out."""

    def connection_closed(self, engine: "AmqpEngine") -> None:
        """The connection is over (``engine.error`` says why, if it failed)."""
