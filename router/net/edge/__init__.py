"""The router's edge: one client connection, from accept to close, one module per phase.

Theory of operation
-------------------
``Acceptor.handle(sock, peer)`` (``acceptor.py``) is the whole life of one connection and the
one place that owns its deadlines. The socket comes straight from ``accept``
(``router.net.listener``) and is wrapped in the lean streams of ``router.net.fastio`` (no trio
stream layers on the hot path). One cancel scope carries the deadline of each phase in turn
(``ConnState.phase`` tells which one fired); the phase modules never set a deadline (the
others live in ``acceptor.py`` too: the linger after our last frames and the small deadline of
a handshake's last reply; the pump's idle deadline is ``router.net.proxy``'s; a TLS
close_notify is bounded in ``context.close``):

0. **Limits** (``limits.py``): per-source admission and the acceptor's ``max-connections``; a
   client over a limit completes SASL unchecked and gets ``amqp:resource-limit-exceeded``
   within ``REFUSAL_TIMEOUT_S``.
1. **TLS** (``tls.py``, TLS acceptors only) within ``tls_handshake_timeout_s``.
2. **Handshake** (``handshake.py``): SASL + AMQP header + Open, sniffed by
   ``router.sniff.amqp.HandshakeSniffer`` within ``handshake_timeout_s``; the router
   authenticates the client itself.
3. **Route** (``route.py``): ``RouterService.route(ConnectionInfo)`` → ``Decision`` (the service
   bounds its quorum wait), then what the client gets by the acceptor's mode: ``redirect``,
   ``proxy``, or ``auto`` (redirect a client whose Open desires ``lodestone:follows-redirect``,
   proxy the others).
4. **Redirect** (``redirect.py``): the Artemis-style redirect or a refusal, then half-close and
   a linger of at most ``close_linger_s`` for the client's Close/EOF.
   **Upstream** (``upstream.py``): connect (``upstream_connect_timeout_s``), then replay the
   client's handshake pipelined (again ``upstream_connect_timeout_s``).
5. **Pump** (``pump.py``): ``router.net.proxy.pump`` with ``idle_timeout_s``.

Errors (``errors.py``): a phase that turns a client away raises an ``EdgeError`` carrying the
AMQP ``condition`` and ``description`` (plus its counter and routing-log action);
``Acceptor._refuse`` is the one place that turns it into the wire reply. The routing log's
lines are built by ``router.routelog`` (its schema). Whatever happens, ``finally`` closes every
stream (TLS streams with a close_notify, bounded).
"""

from router.net.edge.acceptor import Acceptor
from router.net.edge.context import AcceptorSettings, Authenticator, EdgeContext, Principal

__all__ = ["Acceptor", "AcceptorSettings", "Authenticator", "EdgeContext", "Principal"]
