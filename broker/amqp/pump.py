"""The socket pump of one AMQP engine, shared by accepted connections and dialled peers.

Theory of operation
-------------------
:func:`pump_engine` moves bytes between a trio stream and an
:class:`~broker.amqp.engine.AmqpEngine` until the engine is closed:

* the reader (this task) reads the socket dry each pass — one large ``receive_some`` — and
  pushes everything into proton; EOF becomes :meth:`AmqpEngine.close_input`;
* a writer task sends whatever proton wants to write whenever the engine (or another
  connection delivering to one of its consumers) wakes it; it ends the pump once the engine
  reports closed and its last frames (a Close with an error, say) are written;
* a ticker runs proton's timers (:meth:`AmqpEngine.tick`: idle timeout, heartbeats), and once
  this side is closing (:attr:`AmqpEngine.closing`: our Close, the idle timeout, a transport
  error) gives the whole pump ``close_grace_s`` to end: a peer across a silent partition reads
  nothing, so a writer blocked on a full send buffer would otherwise wait for TCP's own
  retransmission timeout (15 minutes and more);
* optionally an open deadline: no Open from the peer within ``open_timeout_s`` → the engine
  fails the connection with ``amqp:connection:forced`` (``on_open_timeout`` is told).

Broken/closed streams propagate to the caller (as an exception group), which owns logging and
counting them; the engine itself is not finished here (the caller does that, once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import trio

from broker.wire.io.trioutil import Wakeup
from broker.wire.sasl import NEED_DATA

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine

__all__ = ["pump_engine", "next_sasl_event", "RECV_BYTES", "CLOSE_GRACE_S"]

RECV_BYTES = 256 * 1024
CLOSE_GRACE_S = 5.0
#: what one read of the SASL exchange takes (a SASL frame is small; the rest is left over)
SASL_RECV_BYTES = 65536


async def next_sasl_event(machine, stream, recv_bytes: int = SASL_RECV_BYTES):
    """Drive a sans-IO SASL machine (``broker.wire.sasl.SaslServer`` or ``SaslClient``) over
    ``stream`` up to its next event: write what it queued, read while it needs data. Returns the
    event, or None at end of stream (the caller decides what that means in its state)."""
    while True:
        ev = machine.next_event()
        out = machine.data_to_send()
        if out:
            await stream.send_all(out)
        if ev is not NEED_DATA:
            return ev
        data = await stream.receive_some(recv_bytes)
        if not data:
            return None
        machine.receive_data(data)


async def pump_engine(engine: "AmqpEngine", stream, wakeup: Wakeup, *, leftover: bytes = b"",
                      open_timeout_s: float | None = None,
                      on_open_timeout: Callable[[], None] | None = None,
                      close_grace_s: float = CLOSE_GRACE_S) -> None:
    """Run ``engine`` over ``stream`` until it closes; ``wakeup`` must be the engine's ``wake``."""
    async with trio.open_nursery() as nursery:

        async def writer() -> None:
            while True:
                await wakeup.wait()
                if engine.dropped:  # ended without a Close (AmqpEngine.drop): nothing more is written
                    nursery.cancel_scope.cancel()
                    return
                out = engine.take_output()
                if out:
                    await stream.send_all(out)
                if engine.closed:
                    nursery.cancel_scope.cancel()
                    return

        async def ticker() -> None:
            while True:
                deadline = engine.tick(trio.current_time())
                wakeup.set()
                now = trio.current_time()
                if engine.closing:
                    # the last frames get close_grace_s to leave: across a silent partition the
                    # writer would wait forever on a full send buffer, the reader on no data
                    nursery.cancel_scope.deadline = min(nursery.cancel_scope.deadline, now + close_grace_s)
                await trio.sleep(max(deadline - now, 0.05) if deadline else 1.0)

        async def open_deadline() -> None:
            await trio.sleep(open_timeout_s)
            if engine.fail_before_open("amqp:connection:forced", f"no open frame within {open_timeout_s:g} s"):
                if on_open_timeout is not None:
                    on_open_timeout()

        nursery.start_soon(writer)
        nursery.start_soon(ticker)
        if open_timeout_s is not None and not engine.opened:
            nursery.start_soon(open_deadline)
        if leftover:
            engine.push(leftover)
            wakeup.set()
        while not engine.closed:
            data = await stream.receive_some(RECV_BYTES)
            if not data:
                engine.close_input()
                wakeup.set()
                break
            engine.push(data)
            wakeup.set()
        # let the writer flush proton's last frames (Close with an error, if any)
        await trio.sleep(close_grace_s)
        nursery.cancel_scope.cancel()
