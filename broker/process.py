"""The broker process: load the users file, then run the node the way its config says.

A plain node serves at once (``broker.server.serve_active``) on its locked data directory; a
shared-store member (``broker.ha.shared_store``) or a replicated one (``broker.ha.replicated``)
runs its HA role first and serves once active. ``lodestone-broker run`` calls :func:`run_node`.
"""

from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

import trio

from broker.config import check_anonymous
from broker.ha.replicated import run_replicated
from broker.ha.shared_store import run_shared_store
from broker.server import serve_active
from broker.store.datadir import open_data_dir
from broker.wire.io.users import load_users

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker")

__all__ = ["run_node"]


async def run_node(cfg: "BrokerConfig", *, task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Run a broker node until SIGTERM/SIGINT (or cancellation); returns the exit status (an
    isolated replication primary: ``broker.ha.replicated.ISOLATED_EXIT``)."""

    security = load_users(cfg.users_file)
    check_anonymous(cfg, security.anonymous_enabled)
    for w in security.warnings():
        log.warning("security: %s", w)
    if cfg.ha.shared_store:  # a primary or backup on a shared data directory (broker.ha)
        await run_shared_store(cfg, security, task_status=task_status)
        log.info("node stopped")
        return 0
    if cfg.ha.replication:   # a primary or backup replicating its journal (broker.ha)
        code = await run_replicated(cfg, security, task_status=task_status)
        log.info("node stopped")
        return code
    datadir = open_data_dir(cfg.data_dir)
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            stop = trio.Event()

            async def on_signal() -> None:
                async for sig in signals:
                    log.info("signal %s: shutting down", signal.Signals(sig).name)
                    stop.set()
                    return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(on_signal)
                await serve_active(cfg, security, datadir, stop, task_status=task_status)
                nursery.cancel_scope.cancel()
    finally:
        datadir.close()
    log.info("node stopped")
    return 0
