"""router.net.proxy over real loopback sockets (plain, spliced, TLS): bytes, half-close, idle, resets."""

from __future__ import annotations

import socket as stdsocket
import ssl

import pytest
import trio
import trustme

from router.net import proxy
from router.net.proxy import EndReason


async def _pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    """A connected pair of real TCP streams over loopback."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        accepted = []

        async def accept():
            accepted.append(await listeners[0].accept())

        nursery.start_soon(accept)
        client = await trio.open_tcp_stream("127.0.0.1", port)
    await listeners[0].aclose()
    return client, accepted[0]


SPLICE_MODES = [pytest.param(True, id="splice"), pytest.param(False, id="streams")]


@pytest.mark.parametrize("use_splice", SPLICE_MODES)
async def test_bytes_both_ways_and_half_close(use_splice):
    # client_app <-> [client_side | proxy | upstream_side] <-> broker_app
    client_app, client_side = await _pair()
    upstream_side, broker_app = await _pair()
    payload = bytes(range(256)) * 4096  # 1 MiB
    got_by_broker = bytearray()
    got_by_client = bytearray()
    result = {}

    async def run_proxy():
        result["stats"] = await proxy.pump(client_side, upstream_side, idle_timeout_s=10, use_splice=use_splice)

    async def client():
        await client_app.send_all(payload)
        await client_app.send_eof()  # half-close: the reverse direction must keep flowing
        while data := await client_app.receive_some(65536):
            got_by_client.extend(data)

    async def broker():
        while data := await broker_app.receive_some(65536):
            got_by_broker.extend(data)
        # after the client's EOF arrived, the broker still answers, then closes
        await broker_app.send_all(b"reply after eof" * 1000)
        await broker_app.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_proxy)
        nursery.start_soon(client)
        nursery.start_soon(broker)
    stats = result["stats"]
    assert bytes(got_by_broker) == payload
    assert bytes(got_by_client) == b"reply after eof" * 1000
    assert stats.bytes_up == len(payload)
    assert stats.bytes_down == len(b"reply after eof") * 1000
    assert stats.reason is EndReason.CLOSED
    assert stats.first_eof == "client"
    assert stats.spliced is (use_splice and proxy.splice_available())
    for s in (client_app, client_side, upstream_side):
        await s.aclose()


@pytest.mark.parametrize("use_splice", SPLICE_MODES)
async def test_idle_timeout_ends_a_silent_connection(use_splice):
    client_app, client_side = await _pair()
    upstream_side, broker_app = await _pair()
    with trio.fail_after(5):
        stats = await proxy.pump(client_side, upstream_side, idle_timeout_s=0.2, use_splice=use_splice)
    assert stats.reason is EndReason.IDLE_TIMEOUT
    for s in (client_app, client_side, upstream_side, broker_app):
        await s.aclose()


@pytest.mark.parametrize("use_splice", SPLICE_MODES)
async def test_upstream_reset_ends_both_directions(use_splice):
    client_app, client_side = await _pair()
    upstream_side, broker_app = await _pair()
    result = {}

    async def run_proxy():
        result["stats"] = await proxy.pump(client_side, upstream_side, idle_timeout_s=10, use_splice=use_splice)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_proxy)
        await client_app.send_all(b"hello")
        assert await broker_app.receive_some(10) == b"hello"
        # RST: SO_LINGER with a zero timeout, then close
        broker_app.socket.setsockopt(stdsocket.SOL_SOCKET, stdsocket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        broker_app.socket.close()
        # the client keeps sending; the proxy must notice the broken upstream and end
        with trio.move_on_after(5):
            try:
                while True:
                    await client_app.send_all(b"x" * 65536)
                    await trio.sleep(0.01)  # pacing the client's writes, not a wait
            except trio.BrokenResourceError:
                pass
    assert result["stats"].reason is EndReason.UPSTREAM_ERROR
    for s in (client_app, client_side, upstream_side):
        await s.aclose()


@pytest.mark.parametrize("use_splice", SPLICE_MODES)
async def test_back_pressure_bounds_bytes_in_flight(use_splice):
    """A broker that does not read must stop the client, not grow memory in the proxy."""
    client_app, client_side = await _pair()
    upstream_side, broker_app = await _pair()
    sent = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: proxy.pump(client_side, upstream_side, idle_timeout_s=10, use_splice=use_splice))
        with trio.move_on_after(1):
            chunk = b"y" * 65536
            while True:
                # socket.send is all-or-nothing under cancellation, so `sent` is exact
                sent += await client_app.socket.send(chunk)
        # kernel socket buffers (4 of them on loopback) + one chunk or pipe: a few MiB, never 100s
        assert sent < 48 * 1024 * 1024
        received = 0
        await client_app.send_eof()
        while data := await broker_app.receive_some(1 << 20):
            received += len(data)
        assert received == sent
        await broker_app.aclose()
    for s in (client_app, client_side, upstream_side):
        await s.aclose()


async def test_tls_client_side_proxies_and_closes_on_upstream_eof():
    ca = trustme.CA()
    cert = ca.issue_cert("router.test")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    raw_client, raw_client_side = await _pair()
    upstream_side, broker_app = await _pair()
    client_app = trio.SSLStream(raw_client, client_ctx, server_hostname="router.test")
    client_side = trio.SSLStream(raw_client_side, server_ctx, server_side=True, https_compatible=True)
    result = {}

    async def run_proxy():
        await client_side.do_handshake()
        result["stats"] = await proxy.pump(client_side, upstream_side, idle_timeout_s=10)

    got = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_proxy)
        await client_app.send_all(b"ping" * 10000)
        n = 0
        while n < 40000:
            n += len(await broker_app.receive_some(65536))
        await broker_app.send_all(b"pong" * 10000)
        await broker_app.aclose()  # broker ends: the TLS client sees the whole reply, then EOF
        try:
            while data := await client_app.receive_some(65536):
                got.extend(data)
        except trio.BrokenResourceError:
            pass
    assert bytes(got) == b"pong" * 10000
    stats = result["stats"]
    assert stats.bytes_up == 40000 and stats.bytes_down == 40000
    assert not stats.spliced
    await trio.aclose_forcefully(client_app)
    await upstream_side.aclose()
