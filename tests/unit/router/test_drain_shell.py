"""The drain's shell (router/drain.py) and a worker's reload steps (router/reload.py) against
their failure modes, with real sockets and stand-ins for the router around them: a broker whose
management API drops the connection never ends the drain (or the router), and an abort that
arrives while a slow prepare is still binding undoes that prepare once it finishes."""

from __future__ import annotations

import collections
import types

import trio
import trio.testing

from router.config import load_router_config
from router.core.keys import KeyType
from router.drain import Drain, run_on_broker
from router.reload import Reloader, file_digests


async def _rude_server(task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Accepts and closes without answering (a broker restarting under the drain)."""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    task_status.started(listener.getsockname()[1])
    with listener:
        while True:
            s, _ = await listener.accept()
            await trio.sleep(0.01)
            s.close()


async def test_a_broker_that_drops_management_calls_is_retried_and_never_ends_the_drain():
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_rude_server)
        target = types.SimpleNamespace(management_url=f"http://127.0.0.1:{port}", name="b2")
        service = types.SimpleNamespace(
            pool_member=lambda group: target, pool=types.SimpleNamespace(drain_fallback=False),
            config=types.SimpleNamespace(pool=None, key_type=KeyType.CLIENT_ID),
            counters=collections.Counter(), name="r")

        async def count_proxied(group):
            return 0, 0

        drain = Drain("b2", 10.0, 0.0)
        with trio.move_on_after(2.5):
            await run_on_broker(service, drain, count_proxied)   # raised BrokenResourceError before
        assert service.counters["drain_errors"] >= 2               # retried, once per second
        assert drain.last_error is not None
        nursery.cancel_scope.cancel()


BASE = """
[routers.r.policy]
name = "FIRST_ELEMENT"
[[routers.r.pool.targets]]
host = "127.0.0.1"
port = 5672
[[acceptors]]
name = "a"
port = 0
router = "r"
"""
WITH_B = BASE + """
[[acceptors]]
name = "b"
host = "127.0.0.1"
port = 0
router = "r"
"""


async def test_an_abort_during_a_slow_prepare_undoes_it_once_it_finishes(tmp_path):
    path = tmp_path / "router.toml"
    path.write_text(BASE)
    cfg = load_router_config(path)
    running = types.SimpleNamespace(config=cfg, draining=False, services={}, acceptors={}, limits={}, ports={})
    go = trio.Event()
    opened = []

    async def open_bound(acc, port):
        await go.wait()                       # binding is slow: the supervisor's step timed out
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        opened.extend(listeners)
        return listeners

    reloader = Reloader(running, bound={}, make_settings=lambda acc: object(), make_acceptor=None,
                        make_limit=None, make_service=None, open_bound=open_bound, serve=None,
                        log_path=lambda rl: None)
    reloader.accepting = object()
    answers = []
    async with trio.open_nursery() as nursery:
        reloader.system = nursery

        async def prepare():
            answers.append(await reloader.prepare_remote(
                WITH_B, file_digests(load_router_config(path, WITH_B.encode())), {"b": 0}, {}))

        async def abort():
            answers.append(await reloader.abort_remote())

        nursery.start_soon(prepare)
        await trio.testing.wait_all_tasks_blocked()     # the prepare waits in its bind
        nursery.start_soon(abort)             # the supervisor gave up and aborts
        await trio.testing.wait_all_tasks_blocked()     # the abort waits for the prepare
        go.set()
    assert answers == [{"changes": 1}, {}]    # the abort waited for the prepare...
    assert reloader._pending is None          # ...and undid it: nothing left to commit
    assert opened and all(listener.socket.fileno() == -1 for listener in opened)   # no listener left
    assert running.config is cfg
