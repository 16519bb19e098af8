"""Client helpers for applications behind a Lodestone router (python-qpid-proton).

Proton does not follow ``amqp:connection:redirect`` by itself (its ``Container`` handles only
``amqp:connection:forced``, transparently). These helpers do, and announce it in the Open's
desired capabilities (``lodestone:follows-redirect``, :data:`FOLLOWS_REDIRECT`):

* event-driven (``Container`` + ``MessagingHandler``): :func:`connect` instead of
  ``container.connect`` (or :class:`RedirectingContainer`) — :mod:`router.client.events`;
* blocking: :func:`connect_following_redirects` — :mod:`router.client.blocking`;
* topology-aware connections to a broker cluster (learn the live members from each broker's
  Open, balance new connections over them): :class:`ClusterConnector` —
  :mod:`router.client.balanced` (pure rules in :mod:`router.client.topology`);
* management-API lookups (connect straight to the broker the router names, fall back to the
  front door): :class:`TargetLookup`, :func:`connect_via_management` — :mod:`router.client.lookup`;
* surviving a broker failover (reconnect, re-create links and temporary queues, resend with
  ``_AMQ_DUPL_ID``, report lost non-durable messages as :class:`NonDurableLost`, tell a failure
  listener): :class:`FailoverConnection` — :mod:`router.client.failover`.

The rules (bounded hops, loop detection, retries of a router that is not ready) live in the pure
:mod:`router.client.hops`; the rhea module ``clients/node/lodestone-redirect.js`` follows the
same ones. See ``docs/clients.md``.
"""

from broker.wire.frames import FOLLOWS_REDIRECT
from router.client.blocking import RouterRefusedClosed, _open_once, connect_following_redirects  # noqa: F401
from router.client.balanced import ClusterConnector
from router.client.errors import NoBrokerReachable, RedirectError, RedirectLoop, RouterRefused, TooManyRedirects
from router.client.events import RedirectFollower, RedirectingContainer, connect
from router.client.failover import (DISCONNECT, DUPLICATE_ID, FAILOVER, RECONNECTED, BrokerIdentity, DeliveryLost,
                                    FailoverConnection, FailoverError, FailoverEvent, NonDurableLost, RetrySchedule)
from router.client.hops import ESTABLISHMENT_FAILED, FORCED, REDIRECT, HopPlan
from router.client.lookup import TargetLookup, connect_via_management
from router.client.topology import POLICIES, Member, Topology, UrlListError, parse_urls

__all__ = [
    "FOLLOWS_REDIRECT", "REDIRECT", "FORCED", "ESTABLISHMENT_FAILED",
    "connect_following_redirects", "connect", "RedirectingContainer", "RedirectFollower",
    "TargetLookup", "connect_via_management", "HopPlan",
    "RedirectError", "RedirectLoop", "TooManyRedirects", "RouterRefused", "RouterRefusedClosed",
    "ClusterConnector", "Topology", "Member", "POLICIES", "parse_urls", "UrlListError", "NoBrokerReachable",
    "FailoverConnection", "FailoverError", "DeliveryLost", "DUPLICATE_ID", "NonDurableLost", "FailoverEvent",
    "BrokerIdentity", "RetrySchedule", "FAILOVER", "RECONNECTED", "DISCONNECT",
]
