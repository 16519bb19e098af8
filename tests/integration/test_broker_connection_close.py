"""``POST /api/v1/connections/close`` against a real broker process, with real proton clients.

Clients whose Open desired ``lodestone:follows-redirect`` get ``amqp:connection:redirect``
naming the target; unmodified ones have their connection ended without a Close (an end of
stream, which every client reconnects from at once), or get ``amqp:connection:forced`` when the
call asks for it (docs/broker.md, "Closing client connections"). The oracle is what each
python-qpid-proton client itself saw: the Close's condition, description and info (or that no
Close came), when it arrived, and when the broker closed the socket.
"""

from __future__ import annotations

import threading
import time

import pytest
from proton import symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container

from broker.wire.frames import FOLLOWS_REDIRECT
from tests.brokerproc import ADMIN, start_broker
from tests.serverproc import http_json
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

REDIRECT, FORCED = "amqp:connection:redirect", "amqp:connection:forced"
IDLE_S = 60.0  # the default [amqp] idle-timeout-s: a client waiting for a heartbeat would wait 30 s


class Clients(MessagingHandler):
    """Connections to one broker, each named by its container id, in one proton Container
    thread; records each one's Close (condition, description, info, time) and disconnect time."""

    def __init__(self, url: str, specs: list[tuple[str, str, bool]]) -> None:
        super().__init__()
        self.url = url
        self.specs = specs   # (container id, user, follows redirects)
        self.closes: dict[str, tuple[str, str, dict, float]] = {}
        self.disconnected: dict[str, float] = {}
        self.container = Container(self)
        self.thread = threading.Thread(target=self.container.run, daemon=True)

    def __enter__(self) -> "Clients":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.container.stop()
        self.thread.join(10)

    def on_start(self, event) -> None:
        for cid, user, follows in self.specs:
            conn = event.container.connect(
                self.url, user=user, password=user, allowed_mechs="PLAIN", reconnect=False,
                desired_capabilities=[symbol(FOLLOWS_REDIRECT)] if follows else None)
            conn.container = cid   # before the Open is written (the reactor writes it later)

    def on_connection_remote_close(self, event) -> None:
        c = event.connection
        cond = c.remote_condition
        self.closes[c.container] = (cond.name if cond else None, cond.description if cond else None,
                                    {str(k): v for k, v in (cond.info or {}).items()} if cond else {},
                                    time.monotonic())
        # (MessagingHandler's child EndpointStateHandler gets the event too, and reacts as usual)

    def on_connection_error(self, event) -> None:
        pass   # recorded above (the default prints it)

    def on_transport_closed(self, event) -> None:
        # both directions of the socket done (MessagingHandler's on_disconnected fires only for
        # a connection still open locally, so not after the client answered a redirect's Close)
        if event.connection is not None:
            self.disconnected.setdefault(event.connection.container, time.monotonic())


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    # the default idle-timeout-s: a proton reactor client stops reading at a Close, and on
    # amqp:connection:forced (which it does not answer) it sees the closed socket only when its
    # next heartbeat (every idle-timeout / 2) fails; an end of stream it sees at once
    b = start_broker(tmp_path_factory.mktemp("close"), config={"amqp": {"idle-timeout-s": IDLE_S}})
    yield b
    b.terminate()


def post(broker, body, auth=ADMIN):
    return http_json(broker.management_url + "/api/v1/connections/close", method="POST", body=body, auth=auth)


def open_ids(broker) -> set[str]:
    status, conns = broker.management_get("/api/v1/connections")
    assert status == 200, conns
    return {c["container_id"] for c in conns}


@pytest.mark.parametrize("body, field", [
    ({}, "selector"),
    ({"all": True, "user": "app"}, "selector"),
    ({"all": False}, "all"),
    ({"user": ""}, "user"),
    ({"container-id": 7}, "container-id"),
    ({"all": True, "redirect": "nohost"}, "redirect"),
    ({"all": True, "redirect": "h:0"}, "redirect"),
    ({"all": True, "rate-per-second": 0}, "rate-per-second"),
    ({"all": True, "rate-per-second": "3"}, "rate-per-second"),
    ({"all": True, "rate": 3}, "rate"),
    ([1], "body"),
])
def test_bad_bodies_get_400_naming_the_field(broker, body, field):
    status, out = post(broker, body)
    assert status == 400, out
    assert field in str(out)


def test_needs_the_manage_permission(broker):
    status, out = post(broker, {"all": True}, auth=("app", "app"))
    assert status == 403, out
    status, _ = post(broker, {"all": True}, auth=None)
    assert status == 401


def test_selectors_pick_only_their_connections(broker):
    specs = [("sel-a", "admin", True), ("sel-b", "admin", False), ("sel-c", "app", False), ("sel-d", "admin", False)]
    with Clients(broker.amqp_url, specs) as clients:
        wait_for(lambda: {"sel-a", "sel-b", "sel-c", "sel-d"} <= open_ids(broker))
        status, out = post(broker, {"container-id": "sel-b"})
        assert status == 202, out
        assert (out["selected"], out["ended"], out["forced"], out["redirected"]) == (1, 1, 0, 0)
        assert out["connections"][0]["condition"] == "end-of-stream"
        wait_for(lambda: "sel-b" in clients.disconnected, timeout_s=5)  # an end of stream: seen at once
        assert "sel-b" not in clients.closes                             # and no Close
        status, out = post(broker, {"user": "app", "redirect": "127.0.0.1:5999"})
        assert status == 202 and (out["selected"], out["ended"]) == (1, 1), out
        wait_for(lambda: "sel-c" in clients.disconnected, timeout_s=5)  # an unmodified client: target or not
        assert "sel-c" not in clients.closes
        status, out = post(broker, {"container-id": "sel-d", "unmodified": FORCED})
        assert status == 202 and (out["selected"], out["forced"]) == (1, 1), out
        wait_for(lambda: "sel-d" in clients.closes)
        assert clients.closes["sel-d"][0] == FORCED                     # asked for: the Close
        assert "sel-a" in open_ids(broker) and "sel-a" not in clients.closes
        status, out = post(broker, {"container-id": "sel-a", "redirect": "[::1]:5998"})
        assert status == 202 and out["redirected"] == 1, out
        wait_for(lambda: "sel-a" in clients.disconnected)
    condition, _description, info, _at = clients.closes["sel-a"]
    assert condition == REDIRECT and info == {"network-host": "::1", "port": 5998}
    wait_for(lambda: not open_ids(broker))


def test_redirect_capable_clients_are_redirected_others_ended_at_the_rate_asked(broker):
    specs = [(f"rate-{i}", "app", i % 2 == 0) for i in range(6)]
    ids = {cid for cid, _u, _f in specs}
    with Clients(broker.amqp_url, specs) as clients:
        wait_for(lambda: ids <= open_ids(broker))
        t0 = time.monotonic()
        status, out = post(broker, {"all": True, "redirect": "127.0.0.1:5999", "rate-per-second": 3})
        answered = time.monotonic() - t0
        assert status == 202, out
        assert (out["selected"], out["redirected"], out["ended"], out["forced"]) == (6, 3, 3, 0), out
        assert out["duration_s"] == pytest.approx(5 / 3, abs=0.01)
        wait_for(lambda: ids <= set(clients.disconnected), timeout_s=15)
    seen = {}
    for cid, _user, follows in specs:
        if follows:
            condition, description, info, at = clients.closes[cid]
            assert condition == REDIRECT, (cid, condition, description)
            assert info == {"network-host": "127.0.0.1", "port": 5999}
            # a redirected client answers the Close and is gone at once
            assert clients.disconnected[cid] - at < 0.5, cid
            seen[cid] = at
        else:
            assert cid not in clients.closes, clients.closes[cid]   # ended without a Close
            seen[cid] = clients.disconnected[cid]
    times = sorted(seen.values())
    spread = times[-1] - times[0]
    print(f"answered in {answered:.3f} s; 6 closes at 3/s spread over {spread:.3f} s")
    assert answered < 1.0            # the call answers at once; the closes run in the background
    assert 1.55 <= spread < 3.5      # 5 intervals of 1/3 s
    assert not ids & open_ids(broker)
