"""Phase 4a, the last frames the router itself writes: an Artemis-style redirect or a refusal,
then the linger.

The redirect is an Open with ``amqp:connection-establishment-failed`` + a Close
``amqp:connection:redirect`` with ``network-host``/``port`` (``broker.wire.frames``); a refusal
is the same Open + a Close with the error's condition (``router.net.edge.errors``). After them
the router half-closes and reads until the client's Close/EOF, so the frames are not lost to a
reset; ``Acceptor`` bounds that linger with ``close_linger_s`` (phase LINGER).
"""

from __future__ import annotations

import trio

from broker.wire.frames import artemis_redirect_description, redirect_frames
from router.net.edge.context import RECEIVE_BYTES


def redirect_reply(router: str, target) -> bytes:
    """The bytes that redirect a client to ``target`` (AMQP header, Open, Close)."""
    text = artemis_redirect_description(router, target.host, target.port)
    return redirect_frames(target.host, target.port, text)


async def send_last(client: trio.abc.Stream, data: bytes) -> None:
    """Write our last frames and half-close (TLS streams cannot: they keep reading)."""
    await client.send_all(data)
    if isinstance(client, trio.abc.HalfCloseableStream):
        await client.send_eof()


async def read_until_eof(client: trio.abc.Stream) -> None:
    """Read (and drop) what the client still sends, up to its EOF."""
    while await client.receive_some(RECEIVE_BYTES):
        pass
