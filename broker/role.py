"""A node's role: the component that decides when, and on which data directory, the node serves.

Theory of operation
-------------------
Every broker process runs one :class:`Role` inside :class:`broker.lifecycle.NodeProcess`, the
owner of the process's life (signals, the management server, nurseries, each activation):

* :class:`broker.lifecycle.LiveOnly` — a plain node: lock the data directory and serve;
* :class:`broker.ha.replicated.Replicated` — a replication primary or backup (a member turns
  from one into the other at a failback with ``restart-backup``, so both are one component);
* :class:`broker.ha.shared_store.SharedStoreMember` — a primary or backup on a shared data
  directory.

A role may own parts that run beside it: ``broker.ha.colocated.ColocatedHost`` (backups hosted
for other primaries, each one more ``NodeProcess`` in this process) and
``broker.lifecycle.ScaleDown``. A :class:`Component` runs while the node serves, whatever its
role: the process calls its ``activated`` and ``deactivating`` at each activation, after the
role's, and its ``stop`` with the role's.

The interface is small. The process calls:

* ``await run(proc)`` in its nursery: the role's loop (wait for a lock, follow a primary, call
  ``proc.serve`` to serve); returns the process's exit status;
* ``stop()``: end ``run`` soon (a signal, or the host of a colocated backup stopping);
* ``activated(node, nursery)`` each time the role's node is built to serve, before any
  listener: the role starts its tasks for that activation in ``nursery`` (cancelled when it
  ends);
* ``await deactivating(node, reason, close_listeners)`` once the node stops being active
  (``reason``: ``"stop"`` or ``"deactivate"``, a hand-over the role asked for), before the
  remaining connections are closed.

The node (:class:`broker.node.Node`, ``node.role``) and the management API read:

* ``describe(node)``: ``GET /api/v1/ha``; ``status``: the HA member's
  ``broker.ha.status.HaStatus`` (``/metrics``, ``/health``), None for a plain node;
* ``replication``: the replication stream of an active primary
  (``broker.ha.replication.ReplicationSource``), else None;
* ``backups()``: this node's backups, ``(connector, management URL, in sync)``;
* ``host_backup(body)``: ``POST /api/v1/ha/colocated``, or None where this node hosts none.

A service that runs whatever the role (a mirror source, say) is one more :class:`Component`:
docs/architecture.md, "Worked example: adding a component that owns a link".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import trio

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig
    from broker.node import Node

__all__ = ["Component", "Role", "plain_view"]


def plain_view(node: "Node") -> dict:
    """``GET /api/v1/ha`` of a node that is no HA member."""
    return {"policy": node.cfg.ha.policy, "role": "primary", "active": node.active, "node_id": node.node_id,
            "phase": "active" if node.active else "starting", "pair": None, "replication": None}


class Component:
    """Something that runs while the node serves, whatever its role (a mirror, a broker
    connection): given to ``broker.lifecycle.NodeProcess``, which calls ``activated`` and
    ``deactivating`` at each activation, after the role's. ``name``: how the node and the
    management API find it (``Node.component``)."""

    name = ""

    def activated(self, node: "Node", nursery: trio.Nursery) -> None:
        pass

    async def deactivating(self, node: "Node", reason: str, close_listeners: Callable[[], None]) -> None:
        pass

    def stop(self) -> None:
        pass


class Role(Component):
    """The base of every role (see the module doc): a plain, always-primary node's answers."""

    #: broker.ha.status.HaStatus of an HA member (``/metrics``, ``/health``), else None
    status: Any = None
    #: broker.ha.replication.ReplicationSource while this role's node serves as a replicating primary
    replication: Any = None

    def __init__(self, cfg: "BrokerConfig") -> None:
        self.cfg = cfg
        self.stopping = trio.Event()

    async def run(self, proc) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not say how it runs")

    def stop(self) -> None:
        self.stopping.set()

    def describe(self, node: "Node") -> dict:
        return plain_view(node)

    def backups(self) -> tuple[tuple[str, str, bool], ...]:
        return ()

    def host_backup(self, body: Any) -> tuple[int, dict] | None:
        return None
