"""Password logins that a flood cannot starve: the trio shell both programs share.

Theory of operation
-------------------
A SASL PLAIN login (broker or router edge) or an HTTP Basic login (either management API) goes
through :meth:`LoginGate.login`:

1. **Known good** — ``SecurityConfig.cached``: this exact login was verified before and the
   source is allowed. Answered on the event loop at once; never throttled.
2. **Throttled source** — the source (``broker.core.limits.source_key``) has
   ``refuse-after-failures`` failures within the window: refused without a hash.
3. **Remembered failure** — the same user and password failed within the window: refused
   without a hash.
4. **Verification** — ``SecurityConfig.verify`` (scrypt, ~50 ms, 16 MiB) in a thread, under the
   gate's own slots: ``max-concurrent-verifications`` at once (never trio's default thread
   limiter, which the journal flush and management use), at most ``max-pending-verifications``
   waiting. Waiters are served by their source's recent failures, fewest first, then in
   arrival order: a client with a clean record overtakes a flood. When the queue is full the
   newcomer displaces the waiter with the worst record, or is itself refused if it is the worst.

Every refusal, whatever its reason, is answered ``failure-delay-ms`` after the request arrived
(doubling per failure past ``throttle-after-failures``, up to ``max-failure-delay-ms``); the
wait costs no CPU and no thread. Throttling is logged once per source per ``log-interval-s``.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass

import trio

from broker.core.limits import FailureMemory, LoginThrottle, source_key
from broker.core.security import Principal, SecurityConfig

__all__ = ["LoginGate", "LoginResult", "LOGIN_COUNTERS"]

log = logging.getLogger("lodestone.auth")

#: counters of :attr:`LoginGate.counters` (each program exports them in /metrics)
LOGIN_COUNTERS = (
    "login_ok_cached", "login_ok_verified", "login_failed", "login_refused_throttled",
    "login_refused_remembered", "login_refused_overloaded", "login_verifications",
)


@dataclass(frozen=True)
class LoginResult:
    principal: Principal | None
    reason: str          # "ok", "bad credentials", "throttled", "overloaded"


class _Overloaded(Exception):
    pass


class _Waiter:
    __slots__ = ("key", "seq", "event", "granted", "dropped")

    def __init__(self, key: str, seq: int):
        self.key = key
        self.seq = seq
        self.event = trio.Event()
        self.granted = False
        self.dropped = False


class _FairSlots:
    """``capacity`` slots; waiters are served by ``priority_of(their source)`` (recent failures:
    fewest first, evaluated when a slot frees, so a source that starts failing while it waits
    falls back), then in arrival order. At most ``max_pending`` wait: a full queue drops its worst
    waiter for a better newcomer, else refuses the newcomer."""

    def __init__(self, capacity: int, max_pending: int, priority_of=lambda key: 0):
        self.capacity = capacity
        self.max_pending = max_pending
        self.priority_of = priority_of
        self.busy = 0
        self._waiting: list[_Waiter] = []
        self._seq = 0

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def _rank(self, w: _Waiter) -> tuple[int, int]:
        return self.priority_of(w.key), w.seq

    async def acquire(self, key: str) -> None:
        if self.busy < self.capacity and not self._waiting:
            self.busy += 1
            await trio.lowlevel.checkpoint()
            return
        self._seq += 1
        w = _Waiter(key, self._seq)
        if len(self._waiting) >= self.max_pending:
            worst = max(self._waiting, key=self._rank)
            if self._rank(worst)[0] <= self._rank(w)[0]:   # the newcomer is no better: refused
                raise _Overloaded()
            self._waiting.remove(worst)
            worst.dropped = True
            worst.event.set()
        self._waiting.append(w)
        try:
            await w.event.wait()
        except BaseException:
            if w.granted:          # granted and cancelled in the same breath: pass the slot on
                self.release()
            elif not w.dropped:
                self._waiting.remove(w)
            raise
        if w.dropped:
            raise _Overloaded()

    def release(self) -> None:
        if self._waiting:
            best = min(self._waiting, key=self._rank)
            self._waiting.remove(best)
            best.granted = True
            best.event.set()       # the slot passes to it: busy stays
        else:
            self.busy -= 1


class LoginGate:
    """One per process: every password login of the process goes through it."""

    def __init__(self, security: SecurityConfig, *, name: str = "lodestone"):
        self.security = security
        st = security.login
        self.settings = st
        capacity = st.max_concurrent_verifications or max(1, (os.cpu_count() or 2) // 2)
        self.capacity = capacity
        self.throttle = LoginThrottle(st)
        self._slots = _FairSlots(capacity, st.max_pending_verifications,
                                 lambda key: self.throttle.failures(key, trio.current_time()))
        self._limiter = trio.CapacityLimiter(capacity)   # our own threads' budget
        self.memory = FailureMemory(st.remembered_failures, st.failure_window_s)
        self.counters: Counter[str] = Counter({k: 0 for k in LOGIN_COUNTERS})
        self.name = name

    # -- the one entry point ----------------------------------------------------------------------
    async def login(self, user: str, password: str, source: str | None) -> LoginResult:
        """Check a user name and password from ``source`` (an address, ``host:port`` accepted).
        Returns when the answer may be given: a refusal only after its delay."""
        t0 = trio.current_time()
        security = self.security
        principal = security.cached(user, password, source)
        if principal is not None:
            self.counters["login_ok_cached"] += 1
            return LoginResult(principal, "ok")
        key = source_key(source)
        digest = security.digest(password)
        reason = "bad credentials"
        if self.throttle.refusing(key, t0):
            self.counters["login_refused_throttled"] += 1
            reason = "throttled"
        elif self.memory.seen(user, digest, t0):
            self.counters["login_refused_remembered"] += 1
        else:
            try:
                await self._slots.acquire(key)
            except _Overloaded:
                self.counters["login_refused_overloaded"] += 1
                reason = "overloaded"
            else:
                try:
                    self.counters["login_verifications"] += 1
                    principal = await trio.to_thread.run_sync(security.verify, user, password, source,
                                                              limiter=self._limiter)
                finally:
                    self._slots.release()
                if principal is not None:
                    self.counters["login_ok_verified"] += 1
                    return LoginResult(principal, "ok")
                self.memory.add(user, digest, trio.current_time())
        await self.failed(source, t0, reason=reason)
        return LoginResult(None, reason)

    async def failed(self, source: str | None, t0: float, *, reason: str = "bad credentials") -> None:
        """Count a refused login from ``source`` that arrived at ``t0`` (also for credentials
        checked elsewhere, e.g. a configured management password) and wait out its delay."""
        key = source_key(source)
        self.counters["login_failed"] += 1
        now = trio.current_time()
        failures = self.throttle.record_failure(key, now)
        if failures > self.settings.throttle_after_failures and self.throttle.should_log(key, now):
            log.warning("%s: %d failed logins from %s within %g s; its logins are %s", self.name,
                        failures, key, self.settings.failure_window_s,
                        "refused without a password check" if self.throttle.refusing(key, now)
                        else f"answered after {self.throttle.delay(failures):g} s")
        await trio.sleep_until(t0 + self.throttle.delay(failures))

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.counters, "verifications_running": self._slots.busy,
                "verifications_pending": self._slots.pending, "tracked_sources": len(self.throttle),
                "remembered_failures": len(self.memory)}
