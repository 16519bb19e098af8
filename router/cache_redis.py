"""Redis tier of the sticky cache, shared by every router replica (redis-py, blocking calls).

The shell calls these methods from worker threads (``trio.to_thread.run_sync``) under a short
deadline; every Redis error surfaces as ``CacheBackendError`` and the router carries on from its
local tier (degraded). Keys are ``<prefix><router>:<key>``; values are target identities (node
ids). Expiry is Redis's: ``PX timeout`` on write, ``GETEX PX`` on read and batched ``PEXPIRE``
for keys hit in the local tier (expire after access); ``timeout = 0`` means no TTL.

Writes use a compare-and-set script so replicas converge: a write wins only if the key is
absent, already holds our value, or holds the value we replaced (a dead node); otherwise Redis
keeps the other replica's choice and returns it, and the caller adopts it locally.
"""

from __future__ import annotations

from typing import Iterable

import redis

from router.errors import CacheBackendError

_CAS = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] or cur == ARGV[2] then
  if ARGV[3] ~= '0' then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  else
    redis.call('SET', KEYS[1], ARGV[1])
  end
  return false
end
if ARGV[3] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return cur
"""


class RedisCache:
    """Blocking Redis client for one router's shared cache."""

    def __init__(self, url: str, *, router: str, prefix: str = "lodestone:",
                 timeout_ms: int = 0, socket_timeout_s: float = 0.25) -> None:
        self.prefix = f"{prefix}{router}:"
        self.timeout_ms = timeout_ms
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            decode_responses=True, retry_on_timeout=False, health_check_interval=0,
            encoding_errors="surrogatepass")  # keys are Python str: lone surrogates round trip
        self._cas = self.client.register_script(_CAS)

    def _k(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str) -> str | None:
        """The identity stored for ``key`` (refreshing its TTL), or None."""
        try:
            if self.timeout_ms:
                return self.client.getex(self._k(key), px=self.timeout_ms)
            return self.client.get(self._k(key))
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis GET failed: {exc}") from exc

    def write(self, puts: Iterable[tuple[str, str, str]], touches: Iterable[str],
              deletes: Iterable[str]) -> dict[str, str]:
        """One pipelined batch: ``puts`` = (key, identity, replaced identity or "").

        Returns ``{key: identity}`` for puts that lost to another replica's live value.
        """
        puts = list(puts)
        px = str(self.timeout_ms)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, ident, old in puts:
                self._cas(keys=[self._k(key)], args=[ident, old or "", px], client=pipe)
            if self.timeout_ms:
                for key in touches:
                    pipe.pexpire(self._k(key), self.timeout_ms)
            for key in deletes:
                pipe.delete(self._k(key))
            results = pipe.execute()
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis write failed: {exc}") from exc
        return {key: res for (key, _, _), res in zip(puts, results) if res}

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis PING failed: {exc}") from exc

    def entries(self, limit: int = 1000) -> dict[str, str]:
        """Up to ``limit`` shared entries (management/debug)."""
        try:
            out = {}
            for k in self.client.scan_iter(match=self.prefix + "*", count=200):
                v = self.client.get(k)
                if v is not None:
                    out[k[len(self.prefix):]] = v
                if len(out) >= limit:
                    break
            return out
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis SCAN failed: {exc}") from exc

    def close(self) -> None:
        try:
            self.client.close()
        except redis.RedisError:
            pass
