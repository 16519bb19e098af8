"""The broker ends first (issue 19): the router closes the client within upstream-close-grace,
for a plain connection (the shared-poller first phase and the two-task pump), a spliced one and a
TLS one, over real loopback sockets.

The client here behaves as python-qpid-proton does after ``amqp:connection:forced``: it reads the
broker's last bytes and the EOF, never closes, and keeps writing empty frames while it waits for
its transport to close. Before issue 19 the router half-closed toward it and kept accepting those
writes until the idle timeout (60 s in the local deployment), so such a client never reconnected.
"""

from __future__ import annotations

import errno
import socket as stdsocket
import ssl

import pytest
import trio
import trustme

from router.net import fastio, proxy
from router.net.proxy import EndReason
from tests.waiting import wait_for_async

GRACE_S = 0.4
EMPTY_FRAME = b"\x00\x00\x00\x08\x02\x00\x00\x00"   # an AMQP empty frame (heartbeat)
CLOSE_FRAMES = b"\x00\x00\x00\x0c\x02\x00\x00\x00\x00\x53\x18\x45"  # Close, no error (what a broker ends with)


async def _socket_pair() -> tuple[stdsocket.socket, stdsocket.socket]:
    """Two connected non-blocking stdlib TCP sockets over loopback (the router's kind)."""
    lsock = stdsocket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    a = await fastio.connect_tcp(stdsocket.AF_INET, lsock.getsockname())
    b, _ = lsock.accept()
    lsock.close()
    fastio.prepare_socket(b)
    return a, b


async def _run_router_side(client_side, upstream_side, *, use_splice: bool, shared_poller: bool, out: dict):
    """What the router's acceptor does: pump, then close both sides."""
    async with trio.open_nursery() as nursery:
        if shared_poller:
            poller = proxy.SharedPoller()
            await nursery.start(poller.run)
        t0 = trio.current_time()
        out["stats"] = await proxy.pump(client_side, upstream_side, idle_timeout_s=30, use_splice=use_splice,
                                        upstream_close_grace_s=GRACE_S)
        out["pump_s"] = trio.current_time() - t0
        client_side.close()
        upstream_side.close()
        nursery.cancel_scope.cancel()


async def _proton_like_client(stream, out: dict) -> None:
    """Read everything up to EOF, then keep writing empty frames every 50 ms without closing,
    until a write fails (the router closed us): records when EOF and the failure came."""
    got = 0
    while data := await stream.receive_some(65536):
        got += len(data)
    out["eof_at"] = trio.current_time()
    out["received"] = got
    while True:
        try:
            await stream.send_all(EMPTY_FRAME)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            out["failed_at"] = trio.current_time()
            out["error"] = exc.__cause__
            break
        await trio.sleep(0.05)  # pacing: the client's empty frames, every 50 ms
    stream.close()


async def _broker_ends(sock: stdsocket.socket, out: dict, bulk: int = 0) -> None:
    """Send ``bulk`` bytes then a Close, and close the socket (both ways)."""
    stream = fastio.FastSocketStream(sock)
    if bulk:
        await stream.send_all(b"m" * bulk)
    await stream.send_all(CLOSE_FRAMES)
    out["broker_closed_at"] = trio.current_time()
    stream.close()


CASES = [
    pytest.param(False, True, 0, id="plain-first-phase"),
    pytest.param(False, False, 0, id="plain-two-task"),
    pytest.param(True, True, 4 << 20, id="spliced"),
]


@pytest.mark.parametrize("use_splice,shared_poller,bulk", CASES)
async def test_client_that_keeps_writing_is_closed_within_the_grace(use_splice, shared_poller, bulk):
    client_app, client_side = await _socket_pair()
    upstream_side, broker_app = await _socket_pair()
    router, client, broker = {}, {}, {}
    cs, us = fastio.FastSocketStream(client_side), fastio.FastSocketStream(upstream_side)
    # before issue 19 the client was kept until the idle timeout (30 s here): fail_after fires
    with trio.fail_after(GRACE_S + 5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _run_router_side(cs, us, use_splice=use_splice, shared_poller=shared_poller,
                                                        out=router))
            nursery.start_soon(_proton_like_client, fastio.FastSocketStream(client_app), client)
            nursery.start_soon(_broker_ends, broker_app, broker, bulk)
    stats = router["stats"]
    assert client["received"] == bulk + len(CLOSE_FRAMES)  # everything the broker sent arrived
    assert stats.reason is EndReason.UPSTREAM_CLOSED
    assert stats.first_eof == "upstream"
    assert "did not close within" in stats.error
    assert stats.bytes_up == 0  # nothing the client wrote after its broker was gone went upstream
    assert stats.dropped_up > 0
    silent = client["failed_at"] - broker["broker_closed_at"]
    assert GRACE_S * 0.9 <= silent <= GRACE_S + 0.5, silent
    assert isinstance(client["error"], OSError) and client["error"].errno in (errno.ECONNRESET, errno.EPIPE)
    if bulk:
        assert stats.spliced is proxy.splice_available()


@pytest.mark.parametrize("use_splice,shared_poller", [pytest.param(True, True, id="first-phase"),
                                                      pytest.param(False, False, id="two-task")])
async def test_client_that_closes_within_the_grace_is_a_normal_close(use_splice, shared_poller):
    client_app, client_side = await _socket_pair()
    upstream_side, broker_app = await _socket_pair()
    router, broker = {}, {}
    cs, us = fastio.FastSocketStream(client_side), fastio.FastSocketStream(upstream_side)

    async def polite_client():
        stream = fastio.FastSocketStream(client_app)
        while await stream.receive_some(65536):
            pass
        await stream.send_all(CLOSE_FRAMES)  # its own Close, then EOF
        await stream.send_eof()
        await trio.sleep(GRACE_S * 3)  # the thing under test: the router ends at the EOF, not at the grace
        stream.close()

    with trio.fail_after(GRACE_S + 5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _run_router_side(cs, us, use_splice=use_splice, shared_poller=shared_poller,
                                                        out=router))
            nursery.start_soon(polite_client)
            nursery.start_soon(_broker_ends, broker_app, broker)
    stats = router["stats"]
    assert stats.reason is EndReason.CLOSED
    assert stats.first_eof == "upstream"
    assert router["pump_s"] < GRACE_S  # it ended at the client's EOF, not at the grace
    assert stats.dropped_up == len(CLOSE_FRAMES)  # the client's Close had nobody to go to


async def test_client_ending_first_still_half_closes():
    """The client ends first: the broker is given its time to answer (half-close kept), far
    longer than the grace."""
    client_app, client_side = await _socket_pair()
    upstream_side, broker_app = await _socket_pair()
    router = {}
    cs, us = fastio.FastSocketStream(client_side), fastio.FastSocketStream(upstream_side)
    answer = b"late answer" * 100
    got = bytearray()

    async def client():
        stream = fastio.FastSocketStream(client_app)
        await stream.send_all(CLOSE_FRAMES)
        await stream.send_eof()
        while data := await stream.receive_some(65536):
            got.extend(data)
        stream.close()

    async def slow_broker():
        stream = fastio.FastSocketStream(broker_app)
        while await stream.receive_some(65536):
            pass
        await trio.sleep(GRACE_S * 3)  # the thing under test: an answer far later than the grace still arrives
        await stream.send_all(answer)
        stream.close()

    with trio.fail_after(GRACE_S * 3 + 5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _run_router_side(cs, us, use_splice=True, shared_poller=True, out=router))
            nursery.start_soon(client)
            nursery.start_soon(slow_broker)
    assert bytes(got) == answer
    assert router["stats"].reason is EndReason.CLOSED
    assert router["stats"].first_eof == "client"


async def test_tls_client_is_closed_within_the_grace():
    """A TLS client side cannot be half-closed: the broker's end closes it (close_notify) at
    once; a client that keeps writing fails well within the grace."""
    ca = trustme.CA()
    cert = ca.issue_cert("router.test")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    client_app, client_side = await _socket_pair()
    upstream_side, broker_app = await _socket_pair()
    tls_side = fastio.FastTLSStream(client_side, server_ctx, server_side=True)
    tls_app = fastio.FastTLSStream(client_app, client_ctx, server_side=False, server_hostname="router.test")
    us = fastio.FastSocketStream(upstream_side)
    router, client, broker = {}, {}, {}

    async def tls_client():
        await tls_app.do_handshake()
        client["handshaken"] = True
        await _proton_like_client(tls_app, client)

    async def router_side():
        await tls_side.do_handshake()
        router["handshaken"] = True
        await _run_router_side(tls_side, us, use_splice=True, shared_poller=False, out=router)

    with trio.fail_after(GRACE_S + 5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(router_side)
            nursery.start_soon(tls_client)
            await wait_for_async(lambda: client.get("handshaken") and router.get("handshaken"), 5,
                                 interval_s=0.01, what="the TLS handshake, both sides")
            nursery.start_soon(_broker_ends, broker_app, broker)
    assert client["received"] == len(CLOSE_FRAMES)
    assert client["failed_at"] - broker["broker_closed_at"] <= GRACE_S + 0.5
    assert router["stats"].first_eof == "upstream"


async def test_trio_streams_client_writing_as_the_broker_ends():
    """The two-task pump over trio's own streams (which allow one reader at a time), the client
    writing all the while the broker ends: the client → broker task itself runs the grace, so
    the client is read by one task only, and it is closed within the grace."""
    client_app, client_side = await _socket_pair()
    upstream_side, broker_app = await _socket_pair()
    cs = trio.SocketStream(trio.socket.from_stdlib_socket(client_side))
    us = trio.SocketStream(trio.socket.from_stdlib_socket(upstream_side))
    router, broker = {}, {}
    failed = {}

    async def chatty_client():
        stream = fastio.FastSocketStream(client_app)
        while True:
            try:
                await stream.send_all(EMPTY_FRAME)
            except trio.BrokenResourceError:
                failed["at"] = trio.current_time()
                break
            await trio.sleep(0.005)  # pacing: the client writes all the while
        stream.close()

    async def run_router():
        t0 = trio.current_time()
        router["stats"] = await proxy.pump(cs, us, idle_timeout_s=30, use_splice=False,
                                           upstream_close_grace_s=GRACE_S)
        router["pump_s"] = trio.current_time() - t0
        client_side.close()
        upstream_side.close()

    async def broker_side():
        # reads the client's frames all along; once the client's writes flow through the router
        # (20 frames) sends its Close and ends its side (a half-close: the router's writes still
        # succeed, so only the EOF tells it)
        stream = fastio.FastSocketStream(broker_app)
        drained = [0]

        async def drain():
            while data := await stream.receive_some(65536):
                drained[0] += len(data)

        async with trio.open_nursery() as inner:
            inner.start_soon(drain)
            await wait_for_async(lambda: drained[0] >= 20 * len(EMPTY_FRAME), 5, interval_s=0.01,
                                 what="the client's frames reaching the broker")
            await stream.send_all(CLOSE_FRAMES)
            await stream.send_eof()
            broker["broker_closed_at"] = trio.current_time()
        stream.close()

    with trio.fail_after(GRACE_S + 5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_router)
            nursery.start_soon(chatty_client)
            nursery.start_soon(broker_side)
    stats = router["stats"]
    assert stats.reason is EndReason.UPSTREAM_CLOSED, (stats.reason, stats.error)
    assert stats.first_eof == "upstream" and stats.dropped_up > 0
    assert failed["at"] - broker["broker_closed_at"] <= GRACE_S + 0.5
