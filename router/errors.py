"""Errors of the router package, split as h11 does: Local (you misused it) vs Remote (a peer misbehaved).

Each error carries the AMQP condition the edge sends when the error ends a client connection
(``condition``), so the shell never has to guess the wire reply.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class of every router error."""

    condition = "amqp:internal-error"


class LocalRouterError(RouterError):
    """We (config, caller, operator) asked for something invalid."""


class RemoteRouterError(RouterError):
    """Something outside this process (a broker's management API, Redis) misbehaved."""


class PolicyError(LocalRouterError, ValueError):
    """Unknown policy name or invalid policy properties."""


class FilterError(LocalRouterError, ValueError):
    """A key-filter / local-target-filter / pin pattern does not compile."""


class PinFileError(LocalRouterError, ValueError):
    """A pinned-routes file is malformed; the message names file and line."""


class MembershipSourceError(LocalRouterError, ValueError):
    """Unknown or unavailable pool membership source."""


class CacheBackendError(RemoteRouterError):
    """The shared cache backend (Redis) failed or timed out; routing continues degraded."""


class CacheBackendTimeout(CacheBackendError):
    """A call to the shared cache backend did not answer within its deadline."""


class ClusterViewError(RemoteRouterError, ValueError):
    """A broker's ``GET /api/v1/cluster`` answer is not a cluster view (``source = "cluster"``)."""
