"""The remote sticky-cache tiers behind one interface: Redis, and the supervisor's cache of a
multi-worker router (the *shared* tier).

``RouterService`` keeps its local tier (``router.core.cache.StickyCache``) in front and, on a
local miss, asks a :class:`RemoteTier` once; decisions and access times are written behind in
batches. Both tiers answer the same async calls, each under the deadline the caller gives:

* ``get(key, timeout_s)`` → the identity stored for ``key`` or None;
* ``write(puts, touches, deletes, timeout_s)`` → ``{key: identity}`` of puts that lost the
  compare-and-set (``puts`` = (key, identity, replaced identity or ""));
* ``ping(timeout_s)``; ``run()`` (background work until cancelled, if any); ``aclose()``.

Every failure is a ``CacheBackendError`` (``CacheBackendTimeout`` for a missed deadline, whose
``silent`` says whether it looks like an outage — nothing answered — rather than a late reply),
so the service degrades to its local tier and never fails a connection. ``name`` is the counter
prefix and the routing log's ``cache_tier``; ``claims`` says that a new decision is claimed at
the tier before the client gets it (the shared tier: one owner, so every worker agrees at once).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import trio

from router.errors import CacheBackendError, CacheBackendTimeout
from router.control import SharedCacheTier

log = logging.getLogger("lodestone.router.service")

READ_TIMEOUTS_TO_DEGRADE = 3  # threaded Redis reads: this many timeouts in a row are an outage


class RemoteTier(Protocol):
    name: str
    claims: bool

    async def get(self, key: str, timeout_s: float) -> str | None: ...

    async def write(self, puts, touches, deletes, timeout_s: float) -> dict[str, str]: ...

    async def ping(self, timeout_s: float) -> None: ...

    async def run(self) -> None: ...

    async def aclose(self) -> None: ...


async def _call(tier: str, router: str, fn, *args, timeout_s: float, thread: bool):
    """``fn(*args)`` under ``timeout_s`` (in a worker thread for a blocking client); anything
    but ``CacheBackendError`` from the client is a bug there, turned into one (it must not fail
    a connection)."""
    with trio.move_on_after(timeout_s) as cs:
        try:
            if thread:
                return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
            return await fn(*args)
        except CacheBackendError:
            raise
        except Exception as exc:
            log.exception("router %s: unexpected error from the %s client", router, tier)
            raise CacheBackendError(f"{tier} client error: {type(exc).__name__}: {exc}") from exc
    assert cs.cancelled_caught
    raise CacheBackendTimeout(f"{tier} timeout after {timeout_s * 1000:.0f} ms")


class RedisTier:
    """Redis (``router.cache_redis.RedisCache`` or anything with its blocking ``get``/``write``/
    ``ping``/``close``): reads on the client's thread-free pipelined ``reader`` when it has one,
    else in a worker thread; writes and pings in a worker thread."""

    name = "redis"
    claims = False

    def __init__(self, client: Any, router: str) -> None:
        self.client = client
        self.router = router
        self.reader = getattr(client, "reader", None)
        self._timeouts_in_row = 0
        self._closed = False

    async def get(self, key: str, timeout_s: float) -> str | None:
        try:
            if self.reader is not None:  # its own deadline: it tells a late task from a late reply
                value = await self.reader.get(key, timeout_s)
            else:
                value = await _call("redis", self.router, self.client.get, key, timeout_s=timeout_s,
                                    thread=True)
        except CacheBackendTimeout as exc:
            # A late answer is not an outage: the pipelined reader knows whether Redis answered
            # nothing at all while this read waited (``silent``); the threaded client cannot
            # tell, so only READ_TIMEOUTS_TO_DEGRADE timeouts in a row count as one.
            self._timeouts_in_row += 1
            if self.reader is None:
                exc.silent = self._timeouts_in_row >= READ_TIMEOUTS_TO_DEGRADE
            elif not hasattr(exc, "silent"):
                exc.silent = True
            raise
        self._timeouts_in_row = 0
        return value

    async def write(self, puts, touches, deletes, timeout_s: float) -> dict[str, str]:
        return await _call("redis", self.router, self.client.write, puts, touches, deletes,
                           timeout_s=timeout_s, thread=True)

    async def ping(self, timeout_s: float) -> None:
        await _call("redis", self.router, self.client.ping, timeout_s=timeout_s, thread=True)

    async def run(self) -> None:
        if self.reader is not None:
            await self.reader.run()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.reader is not None:
            with trio.CancelScope(shield=True):
                await self.reader.aclose()
        self.client.close()


class SharedTier:
    """The supervisor's cache, seen from a worker (``router.control.SharedCacheTier`` over the
    control channel): async already, no thread; every timeout is an outage (same machine)."""

    name = "shared"
    claims = True

    def __init__(self, link: Any, router: str) -> None:

        self.client = SharedCacheTier(link, router)
        self.router = router

    async def get(self, key: str, timeout_s: float) -> str | None:
        return await _call("shared", self.router, self.client.get, key, timeout_s=timeout_s, thread=False)

    async def write(self, puts, touches, deletes, timeout_s: float) -> dict[str, str]:
        return await _call("shared", self.router, self.client.write, puts, touches, deletes,
                           timeout_s=timeout_s, thread=False)

    async def ping(self, timeout_s: float) -> None:
        await _call("shared", self.router, self.client.ping, timeout_s=timeout_s, thread=False)

    async def run(self) -> None:
        return None  # the link is the worker's; nothing runs per tier

    async def aclose(self) -> None:
        self.client.close()
