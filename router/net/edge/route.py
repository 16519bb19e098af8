"""Phase 3, routing: ``ConnectionInfo`` → ``RouterService.route`` → ``Decision``, and what the
client gets: a redirect, the proxy, or a refusal.

The service bounds its own quorum wait (``quorum-timeout``), so ``Acceptor`` gives this phase
no deadline. What happens next depends on the acceptor's mode:

* ``redirect``: every routed client is redirected (``router.net.edge.redirect``);
* ``proxy``: every routed client is proxied (``router.net.edge.upstream``);
* ``auto``: a client whose Open announces the desired capability ``lodestone:follows-redirect``
  (``broker.wire.frames.FOLLOWS_REDIRECT``, read by the sniffer) is redirected, every other one
  is proxied — one port serves every client.
"""

from __future__ import annotations

import time

from broker.wire.frames import artemis_not_ready_description, artemis_rejected_description
from router.core.decide import Decision, Outcome
from router.core.keys import ConnectionInfo
from router.net.edge.context import AcceptorSettings, ConnState
from router.net.edge.errors import ExternalNotProxied, RouteRefused
from router.sniff.amqp import Detected

ROUTE_COUNTER = {Outcome.OK: "route_ok", Outcome.REFUSED_UNAVAILABLE: "route_refused_unavailable",
                 Outcome.REFUSED_USE_ANOTHER: "route_refused_use_another"}
#: a decision's ``explanation.cache`` → its counter (``off`` and ``skipped`` count nothing)
CACHE_COUNTER = {"hit": "cache_hit", "miss": "cache_miss", "stale": "cache_miss"}

REDIRECT, PROXY = "redirect", "proxy"


async def decide(service, s: AcceptorSettings, c: ConnState) -> Decision:
    """Route ``c`` (sets ``c.decision``, ``c.decision_us``)."""
    info = ConnectionInfo(source=c.source, sni_host=c.sni, container_id=c.container_id,
                          user=c.user, roles=c.roles, acceptor=s.name)
    t0 = time.perf_counter_ns()
    decision: Decision = await service.route(info)
    c.decision_us = (time.perf_counter_ns() - t0) // 1000
    c.decision = decision
    return decision


def action_for(s: AcceptorSettings, decision: Decision, detected: Detected) -> str:
    """``REDIRECT`` or ``PROXY`` for a routed client; raises ``RouteRefused`` when the decision
    names no target, ``ExternalNotProxied`` for an EXTERNAL client that would be proxied."""
    if decision.outcome is not Outcome.OK or decision.target is None:
        raise RouteRefused(refusal_text(s.router, decision))
    mode = s.mode
    if mode == REDIRECT or (mode == "auto" and detected.follows_redirect):
        return REDIRECT
    if detected.mechanism == "EXTERNAL":
        raise ExternalNotProxied(f"Connection router {s.router} cannot proxy SASL EXTERNAL "
                                 "(the client certificate cannot be replayed to a broker); "
                                 "use PLAIN or a redirect acceptor")
    return PROXY


def refusal_text(router: str, decision: Decision) -> str:
    """The Close description of a refusing decision."""
    if decision.outcome is Outcome.REFUSED_USE_ANOTHER:
        reason = decision.explanation.reason
        if reason.startswith("key too long"):  # max-key-length: tell the client why
            return f"{artemis_rejected_description(router)} ({reason})"
        return artemis_rejected_description(router)
    return artemis_not_ready_description(router)   # the reason: routing log and management
