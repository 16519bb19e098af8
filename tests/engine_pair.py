"""An in-memory proton client wired to a broker engine: bytes move between them until neither
has anything more to say (unit tests of the engine without sockets)."""

from __future__ import annotations


def pump(transport, engine, rounds: int = 20) -> None:
    """Move bytes between a client ``proton.Transport`` and an ``AmqpEngine`` until quiet."""
    for _ in range(rounds):
        moved = False
        n = transport.pending()
        if n > 0:
            data = transport.peek(n)
            transport.pop(len(data))
            engine.push(data)
            moved = True
        out = engine.take_output()
        if out:
            transport.push(out)
            moved = True
        if not moved:
            return
