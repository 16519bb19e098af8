"""TLS for the router's edge: server contexts for acceptors, client contexts for upstreams.

SNI: Python exposes the client's server_name only through ``SSLContext.sni_callback``, which
runs during the handshake with the connection's ``ssl.SSLObject``. The callback stores the name
on that object (``SSLObject`` has no ``__slots__``) and :func:`sni_of` reads it back after the
handshake. The name is lower-cased, as Artemis' Netty SNI handler does (its SNI_HOST keys are
lower-case ASCII). An IP literal sent as SNI (forbidden by RFC 6066, sent by some clients that
connect to an address) counts as no SNI.

mTLS: with a client CA configured the acceptor asks for a certificate (``CERT_OPTIONAL``, or
``CERT_REQUIRED`` when the acceptor insists). A verified certificate's subject common name is the
SASL EXTERNAL user (:func:`peer_common_name`).
"""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path

_SNI_ATTR = "_lodestone_sni"


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def _store_sni(ssl_object, server_name, _ctx) -> None:
    # Runs inside the handshake. Returning None continues it with the same context.
    # RFC 6066 §3 forbids IP literals in SNI, yet some clients (proton connecting to an IP) send
    # one: it names no virtual host, so it is treated as "no SNI".
    if server_name and not _is_ip_literal(server_name):
        try:
            setattr(ssl_object, _SNI_ATTR, server_name.lower())
        except AttributeError:  # pragma: no cover - an SSLSocket without a settable attribute
            pass
    return None


def server_context(certificate: str | Path, key: str | Path, *, client_ca: str | Path | None = None,
                   require_client_certificate: bool = False) -> ssl.SSLContext:
    """An acceptor's TLS context: our certificate chain, SNI capture, optional client certs."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(certificate), str(key))
    # Session tickets are on by default; no renegotiation; trio's SSLStream wants this off.
    ctx.options |= ssl.OP_NO_RENEGOTIATION if hasattr(ssl, "OP_NO_RENEGOTIATION") else 0
    # TLS 1.3: one session ticket per full handshake instead of OpenSSL's default two (meant for
    # browsers opening parallel connections; an AMQP client resumes one connection at a time).
    # Resumption still works (tests/unit/broker/wire/io/test_tls_context.py); each ticket costs ~30 µs
    # of server CPU (session encoding, ticket encryption: measured in-process, OpenSSL 3.0) plus
    # one write to the socket.
    ctx.num_tickets = 1
    if client_ca is not None:
        ctx.load_verify_locations(str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_certificate else ssl.CERT_OPTIONAL
    ctx.sni_callback = _store_sni
    return ctx


def client_context(*, ca: str | Path | None = None, verify: bool = True,
                   certificate: str | Path | None = None, key: str | Path | None = None) -> ssl.SSLContext:
    """An upstream TLS context (router → broker). ``ca`` None means the system trust store."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca) if ca else None)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if certificate is not None:
        ctx.load_cert_chain(str(certificate), str(key) if key else None)
    return ctx


def capture_sni(ctx: ssl.SSLContext) -> None:
    """Make ``ctx`` (a server context) keep each client's SNI host name for :func:`sni_of`."""
    ctx.sni_callback = _store_sni


def sni_of(ssl_object) -> str | None:
    """The SNI host name the client sent (lower-cased), or None."""
    return getattr(ssl_object, _SNI_ATTR, None)


def peer_common_name(ssl_object) -> str | None:
    """The verified client certificate's subject CN, or None (no certificate / not verified)."""
    try:
        cert = ssl_object.getpeercert()
    except (ValueError, ssl.SSLError):
        return None
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return value
    return None
