"""The multi-worker control channel (router.control) and the shared sticky-cache tier, in one
process over real socketpairs: a supervisor-side owner RouterService and follower services as the
workers run them."""

from __future__ import annotations

import functools
import socket

import pytest
import trio
import trio.testing

from router.config import CacheConfig, PolicyConfig, PoolConfig, RouterConfig, TargetConfig
from router.control import ChannelClosed, Link, RemoteFailure, stream_from_socket
from router.core.keys import ConnectionInfo, KeyType
from router.management import aggregate_workers
from router.service import RouterService
from router.workers import Supervisor, WorkerSlot


def link_pair(handler_a, handler_b) -> tuple[Link, Link]:
    a, b = socket.socketpair()
    return Link(stream_from_socket(a), handler_a, name="a"), Link(stream_from_socket(b), handler_b, name="b")


async def test_link_answers_requests_in_order_and_reports_errors():
    seen = []

    def handle(msg):
        seen.append(msg["op"])
        if msg["op"] == "boom":
            raise ValueError("no such thing")
        return {"echo": msg.get("x"), "seen": list(seen)}

    a, b = link_pair(handle, lambda m: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        for i in range(5):
            b.send({"op": f"one-way-{i}"})
        reply = await b.request({"op": "ask", "x": "\udcff-surrogate"}, timeout_s=5)
        # one-way messages sent earlier were handled first, in order; lone surrogates survive
        assert reply["seen"] == [f"one-way-{i}" for i in range(5)] + ["ask"]
        assert reply["echo"] == "\udcff-surrogate"
        with pytest.raises(RemoteFailure, match="no such thing"):
            await b.request({"op": "boom"}, timeout_s=5)
        nursery.cancel_scope.cancel()


async def test_a_coroutine_answer_lets_later_messages_through_and_reports_errors():
    """A handler may answer with a coroutine (a reload step): later messages are handled while
    it runs, its result is the reply, and its exception the peer's RemoteFailure."""
    go = trio.Event()
    seen = []

    async def slow(fail: bool) -> dict:
        await go.wait()
        if fail:
            raise ValueError("cannot bind")
        return {"done": list(seen)}

    def handle(msg):
        if msg["op"] in ("slow", "slow-fail"):
            return slow(msg["op"] == "slow-fail")
        seen.append(msg["op"])
        if msg["op"] == "release":
            go.set()
        return {}

    a, b = link_pair(handle, lambda m: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(a.run)
        await nursery.start(b.run)
        answers = {}

        async def ask(op):
            try:
                answers[op] = await b.request({"op": op}, timeout_s=5)
            except RemoteFailure as exc:
                answers[op] = str(exc)

        nursery.start_soon(ask, "slow")
        nursery.start_soon(ask, "slow-fail")
        await trio.testing.wait_all_tasks_blocked()
        await b.request({"op": "release"}, timeout_s=5)    # handled while both wait
        with trio.fail_after(5):
            while len(answers) < 2:
                await trio.sleep(0.01)
        assert answers["slow"] == {"done": ["release"], "re": answers["slow"]["re"]}
        assert "cannot bind" in answers["slow-fail"]
        nursery.cancel_scope.cancel()


def test_the_config_message_is_read_first_and_the_rest_stays_for_the_link():
    from router.control import _encode, read_config_message

    a, b = socket.socketpair()
    try:
        a.sendall(_encode({"op": "config", "text": "name = \"r\"\n"}) + _encode({"op": "state"}))
        assert read_config_message(b.fileno()) == "name = \"r\"\n"
        rest = b.recv(1000)
        assert rest == _encode({"op": "state"})
        a.sendall(_encode({"op": "state"}))
        with pytest.raises(ValueError, match="config message first"):
            read_config_message(b.fileno())
    finally:
        a.close()
        b.close()


async def test_a_closed_peer_fails_waiting_requests_and_sets_closed():
    a, b = link_pair(lambda m: None, lambda m: None)

    async with trio.open_nursery() as nursery:
        await nursery.start(b.run)
        a_scope = trio.CancelScope()

        async def run_a(task_status=trio.TASK_STATUS_IGNORED):
            with a_scope:
                await a.run(task_status=task_status)

        await nursery.start(run_a)  # a is running...
        a_scope.cancel()  # ...and goes away: its stream is closed
        with pytest.raises(ChannelClosed):
            await b.request({"op": "anything"}, timeout_s=5)
        with trio.fail_after(5):
            await b.closed.wait()
        with pytest.raises(ChannelClosed):
            b.send({"op": "late"})


def rconfig(name="r", policy="ROUND_ROBIN") -> RouterConfig:
    targets = tuple(TargetConfig(f"t{i}", "127.0.0.1", 5000 + i) for i in range(3))
    return RouterConfig(name, key_type=KeyType.CLIENT_ID, policy=PolicyConfig(policy, {}),
                        cache=CacheConfig(), pool=PoolConfig(check_period_ms=60_000, quorum_timeout_ms=0,
                                                             targets=targets))


def owner_service() -> RouterService:
    import random

    svc = RouterService(rconfig(), rng=random.Random(1))
    for i in range(3):
        svc.pool.set_ready(f"t{i}", True, node_id=f"n{i}")
    return svc


@pytest.mark.parametrize("existing, put, want_value, conflict", [
    (None, ("k", "n1", ""), "n1", None),          # absent: ours
    ("n1", ("k", "n1", ""), "n1", None),          # same value: ours
    ("n0", ("k", "n1", "n0"), "n1", None),        # we replaced the value it holds (stale): ours
    ("n2", ("k", "n1", "n0"), "n2", "n2"),        # someone else's live choice: theirs, reported
    ("n2", ("k", "n1", ""), "n2", "n2"),
])
def test_owner_write_is_compare_and_set(existing, put, want_value, conflict):
    svc = owner_service()
    if existing is not None:
        svc.core.cache.put("k", existing, svc.clock())
    conflicts = svc.shared_write([put], [], [])
    assert conflicts == ({} if conflict is None else {"k": conflict})
    assert svc.shared_get("k") == want_value
    assert svc.shared_write([], [], ["k"]) == {} and svc.shared_get("k") is None


def followers(owner: RouterService, n: int, nursery: trio.Nursery, wrap=None):
    """``n`` follower services linked to ``owner`` through the supervisor's real handler
    (``wrap(handler)`` may interpose on it)."""
    import random

    sup = Supervisor("unused.toml", None, n, {})
    sup.services = {"r": owner}
    out = []
    for i in range(n):
        slot = WorkerSlot(i)
        handler = functools.partial(sup._handle, slot)
        hub, worker = link_pair(wrap(handler) if wrap else handler, lambda m: None)
        svc = RouterService(rconfig(), rng=random.Random(100 + i), shared=worker)
        svc.apply_pool_states(owner.pool_states())
        nursery.start_soon(hub.run)
        nursery.start_soon(worker.run)
        out.append(svc)
    return out


@pytest.fixture
def patient(monkeypatch):
    """A loaded test machine must not turn a slow answer into a degraded (local) decision."""
    import router.service

    monkeypatch.setattr(router.service, "SHARED_TIMEOUT_S", 30.0)


async def test_followers_share_the_owners_cache_and_agree_on_concurrent_new_keys(patient):
    owner = owner_service()
    async with trio.open_nursery() as nursery:
        w0, w1 = followers(owner, 2, nursery)
        assert w0.pool.ready_count == w1.pool.ready_count == 3 and w0.follower
        # a key decided by one worker is a hit on the other (asked once, then local)
        d0 = await w0.route(ConnectionInfo("127.0.0.1:1", container_id="client-a"))
        d1 = await w1.route(ConnectionInfo("127.0.0.1:2", container_id="client-a"))
        assert d1.target.identity == d0.target.identity == owner.shared_get("client-a")
        assert d1.explanation.cache == "hit" and d1.explanation.cache_tier == "shared"
        assert w1.counters["shared_hits"] == 1
        # many connections of fresh keys at once through both workers: one target per key
        for k in range(20):
            got = []

            async def one(svc, i, key=f"race-{k}"):
                got.append((await svc.route(ConnectionInfo(f"127.0.0.1:{i}", container_id=key))).target.identity)

            async with trio.open_nursery() as race:
                for i in range(6):
                    race.start_soon(one, (w0, w1)[i % 2], i)
            assert len(set(got)) == 1, (k, got)
            assert owner.shared_get(f"race-{k}") == got[0]
        nursery.cancel_scope.cancel()


async def test_a_worker_that_loses_the_claim_adopts_the_winners_target(patient):
    owner = owner_service()
    winner = {}

    def wrap(handler):
        def handle(msg):
            if msg["op"] == "cache_write" and msg["puts"] and msg["puts"][0][0] == "contested":
                # another worker claims "contested" just before this one's claim arrives
                ours = msg["puts"][0][1]
                winner["ident"] = next(f"n{i}" for i in range(3) if f"n{i}" != ours)
                owner.shared_write([("contested", winner["ident"], "")], [], [])
            return handler(msg)
        return handle

    async with trio.open_nursery() as nursery:
        (w0,) = followers(owner, 1, nursery, wrap)
        d = await w0.route(ConnectionInfo("127.0.0.1:1", container_id="contested"))
        assert d.target.identity == winner["ident"] == owner.shared_get("contested")
        assert d.explanation.cache == "hit" and d.explanation.cache_tier == "shared"
        assert w0.counters["shared_conflicts"] == 1
        again = await w0.route(ConnectionInfo("127.0.0.1:2", container_id="contested"))
        assert again.target.identity == winner["ident"] and again.explanation.cache_tier == "local"
        nursery.cancel_scope.cancel()


async def test_a_follower_degrades_to_its_local_tier_when_the_supervisor_is_gone():
    import random

    a, b = socket.socketpair()
    worker = Link(stream_from_socket(b), lambda m: None, name="worker")
    a.close()  # the supervisor is gone
    svc = RouterService(rconfig(), rng=random.Random(3), shared=worker)
    svc.apply_pool_states(owner_service().pool_states())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.run)
        with trio.fail_after(5):
            await worker.closed.wait()
        d = await svc.route(ConnectionInfo("127.0.0.1:1", container_id="k"))
        assert d.target is not None and svc.degraded and svc.counters["shared_errors"] >= 1
        assert (await svc.route(ConnectionInfo("127.0.0.1:1", container_id="k"))).explanation.cache == "hit"
        nursery.cancel_scope.cancel()


def test_counters_are_summed_over_workers_with_a_per_worker_breakdown():
    owner = owner_service()
    owner.counters["probe_rounds"] = 4

    def report(w, accepted, route_ok):
        return {"worker": w, "pid": 100 + w, "counters": [["redir", "accepted", accepted]],
                "active": {"redir": w}, "bytes_up": {}, "bytes_down": {},
                "routers": {"r": {"route_ok": route_ok, "probe_rounds": 0}}, "routing_log": [accepted, 0]}

    agg = aggregate_workers([report(0, 3, 2), report(1, 5, 4)], {"r": owner})
    assert agg.stats.get("accepted") == 8 and agg.stats.active["redir"] == 1
    assert agg.routers["r"]["route_ok"] == 6 and agg.routers["r"]["probe_rounds"] == 4
    assert agg.lines_written == 8
    assert [(w["worker"], w["edge"]["accepted"]) for w in agg.per_worker] == [(0, 3), (1, 5)]
