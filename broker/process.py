"""The broker process: load the users file, then run the node in the role its config gives it.

``[ha] policy`` picks the role (``broker.role``): ``live-only`` (the default) serves at once on
its locked data directory (:class:`broker.lifecycle.LiveOnly`); ``replication`` runs a primary or
backup of a replicated pair (:class:`broker.ha.replicated.Replicated`); ``shared-store`` one of a
pair on a shared data directory (:class:`broker.ha.shared_store.SharedStoreMember`).
:class:`broker.lifecycle.NodeProcess` runs it. ``lodestone-broker run`` calls :func:`run_node`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from broker.config import check_anonymous
from broker.connections.mirror import MirrorTarget
from broker.connections.service import BrokerConnections
from broker.ha.replicated import Replicated
from broker.ha.shared_store import SharedStoreMember
from broker.lifecycle import LiveOnly, NodeProcess
from broker.role import Component, Role
from broker.wire.io.users import load_users

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker")

__all__ = ["run_node", "role_for", "components_for"]


def role_for(cfg: "BrokerConfig") -> Role:
    """The role ``[ha]`` gives this node."""
    if cfg.ha.shared_store:
        return SharedStoreMember(cfg)
    if cfg.ha.replication:
        return Replicated(cfg)
    return LiveOnly(cfg)


def components_for(cfg: "BrokerConfig") -> list[Component]:
    """What runs beside the role, whatever it is: the broker connections (and their mirrors'
    sources), and on every node the mirrors' target."""
    out: list[Component] = [MirrorTarget()]
    if cfg.broker_connections:
        out.append(BrokerConnections(cfg.broker_connections))
    return out


async def run_node(cfg: "BrokerConfig", *, task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Run a broker node until SIGTERM/SIGINT (or cancellation); returns the exit status (an
    isolated replication primary: ``broker.ha.replicated.ISOLATED_EXIT``)."""

    security = load_users(cfg.users_file)
    check_anonymous(cfg, security.anonymous_enabled)
    for w in security.warnings():
        log.warning("security: %s", w)
    code = await NodeProcess(cfg, security, components=components_for(cfg)).run(role_for(cfg), task_status=task_status)
    log.info("node stopped")
    return code
