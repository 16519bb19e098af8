"""Phase 5, the pump of a proxied connection: pass the broker's first bytes (after its SASL
outcome) to the client, then ``router.net.proxy.pump`` both ways until one side ends.

The pump owns the idle deadline (``idle_timeout_s``, re-armed lazily inside
``router.net.proxy``); it runs after the connection's phase scope, so a drain deadline of the
handlers nursery cancels it (``proxy_cancelled``). From here on the broker speaks for itself:
its Open, and its Close with its error, reach the client byte for byte; once it has ended its
stream the client gets ``upstream_close_grace_s`` (``upstream-close-grace-ms``) to close too, and
is then closed by the router (``router.net.proxy``). One routing-log ``close`` line and one
``proxy_*`` counter per connection.
"""

from __future__ import annotations

import trio

from router.net import proxy as proxy_mod
from router.net.edge.context import AcceptorSettings, ConnState

END_COUNTER = {proxy_mod.EndReason.CLOSED: "proxy_closed",
               proxy_mod.EndReason.IDLE_TIMEOUT: "proxy_idle_timeout",
               proxy_mod.EndReason.CLIENT_ERROR: "proxy_client_error",
               proxy_mod.EndReason.UPSTREAM_ERROR: "proxy_upstream_error",
               proxy_mod.EndReason.UPSTREAM_CLOSED: "proxy_upstream_closed",
               proxy_mod.EndReason.CANCELLED: "proxy_cancelled"}


async def run_pump(s: AcceptorSettings, c: ConnState, on_closed, *, result: proxy_mod.PumpStats | None = None,
                   state=None) -> None:
    """Pump ``c.client`` ↔ ``c.upstream``; ``on_closed(c, PumpStats)`` once, however it ends
    (also when cancelled; the cancellation then goes on up). ``result`` and ``state``: the
    counts so far and where a ``proxy_mod.Relay`` handed the connection over."""
    result = result if result is not None else proxy_mod.PumpStats()
    try:
        if c.leftover:
            # the broker's bytes after its sasl-outcome (its AMQP header + Open, usually)
            try:
                await c.client.send_all(c.leftover)
            except trio.BrokenResourceError as exc:
                result.reason = proxy_mod.EndReason.CLIENT_ERROR
                result.error = f"client: send {exc}"
                on_closed(c, result)
                return
            result.bytes_down += len(c.leftover)
        await proxy_mod.pump(c.client, c.upstream, idle_timeout_s=s.idle_timeout_s,
                             chunk_bytes=s.chunk_bytes, use_splice=s.use_splice, stats=result,
                             upstream_close_grace_s=s.upstream_close_grace_s, state=state)
    except BaseException as exc:
        # drain deadline / shutdown: a bare Cancelled from the one-task pump, or a group of
        # them from the two-task pump's nursery (trio's strict exception groups)
        if isinstance(exc, trio.Cancelled) or (isinstance(exc, BaseExceptionGroup)
                                               and exc.split(trio.Cancelled)[1] is None):
            result.reason = proxy_mod.EndReason.CANCELLED
            on_closed(c, result)
        raise
    on_closed(c, result)
