"""Per-source connection limits and equal-time login refusals, on real broker and router processes.

* Every limit (connections per source, connections still authenticating per source, the
  connection rate per source; the broker acceptor's ``max-connections``) is hit, answered with
  ``amqp:resource-limit-exceeded`` naming the limit (decoded by an unmodified proton client),
  counted, and leaves clients from other addresses alone.
* A refused login takes the same time whatever the reason (unknown user, wrong password, a
  source the user may not connect from): the users file's promise that timing does not reveal
  which users exist. Measured with raw SASL from a fresh source address per attempt, so no
  throttling interferes.
"""

from __future__ import annotations

import json
import socket
import statistics
import time
from pathlib import Path

import pytest
from proton import ConnectionException
from proton.utils import BlockingConnection

from broker.wire.codec import Symbol
from broker.wire.frames import (
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    Close,
    FrameReader,
    Open,
    SaslInit,
    SaslOutcome,
    decode_performative,
    encode_frame,
)
from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.serverproc import http_json
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin-pw", ["admin"]), "app": ("app-pw", ["app"])}


@pytest.fixture(scope="module")
def users(tmp_path_factory) -> Path:
    return write_users_file(tmp_path_factory.mktemp("limits-users") / "users.toml", USERS)


def _sasl(user: str, password: str) -> bytes:
    return SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), f"\0{user}\0{password}".encode()))


def _sock(port: int, source: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(15)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def _read_performatives(s: socket.socket, until) -> list:
    """Read frames until ``until(performative)`` is true or EOF; returns what was decoded."""
    reader = FrameReader(1 << 20)
    seen: list = []
    while True:
        data = s.recv(65536)
        if not data:
            return seen
        reader.receive_data(data)
        while True:
            if reader.buffered >= 4 and reader.peek(4) == b"AMQP":
                if reader.next_protocol_header() is NEED_DATA:
                    break
                continue
            f = reader.next_event()
            if f is NEED_DATA:
                break
            if not f.body:
                continue
            p = decode_performative(f.body)
            seen.append(p)
            if until(p):
                return seen


def _failed(open_: Open) -> bool:
    """The failed-establishment Open that precedes a refusal's Close."""
    return bool((open_.properties or {}).get(Symbol("amqp:connection-establishment-failed")))


def _authenticated(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that finished SASL and AMQP Open (holds one authenticated slot)."""
    s = _sock(port, source)
    s.sendall(_sasl("app", "app-pw") + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id="holder")))
    got = _read_performatives(s, lambda p: isinstance(p, Close) or isinstance(p, Open) and not _failed(p))
    assert got and isinstance(got[-1], Open), got
    return s


def _proton_refusal(url: str) -> str:
    with pytest.raises(ConnectionException) as ei:
        BlockingConnection(url, timeout=15, user="app", password="app-pw", allowed_mechs="PLAIN").close()
    return str(ei.value)


def _broker_events(broker) -> dict[str, float]:
    status, text = http_json(broker.management_url + "/metrics", auth=("admin", "admin-pw"), timeout_s=10)
    assert status == 200, text
    out = {}
    for line in text.splitlines():
        if line.startswith("lodestone_broker_events_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


# -- the broker ----------------------------------------------------------------------------------

def test_broker_unauthenticated_per_source(tmp_path, users):
    b = start_broker(tmp_path, users_file=users,
                     config={"acceptors.amqp": {"max-unauthenticated-per-source": 2}})
    held = []
    try:
        held = [_sock(b.port), _sock(b.port)]          # two silent sockets: the source's budget
        text = _proton_refusal(b.amqp_url)
        assert "amqp:resource-limit-exceeded" in text and "max-unauthenticated-per-source" in text, text
        # another address is not affected; the source recovers once its sockets go
        s = _authenticated(b.port, "127.0.0.2")
        s.close()
        for h in held:
            h.close()
        wait_for(lambda: _connect_ok(b.amqp_url), timeout_s=10)
        assert _broker_events(b)["refused_source_unauthenticated"] >= 1
    finally:
        for h in held:
            h.close()
        b.terminate()


def test_broker_connections_per_source_and_acceptor_limit(tmp_path, users):
    b = start_broker(tmp_path, users_file=users,
                     config={"acceptors.amqp": {"max-connections-per-source": 2, "max-connections": 3}})
    held = []
    try:
        held = [_authenticated(b.port), _authenticated(b.port)]
        text = _proton_refusal(b.amqp_url)
        assert "amqp:resource-limit-exceeded" in text and "max-connections-per-source" in text, text
        held.append(_authenticated(b.port, "127.0.0.2"))           # the acceptor's third and last
        s = _sock(b.port, "127.0.0.3")
        s.sendall(_sasl("app", "app-pw") + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id="x")))
        got = _read_performatives(s, lambda p: isinstance(p, Close))
        s.close()
        close = got[-1]
        assert isinstance(close, Close) and str(close.error.condition) == "amqp:resource-limit-exceeded", got
        assert "max-connections" in close.error.description
        ev = _broker_events(b)
        assert ev["refused_source_connections"] >= 1 and ev["refused_acceptor_connections"] >= 1
    finally:
        for h in held:
            h.close()
        b.terminate()


def test_broker_connection_rate_per_source(tmp_path, users):
    b = start_broker(tmp_path, users_file=users,
                     config={"acceptors.amqp": {"max-connection-rate-per-source": 3}})
    try:
        outcomes = []
        for _ in range(8):                           # well within one second
            s = _sock(b.port)
            s.sendall(_sasl("app", "app-pw") + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id="r")))
            got = _read_performatives(s, lambda p: isinstance(p, Close) or isinstance(p, Open) and not _failed(p))
            s.close()
            outcomes.append(got[-1])
        refused = [p for p in outcomes if isinstance(p, Close)]
        assert len(refused) >= 4, outcomes
        assert all(str(p.error.condition) == "amqp:resource-limit-exceeded" and
                   "max-connection-rate-per-source" in p.error.description for p in refused)
        _authenticated(b.port, "127.0.0.2").close()  # another address: its own bucket
        assert _broker_events(b)["refused_source_rate"] >= 4
    finally:
        b.terminate()


def _connect_ok(url: str) -> bool:
    try:
        BlockingConnection(url, timeout=5, user="app", password="app-pw", allowed_mechs="PLAIN").close()
        return True
    except ConnectionException:
        return False


# -- the router ----------------------------------------------------------------------------------

def _router(tmp_path, users, broker, **acceptor) -> object:
    lines = [f"users-file = {toml_str(users)}", "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
             "[routing-log]", "enabled = false",
             "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"', "idle-timeout-s = 60"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in acceptor.items()]
    lines += ["[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
              "[routers.main.pool]", "check-period = 250", 'username = "admin"', 'password = "admin-pw"',
              "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {broker.port}",
              f"management-url = {toml_str(broker.management_url)}", ""]
    r = start_router(tmp_path / "router", "\n".join(lines), expect=2, auth=("admin", "admin"))
    wait_for(lambda: r.get("/api/v1/routers/main/pool")[1]["ready"] == 1, timeout_s=20)
    return r


def test_router_per_source_limits(tmp_path, users):
    b = start_broker(tmp_path, users_file=users)
    r = _router(tmp_path, users, b, **{"max-unauthenticated-per-source": 1, "max-connections-per-source": 3})
    held = []
    try:
        port = r.port("proxy")
        held.append(_sock(port))                                       # silent: the source's one
        text = _proton_refusal(r.url("proxy"))
        assert "amqp:resource-limit-exceeded" in text and "max-unauthenticated-per-source" in text, text
        held.pop().close()
        wait_for(lambda: _connect_ok(r.url("proxy")), timeout_s=10)
        held += [_authenticated(port), _authenticated(port), _authenticated(port)]
        text = _proton_refusal(r.url("proxy"))
        assert "amqp:resource-limit-exceeded" in text and "max-connections-per-source" in text, text
        other = _authenticated(port, "127.0.0.2")                      # another address: served
        other.close()
        c = r.counters("proxy")
        assert c["refused_source_unauthenticated"] >= 1 and c["refused_source_connections"] >= 1
    finally:
        for h in held:
            h.close()
        r.terminate()
        b.terminate()


def test_router_acceptor_limit_is_answered_in_amqp(tmp_path, users):
    b = start_broker(tmp_path, users_file=users)
    r = _router(tmp_path, users, b, **{"max-connections": 2})
    held = []
    try:
        port = r.port("proxy")
        held += [_authenticated(port), _authenticated(port, "127.0.0.2")]
        text = _proton_refusal(r.url("proxy"))
        assert "amqp:resource-limit-exceeded" in text and "max-connections" in text, text
        assert r.counters("proxy")["connection_limit_rejected"] >= 1
        held.pop().close()
        wait_for(lambda: _connect_ok(r.url("proxy")), timeout_s=10)   # a slot again: served
    finally:
        for h in held:
            h.close()
        r.terminate()
        b.terminate()


# -- equal refusal times ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_cost_users(tmp_path_factory) -> Path:
    """Production scrypt cost; ``netonly`` may connect only from 10.0.0.0/8."""
    from broker.wire.io.users import hash_password

    lines = []
    for name, pw, roles, sources in [("app", "app-pw", ["app"], None), ("admin", "admin-pw", ["admin"], None),
                                     ("netonly", "net-pw", ["app"], ["10.0.0.0/8"])]:
        lines += [f"[users.{name}]", f"password = {json.dumps(hash_password(pw))}", f"roles = {json.dumps(roles)}"]
        if sources:
            lines.append(f"sources = {json.dumps(sources)}")
        lines.append("")
    lines += ["[[permissions]]", 'match = "#"', 'send = ["app"]', 'consume = ["app"]', 'manage = ["admin"]', ""]
    path = tmp_path_factory.mktemp("real-cost-users") / "users.toml"
    path.write_text("\n".join(lines))
    return path


def _refusal_ms(port: int, source: str, user: str, password: str) -> float:
    s = _sock(port, source)
    try:
        s.sendall(_sasl(user, password))
        t0 = time.perf_counter()
        got = _read_performatives(s, lambda p: isinstance(p, SaslOutcome))
        took = (time.perf_counter() - t0) * 1000
        assert got and isinstance(got[-1], SaslOutcome) and got[-1].code != 0, got
        return took
    finally:
        s.close()


def _refusal_medians(port: int) -> dict[str, float]:
    cases = {"unknown user": ("nobody", "x"), "wrong password": ("app", "nope"),
             "source not allowed": ("netonly", "net-pw")}
    times: dict[str, list[float]] = {k: [] for k in cases}
    n = 0
    for _round in range(7):
        for reason, (user, password) in cases.items():
            n += 1
            times[reason].append(_refusal_ms(port, f"127.0.{1 + n // 250}.{2 + n % 250}", user, password))
    return {k: statistics.median(v) for k, v in times.items()}


@pytest.mark.parametrize("where", ["broker", "router"])
def test_refusals_take_the_same_time_whatever_the_reason(tmp_path, real_cost_users, where):
    b = start_broker(tmp_path, users_file=real_cost_users)
    r = None
    try:
        port = b.port
        if where == "router":
            r = _router(tmp_path, real_cost_users, b)
            port = r.port("proxy")
        medians = _refusal_medians(port)
        print(where, medians)
        assert all(m >= 250 for m in medians.values()), medians      # failure-delay-ms, every reason
        assert max(medians.values()) - min(medians.values()) < 25, medians
    finally:
        if r is not None:
            r.terminate()
        b.terminate()
