"""Clients that vanish at every phase: the router survives, counts the right outcome, serves others.

Real router process (``tests/routerproc.py``), a real broker (``tests/brokerproc.py``), trustme TLS.
Four acceptors: redirect and proxy, each plain and TLS (the TLS proxy also speaks TLS upstream, so
both pump paths — splice and TLS streams — are hit). A misbehaving client is a raw socket that
leaves at one phase, either with a TCP reset (``SO_LINGER`` 0 + close) or, on TLS, with a TCP FIN
and no close_notify (``SSLSocket.shutdown(SHUT_WR)``). After each:

* the router process is alive,
* the acceptor's counters moved by exactly the expected amounts (and ``internal_error`` did not),
* ``active_connections`` is back to 0,
* an unmodified proton client is served on the same acceptor.

``test_many_at_once`` runs 200 concurrent connections, half misbehaving, half well-behaved.
"""

from __future__ import annotations

import random
import socket
import ssl

import pytest
import trio
import trustme
from proton import ConnectionException, Message, SSLDomain
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
from router.client import connect_following_redirects
from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin-pw", ["admin"]), "alice": ("alice-pw", ["app"])}
ACCEPTORS = {  # name: (mode, tls)
    "redirect-plain": ("redirect", False),
    "redirect-tls": ("redirect", True),
    "proxy-plain": ("proxy", False),
    "proxy-tls": ("proxy", True),
}

SASL_INIT = encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), b"\0alice\0alice-pw"))


def _open_frame(container_id: str = "reset-test") -> bytes:
    return encode_frame(FRAME_AMQP, 0, Open(container_id=container_id))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-resets")
    ca = trustme.CA()
    ca_pem = tmp / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_pem))
    pem = tmp / "router.pem"
    ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(pem))
    users = write_users_file(tmp / "users.toml", USERS)
    broker = start_broker(tmp, name="b1", users_file=users, tls=ca)
    tls_port = int(broker.amqps_url.rsplit(":", 1)[1])
    lines = [f"users-file = {toml_str(users)}", "[management]", "port = 0",
             "[routing-log]", "enabled = false"]
    for router, port, tls in (("plain", broker.port, False), ("tls", tls_port, True)):
        lines += [f"[routers.{router}]", 'key-type = "CLIENT_ID"', f"[routers.{router}.policy]",
                  'name = "FIRST_ELEMENT"', f"[routers.{router}.pool]", "check-period = 500",
                  'username = "admin"', 'password = "admin-pw"', f"[[routers.{router}.pool.targets]]",
                  'name = "b1"', 'host = "127.0.0.1"', f"port = {port}", f"tls = {toml_str(tls)}",
                  f"management-url = {toml_str(broker.management_url)}"]
    for name, (mode, tls) in ACCEPTORS.items():
        lines += ["[[acceptors]]", f"name = {toml_str(name)}", "port = 0", f"router = {toml_str('tls' if tls else 'plain')}",
                  f"mode = {toml_str(mode)}", "idle-timeout-s = 60"]
        if tls:
            lines += [f"tls-cert = {toml_str(pem)}", f"tls-key = {toml_str(pem)}"]
        if mode == "proxy":
            lines += [f"upstream-ca = {toml_str(ca_pem)}"]
    router = start_router(tmp / "router", "\n".join(lines) + "\n", expect=len(ACCEPTORS) + 1,
                          auth=("admin", "admin-pw"))
    for r in ("plain", "tls"):
        wait_for(lambda r=r: router.get(f"/api/v1/routers/{r}/pool")[1]["ready"] == 1, 20)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    env = type("Env", (), {})()
    env.router, env.broker, env.ca_pem, env.client_ctx = router, broker, ca_pem, client_ctx
    env.users, env.router_pem = users, pem
    try:
        yield env
    finally:
        alive = router.proc.poll() is None
        status = router.terminate()
        broker.kill()
        assert alive and status == 0, router.stderr_text()
        assert "Traceback" not in router.stderr_text(), router.stderr_text()


# -- helpers -----------------------------------------------------------------------------------

def _snapshot(router, acceptor: str) -> tuple[dict[str, int], int]:
    status, body = router.get("/api/v1/counters")
    assert status == 200, body
    a = body["acceptors"][acceptor]
    return a["counters"], a["active_connections"]


def _abort(sock) -> None:
    """TCP reset: SO_LINGER on with a zero timeout, then close (no FIN, no close_notify)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def _fin_without_close_notify(sock) -> None:
    """A TCP FIN with no TLS close_notify, then read (raw) until the router closes its side."""
    sock.shutdown(socket.SHUT_WR)  # on an SSLSocket this drops the TLS layer: no close_notify
    sock.settimeout(20)
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    sock.close()


def _performatives(reader: FrameReader):
    """Decode what is buffered: yield performatives, skipping protocol headers and empty frames."""
    while True:
        if reader.buffered >= 4 and reader.peek(4) == b"AMQP":
            if reader.next_protocol_header() is NEED_DATA:
                return
            continue
        ev = reader.next_event()
        if ev is NEED_DATA:
            return
        if ev.body:
            yield decode_performative(ev.body)


def _read_frames_until(sock, want, what: str) -> None:
    """Read the peer's frames until ``want(performative)`` is true."""
    reader = FrameReader(1 << 20)
    sock.settimeout(20)
    while True:
        data = sock.recv(65536)
        assert data, f"connection closed before {what}"
        reader.receive_data(data)
        if any(want(p) for p in _performatives(reader)):
            return


def _good_client(env, acceptor: str) -> None:
    """An unmodified proton client is served on ``acceptor``; then wait until the router is done
    with it (so the next case's counter snapshot is not racing its close)."""
    mode, tls = ACCEPTORS[acceptor]
    kw = {"timeout": 20, "allowed_mechs": "PLAIN", "user": "alice", "password": USERS["alice"][0]}
    if tls:
        d = SSLDomain(SSLDomain.MODE_CLIENT)
        d.set_trusted_ca_db(str(env.ca_pem))
        d.set_peer_authentication(SSLDomain.VERIFY_PEER)
        kw["ssl_domain"] = d
    if mode == "redirect":
        conn = connect_following_redirects(env.router.url(acceptor), **kw)
    else:
        conn = BlockingConnection(env.router.url(acceptor), **kw)
    try:
        assert (conn.conn.remote_properties or {}).get("node-id") == env.broker.node_id
        address = f"resets.{acceptor}"
        conn.create_sender(address).send(Message(body="still served"))
        receiver = conn.create_receiver(address)
        assert receiver.receive(timeout=20).body == "still served"
        receiver.accept()
    finally:
        conn.close()
    wait_for(lambda: _snapshot(env.router, acceptor)[1] == 0, 20)


# Counters that end a connection: each accepted connection moves exactly one of them.
OUTCOME_COUNTERS = ["tls_handshake_timeout", "tls_handshake_failed", "handshake_timeout", "handshake_eof",
                    "handshake_oversized", "protocol_header_rejected", "protocol_error", "auth_failed",
                    "redirected", "refused", "proxy_external_refused", "upstream_connect_failed",
                    "upstream_connect_timeout", "upstream_auth_failed", "upstream_protocol_error",
                    "proxy_closed", "proxy_idle_timeout", "proxy_client_error", "proxy_upstream_error",
                    "proxy_cancelled", "internal_error"]

# phases in the order a client goes through them; each says what the client sent before leaving
PHASES = ["connect", "mid-tls", "after-tls", "after-sasl-header", "after-sasl-init", "after-amqp-header",
          "after-open", "in-linger", "mid-pump"]
SENT_BEFORE = {"after-sasl-header": SASL_HEADER, "after-sasl-init": SASL_HEADER + SASL_INIT,
               "after-amqp-header": SASL_HEADER + SASL_INIT + AMQP_HEADER}


def _expected(mode: str, tls: bool, phase: str, how: str) -> dict[str, int]:
    """Exactly how much each counter of the acceptor moves for one misbehaving client."""
    exp = {"accepted": 1}
    if phase in ("connect", "mid-tls"):
        exp["tls_handshake_failed" if tls else "handshake_eof"] = 1
        return exp
    if tls:
        exp["tls_handshake_ok"] = 1
    if phase in ("after-tls", "after-sasl-header"):
        exp["handshake_eof"] = 1
        return exp
    exp["auth_ok"] = 1
    if phase in ("after-sasl-init", "after-amqp-header"):
        exp["handshake_eof"] = 1
        return exp
    exp["route_ok"] = 1
    if mode == "redirect":
        exp["redirected"] = 1
    else:
        exp["proxied"] = 1
        exp["proxy_client_error" if how == "reset" else "proxy_closed"] = 1
    return exp


def _acceptable(mode: str, tls: bool, phase: str, how: str) -> list[dict[str, int]]:
    """The expected counter moves; under TLS a reset the router meets on a read is an EOF
    without close_notify (docs/router.md, Pump), on a write (the broker's Open or later
    frames to the client) a broken client — which one comes first is a race."""
    exp = _expected(mode, tls, phase, how)
    if tls and how == "reset" and "proxy_client_error" in exp:
        as_eof = dict(exp)
        del as_eof["proxy_client_error"]
        as_eof["proxy_closed"] = 1
        return [exp, as_eof]
    return [exp]


def _cases():
    for acceptor, (mode, tls) in ACCEPTORS.items():
        for phase in PHASES:
            if phase in ("mid-tls", "after-tls") and not tls:
                continue
            if phase == "mid-pump" and mode != "proxy" or phase == "in-linger" and mode != "redirect":
                continue
            for how in ("reset", "fin") if tls else ("reset",):
                yield pytest.param(acceptor, phase, how, id=f"{acceptor}-{phase}-{how}")


def _misbehave(env, acceptor: str, phase: str, how: str) -> None:
    mode, tls = ACCEPTORS[acceptor]
    leave = _abort if how == "reset" else _fin_without_close_notify
    raw = socket.create_connection(("127.0.0.1", env.router.port(acceptor)), timeout=20)
    if phase == "connect":
        return leave(raw)
    if phase == "mid-tls":
        # Our ClientHello out, the router's first flight in: the router now waits for our Finished.
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        obj = env.client_ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
        with pytest.raises(ssl.SSLWantReadError):
            obj.do_handshake()
        raw.sendall(outgoing.read())
        assert raw.recv(65536), "router closed during the TLS handshake"
        return leave(raw)
    sock = raw
    if tls:
        before_ok = _snapshot(env.router, acceptor)[0]["tls_handshake_ok"]
        sock = env.client_ctx.wrap_socket(raw, server_hostname="localhost")
        # TLS 1.3: our handshake ends before the router has read our Finished; wait for its side
        wait_for(lambda: _snapshot(env.router, acceptor)[0]["tls_handshake_ok"] == before_ok + 1, 20)
    if phase == "after-tls":
        return leave(sock)
    if phase in SENT_BEFORE:
        sock.sendall(SENT_BEFORE[phase])
        return leave(sock)
    sock.sendall(SASL_HEADER + SASL_INIT + AMQP_HEADER + _open_frame(f"{acceptor}-{phase}-{how}"))
    if phase == "after-open":
        # Leave as soon as our SASL outcome arrives: the router has the Open and is now routing,
        # connecting upstream or replaying. (Leaving before that, the router meets the reset
        # writing the outcome: handshake_eof, as for the phases above.)
        _read_frames_until(sock, lambda p: isinstance(p, SaslOutcome), "the SASL outcome")
        return leave(sock)
    if phase == "in-linger":  # redirected: the Close arrived, the router lingers for ours
        _read_frames_until(sock, lambda p: isinstance(p, Close), "the redirect Close")
        return leave(sock)
    assert phase == "mid-pump"  # the broker's Open came through: the pump is running
    _read_frames_until(sock, lambda p: isinstance(p, Open), "the broker's Open")
    return leave(sock)


# -- 1. a client leaving at every phase --------------------------------------------------------

@pytest.mark.parametrize("acceptor, phase, how", list(_cases()))
def test_a_client_leaving_at_any_phase_is_counted_and_others_are_served(env, acceptor, phase, how):
    mode, tls = ACCEPTORS[acceptor]
    before, active = _snapshot(env.router, acceptor)
    assert active == 0
    _misbehave(env, acceptor, phase, how)
    acceptable = _acceptable(mode, tls, phase, how)

    def settled():
        now, active = _snapshot(env.router, acceptor)
        return active == 0 and any(all(now[k] - before[k] >= v for k, v in exp.items()) for exp in acceptable) \
            and now

    try:
        after = wait_for(settled, 20)
    except AssertionError:
        after = _snapshot(env.router, acceptor)[0]  # the assertion below says what moved
    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert moved in acceptable, (moved, acceptable)
    assert env.router.proc.poll() is None, env.router.stderr_text()
    _good_client(env, acceptor)


# -- 3. many at once ---------------------------------------------------------------------------

async def _raw_handshake(stream, container_id: str):
    """A correct AMQP client over a trio stream: SASL PLAIN + Open, pipelined. Returns the
    peer's first Open (a redirect's failed-establishment Open, or the broker's) and its Close;
    the broker's Open is answered with our Close."""
    await stream.send_all(SASL_HEADER + SASL_INIT + AMQP_HEADER + _open_frame(container_id))
    reader = FrameReader(1 << 20)
    opened = None
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise AssertionError(f"{container_id}: EOF before a Close (Open: {opened})")
        reader.receive_data(data)
        for p in _performatives(reader):
            if isinstance(p, Open) and opened is None:
                opened = p
                if not (p.properties or {}).get(Symbol("amqp:connection-establishment-failed")):
                    await stream.send_all(encode_frame(FRAME_AMQP, 0, Close()))  # the broker's: goodbye
            elif isinstance(p, Close):
                return opened, p


async def test_many_at_once(env):
    """200 concurrent connections over the four acceptors: half reset, FIN, send garbage or leave
    mid-pump; half are well-behaved AMQP clients, all of which must be served (redirect clients
    follow the redirect to the broker). Then every acceptor is back to 0 active connections."""
    rng = random.Random(20240601)
    before = {a: _snapshot(env.router, a)[0] for a in ACCEPTORS}
    all_connected = trio.Event()
    n = 200
    connected = 0
    results: dict[int, str] = {}
    client_ctx = env.client_ctx

    async def open_stream(acceptor: str, *, port: int | None = None, tls: bool | None = None):
        mode, atls = ACCEPTORS[acceptor]
        tls = atls if tls is None else tls
        s = await trio.open_tcp_stream("127.0.0.1", port or env.router.port(acceptor))
        if tls:
            s = trio.SSLStream(s, client_ctx, server_hostname="localhost")
        return s

    async def good(i: int, acceptor: str) -> None:
        nonlocal connected
        mode, tls = ACCEPTORS[acceptor]
        stream = await open_stream(acceptor)
        connected += 1
        if connected == n:
            all_connected.set()
        await all_connected.wait()
        async with stream:
            opened, closed = await _raw_handshake(stream, f"good-{i}")
        if mode == "redirect":
            assert closed.error is not None and str(closed.error.condition) == "amqp:connection:redirect", closed
            info = closed.error.info
            port = int(info[Symbol("port")])
            async with await open_stream(acceptor, port=port) as stream2:
                opened, closed = await _raw_handshake(stream2, f"good-{i}-hop")
        assert (opened.properties or {}).get(Symbol("node-id")) == env.broker.node_id, opened
        assert closed.error is None, closed
        results[i] = "ok"

    async def bad(i: int, acceptor: str) -> None:
        nonlocal connected
        mode, tls = ACCEPTORS[acceptor]
        raw = await trio.open_tcp_stream("127.0.0.1", env.router.port(acceptor))
        connected += 1
        if connected == n:
            all_connected.set()
        await all_connected.wait()
        kind = rng.choice(["reset-now", "garbage", "reset-after-sasl", "fin-after-open", "reset-mid-pump"])
        stream = trio.SSLStream(raw, client_ctx, server_hostname="localhost") if tls else raw
        try:
            if kind == "garbage":
                # on a TLS port the garbage is the ClientHello; elsewhere it is the AMQP header
                await raw.send_all(b"GET / HTTP/1.1\r\n\r\n" + bytes(rng.randrange(256) for _ in range(64)))
                while await raw.receive_some(65536):
                    pass
            elif kind == "reset-after-sasl":
                await stream.send_all(SASL_HEADER + SASL_INIT)
            elif kind == "fin-after-open":
                await stream.send_all(SASL_HEADER + SASL_INIT + AMQP_HEADER + _open_frame(f"bad-{i}"))
                await raw.send_eof()
                while await raw.receive_some(65536):
                    pass
            elif kind == "reset-mid-pump":
                await _raw_handshake_until_open(stream, f"bad-{i}")
        except (trio.BrokenResourceError, OSError):
            pass
        finally:
            _abort(raw.socket)  # a reset (after the FIN / EOF where that came first)
        results[i] = kind

    names = list(ACCEPTORS)
    async with trio.open_nursery() as nursery:
        for i in range(n):
            acceptor = names[i % len(names)]
            nursery.start_soon(good if (i // len(names)) % 2 == 0 else bad, i, acceptor)
    assert sum(1 for v in results.values() if v == "ok") == n // 2
    assert len(results) == n

    def settled():
        snap = {a: _snapshot(env.router, a) for a in ACCEPTORS}
        return all(active == 0 for _c, active in snap.values()) and snap

    snap = await trio.to_thread.run_sync(wait_for, settled, 30)
    assert env.router.proc.poll() is None
    accepted = 0
    for a in ACCEPTORS:
        counters = snap[a][0]
        assert counters["internal_error"] == before[a]["internal_error"], (a, counters)
        accepted += counters["accepted"] - before[a]["accepted"]
    assert accepted == n  # redirect hops go to the broker, not the router
    # every connection ended in exactly one outcome counter
    ended = sum(snap[a][0][k] - before[a][k] for a in ACCEPTORS for k in OUTCOME_COUNTERS)
    assert ended == n, {a: {k: snap[a][0][k] - before[a][k] for k in OUTCOME_COUNTERS
                            if snap[a][0][k] != before[a][k]} for a in ACCEPTORS}
    kinds = [v for v in results.values() if v != "ok"]
    assert {k: kinds.count(k) for k in set(kinds)} and len(set(kinds)) == 5  # every misbehaviour ran
    for a in ACCEPTORS:
        await trio.to_thread.run_sync(_good_client, env, a)


async def _raw_handshake_until_open(stream, container_id: str) -> None:
    """Send a whole handshake and read until the broker's (or the router's) Open arrived."""
    await stream.send_all(SASL_HEADER + SASL_INIT + AMQP_HEADER + _open_frame(container_id))
    got = b""
    while b"\x00\x53\x10" not in got:  # the Open performative's descriptor
        data = await stream.receive_some(65536)
        if not data:
            return
        got += data


# -- the router cuts: drain deadline -----------------------------------------------------------

def test_proxied_clients_still_open_at_the_drain_deadline_are_cut_and_logged_as_cancelled(env, tmp_path):
    """SIGTERM with a short drain: both pump shapes (plain: one task; TLS: a nursery of two,
    whose cancellation trio wraps in an exception group) end as ``cancelled`` in the routing log,
    the clients see their connections end, and the process exits 0."""
    import json

    log_path = tmp_path / "routing.log"
    tls_port = int(env.broker.amqps_url.rsplit(":", 1)[1])
    text = "\n".join([
        f"users-file = {toml_str(env.users)}", "[management]", "port = 0",
        "[routing-log]", f"path = {toml_str(log_path)}",
        *(line for router, port, tls in (("plain", env.broker.port, "false"), ("tls", tls_port, "true")) for line in (
            f"[routers.{router}]", 'key-type = "CLIENT_ID"', f"[routers.{router}.policy]", 'name = "FIRST_ELEMENT"',
            f"[routers.{router}.pool]", "check-period = 500", 'username = "admin"', 'password = "admin-pw"',
            f"[[routers.{router}.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {port}",
            f"tls = {tls}", f"management-url = {toml_str(env.broker.management_url)}")),
        # plain both ways: the one-task pump; TLS both ways: the two-task pump (a nursery)
        "[[acceptors]]", 'name = "proxy-plain"', "port = 0", 'router = "plain"', 'mode = "proxy"',
        "[[acceptors]]", 'name = "proxy-tls"', "port = 0", 'router = "tls"', 'mode = "proxy"',
        f"upstream-ca = {toml_str(env.ca_pem)}", f"tls-cert = {toml_str(env.router_pem)}",
        f"tls-key = {toml_str(env.router_pem)}",
    ]) + "\n"
    router = start_router(tmp_path / "router", text, expect=3, auth=("admin", "admin-pw"),
                          extra_args=["--drain-timeout-s", "1"])
    conns = []
    try:
        for r in ("plain", "tls"):
            wait_for(lambda r=r: router.get(f"/api/v1/routers/{r}/pool")[1]["ready"] == 1, 20)
        for acceptor in ("proxy-plain", "proxy-tls"):
            kw = {"timeout": 20, "allowed_mechs": "PLAIN", "user": "alice", "password": USERS["alice"][0]}
            if acceptor == "proxy-tls":
                d = SSLDomain(SSLDomain.MODE_CLIENT)
                d.set_trusted_ca_db(str(env.ca_pem))
                d.set_peer_authentication(SSLDomain.VERIFY_PEER)
                kw["ssl_domain"] = d
            conn = BlockingConnection(router.url(acceptor), **kw)
            conn.create_sender(f"drain.{acceptor}").send(Message(body="before the drain"))
            conns.append(conn)
        assert router.terminate(30) == 0, router.stderr_text()
        for conn in conns:
            with pytest.raises(ConnectionException):
                conn.create_sender("drain.after").send(Message(body="after the drain"))
    finally:
        router.kill()
        for conn in conns:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - the router cut it
                pass
    closes = [json.loads(line) for line in log_path.read_text().splitlines() if '"event":"close"' in line]
    assert sorted((c["acceptor"], c["close_reason"]) for c in closes) == [("proxy-plain", "cancelled"),
                                                                          ("proxy-tls", "cancelled")], closes
    assert "Traceback" not in router.stderr_text(), router.stderr_text()


# -- accept() itself reporting a connection's network error ------------------------------------

async def test_accept_errors_that_concern_one_connection_do_not_stop_the_acceptor(monkeypatch):
    """Linux hands a new connection's pending network error back from accept() (accept(2)):
    such errors concern that connection only; the loop keeps accepting. In-process, with a real
    listening socket whose accept() reports ECONNRESET / ETIMEDOUT / EHOSTUNREACH once each."""
    import errno
    import os
    from functools import partial

    from router.net import listener as listener_mod
    from router.net.listener import ConnectionLimit, serve_listeners

    class FlakyAccept(socket.socket):
        errors = [errno.ECONNRESET, errno.ETIMEDOUT, errno.EHOSTUNREACH]

        def accept(self):
            if self.errors:
                code = self.errors.pop(0)
                raise OSError(code, errno.errorcode[code])
            return super().accept()

    lsock = FlakyAccept(socket.AF_INET, socket.SOCK_STREAM)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    lsock.setblocking(False)
    # trio wraps only exact socket.socket objects: give it a duplicate of the descriptor, and
    # the accept loop (which accepts on the stdlib socket under the listener) the flaky one
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=os.dup(lsock.fileno()))))
    monkeypatch.setattr(listener_mod, "_stdlib_listener", lambda _listener: lsock)
    served = []
    got_one = trio.Event()

    async def handler(sock, peer):
        served.append(peer)
        sock.close()
        got_one.set()

    limit = ConnectionLimit(None)
    with trio.fail_after(20):
        async with trio.open_nursery() as handlers:
            handlers.start_soon(partial(serve_listeners, handler, [listener], handler_nursery=handlers,
                                        limit=limit, on_rejected=lambda: None))
            client = await trio.open_tcp_stream("127.0.0.1", lsock.getsockname()[1])
            await got_one.wait()
            await client.aclose()
            handlers.cancel_scope.cancel()
    await listener.aclose()
    lsock.close()
    assert len(served) == 1 and not FlakyAccept.errors and limit.active == 0
