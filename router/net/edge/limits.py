"""Admission at the edge: per-source limits (``broker.wire.limits``) and the acceptor's
``max-connections``, and the texts of their refusals.

A client over a limit is not closed mute: its SASL completes without a credential check and it
gets Open + Close ``amqp:resource-limit-exceeded`` (``SourceRefused``) within
``REFUSAL_TIMEOUT_S`` (``Acceptor`` sets that deadline instead of the usual ones); past
``max-refusing-per-source`` refusals in flight for one address, or ``MAX_REFUSING`` for the
acceptor, it is closed at once (``refused_dropped``).
"""

from __future__ import annotations

from broker.wire.limits import SourceLimits
from router.net.edge.errors import SourceRefused

REFUSAL_TIMEOUT_S = 2.0   # a client over a per-source limit gets this long to hear its refusal
MAX_REFUSING = 256        # acceptor-wide refusals in flight (over max-connections); more: closed
OVER_LIMIT_REFUSAL_S = 0.25   # ... and how long each may take (a silent client is simply closed)

_LIMIT_TEXT = {
    "source_connections": "Connection router {r}: {src} has {lim.max_connections_per_source} connections "
                          "open (max-connections-per-source)",
    "source_unauthenticated": "Connection router {r}: {src} has {lim.max_unauthenticated_per_source} "
                              "connections still authenticating (max-unauthenticated-per-source)",
    "source_rate": "Connection router {r}: {src} opens connections faster than "
                   "{lim.max_connection_rate_per_source:g} per second (max-connection-rate-per-source)",
}


def source_refusal_text(reason: str, router: str, source: str, limits: SourceLimits) -> str:
    """What a client over a per-source limit (``reason`` from ``SourceLimiter.admit``) is told."""
    return _LIMIT_TEXT[reason].format(r=router, src=source, lim=limits)


def acceptor_refusal_text(router: str, acceptor: str, max_connections: int) -> str:
    """What a client over the acceptor's ``max-connections`` is told."""
    return (f"Connection router {router}: acceptor {acceptor} is at its limit of "
            f"{max_connections} connections (max-connections)")


def refusal(text: str) -> SourceRefused:
    """The error a refused client's connection ends with (counted at admission already)."""
    return SourceRefused(text)
