"""Phase 1, TLS (TLS acceptors only): the server-side handshake, SNI and the client certificate.

Runs under the connection's scope with ``tls_handshake_timeout_s`` (set by ``Acceptor``). The
SNI host name comes from the context's ``sni_callback`` (``broker.wire.io.tls``); with mTLS the
verified certificate's CN is the SASL EXTERNAL identity. A failure is counted here
(``tls_handshake_failed``) and ends the connection without a reply: nothing AMQP was spoken yet.
"""

from __future__ import annotations

import logging
import socket
import ssl
from typing import Callable

import trio

from router.net import fastio
from router.net.edge.context import ConnState
from broker.wire.io.tls import peer_common_name, sni_of

log = logging.getLogger("router.connection")


async def accept_tls(sock: socket.socket, ssl_context: ssl.SSLContext, c: ConnState,
                     inc: Callable[[str], None]) -> fastio.FastTLSStream | None:
    """Wrap ``sock`` (``c.client``) and run the handshake; None (counted) if it failed."""
    try:
        client = c.client = fastio.FastTLSStream(sock, ssl_context, server_side=True)
    except OSError as exc:  # the socket broke before the handshake began
        inc("tls_handshake_failed")
        log.debug("%s: TLS setup failed: %s", c.source, exc)
        return None
    try:
        await client.do_handshake()
    except trio.BrokenResourceError as exc:
        inc("tls_handshake_failed")
        log.debug("%s: TLS handshake failed: %s", c.source, exc.__cause__ or exc)
        return None
    inc("tls_handshake_ok")
    ssl_object = client.ssl_object
    c.sni = sni_of(ssl_object)
    c.cert_cn = peer_common_name(ssl_object)
    return client
