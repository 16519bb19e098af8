"""Locust load through Lodestone's front door: AMQP 1.0 users (python-qpid-proton).

    .venv/bin/locust -f loadtest/locustfile.py --headless -u 30 -r 10 -t 60s \\
        --host amqp://127.0.0.1:5672 --scenario steady --csv var/locust/run

Three users, each looping: connect, send a message to its own address, receive it back, close —
every step is a Locust request (request_type = step, name = user):

* ``RedirectUser`` — ``router.client.connect_following_redirects`` (announces
  ``lodestone:follows-redirect``) at ``--redirect-url`` (default ``--host``: the ``auto``
  acceptor redirects such clients). Steps: ``redirect`` (the whole journey; a failure when the
  router did not redirect), ``round trip``, ``close``.
* ``ProxyUser`` — plain proton ``BlockingConnection`` at ``--proxy-url`` (default ``--host``:
  the ``auto`` acceptor proxies a client that announces nothing). Steps: ``connect``,
  ``round trip``, ``close``.
* ``LookupUser`` — ``router.client.TargetLookup`` asks ``--management-url`` where its key goes,
  then ``connect_via_management`` connects there (the front door when the API cannot help).
  Steps: ``lookup`` (a failure when the API gave no usable answer), ``connect``, ``round trip``,
  ``close``. ``--lookup-ttl`` (default 0: every journey asks) is ``TargetLookup``'s ``ttl_s``;
  note that ``TargetLookup`` keeps a refusing answer (``REFUSED_UNAVAILABLE``, below quorum) for
  ``ttl_s`` too, so with a TTL its lookups keep failing that long after the quorum is reached
  (its connections still get through the front door).

Each Locust user has a key (its AMQP container-id, the router's CLIENT_ID key) and an address of
its own, both stable for its lifetime, so stickiness is exercised on every connection — except
with ``--fresh-keys`` (and in the ``redis-kill`` scenario), where every journey takes a new key,
so every routing decision misses the router's local cache tier and asks the shared one (Redis).

Scenarios (``--scenario`` / ``LODESTONE_SCENARIO``) choose the load shape; the killing in the
kill scenarios is done by whoever owns the processes (the test harness, or ``--kill-cmd`` at
``--kill-at`` seconds):

* ``steady`` — ``-u`` users spawned at ``-r``/s, held for ``-t``;
* ``storm`` — every user at once (a connection storm at start-up; start the router before its
  brokers to exercise the quorum gate: clients wait in the gate, none may be refused once the
  quorum is reached);
* ``broker-kill`` — steady, and a broker dies under load (failures only within one
  ``check-period`` of the kill);
* ``redis-kill`` — steady with fresh keys, and Redis (the router's cache backend) dies under load
  (no failures: the router decides from its local tier).

``--events-file PATH`` (``LODESTONE_LOCUST_EVENTS``) writes one JSON line per request
(``t`` = wall-clock seconds at the end of the step, ``type``, ``name``, ``ok``, ``ms``, ``error``)
and one per ``--kill-cmd`` (``{"t": …, "kill": cmd, "rc": …}``), so a harness can check that
every failure falls inside the scenario's window.

Proton's ``BlockingConnection`` is pure Python over ``select`` and ``socket``, which Locust's gevent
monkey-patching makes cooperative: each user's waits yield to the gevent hub, so many users share
one Locust process without blocking each other.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

from locust import LoadTestShape, User, between, events, task
from proton import Message
from proton.utils import BlockingConnection

from router.client import TargetLookup, connect_following_redirects, connect_via_management

SCENARIOS = ("steady", "storm", "broker-kill", "redis-kill")


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    g = parser.add_argument_group("Lodestone")
    g.add_argument("--scenario", choices=SCENARIOS, default=os.environ.get("LODESTONE_SCENARIO", "steady"),
                   help="load shape: steady, storm, broker-kill, redis-kill (env LODESTONE_SCENARIO)")
    g.add_argument("--redirect-url", default=os.environ.get("LODESTONE_REDIRECT_URL", ""),
                   help="front door of RedirectUser (default: --host)")
    g.add_argument("--proxy-url", default=os.environ.get("LODESTONE_PROXY_URL", ""),
                   help="front door of ProxyUser (default: --host)")
    g.add_argument("--management-url", default=os.environ.get("LODESTONE_MANAGEMENT_URL", "http://127.0.0.1:8160"),
                   help="router management API for LookupUser")
    g.add_argument("--fresh-keys", action="store_true",
                   default=os.environ.get("LODESTONE_FRESH_KEYS", "") not in ("", "0"),
                   help="a new key (container-id) every journey: every routing decision is a cache miss "
                        "(on by default in the redis-kill scenario)")
    g.add_argument("--lookup-ttl", type=float, default=float(os.environ.get("LODESTONE_LOOKUP_TTL", "0")),
                   help="TargetLookup ttl_s: seconds an answer is kept (0 = every journey asks the API, "
                        "so each 'lookup' step is a real request)")
    g.add_argument("--router-name", default=os.environ.get("LODESTONE_ROUTER_NAME", "main"))
    g.add_argument("--management-user", default=os.environ.get("LODESTONE_MANAGEMENT_USER", "admin"))
    g.add_argument("--management-password", default=os.environ.get("LODESTONE_MANAGEMENT_PASSWORD", "admin"))
    g.add_argument("--amqp-user", default=os.environ.get("LODESTONE_AMQP_USER", "app"))
    g.add_argument("--amqp-password", default=os.environ.get("LODESTONE_AMQP_PASSWORD", "app"))
    g.add_argument("--amqp-timeout", type=float, default=float(os.environ.get("LODESTONE_AMQP_TIMEOUT", "10")),
                   help="seconds for each blocking AMQP step")
    g.add_argument("--events-file", default=os.environ.get("LODESTONE_LOCUST_EVENTS", ""),
                   help="JSON lines, one per request, with wall-clock timestamps")
    g.add_argument("--kill-cmd", default=os.environ.get("LODESTONE_KILL_CMD", ""),
                   help="a command (split like a shell's, run without one) run once at --kill-at, e.g. 'kill -9 <broker pid>'")
    g.add_argument("--kill-at", type=float, default=float(os.environ.get("LODESTONE_KILL_AT", "0")),
                   help="seconds after the test starts to run --kill-cmd")


# -- the events file ------------------------------------------------------------------------------

_events_lock = threading.Lock()
_events_fh = None


def _write_event(record: dict) -> None:
    if _events_fh is None:
        return
    line = json.dumps(record) + "\n"
    with _events_lock:
        _events_fh.write(line)
        _events_fh.flush()


@events.init.add_listener
def _on_init(environment, **_kw) -> None:
    global _events_fh
    path = environment.parsed_options.events_file if environment.parsed_options else ""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        _events_fh = open(path, "a", encoding="utf-8")


@events.request.add_listener
def _on_request(request_type, name, response_time, response_length, exception=None, **_kw) -> None:
    _write_event({"t": round(time.time(), 3), "type": request_type, "name": name, "ok": exception is None,
                  "ms": round(response_time or 0, 1), "error": None if exception is None else repr(exception)[:300]})


@events.test_start.add_listener
def _on_test_start(environment, **_kw) -> None:
    opts = environment.parsed_options
    if opts is None or not opts.kill_cmd:
        return
    from locust.runners import WorkerRunner

    if isinstance(environment.runner, WorkerRunner):
        return  # distributed (--processes): the master alone kills
    import gevent

    def kill() -> None:
        t = time.time()
        rc = subprocess.call(shlex.split(opts.kill_cmd))
        _write_event({"t": round(t, 3), "kill": opts.kill_cmd, "rc": rc})

    gevent.spawn_later(max(0.0, opts.kill_at), kill)


@events.quitting.add_listener
def _on_quit(**_kw) -> None:
    if _events_fh is not None:
        with _events_lock:
            _events_fh.flush()


# -- the users ------------------------------------------------------------------------------------

def _without_userinfo(url: str) -> str:
    """``url`` without userinfo: the credentials go as keyword arguments (``--amqp-user``)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], parts.path, "", ""))


class _AmqpUser(User):
    """Common loop: connect (subclass), round trip on its own address, close."""

    abstract = True
    wait_time = between(0.1, 0.3)
    kind = "amqp"

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.opts = opts
        self.key = f"locust-{self.kind}-{uuid.uuid4().hex[:12]}"
        self.address = f"locust.{self.kind}.{self.key}"
        self.credentials = {"user": opts.amqp_user if opts else "app",
                            "password": opts.amqp_password if opts else "app",
                            "container_id": self.key, "timeout": opts.amqp_timeout if opts else 10}

    # each step is timed and fired as one request event
    def _step(self, step: str, fn):
        start = time.perf_counter()
        result, exc, length = None, None, 0
        try:
            result = fn()
            if isinstance(result, tuple):
                result, length = result
        except Exception as e:  # noqa: BLE001 - every failure is a failed request
            exc = e
        self.environment.events.request.fire(
            request_type=step, name=self.kind, response_time=(time.perf_counter() - start) * 1000,
            response_length=length, exception=exc, context={"key": self.key})
        if exc is not None:
            raise _StepFailed() from exc
        return result

    def connect(self):  # pragma: no cover - subclasses
        raise NotImplementedError

    @task
    def journey(self) -> None:
        if self.opts is not None and (self.opts.fresh_keys or self.opts.scenario == "redis-kill"):
            self.key = f"locust-{self.kind}-{uuid.uuid4().hex[:12]}"
            self.credentials["container_id"] = self.key
        conn = None
        try:
            conn = self.connect()
            self._step("round trip", lambda: self._round_trip(conn))
        except _StepFailed:
            pass
        finally:
            if conn is not None:
                try:
                    self._step("close", conn.close)
                except _StepFailed:
                    pass

    def _round_trip(self, conn):
        body = uuid.uuid4().hex
        receiver = conn.create_receiver(self.address, credit=1)
        sender = conn.create_sender(self.address)
        sender.send(Message(body=body), timeout=self.credentials["timeout"])
        msg = receiver.receive(timeout=self.credentials["timeout"])
        receiver.accept()
        if msg.body != body:
            raise AssertionError(f"round trip on {self.address}: got {msg.body!r}, sent {body!r}")
        sender.close()
        receiver.close()
        return None, len(body)

    def front_door(self, explicit: str) -> str:
        url = explicit or self.host
        if not url:
            raise ValueError("no front door: pass --host (or --redirect-url / --proxy-url)")
        return _without_userinfo(url)


class _StepFailed(Exception):
    """A step failed (already reported); the journey stops there."""


class RedirectUser(_AmqpUser):
    """Follows ``amqp:connection:redirect`` with ``router.client.connect_following_redirects``."""

    kind = "redirect"

    def connect(self):
        url = self.front_door(self.opts.redirect_url if self.opts else "")

        def go():
            conn = connect_following_redirects(url, **self.credentials)
            hops = getattr(conn, "lodestone_hops", [])
            if len(hops) < 2:
                conn.close()
                raise AssertionError(f"not redirected (hops {hops}): is {url} a redirect or auto acceptor?")
            return conn, len(hops) - 1

        return self._step("redirect", go)


class ProxyUser(_AmqpUser):
    """An unmodified proton ``BlockingConnection``: the router proxies it."""

    kind = "proxy"

    def connect(self):
        url = self.front_door(self.opts.proxy_url if self.opts else "")
        return self._step("connect", lambda: BlockingConnection(url, **self.credentials))


class LookupUser(_AmqpUser):
    """Asks the management API where its key goes (``TargetLookup``), then connects there
    (``connect_via_management``: the front door with redirect following when the API cannot help)."""

    kind = "lookup"

    def on_start(self) -> None:
        super().on_start()
        opts = self.opts
        self.lookup = TargetLookup(opts.management_url, opts.router_name,
                                   auth=(opts.management_user, opts.management_password),
                                   ttl_s=opts.lookup_ttl, timeout_s=2.0)

    def connect(self):
        url = self.front_door(self.opts.redirect_url)

        def ask():
            answer = self.lookup.answer(self.key)
            if answer is None:
                raise ConnectionError(f"management lookup failed: {self.lookup.last_error}")
            if answer.outcome != "OK":
                raise ConnectionError(f"management lookup answered {answer.outcome}")
            return answer, 1

        try:
            self._step("lookup", ask)
        except _StepFailed:
            pass  # connect_via_management still gets through the front door
        return self._step("connect", lambda: connect_via_management(self.lookup, url, key=self.key,
                                                                    **self.credentials))


# -- the load shapes ------------------------------------------------------------------------------

class ScenarioShape(LoadTestShape):
    """``-u``/``-r``/``-t`` shaped by ``--scenario``: ``storm`` spawns every user at once, the
    others ramp at ``-r``/s; all hold until ``-t``."""

    use_common_options = True

    def tick(self):
        opts = self.runner.environment.parsed_options
        users = opts.num_users or 1
        rate = opts.spawn_rate or 1
        limit = opts.run_time
        if limit and self.get_run_time() >= limit:
            return None
        if opts.scenario == "storm":
            return users, users
        return users, rate
