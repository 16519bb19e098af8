"""Unmodified rhea 3 applications (real ``node``) through a real router in ``redirect`` mode
(and, at the end, through its ``auto`` acceptor: redirected with the helper, proxied without).

The application is ``clients/node/test/app.js`` (an ordinary rhea program); with ``helper`` it
connects with ``clients/node/lodestone-redirect.js`` (one line), without it with rhea's own
``container.connect``. rhea comes from npm (``clients/node/package-lock.json``), installed by
``etc/run-tests.sh`` (or here, by ``npm ci``, when ``node_modules`` is missing). Without ``node``
the module is skipped, and says so loudly.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.nodeclients import node_executable
from proton import Message
from proton.utils import BlockingConnection

from clients_env import USERS

pytestmark = pytest.mark.slow

NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"


@pytest.fixture(scope="module")
def node():
    return node_executable("rhea client tests")


@pytest.fixture(scope="module")
def env(clients_env):
    return clients_env


def run_app(node, env, acceptor: str = "redir", **cfg) -> dict:
    host, port = env.front_door(acceptor).split("://", 1)[1].rsplit(":", 1)
    cfg = {"host": host, "port": int(port), "username": "app", "password": USERS["app"][0],
           "helper": True, "deadline_ms": 20000, **cfg}
    t0 = time.monotonic()
    proc = subprocess.run([node, str(NODE_DIR / "test" / "app.js"), json.dumps(cfg)], cwd=NODE_DIR,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1, (proc.stdout, proc.stderr)
    out = json.loads(lines[0])
    out["took_s"] = time.monotonic() - t0
    out["stderr"] = proc.stderr
    return out


def drain(broker, address: str, timeout_s: float = 3.0) -> list[str]:
    conn = BlockingConnection(broker.amqp_url, timeout=10, user="admin", password=USERS["admin"][0],
                              allowed_mechs="PLAIN")
    try:
        rcv = conn.create_receiver(address, credit=100)
        got = []
        while True:
            try:
                m = rcv.receive(timeout=timeout_s)
            except Exception:  # proton's Timeout: nothing more
                break
            got.append(m.body)
            rcv.accept()
            timeout_s = 1.0
        return got
    finally:
        conn.close()


def key() -> str:
    return f"rhea-{uuid.uuid4().hex[:8]}"


def test_rhea_sender_follows_the_redirect_to_the_broker_management_names(node, env):
    k, address = key(), f"rh.send.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.redirected()
    out = run_app(node, env, container_id=k, address=address, send=10)
    assert out["errors"] == [] and out["accepted"] == 10, out
    assert out["events"].count("opened") == 1 and out["opened_nodes"] == [target.node_id]
    assert out["hops"] == [env.front_door().split("://", 1)[1], f"127.0.0.1:{target.port}"]
    assert out["link_same"] and "lodestone:follows-redirect" in out["desired_capabilities"]
    assert env.redirected() == before + 1
    assert sorted(drain(target, address)) == sorted(f"n{i}" for i in range(10))


def test_rhea_receiver_is_recreated_on_the_broker(node, env):
    k, address = key(), f"rh.recv.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    conn = BlockingConnection(target.amqp_url, timeout=10, user="admin", password=USERS["admin"][0],
                              allowed_mechs="PLAIN")
    snd = conn.create_sender(address)
    for i in range(5):
        snd.send(Message(body=f"p{i}"))
    conn.close()
    out = run_app(node, env, container_id=k, address=address, receive=5)
    assert out["errors"] == [] and sorted(out["received"]) == [f"p{i}" for i in range(5)], out
    assert out["opened_nodes"] == [target.node_id] and out["link_same"]


def test_rhea_redirect_loop_and_too_many_hops_are_clear_errors(node, env):
    ping, pong = env.loop_ports
    out = run_app(node, env, "ping", container_id=key(), address="rh.loop", send=1)
    assert out["events"] == ["error"] and out["sent"] == 0, out
    (err,) = out["errors"]
    assert err["condition"] == "amqp:connection:redirect" and "redirect loop" in err["description"]
    assert err["lodestone"]["name"] == "RedirectLoop"
    assert err["lodestone"]["hops"] == [f"127.0.0.1:{ping}", f"127.0.0.1:{pong}", f"127.0.0.1:{ping}"]
    out = run_app(node, env, "ping", container_id=key(), address="rh.hops", send=1, max_hops=1)
    assert out["events"] == ["error"], out
    assert out["errors"][0]["lodestone"]["name"] == "TooManyRedirects"
    assert "more than 1 redirects" in out["errors"][0]["description"]


def test_rhea_not_ready_router_is_retried_then_reported(node, env):
    before = env.router.counters("q-redir")["refused"]
    out = run_app(node, env, "q-redir", container_id=key(), address="rh.q", send=1, refusal_backoff_ms=[100, 200])
    assert out["events"] == ["error"] and out["sent"] == 0, out
    (err,) = out["errors"]
    assert err["condition"] == "amqp:connection:forced" and "is not ready" in err["description"]
    assert "gave up after 3 attempts" in err["description"] and err["lodestone"]["name"] == "RouterRefused"
    assert env.router.counters("q-redir")["refused"] == before + 3


def test_plain_rhea_without_the_helper_does_not_get_through(node, env):
    """Documents the problem: rhea reports the router's failed connection as opened, then treats
    the redirect as fatal; the message reaches no broker."""
    address = f"rh.plain.{uuid.uuid4().hex[:6]}"
    out = run_app(node, env, container_id=key(), address=address, send=1, helper=False, deadline_ms=5000)
    assert out["sent"] == 0 and out["accepted"] == 0, out
    assert out["opened_nodes"] == [None]  # "opened" — the router's failed-establishment Open
    assert [e["condition"] for e in out["errors"]] == ["amqp:connection:redirect"]
    for b in env.brokers:
        assert drain(b, address, timeout_s=0.5) == []


# -- through an ``auto`` acceptor --------------------------------------------------------------------
# The helper announces ``lodestone:follows-redirect``: redirected, then connected straight to the
# broker. Plain rhea announces nothing: proxied to the same broker. The application holds its
# connection open (``hold``) while the test reads the brokers' connection lists.

def run_app_holding(node, env, acceptor: str = "auto", **cfg) -> dict:
    """``run_app`` for an application that keeps its connection until stdin ends; adds
    ``on_brokers``: the brokers listing its container id while it was still connected."""
    host, port = env.front_door(acceptor).split("://", 1)[1].rsplit(":", 1)
    cfg = {"host": host, "port": int(port), "username": "app", "password": USERS["app"][0],
           "helper": True, "deadline_ms": 20000, "hold": True, **cfg}
    with subprocess.Popen([node, str(NODE_DIR / "test" / "app.js"), json.dumps(cfg)], cwd=NODE_DIR,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            line = ""
            while not line.startswith("{"):
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
            out = json.loads(line)
            out["on_brokers"] = env.brokers_with(cfg["container_id"])
            rest, stderr = proc.communicate(timeout=30)  # closes stdin: the application ends
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, stderr
    assert not [x for x in rest.splitlines() if x.startswith("{")], rest
    out["stderr"] = stderr
    return out


def preload(broker, address: str, bodies: list[str]) -> None:
    conn = BlockingConnection(broker.amqp_url, timeout=10, user="admin", password=USERS["admin"][0],
                              allowed_mechs="PLAIN")
    try:
        snd = conn.create_sender(address)
        for b in bodies:
            snd.send(Message(body=b))
    finally:
        conn.close()


def test_rhea_auto_helper_is_redirected_to_the_broker_management_names(node, env):
    k, address = key(), f"rh.au.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.auto_counts()
    out = run_app_holding(node, env, container_id=k, address=address, send=10)
    assert out["errors"] == [] and out["accepted"] == 10 and out["sent"] == 10, out
    assert out["events"].count("opened") == 1 and out["opened_nodes"] == [target.node_id], out
    assert out["on_brokers"] == [target.node_id]  # connected to the broker itself
    assert out["hops"] == [env.front_door("auto").split("://", 1)[1], f"127.0.0.1:{target.port}"]
    assert out["link_same"] and "lodestone:follows-redirect" in out["desired_capabilities"]
    env.assert_routed(k, before, "redirected", target)
    assert sorted(drain(target, address)) == sorted(f"n{i}" for i in range(10))


def test_rhea_auto_plain_sender_is_proxied_to_the_broker_management_names(node, env):
    """Plain rhea (``container.connect``): proxied, it sees the broker's Open, no error, and every
    message arrives on the broker the API names."""
    k, address = key(), f"rh.aup.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.auto_counts()
    out = run_app_holding(node, env, container_id=k, address=address, send=10, helper=False)
    assert out["errors"] == [] and out["accepted"] == 10 and out["sent"] == 10, out
    assert out["events"] == ["opened"] and out["opened_nodes"] == [target.node_id], out
    assert out["on_brokers"] == [target.node_id]  # the proxied connection, as the broker lists it
    assert out["hops"] is None and "lodestone:follows-redirect" not in (out["desired_capabilities"] or [])
    env.assert_routed(k, before, "proxied", target)
    assert sorted(drain(target, address)) == sorted(f"n{i}" for i in range(10))
    assert [env.queue(b, address) for b in env.brokers if b is not target] == [None, None]


def test_rhea_auto_plain_receiver_is_proxied(node, env):
    k, address = key(), f"rh.aur.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    preload(target, address, [f"p{i}" for i in range(5)])
    before = env.auto_counts()
    out = run_app_holding(node, env, container_id=k, address=address, receive=5, helper=False)
    assert out["errors"] == [] and sorted(out["received"]) == [f"p{i}" for i in range(5)], out
    assert out["opened_nodes"] == [target.node_id] and out["on_brokers"] == [target.node_id], out
    env.assert_routed(k, before, "proxied", target)
