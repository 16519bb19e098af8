"""Errors that end one client connection at the edge, each carrying its wire reply.

Every phase after the client's Open (limits, route, upstream) reports why it turns a client away
by raising an :class:`EdgeError`: the AMQP ``condition`` and ``description`` the client gets in
a Close, the edge counter that records it (``counter``) and, once a routing decision exists, the
routing log's ``action``. ``Acceptor`` (``router.net.edge.acceptor``) is the one place that
turns them into the wire reply (:func:`reply_frames`: AMQP header + failed-establishment Open +
Close) and writes it; phases never write refusals themselves.

Errors before the Open (TLS, bad protocol header, malformed frames) are the codec's own
``broker.wire.errors.RemoteProtocolError`` (they carry their ``reply`` bytes) and are answered by the
handshake phase. As in ``router.errors``: ``RemoteEdgeError`` = a peer (the broker) misbehaved,
the others are our own decision to refuse.
"""

from __future__ import annotations

from broker.wire.frames import refuse_frames
from router.errors import RouterError

FORCED = "amqp:connection:forced"


class EdgeError(RouterError):
    """A client connection is refused: ``condition`` + ``description`` on the wire."""

    condition = FORCED
    #: edge counter (``router.net.stats.COUNTER_NAMES``) incremented when answered, or None
    counter: str | None = None
    #: routing-log ``action`` of the route line written when answered (None: no line)
    action: str | None = None

    def __init__(self, description: str, condition: str | None = None, *,
                 counter: str | None = None) -> None:
        super().__init__(description)
        self.description = description
        if condition is not None:
            self.condition = condition
        if counter is not None:
            self.counter = counter

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r}, condition={self.condition!r})"


class SourceRefused(EdgeError):
    """Over a per-source or acceptor limit (counted at admission): no credentials checked."""

    condition = "amqp:resource-limit-exceeded"


class RouteRefused(EdgeError):
    """The routing core found no target (not ready, no policy/pool, key too long)."""

    counter = "refused"
    action = "refused"


class ExternalNotProxied(EdgeError):
    """SASL EXTERNAL cannot be replayed to a broker (the router holds no client key)."""

    condition = "amqp:not-implemented"
    counter = "proxy_external_refused"
    action = "refused_external"


class UpstreamError(EdgeError):
    """The broker chosen for a proxied connection failed before the pump started."""

    counter = "upstream_connect_failed"
    action = "upstream_failed"
    #: the broker looks down: the acceptor has it marked not ready and probed again at once
    #: (``RouterService.upstream_failed``); not for a refusal of the client's own credentials
    #: or the router's own lack of descriptors
    target_down = True


class UpstreamUnreachable(UpstreamError):
    """Refused, unreachable, or its TLS handshake failed."""


class UpstreamFdExhausted(UpstreamError):
    """No descriptor left to connect to the broker (established connections are unaffected)."""

    counter = "upstream_fd_exhausted"
    target_down = False


class UpstreamTimeout(UpstreamError):
    """Connect (TLS) or handshake replay not done within ``connect-timeout-ms``."""

    counter = "upstream_connect_timeout"


class UpstreamProtocolError(UpstreamError):
    """The broker closed/reset during the replay or answered something that is not SASL."""

    counter = "upstream_protocol_error"


class UpstreamAuthRefused(UpstreamError):
    """The broker refused the client's replayed credentials."""

    condition = "amqp:unauthorized-access"
    counter = "upstream_auth_failed"
    target_down = False


def reply_frames(err: EdgeError) -> bytes:
    """The bytes that tell the client: AMQP header + failed-establishment Open + Close(error)."""
    return refuse_frames(err.condition, err.description)
