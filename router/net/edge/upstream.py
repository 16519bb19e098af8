"""Phase 4b, the upstream of a proxied connection: connect to the broker and replay the
client's handshake.

``Acceptor`` runs :meth:`Upstream.connect` and then :meth:`Upstream.replay`, each under the
connection's scope with a deadline of ``upstream_connect_timeout_s`` (phases CONNECT and
REPLAY). Connect: TCP (an IP literal skips the resolver), then with the acceptor's
``upstream-proxy-protocol`` a PROXY v2 header naming the client (before TLS and SASL), then TLS
when the target has ``tls = true`` or the acceptor ``upstream-tls = true``.

The replay is pipelined (AMQP §5.3.2 lets a client send its SASL header, sasl-init, AMQP header
and Open without waiting): the client's SASL bytes and its AMQP header + Open go out in one
write, and the broker's SASL outcome is parsed from the first bytes it answers with — a
byte-exact memo of known ok-answers, else ``SaslClientReplay``; whatever follows the outcome
(its AMQP header, Open) is for the client (``c.leftover``). A broker that refuses the
credentials never reads the pipelined Open. SASL EXTERNAL never gets here (``route``).

Failures raise an ``UpstreamError`` (``router.net.edge.errors``) after closing what was opened;
``Acceptor`` answers the client.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import ssl

import trio

from broker.wire.sasl import SaslClientReplay, UpstreamAuthFailed, UpstreamAuthOk
from broker.wire.errors import RemoteProtocolError
from broker.wire.proxyproto import build_header as build_proxy_header
from router.net import fastio
from router.net.edge.context import RECEIVE_BYTES, AcceptorSettings, ConnState
from router.net.edge.errors import (
    UpstreamAuthRefused,
    UpstreamFdExhausted,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from router.sniff.amqp import NEED_DATA, Detected

log = logging.getLogger("router.connection")

# Upstream SASL replies that ended in outcome ok, byte for byte (SASL header + mechanisms +
# outcome): a broker answers every replay with the same bytes, so a reply that starts with a
# known prefix is an UpstreamAuthOk whose leftover is the rest (the parse is a pure function of
# the bytes; anything else goes through SaslClientReplay).
_UPSTREAM_OK_PREFIXES: dict[bytes, None] = {}
_MAX_OK_PREFIXES = 32

_ADDR_CACHE: dict[tuple[str, int], tuple[int, tuple] | None] = {}


def _ip_address_for(host: str, port: int) -> tuple[int, tuple] | None:
    """(family, sockaddr) when ``host`` is an IP literal, None for a name (memoized)."""
    key = (host, port)
    try:
        return _ADDR_CACHE[key]
    except KeyError:
        pass
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        r = None
    else:
        r = (socket.AF_INET6, (host, port, 0, 0)) if ip.version == 6 else (socket.AF_INET, (host, port))
    if len(_ADDR_CACHE) < 4096:
        _ADDR_CACHE[key] = r
    return r


async def connect_tcp(host: str, port: int) -> socket.socket:
    """TCP connect (a non-blocking stdlib socket). An IP literal skips the resolver; a name is
    resolved by trio and its addresses are tried in order."""
    addr = _ip_address_for(host, port)
    if addr is not None:
        return await fastio.connect_tcp(*addr)
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    last: OSError = OSError(f"{host} has no address")
    for family, _type, _proto, _canon, sockaddr in infos:
        try:
            return await fastio.connect_tcp(family, sockaddr)
        except OSError as exc:
            last = exc
    raise last


def broker_name(target) -> str:
    """How a refusal names the broker: ``<name>:<port>`` (``<host>:<port>`` without a name)."""
    return f"{target.name}:{target.port}" if target.name else f"{target.host}:{target.port}"


def timeout_error(router: str, target, replaying: bool) -> UpstreamTimeout:
    """The error of a connect (TLS) or replay that missed its deadline."""
    where = broker_name(target)
    return UpstreamTimeout(f"Connection router {router} timed out replaying the handshake to {where}"
                           if replaying else f"Connection router {router} timed out connecting to broker {where}")


class Upstream:
    """One acceptor's upstream side (its settings, its lazily built client TLS context)."""

    def __init__(self, settings: AcceptorSettings) -> None:
        self.settings = settings
        self._ctx = settings.upstream_ssl_context

    async def connect(self, c: ConnState, target) -> None:
        """Connect to ``target`` (``c.upstream``). Raises ``UpstreamUnreachable`` /
        ``UpstreamFdExhausted`` with nothing left open."""
        s = self.settings
        usock = None
        try:
            usock = await connect_tcp(target.host, target.port)
            if s.tcp_user_timeout_ms > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
                usock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, s.tcp_user_timeout_ms)
            if s.upstream_proxy_protocol:
                # before TLS and SASL: the broker trusts this header from the router's address only
                # (its acceptor's proxy-protocol-from) and uses the client's address from then on
                await fastio.FastSocketStream(usock).send_all(build_proxy_header((c.host, c.port)))
            if target.tls or s.upstream_tls:
                ctx = self._ctx
                if ctx is None:
                    ctx = self._ctx = ssl.create_default_context()
                upstream = c.upstream = fastio.FastTLSStream(usock, ctx, server_side=False,
                                                             server_hostname=target.host)
                await upstream.do_handshake()
            else:
                c.upstream = fastio.FastSocketStream(usock)
        except (OSError, trio.BrokenResourceError) as exc:
            if c.upstream is not None:
                c.upstream.close()
                c.upstream = None
            elif usock is not None:
                usock.close()
            r, where = s.router, broker_name(target)
            if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
                # out of descriptors: this client is refused, established ones are unaffected
                raise UpstreamFdExhausted(f"Connection router {r} is out of file descriptors and cannot "
                                          f"connect to broker {where}") from exc
            log.info("%s: cannot reach %s: %s", s.name, where, exc)
            raise UpstreamUnreachable(f"Connection router {r} could not reach broker {where}") from exc

    async def replay(self, c: ConnState, detected: Detected) -> None:
        """Replay the client's handshake on ``c.upstream`` (sets ``c.leftover``). Raises
        ``UpstreamProtocolError`` / ``UpstreamAuthRefused`` after closing the upstream."""
        s = self.settings
        upstream = c.upstream
        target = c.decision.target
        try:
            client_bytes = detected.proxied_bytes()  # without lodestone:follows-redirect
            if detected.sasl_init_bytes is None:
                await upstream.send_all(client_bytes)
                return
            await upstream.send_all(detected.sasl_init_bytes + client_bytes)
            data = await upstream.receive_some(RECEIVE_BYTES)
            for prefix in _UPSTREAM_OK_PREFIXES:
                if data.startswith(prefix):
                    c.leftover = data[len(prefix):]
                    return
            refused = await self._replay_slow(upstream, c, detected, data)
        except (RemoteProtocolError, trio.BrokenResourceError) as exc:
            where = broker_name(target)
            log.info("%s: broker %s broke the handshake replay: %s", s.name, where, exc)
            self._drop(c)
            raise UpstreamProtocolError(f"Connection router {s.router}: broker {where} failed the handshake") from exc
        if refused is not None:
            self._drop(c)
            raise UpstreamAuthRefused(f"broker {broker_name(target)} refused the credentials "
                                      f"(sasl-outcome {refused})")

    @staticmethod
    def _drop(c: ConnState) -> None:
        c.upstream.close()
        c.upstream = None

    async def _replay_slow(self, upstream, c: ConnState, detected: Detected, data: bytes) -> int | None:
        """Parse the broker's SASL answer with ``SaslClientReplay`` (first time, split reads,
        refusals). Sets ``c.leftover``; returns the sasl-outcome code if the broker refused the
        credentials. Raises RemoteProtocolError / BrokenResourceError."""
        replay = SaslClientReplay(detected.sasl_init_bytes, max_frame_bytes=self.settings.max_handshake_bytes)
        replay.data_to_send()  # already sent, pipelined
        received = bytearray()
        while True:
            if not data:
                raise RemoteProtocolError("broker closed during SASL")
            received += data
            replay.receive_data(data)
            ev = replay.next_event()
            if ev is not NEED_DATA:
                break
            data = await upstream.receive_some(RECEIVE_BYTES)
        if isinstance(ev, UpstreamAuthFailed):
            return ev.code
        assert isinstance(ev, UpstreamAuthOk)
        c.leftover = ev.leftover
        prefix = bytes(received[:len(received) - len(ev.leftover)])
        if len(_UPSTREAM_OK_PREFIXES) < _MAX_OK_PREFIXES:
            _UPSTREAM_OK_PREFIXES[prefix] = None
        return None
