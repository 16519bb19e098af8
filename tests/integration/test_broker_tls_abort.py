"""A TLS client that vanishes without close_notify, at every phase, must not take the node down."""

import socket
import ssl
from urllib.parse import urlsplit

import pytest
import trustme
from proton import Message
from proton.utils import BlockingConnection

from broker.wire.codec import Symbol
from broker.wire.frames import AMQP_HEADER, FRAME_AMQP, FRAME_SASL, SASL_HEADER, Open, SaslInit, encode_frame
from tests.brokerproc import start_broker

pytestmark = pytest.mark.slow


def _abort(sock: socket.socket) -> None:
    """Close the TCP socket under a TLS session with a reset: no close_notify, no FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


OPENED = (SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), b"\x00app\x00app"))
          + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id="tls-abort")))


@pytest.mark.parametrize("phase", ["mid-handshake", "after-handshake", "after-sasl-header", "eof-no-notify",
                                   "open-then-abort", "open-then-eof-no-notify"])
def test_tls_abort_leaves_the_broker_serving(tmp_path, phase):
    ca = trustme.CA()
    broker = start_broker(tmp_path, tls=ca)
    try:
        u = urlsplit(broker.amqps_url)
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        for _ in range(3):
            raw = socket.create_connection((u.hostname, u.port))
            if phase == "mid-handshake":
                raw.sendall(b"\x16\x03\x01\x00\xc8\x01\x00\x00\xc4\x03\x03")  # a ClientHello cut short
                _abort(raw)
                continue
            tls = ctx.wrap_socket(raw, server_hostname="localhost")
            if phase in ("after-sasl-header", "eof-no-notify"):
                tls.sendall(SASL_HEADER)
                tls.recv(4096)
            if phase.startswith("open-then"):
                tls.settimeout(10)
                tls.sendall(OPENED)
                got = b""
                while b"\x00\x53\x10" not in got:  # wait for the broker's Open (descriptor 0x10)
                    chunk = tls.recv(4096)
                    assert chunk, f"broker closed before its Open: {got!r}"
                    got += chunk
            if phase.endswith("eof-no-notify"):
                tls.shutdown(socket.SHUT_WR)  # SSLSocket.shutdown: a TCP FIN, no TLS close_notify
                tls.settimeout(10)
                while tls.recv(4096):  # now plain reads: wait for the broker to close its side
                    pass
                tls.close()
            else:
                _abort(tls)
        conn = BlockingConnection(broker.amqp_url, user="app", password="app", allowed_mechs="PLAIN",
                                  allow_insecure_mechs=True, timeout=20)
        try:
            conn.create_sender("after-abort").send(Message(body="still here"))
            receiver = conn.create_receiver("after-abort")
            assert receiver.receive(timeout=10).body == "still here"
            receiver.accept()
        finally:
            conn.close()
        assert broker.proc.poll() is None, broker.stderr_text()
    finally:
        broker.terminate()
