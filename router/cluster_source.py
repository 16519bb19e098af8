"""``source = "cluster"``: a pool that follows a Lodestone broker cluster (the shell).

Theory of operation
-------------------
Every ``check-period`` the source asks one broker for ``GET <management-url>/api/v1/cluster``
(HTTP Basic with the pool's ``username``/``password``, the probes' credentials), in the order of
``ClusterMembership.candidates``: the node that answered last, the other known nodes, then the
``seed-connectors``; the first valid answer is the view of that round. The pure
``router.core.membership`` turns views into joins and leaves (the rule for leaving is there);
this module applies them to the pool and says so (``on_change``). Health probes and the quorum
gate the targets exactly as static ones: a target joins not ready and gets connections once its
probe says it is active.

If no node answers, the membership stays as it was and the error is kept (``status()``, shown
under the router's pool in the management API); the next round tries again. The first round is
done before ``follow`` reports started, so a router that starts with a reachable seed knows its
cluster before it listens.

Only the process that probes follows (``workers = 1``: the router; ``workers > 1``: the
supervisor, which pushes the membership to its workers with the probe results), so the brokers
see one read per check-period whatever the number of workers, and every worker holds the
supervisor's membership.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from typing import Any

import h11
import trio

from router.core.membership import ClusterMembership, parse_cluster_view
from router.core.policies.base import Target
from router.core.pool import FollowContext, Pool, register_membership_source
from router.errors import ClusterViewError, MembershipSourceError
from router.health import basic_auth, http_get

log = logging.getLogger("lodestone.router.cluster")

DEFAULT_LEAVE_AFTER_MS = 30_000
OPTIONS = ("seed-connectors", "leave-after-ms")


class ClusterSource:
    """Membership read from a broker cluster's ``GET /api/v1/cluster``."""

    dynamic = True

    def __init__(self, targets: list[Target], options: dict[str, Any]) -> None:
        if targets:
            raise MembershipSourceError("a cluster pool takes no targets (they come from the cluster)")
        unknown = set(options) - set(OPTIONS)
        if unknown:
            raise MembershipSourceError(f"cluster source: unknown options {sorted(unknown)}")
        seeds = options.get("seed-connectors") or ()
        if isinstance(seeds, str):
            seeds = [s for s in seeds.split(",") if s.strip()]
        if not seeds:
            raise MembershipSourceError("cluster source needs seed-connectors (management URLs)")
        self.seeds = tuple(s.strip().rstrip("/") for s in seeds)
        self.leave_after_ms = int(options.get("leave-after-ms", DEFAULT_LEAVE_AFTER_MS))
        self.membership = ClusterMembership(self.leave_after_ms / 1000.0)
        self.last_error: str | None = None
        self.last_read_from: str | None = None
        self.reads = 0
        self.read_errors = 0
        self._root: str | None = None   # the root the last view named (OpenAMQ's model)

    def start(self, pool: Pool) -> None:
        """Nothing is known before the first read."""

    def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"source": "cluster", "seed_connectors": list(self.seeds),
                "leave_after_ms": self.leave_after_ms, "members": sorted(self.membership.known),
                "last_read_from": self.last_read_from, "last_error": self.last_error,
                "reads": self.reads, "read_errors": self.read_errors, "root": self._root}

    async def read_view(self, url: str, ctx: FollowContext, timeout_s: float,
                        ssl_context: ssl.SSLContext | None = None):
        """One node's view (``ViewMember`` list); raises on any failure."""
        status, body = await http_get(url + "/api/v1/cluster",
                                      headers=basic_auth(ctx.username, ctx.password),
                                      timeout_s=timeout_s, ssl_context=ssl_context)
        if status != 200:
            raise ClusterViewError(f"HTTP {status}")
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise ClusterViewError(f"bad JSON: {exc}") from None
        view = parse_cluster_view(data, url)
        root = data.get("root") if isinstance(data, dict) else None
        self._root = root if isinstance(root, str) and root else None
        return view

    async def refresh(self, pool: Pool, ctx: FollowContext) -> bool:
        """One round: read a view from the first node that answers, apply the change. True if
        the pool changed."""
        timeout = min(ctx.check_period_ms / 1000.0, 2.0)
        errors = []
        for url in self.membership.candidates(self.seeds):
            try:
                view = await self.read_view(url, ctx, timeout)
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError,
                    ValueError, ssl.SSLError) as exc:
                text = "timeout" if isinstance(exc, trio.TooSlowError) else (str(exc) or type(exc).__name__)
                errors.append(f"{url}: {text}")
                continue
            self.reads += 1
            self.membership.answered(url)
            self.last_read_from = url
            if self.last_error is not None:
                log.warning("cluster pool: reading the cluster from %s again", url)
            self.last_error = None
            now = (ctx.clock or time.monotonic)()
            change = self.membership.observe(view, now)
            root_moved = pool.root != self._root
            if root_moved:
                log.info("cluster pool: the cluster's root is now %s (as %s sees it)", self._root or "none", url)
                pool.root = self._root
            for slot in change.removed:
                if pool.remove_target(slot):
                    log.info("cluster pool: %s left", slot)
            for t in change.added:
                if pool.add_target(t):
                    log.info("cluster pool: %s joined (amqp %s:%d, management %s%s)", t.name,
                             t.host, t.port, t.management_url,
                             f"; backup of node {t.node_id}" if t.backup else "")
            for t in change.updated:
                if pool.update_target(t):
                    log.info("cluster pool: %s is now listed as %s of node %s", t.name,
                             "a backup" if t.backup else "the primary", t.node_id)
            return bool(change) or root_moved
        self.read_errors += 1
        text = "; ".join(errors) or "no management URL to ask"
        if self.last_error is None:
            log.warning("cluster pool: no node answered GET /api/v1/cluster (%s); keeping %d "
                        "member(s)", text, len(self.membership.known))
        self.last_error = text
        return False

    async def follow(self, pool: Pool, ctx: FollowContext,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Re-read the cluster every check-period until cancelled (started after round one)."""
        period = ctx.check_period_ms / 1000.0
        first = True
        while True:
            if await self.refresh(pool, ctx) and ctx.on_change is not None:
                ctx.on_change()
            if first:
                first = False
                task_status.started()
            await trio.sleep(period)


register_membership_source("cluster", ClusterSource)
