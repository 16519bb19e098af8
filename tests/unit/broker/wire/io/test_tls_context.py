"""broker.wire.io.tls.server_context: TLS 1.3 session resumption still works with one ticket per
full handshake, and the context keeps TLS >= 1.2 and client-certificate verification."""

import ssl

import pytest
import trustme

from broker.wire.io.tls import server_context


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = trustme.CA()
    cert = ca.issue_cert("localhost")
    d = tmp_path_factory.mktemp("tls")
    pem = d / "server.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(pem))
    ca_pem = d / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    return pem, ca_pem


def _handshake(sctx, cctx, session=None):
    """Full TLS exchange over memory BIOs (real OpenSSL on both sides); returns the client
    SSLObject after the server's post-handshake tickets were read."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = cctx.wrap_bio(c_in, c_out, server_hostname="localhost", session=session)
    server = sctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(6):
        for obj in (client, server):
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    server.write(b"x")  # tickets go out before this record; reading it consumes them
    c_in.write(s_out.read())
    assert client.read(1) == b"x"
    return client


def test_one_ticket_and_resumption_works(pki):
    pem, ca_pem = pki
    sctx = server_context(pem, pem)
    assert sctx.num_tickets == 1
    assert sctx.minimum_version == ssl.TLSVersion.TLSv1_2
    cctx = ssl.create_default_context(cafile=str(ca_pem))  # verifies the server certificate
    first = _handshake(sctx, cctx)
    assert first.version() == "TLSv1.3"
    assert not first.session_reused
    session = first.session
    assert session is not None and session.has_ticket
    second = _handshake(sctx, cctx, session=session)
    assert second.session_reused


def test_client_ca_still_verifies(pki):
    pem, ca_pem = pki
    sctx = server_context(pem, pem, client_ca=ca_pem, require_client_certificate=True)
    assert sctx.verify_mode == ssl.CERT_REQUIRED
    assert server_context(pem, pem, client_ca=ca_pem).verify_mode == ssl.CERT_OPTIONAL
