"""Password logins that a flood cannot starve: the trio shell both programs share.

Theory of operation
-------------------
A SASL PLAIN login (broker or router edge) or an HTTP Basic login (either management API) goes
through :meth:`LoginGate.login`:

1. **Known good** — ``SecurityConfig.cached``: this exact login was verified before and the
   source is allowed. Answered on the event loop at once; never throttled.
2. **Throttled source** — the source (``broker.wire.limits.source_key``) has
   ``refuse-after-failures`` failures within the window, or is past ``throttle-after-failures``
   and already had its one password check for the current delay: refused without a hash.
3. **Remembered failure** — the same user and password failed from the same source within the
   window: refused without a hash (per source: a login refused for its source address must not
   shadow the same credentials from an allowed one).
4. **One check per credentials at a time** — a login whose user and password are being verified
   for another login right now waits for that check and takes its answer from the cache
   (``login_ok_cached``); a failed or source-refused check sends it on to its own. A fleet that
   reconnects at once with one account (after a restart) costs one hash, not one per client.
5. **Verification** — ``SecurityConfig.verify`` (scrypt, ~50 ms, 16 MiB) in a thread, under the
   gate's own slots: ``max-concurrent-verifications`` at once, plus one slot that only a source
   that is not suspect may use, at most ``max-pending-verifications`` waiting. A source's
   *suspicion* is its failures in the window plus its other logins waiting or hashing right
   now (a flood opens many at once; a client logs in once). Waiters are served least suspect
   first, re-ranked whenever a slot frees, then in arrival order: a client with a clean record
   overtakes a flood. The hashes run on the gate's own threads (never trio's shared thread
   cache, which the journal flush uses); a suspect source's at a lower scheduling priority
   (nice +10), so they get only the CPU the event loops and clean logins leave and a flood of
   hashes cannot slow the clients already connected. When the queue is full the
   newcomer displaces the waiter with the worst record, or is itself refused if it is the worst.

Every refusal, whatever its reason, is answered ``failure-delay-ms`` after the request arrived
(doubling per failure past ``throttle-after-failures``, up to ``max-failure-delay-ms``); the
wait costs no CPU and no thread. Throttling is logged once per source per ``log-interval-s``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import trio

from broker.wire.limits import FailureMemory, LoginThrottle, source_key
from broker.wire.io.users import Principal, SecurityConfig

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

    def __init__(self, capacity: int, max_pending: int, priority_of=lambda key: 0, reserved: int = 0):
        self.capacity = capacity
        self.reserved = reserved   # extra slots only a clean source (priority 0) may take
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

    def _free_for(self, priority: int) -> bool:
        return self.busy < self.capacity + (self.reserved if priority == 0 else 0)

    async def acquire(self, key: str) -> None:
        priority = self.priority_of(key)
        # straight in when a slot is free for us: nobody waits, or we are clean and a reserved
        # slot is free (a waiter that could use a free slot would already have it)
        if self._free_for(priority) and (not self._waiting or priority == 0):
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
        self.busy -= 1
        while self._waiting:
            best = min(self._waiting, key=self._rank)
            if not self._free_for(self._rank(best)[0]):
                break
            self._waiting.remove(best)
            best.granted = True
            self.busy += 1
            best.event.set()


HASH_THREAD_NICE = 10   # hashing threads yield the CPU to the event loops (Linux: per thread)


def _background_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HASH_THREAD_NICE)
    except (OSError, AttributeError):   # not permitted / not Linux: normal priority
        pass


class _HashExecutor:
    """The gate's own threads (never trio's shared thread cache), ``workers`` at most; with
    ``background`` each runs at a lower scheduling priority, so its hashes only get the CPU
    the event loops leave."""

    def __init__(self, workers: int, *, background: bool):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lodestone-hash",
                                        initializer=_background_priority if background else None)

    async def run(self, fn, *args):
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        fut = self._pool.submit(fn, *args)
        fut.add_done_callback(lambda _f: token.run_sync_soon(done.set))
        # a hash is short and holds a slot: wait for it even when cancelled, so the slot count
        # never runs ahead of the threads actually hashing
        with trio.CancelScope(shield=True):
            await done.wait()
        return fut.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class LoginGate:
    """One per process: every password login of the process goes through it."""

    def __init__(self, security: SecurityConfig, *, name: str = "lodestone"):
        self.security = security
        st = security.login
        self.settings = st
        capacity = st.max_concurrent_verifications or max(1, (os.cpu_count() or 2) // 2)
        self.capacity = capacity
        self.throttle = LoginThrottle(st)
        # one more slot than the capacity, for sources without a failure in the window: a
        # good client's first login never queues behind a flood's hash
        self._inflight: Counter[str] = Counter()   # verifications per source, waiting or hashing
        #: (user, password digest) being verified now -> set once it is done (one hash for a
        #: burst of logins with the same credentials)
        self._flights: dict[tuple[str, bytes], trio.Event] = {}
        self._slots = _FairSlots(capacity, st.max_pending_verifications, self._suspicion, reserved=1)
        # a source with failures in the window hashes at a low priority; a clean one does not
        self._hasher = _HashExecutor(capacity + 1, background=False)
        self._suspect_hasher = _HashExecutor(capacity, background=True)
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
        if self.throttle.refusing(key, t0) or not self.throttle.may_verify(key, t0):
            self.counters["login_refused_throttled"] += 1
            reason = "throttled"
        elif self.memory.seen(f"{key}\0{user}", digest, t0):
            self.counters["login_refused_remembered"] += 1
        else:
            flight = self._flights.get((user, digest))
            if flight is not None:
                # the same credentials are being checked right now (a fleet reconnecting with
                # one account): wait for that one hash instead of making another
                await flight.wait()
                principal = security.cached(user, password, source)
                if principal is not None:
                    self.counters["login_ok_cached"] += 1
                    return LoginResult(principal, "ok")
                # that check failed, or this source may not use the account: its own check
            self._inflight[key] += 1
            own = (user, digest) not in self._flights
            if own:
                flight = self._flights[(user, digest)] = trio.Event()
            try:
                principal = await self._verify(key, user, password, source)
            except _Overloaded:
                self.counters["login_refused_overloaded"] += 1
                reason = "overloaded"
            finally:
                self._inflight[key] -= 1
                if not self._inflight[key]:
                    del self._inflight[key]
                if own:
                    del self._flights[(user, digest)]
                    flight.set()
            if principal is not None:
                self.counters["login_ok_verified"] += 1
                return LoginResult(principal, "ok")
            if reason != "overloaded":
                self.memory.add(f"{key}\0{user}", digest, trio.current_time())
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

    async def _verify(self, key: str, user: str, password: str, source: str | None) -> Principal | None:
        """One password check under the slots (raises ``_Overloaded`` when refused a place)."""
        await self._slots.acquire(key)
        try:
            principal = self.security.cached(user, password, source)
            if principal is not None:    # verified by another login while this one waited
                return principal
            self.counters["login_verifications"] += 1
            hasher = self._hasher if self._suspicion(key) == 0 else self._suspect_hasher
            return await hasher.run(self.security.verify, user, password, source)
        finally:
            self._slots.release()

    def _suspicion(self, key: str) -> int:
        """How suspect a source's login is: its failures in the window, plus its other logins
        waiting or hashing right now (a flood opens many at once; a client logs in once). 0 =
        clean: may use the reserved slot, and hashes at normal priority."""
        return self.throttle.failures(key, trio.current_time()) + max(0, self._inflight[key] - 1)

    # -- introspection ----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.counters, "verifications_running": self._slots.busy,
                "verifications_pending": self._slots.pending, "tracked_sources": len(self.throttle),
                "remembered_failures": len(self.memory)}
