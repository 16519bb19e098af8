"""``router.net.proxy.Relay`` and ``RelayKeeper``: a plain connection's first phase with no task of
its own, over real loopback TCP pairs and a real shared poller. How it ends (closed, idle,
cancelled, broken), that it hands over to the two-task pump with the bytes it could not write,
and that its ``on_end`` runs exactly once."""

from __future__ import annotations

import pytest
import trio

from router.net import proxy as proxy_mod
from router.net.proxy import EndReason, PumpStats, Relay
from tests.unit.router.net.test_proxy import _pair


class _Ends:
    def __init__(self) -> None:
        self.ended: list[PumpStats] = []
        self.resumed: list = []

    def on_end(self, stats: PumpStats) -> None:
        self.ended.append(stats)

    async def resume(self, state) -> None:
        self.resumed.append(state)


_OPEN: list = []     # every stream a test made: closed when it ends (no socket left to the GC)


async def _relay(nursery, poller, idle: float | None = None, *, start: bool = True):
    client_app, client_side = await _pair()
    upstream_side, broker_app = await _pair()
    _OPEN.extend((client_app, client_side, upstream_side, broker_app))
    keeper = poller.keeper
    keeper.nursery = nursery
    ends = _Ends()
    relay = Relay(poller, keeper, client_side.socket._sock, upstream_side.socket._sock, PumpStats(), idle,
                  ends.on_end, ends.resume)
    if start:
        relay.start()
    return client_app, broker_app, relay, ends, (client_side, upstream_side)


@pytest.fixture(autouse=True)
def _close_streams():
    yield
    while _OPEN:
        _OPEN.pop().socket._sock.close()     # the trio run is over: the stdlib socket under it


async def _until(cond, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not cond():
            await trio.sleep(0.01)


async def test_bytes_both_ways_then_both_ends_close():
    async with trio.open_nursery() as nursery:
        poller = proxy_mod.SharedPoller()
        await nursery.start(poller.run)
        client, broker, relay, ends, _ = await _relay(nursery, poller)
        await client.send_all(b"hello broker")
        assert await broker.receive_some(100) == b"hello broker"
        await broker.send_all(b"hello client")
        assert await client.receive_some(100) == b"hello client"
        await client.send_eof()                  # the client ends first: passed on, half-closed
        assert await broker.receive_some(100) == b""
        await broker.send_all(b"last words")     # the other direction keeps flowing
        assert await client.receive_some(100) == b"last words"
        await broker.send_eof()
        assert await client.receive_some(100) == b""
        await _until(lambda: ends.ended)
        (stats,) = ends.ended
        assert (stats.reason, stats.first_eof, stats.bytes_up, stats.bytes_down) == \
            (EndReason.CLOSED, "client", 12, 22)
        assert not poller.keeper.relays and not ends.resumed
        nursery.cancel_scope.cancel()


async def test_an_idle_relay_ends_idle_and_the_keeper_with_it():
    async with trio.open_nursery() as nursery:
        poller = proxy_mod.SharedPoller()
        await nursery.start(poller.run)
        client, broker, relay, ends, _ = await _relay(nursery, poller, idle=0.3)
        t0 = trio.current_time()
        await _until(lambda: ends.ended)
        took = trio.current_time() - t0
        assert ends.ended[0].reason is EndReason.IDLE_TIMEOUT
        assert 0.3 <= took <= 0.3 + 0.3 / 8 + 0.1, took     # idle, plus at most one sweep
        await _until(lambda: not poller.keeper._running)      # no relay left: no keeper task
        nursery.cancel_scope.cancel()


async def test_a_cancelled_nursery_ends_every_relay_once_as_cancelled():
    poller = proxy_mod.SharedPoller()
    ends_all = []
    with trio.CancelScope() as outer:
        async with trio.open_nursery() as system:
            await system.start(poller.run)
            async with trio.open_nursery() as handlers:
                for _ in range(3):
                    ends_all.append((await _relay(handlers, poller))[3])
                handlers.cancel_scope.cancel()         # a drain's deadline
            assert [[s.reason for s in e.ended] for e in ends_all] == [[EndReason.CANCELLED]] * 3
            outer.cancel()


async def test_a_broker_that_ends_first_and_bulk_hand_over_to_the_pump():
    async with trio.open_nursery() as nursery:
        poller = proxy_mod.SharedPoller()
        await nursery.start(poller.run)
        client, broker, relay, ends, _ = await _relay(nursery, poller)
        await broker.send_eof()                  # the broker first: the client's grace is the pump's
        await _until(lambda: ends.resumed)
        assert ends.resumed[0] == ((False, b"", False), (True, b"", False)) and not ends.ended
        assert relay not in poller.keeper.relays

        client, broker, relay, ends, _ = await _relay(nursery, poller)
        nursery.start_soon(client.send_all, b"x" * (1 << 20))   # a full read: bulk, the pump splices
        await _until(lambda: ends.resumed)
        up, down = ends.resumed[0]
        assert up[2] is True and down == (False, b"", False)
        nursery.cancel_scope.cancel()


async def test_a_reset_ends_the_relay_as_broken():
    async with trio.open_nursery() as nursery:
        poller = proxy_mod.SharedPoller()
        await nursery.start(poller.run)
        client, broker, relay, ends, _ = await _relay(nursery, poller)
        import socket
        import struct
        client.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await client.aclose()                     # a TCP reset
        await _until(lambda: ends.ended)
        assert ends.ended[0].reason is EndReason.CLIENT_ERROR and len(ends.ended) == 1
        nursery.cancel_scope.cancel()


async def test_an_owner_that_fails_while_ending_one_relay_stops_no_other():
    """``on_end`` raising (a bug in one connection's bookkeeping) is logged; the keeper's sweep
    and the dispatcher go on serving the other relays."""
    async with trio.open_nursery() as nursery:
        poller = proxy_mod.SharedPoller()
        await nursery.start(poller.run)
        _, _, bad, bad_ends, _ = await _relay(nursery, poller, idle=0.05)

        def explode(stats):
            bad_ends.ended.append(stats)
            raise RuntimeError("bookkeeping bug")
        bad.on_end = explode
        client, broker, good, good_ends, _ = await _relay(nursery, poller)
        await _until(lambda: bad_ends.ended)      # the idle sweep ended it, and survived its owner
        assert bad_ends.ended[0].reason is EndReason.IDLE_TIMEOUT
        await client.send_all(b"still here")      # the dispatcher still serves the other relay
        assert await broker.receive_some(100) == b"still here"
        assert good in poller.keeper.relays and not good_ends.ended
        nursery.cancel_scope.cancel()
    assert good_ends.ended[0].reason is EndReason.CANCELLED


async def test_a_bug_in_the_first_phase_ends_that_relay_as_an_internal_error():
    async with trio.open_nursery() as nursery:
        poller = proxy_mod.SharedPoller()
        await nursery.start(poller.run)
        client, _, relay, ends, _ = await _relay(nursery, poller)

        def broken_refresh():
            raise ValueError("a bug")
        relay.phase.refresh = broken_refresh      # called on every read that carried bytes
        await client.send_all(b"x")
        await _until(lambda: ends.ended)
        (stats,) = ends.ended
        assert (stats.reason, stats.error) == (EndReason.CANCELLED, proxy_mod.INTERNAL_ERROR)
        assert not poller.keeper.relays and not poller._owners
        nursery.cancel_scope.cancel()


async def test_a_failed_start_leaves_nothing_registered():
    async with trio.open_nursery() as nursery:
        poller = proxy_mod.SharedPoller()
        await nursery.start(poller.run)
        client_app, _, relay, ends, _ = await _relay(nursery, poller, start=False)
        keeper = poller.keeper
        keeper.nursery = None                      # keeper.add cannot start its task: raises
        with pytest.raises(AttributeError):
            relay.start()
        relay.abandon()
        assert not poller._owners and not keeper.relays and not ends.ended
        await client_app.send_all(b"x")            # nothing fires for it any more
        await trio.sleep(0.05)
        assert not ends.ended
        nursery.cancel_scope.cancel()
