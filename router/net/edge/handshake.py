"""Phase 2, the handshake: SASL + AMQP header + Open, read by ``router.sniff.amqp``.

Runs under the connection's scope with ``handshake_timeout_s`` (one deadline for the whole
exchange, set by ``Acceptor``, so a slow-drip client cannot stretch it). The router
authenticates the client itself: PLAIN against the users file (through the ``LoginGate``),
ANONYMOUS when the users file allows it, EXTERNAL from the verified certificate; bad credentials
get a SASL ``auth`` outcome. Garbage, a wrong protocol header, malformed or oversized frames are
the codec's ``RemoteProtocolError``s: they carry their own reply bytes, which ``run`` returns
for ``Acceptor`` to write under its deadline, and each case has its own counter. A client over
a per-source limit (``c.refusal``) completes SASL without a credential check: only its refusal
follows.
"""

from __future__ import annotations

import logging

import trio

from broker.wire.sasl import parse_plain
from broker.wire.limits import SourceLimiter, source_key
from broker.wire.errors import DecodeError, NotThisProtocol, RemoteProtocolError
from router.net.edge.context import RECEIVE_BYTES, AcceptorSettings, ConnState, EdgeContext
from router.sniff.amqp import NEED_DATA, AuthFailed, AuthRequested, Detected, HandshakeSniffer

log = logging.getLogger("router.connection")

_SASL_AUTH = 1  # sasl-outcome code "auth" (§5.3.3.6)


class Handshake:
    """One acceptor's handshake phase (its settings, the edge's authenticator and limiter)."""

    def __init__(self, settings: AcceptorSettings, edge: EdgeContext, limiter: SourceLimiter, inc):
        self.settings = settings
        self.edge = edge
        self.limiter = limiter
        self._inc = inc

    async def run(self, client: trio.abc.Stream, c: ConnState) -> Detected | bytes:
        """Read the client's handshake up to its Open. When it ends otherwise (counted here):
        the last bytes to write to the client before closing (may be empty); ``Acceptor``
        writes them under its own small deadline."""
        s = self.settings
        sniffer = HandshakeSniffer(True, s.max_handshake_bytes, mechanisms=self._mechanisms_for(c),
                                   allow_no_sasl=self._anonymous_allowed())
        try:
            while True:
                ev = sniffer.next_event()
                if ev is NEED_DATA:
                    out = sniffer.data_to_send()
                    if out:
                        await client.send_all(out)
                    data = await client.receive_some(RECEIVE_BYTES)
                    if not data:
                        self._inc("handshake_eof")
                        return b""
                    sniffer.receive_data(data)
                elif isinstance(ev, AuthRequested) and c.refusal is not None:
                    sniffer.accept(None)  # over a limit: no credentials checked, only the refusal follows
                elif isinstance(ev, AuthRequested):
                    principal = await self._authenticate(ev, c)
                    if principal is None:
                        sniffer.reject(_SASL_AUTH, "authentication failed")
                    else:
                        # ConnectionInfo.user is None for an anonymous client (the contract)
                        c.user = None if ev.mechanism == "ANONYMOUS" else principal.user
                        c.roles, c.mechanism = tuple(principal.roles), ev.mechanism
                        self._inc("auth_ok")
                        sniffer.accept(principal.user)
                        c.authenticated = True
                        self.limiter.authenticated(source_key(c.host))
                elif isinstance(ev, AuthFailed):
                    self._inc("auth_failed")
                    return sniffer.data_to_send()
                elif isinstance(ev, Detected):
                    out = sniffer.data_to_send()
                    if out:
                        await client.send_all(out)
                    if ev.sasl_init_bytes is None and c.refusal is None:
                        # No SASL at all: anonymous (allowed only when the users file allows it)
                        principal = self._anonymous()
                        if principal is None:  # pragma: no cover - the sniffer refuses first
                            return b""
                        c.user, c.roles, c.mechanism = None, tuple(principal.roles), None
                        c.authenticated = True
                        self.limiter.authenticated(source_key(c.host))
                    c.container_id = ev.open.container_id
                    c.open_hostname = ev.open.hostname
                    return ev
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The client left (reset, or TLS broken) while we read or wrote its handshake: our
            # SASL header/mechanisms/outcome may meet a reset as well as our next read does.
            self._inc("handshake_eof")
            return b""
        except NotThisProtocol as exc:
            self._inc("protocol_header_rejected")
            return sniffer.data_to_send() + (exc.reply or b"")
        except RemoteProtocolError as exc:
            self._inc("handshake_oversized" if sniffer._received > s.max_handshake_bytes else
                      "handshake_decode_error" if isinstance(exc, DecodeError) else "protocol_error")
            log.debug("%s: %s: handshake error %s", s.name, c.source, exc)
            return sniffer.data_to_send() + (exc.reply or b"")

    def _anonymous_allowed(self) -> bool:
        return "ANONYMOUS" in self.settings.mechanisms and self._anonymous() is not None

    def _anonymous(self):
        auth = self.edge.authenticator
        return auth.anonymous_principal() if auth is not None else None

    def _mechanisms_for(self, c: ConnState) -> tuple[str, ...]:
        mechs = []
        for m in self.settings.mechanisms:
            if m == "EXTERNAL" and c.cert_cn is None:
                continue  # only offered to clients that presented a verified certificate
            if m == "ANONYMOUS" and self._anonymous() is None:
                continue
            mechs.append(m)
        return tuple(mechs) or ("PLAIN",)

    async def _authenticate(self, ev: AuthRequested, c: ConnState):
        auth = self.edge.authenticator
        if auth is None:
            return None
        try:
            if ev.mechanism == "PLAIN":
                _authzid, user, password = parse_plain(ev.initial_response)
                gate = self.edge.login_gate
                if gate is None:  # pragma: no cover - an Authenticator that is not a users file
                    principal = auth.cached(user, password, c.host)
                    if principal is None:
                        principal = await trio.to_thread.run_sync(auth.authenticate, user, password, c.host)
                    return principal
                # a known login at once; else throttled, fair, on the gate's own threads, and a
                # refusal only after its delay (broker.wire.io.login)
                return (await gate.login(user, password, c.host)).principal
            if ev.mechanism == "EXTERNAL":
                if c.cert_cn is None:
                    return None
                return auth.principal_for_certificate(c.cert_cn, c.host)
            if ev.mechanism == "ANONYMOUS":
                return auth.anonymous_principal()
        except RemoteProtocolError:
            return None
        return None

