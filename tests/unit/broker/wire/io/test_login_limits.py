"""Per-source admission and login throttling: the pure tables (broker.wire.limits) and the
shared login gate (broker.wire.io.login) over a real users file."""

from __future__ import annotations

import time

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from broker.wire.io.login import LoginGate, _FairSlots, _Overloaded
from broker.wire.limits import (
    Admission,
    FailureMemory,
    LoginSettings,
    LoginThrottle,
    OncePer,
    SourceLimiter,
    SourceLimits,
    source_key,
)
from broker.wire.io.users import SecurityConfig, User, hash_password, load_users
from broker.wire.io.tomlconfig import ConfigError
from tests.waiting import wait_for_async


# -- source keys -------------------------------------------------------------------------------

@pytest.mark.parametrize("source, key", [
    ("127.0.0.1", "127.0.0.1"),
    ("127.0.0.2:5672", "127.0.0.2"),
    ("[::1]:5672", "::/64"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
    ("[2001:db8:1:2:ffff::9]:1", "2001:db8:1:2::/64"),
    ("::ffff:10.1.2.3", "10.1.2.3"),
    (None, "?"),
    ("not an address", "not an address"),
])
def test_source_key(source, key):
    assert source_key(source) == key


# -- SourceLimiter -------------------------------------------------------------------------------

def test_connections_per_source_counted_and_released():
    lim = SourceLimiter(SourceLimits(max_connections_per_source=2, max_unauthenticated_per_source=0,
                                     max_refusing_per_source=1))
    assert lim.admit("a", 0)[0] is Admission.ADMIT
    assert lim.admit("a", 0)[0] is Admission.ADMIT
    assert lim.admit("a", 0) == (Admission.REFUSE, "source_connections")
    assert lim.admit("a", 0) == (Admission.DROP, "source_connections")    # one refusal in flight
    assert lim.admit("b", 0)[0] is Admission.ADMIT                         # other sources unaffected
    lim.release_refusal("a")
    lim.release("a", authenticated=False)
    assert lim.admit("a", 0)[0] is Admission.ADMIT


def test_unauthenticated_per_source():
    lim = SourceLimiter(SourceLimits(max_connections_per_source=0, max_unauthenticated_per_source=2))
    lim.admit("a", 0)
    lim.admit("a", 0)
    assert lim.admit("a", 0) == (Admission.REFUSE, "source_unauthenticated")
    lim.release_refusal("a")
    lim.authenticated("a")                     # one finished SASL: a slot for another handshake
    assert lim.admit("a", 0)[0] is Admission.ADMIT
    assert lim.snapshot("a") == {"connections": 3, "unauthenticated": 2, "refusing": 0}
    lim.release("a", authenticated=True)
    lim.release("a", authenticated=False)
    lim.release("a", authenticated=False)
    assert lim.snapshot("a") == {"connections": 0, "unauthenticated": 0, "refusing": 0}


def test_rate_per_source_token_bucket():
    lim = SourceLimiter(SourceLimits(max_connections_per_source=0, max_unauthenticated_per_source=0,
                                     max_connection_rate_per_source=10))
    admitted = sum(lim.admit("a", 0.0)[0] is Admission.ADMIT for _ in range(30))
    assert admitted == 10                      # a burst of one second's worth
    assert lim.admit("a", 0.05)[1] == "source_rate"
    assert lim.admit("a", 0.2)[0] is Admission.ADMIT   # 0.2 s refills two tokens
    assert lim.admit("b", 0.0)[0] is Admission.ADMIT


def test_acceptor_wide_refusals_share_the_refusing_budget():
    lim = SourceLimiter(SourceLimits(max_refusing_per_source=2))
    assert lim.refuse("a", 0) is Admission.REFUSE
    assert lim.refuse("a", 0) is Admission.REFUSE
    assert lim.refuse("a", 0) is Admission.DROP


def test_limiter_table_is_bounded_and_keeps_busy_sources():
    lim = SourceLimiter(SourceLimits(max_connections_per_source=1), max_tracked=100)
    lim.admit("busy", 0)
    for i in range(1000):
        k = f"10.0.{i // 256}.{i % 256}"
        lim.admit(k, 0)
        lim.release(k, authenticated=False)
    assert len(lim) <= 101
    assert lim.admit("busy", 1) == (Admission.REFUSE, "source_connections")   # not forgotten


# -- LoginThrottle / FailureMemory / OncePer ------------------------------------------------------

def test_throttle_delay_grows_then_refuses_then_forgets():
    st = LoginSettings(failure_delay_s=0.25, max_failure_delay_s=2.0, throttle_after_failures=3,
                       refuse_after_failures=6, failure_window_s=60)
    th = LoginThrottle(st)
    delays = [th.delay(th.record_failure("a", float(i))) for i in range(6)]
    assert delays == [0.25, 0.25, 0.25, 0.5, 1.0, 2.0]
    assert th.refusing("a", 6.0)
    assert not th.refusing("b", 6.0)
    assert th.failures("a", 60.5) == 5        # the first (t=0) aged out of the window
    assert not th.refusing("a", 60.5)
    assert th.failures("a", 200.0) == 0
    assert len(th) == 0


def test_a_throttled_source_gets_one_password_check_per_delay():
    st = LoginSettings(failure_delay_s=0.25, max_failure_delay_s=4.0, throttle_after_failures=2,
                       refuse_after_failures=0)
    th = LoginThrottle(st)
    assert th.may_verify("a", 0.0) and th.may_verify("a", 0.0)     # below the threshold: free
    th.record_failure("a", 0.0)
    th.record_failure("a", 0.0)
    assert th.may_verify("a", 1.0)          # the one check of this delay (next failure: 0.5 s)
    assert not th.may_verify("a", 1.2)
    assert th.may_verify("a", 1.5)
    assert th.may_verify("b", 1.5)           # other sources unaffected


def test_throttle_tracks_a_bounded_number_of_sources():
    th = LoginThrottle(LoginSettings(max_tracked_sources=16))
    for i in range(1000):
        th.record_failure(f"s{i}", 0.0)
    assert len(th) == 16


def test_failure_memory_expires_and_is_bounded():
    m = FailureMemory(max_entries=3, ttl_s=10)
    m.add("u", b"1", 0)
    assert m.seen("u", b"1", 5)
    assert not m.seen("u", b"2", 5)
    assert not m.seen("u", b"1", 10.5)
    for i in range(10):
        m.add("u", bytes([i]), 0)
    assert len(m) == 3


def test_once_per():
    once = OncePer(10)
    assert once("k", 0) and not once("k", 5) and once("k", 10) and once("j", 10)


def test_login_table_is_read_and_checked(tmp_path):
    h = hash_password("pw", n=1024)
    f = tmp_path / "users.toml"
    f.write_text(f'[users.u]\npassword = "{h}"\n[login]\nfailure-delay-ms = 100\n'
                 'throttle-after-failures = 2\nrefuse-after-failures = 4\nmax-concurrent-verifications = 3\n')
    sec = load_users(f)
    assert sec.login.failure_delay_s == 0.1
    assert (sec.login.throttle_after_failures, sec.login.refuse_after_failures) == (2, 4)
    assert sec.login.max_concurrent_verifications == 3
    f.write_text(f'[users.u]\npassword = "{h}"\n[login]\nrefuse-after-failures = 3\n')
    with pytest.raises(ConfigError, match=r"login.refuse-after-failures: 3 must be 0 \(never\) or > "):
        load_users(f)
    f.write_text(f'[users.u]\npassword = "{h}"\n[login]\nfailure-delay = 3\n')
    with pytest.raises(ConfigError, match="failure-delay"):
        load_users(f)


# -- the fair verification slots -----------------------------------------------------------------

async def test_fair_slots_serve_the_cleanest_source_first():
    failures = {"good": 0}
    slots = _FairSlots(capacity=1, max_pending=10, priority_of=lambda key: failures.get(key, 9))
    order = []
    first_done = trio.Event()

    async def user(name, priority):
        await slots.acquire(name)
        order.append(name)
        if name == "first":
            await first_done.wait()   # holds the slot until every other one is queued
        else:
            await trio.sleep(0.01)    # pacing, not a wait: held a moment, as a hash holds it
        slots.release()

    async with trio.open_nursery() as n:
        # each one is queued (blocked in acquire) before the next comes: arrival order is
        # what the test says, however slow the machine (no wall-clock sleeps)
        n.start_soon(user, "first", 9)
        await wait_all_tasks_blocked()
        assert order == ["first"] and slots.pending == 0
        for i in range(3):
            n.start_soon(user, f"flood{i}", 9)
            await wait_all_tasks_blocked()
            assert slots.pending == i + 1
        n.start_soon(user, "good", 0)
        await wait_all_tasks_blocked()
        assert slots.pending == 4 and order == ["first"]
        first_done.set()
    assert order[0] == "first" and order[1] == "good"
    assert order[2:] == ["flood0", "flood1", "flood2"]


async def test_fair_slots_full_queue_drops_the_worst():
    slots = _FairSlots(capacity=1, max_pending=2, priority_of=lambda key: 0 if key == "good" else 5)
    results = {}
    holder_done = trio.Event()

    async def user(name, priority):
        try:
            await slots.acquire(name)
        except _Overloaded:
            results[name] = "overloaded"
            return
        results[name] = "ran"
        if name == "holder":
            await holder_done.wait()   # holds the slot until every other one has arrived
        else:
            await trio.sleep(0.01)     # pacing, not a wait: held a moment, as a hash holds it
        slots.release()

    async with trio.open_nursery() as n:
        # each one has arrived (queued, or refused) before the next comes: no wall-clock sleeps
        n.start_soon(user, "holder", 5)
        await wait_all_tasks_blocked()
        n.start_soon(user, "flood-a", 5)
        await wait_all_tasks_blocked()
        n.start_soon(user, "flood-b", 5)
        await wait_all_tasks_blocked()
        assert slots.pending == 2
        n.start_soon(user, "flood-c", 5)       # no better than the worst waiting: refused
        await wait_all_tasks_blocked()
        n.start_soon(user, "good", 0)          # better: displaces the newest worst (flood-b)
        await wait_all_tasks_blocked()
        holder_done.set()
    assert results == {"holder": "ran", "flood-a": "ran", "flood-b": "overloaded",
                       "flood-c": "overloaded", "good": "ran"}
    assert slots.busy == 0 and slots.pending == 0


async def test_fair_slots_rank_waiters_when_the_slot_frees():
    failures = {"a": 0, "b": 0}
    slots = _FairSlots(capacity=1, max_pending=10, priority_of=lambda key: failures[key])
    order = []

    async def user(name):
        await slots.acquire(name)
        order.append(name)
        slots.release()

    await slots.acquire("a")
    async with trio.open_nursery() as n:
        n.start_soon(user, "a")
        await wait_for_async(lambda: slots.pending == 1, 5, interval_s=0.001, what="a queued")
        n.start_soon(user, "b")
        await wait_for_async(lambda: slots.pending == 2, 5, interval_s=0.001, what="b queued")
        failures["a"] = 7          # "a" failed meanwhile: "b" goes first
        slots.release()
    assert order == ["b", "a"]


async def test_reserved_slot_is_for_clean_sources_only():
    failures = {"flood": 3, "good": 0}
    slots = _FairSlots(capacity=1, max_pending=10, priority_of=lambda key: failures[key], reserved=1)
    await slots.acquire("flood")                      # the capacity
    with trio.move_on_after(0.01) as scope:
        await slots.acquire("flood")                  # a failing source may not take the reserve
    assert scope.cancelled_caught
    with trio.fail_after(0.01):
        await slots.acquire("good")                   # a clean one may
    assert slots.busy == 2
    slots.release()
    slots.release()
    assert slots.busy == 0


async def test_fair_slots_cancelled_waiter_leaves_no_trace():
    slots = _FairSlots(capacity=1, max_pending=4)
    await slots.acquire("a")
    with trio.move_on_after(0.01):
        await slots.acquire("a")
    assert slots.pending == 0
    slots.release()
    assert slots.busy == 0


# -- the login gate over a real users file ---------------------------------------------------------

def _security(**login) -> SecurityConfig:
    users = {"alice": User("alice", hash_password("right", n=1024), ("app",)),
             "local": User("local", hash_password("right", n=1024), ("app",), sources=())}
    import ipaddress
    users["local"] = User("local", users["local"].password, ("app",),
                          sources=(ipaddress.ip_network("10.9.0.0/16"),))
    return SecurityConfig(users, [], login=LoginSettings(**login))


async def test_gate_every_refusal_waits_the_same_delay():
    gate = LoginGate(_security(failure_delay_s=0.15, throttle_after_failures=100, refuse_after_failures=0))
    ok = await gate.login("alice", "right", "127.0.0.1")
    assert ok.principal is not None and ok.principal.user == "alice"
    for user, password, src in [("alice", "wrong", "127.0.0.1"), ("nobody", "x", "127.0.0.1"),
                                ("local", "right", "127.0.0.1")]:      # source not allowed
        t0 = time.perf_counter()
        res = await gate.login(user, password, src)
        took = time.perf_counter() - t0
        assert res.principal is None
        assert 0.15 <= took < 0.6, (user, took)   # never sooner than the delay, whatever the reason


async def test_gate_cached_login_is_immediate_and_never_throttled():
    gate = LoginGate(_security(failure_delay_s=0.01, throttle_after_failures=1, refuse_after_failures=2))
    assert (await gate.login("alice", "right", "127.0.0.5")).principal is not None
    for i in range(3):
        await gate.login("alice", f"bad{i}", "127.0.0.5")
    assert gate.throttle.refusing("127.0.0.5", trio.current_time())
    before = gate.counters["login_verifications"]
    res = await gate.login("alice", "right", "127.0.0.5")      # known good: through, no hash
    assert res.principal is not None and gate.counters["login_verifications"] == before
    res = await gate.login("alice", "new-password?", "127.0.0.5")
    assert res.reason == "throttled"
    assert gate.counters["login_verifications"] == before       # refused without a hash
    assert gate.counters["login_refused_throttled"] == 2    # the third bad one and this one


async def test_gate_remembers_a_failed_password():
    sec = _security(failure_delay_s=0.0)
    gate = LoginGate(sec)
    await gate.login("alice", "wrong", "127.0.0.1")
    calls = sec.scrypt_calls
    await gate.login("alice", "wrong", "127.0.0.1")
    assert sec.scrypt_calls == calls
    assert gate.counters["login_refused_remembered"] == 1


async def test_gate_runs_at_most_its_capacity_of_hashes():
    sec = _security(failure_delay_s=0.0, max_concurrent_verifications=1, throttle_after_failures=1000,
                    refuse_after_failures=0)
    gate = LoginGate(sec)
    peak = 0
    orig = sec.verify

    running = 0

    def verify(*a):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            return orig(*a)
        finally:
            running -= 1

    sec.verify = verify
    async with trio.open_nursery() as n:
        for i in range(20):
            n.start_soon(gate.login, "alice", f"w{i}", f"127.0.1.{i}")
    assert peak == 2          # the capacity, and the slot reserved for clean sources
    assert gate.counters["login_verifications"] == 20


async def test_gate_a_burst_with_one_account_costs_one_hash():
    # a fleet reconnecting at once (a restart) with the same credentials: one scrypt, every
    # client admitted; before, each of them hashed (50 ms of CPU apiece, queued behind the slots)
    sec = _security(failure_delay_s=0.0)
    gate = LoginGate(sec)
    calls = sec.scrypt_calls
    results = []

    async def one(i):
        results.append(await gate.login("alice", "right", f"127.0.2.{i}"))

    async with trio.open_nursery() as n:
        for i in range(30):
            n.start_soon(one, i)
    assert [r.reason for r in results] == ["ok"] * 30
    assert sec.scrypt_calls == calls + 1
    assert gate.counters["login_verifications"] == 1 and gate.counters["login_ok_cached"] == 29


async def test_gate_a_shared_check_does_not_admit_a_refused_source_or_a_wrong_password():
    sec = _security(failure_delay_s=0.0)
    gate = LoginGate(sec)
    results = {}

    async def one(name, user, password, src):
        results[name] = await gate.login(user, password, src)

    async with trio.open_nursery() as n:
        n.start_soon(one, "allowed", "local", "right", "10.9.0.1")
        n.start_soon(one, "refused", "local", "right", "127.0.0.1")     # not in the user's sources
        n.start_soon(one, "wrong", "alice", "wrong", "127.0.0.3")
        n.start_soon(one, "right", "alice", "right", "127.0.0.4")
    assert results["allowed"].principal is not None and results["right"].principal is not None
    assert results["refused"].principal is None and results["wrong"].principal is None
