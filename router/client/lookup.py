"""Management-API lookups: ask the router where a key goes, then connect straight there.

Artemis documents two ways for a client to find its broker: be redirected at connect time, or
ask the connection router's management API (``getTargetAsJSON(key)``) and connect to the
connector it names. Lodestone's router answers the second at
``GET /api/v1/routers/<router>/target?key=K`` (HTTP Basic credentials of a ``manage`` user)::

    {"nodeID": "...", "local": false, "outcome": "OK",
     "connector": {"name": "b1", "params": {"host": "10.0.0.7", "port": 5672, "sslEnabled": false}, ...}}

:class:`TargetLookup` asks that, keeps each answer for ``ttl_s`` seconds (the router's sticky
cache makes the answer stable; the TTL bounds how long a client keeps going to a broker the
router has since moved the key away from) and returns ``None`` whenever the API cannot help —
down, slow, 401/403/404/5xx, a refusing outcome (``REFUSED_*``), a local target (no connector)
— so the caller falls back to the front door, where redirect following does the rest.

    lookup = TargetLookup("http://127.0.0.1:8160", "main", auth=("admin", "admin"))
    conn = connect_via_management(lookup, "amqp://127.0.0.1:5672", key="orders-1",
                                  container_id="orders-1", user="app", password="app")

The event-driven helper takes the same object: ``connect(container, url, lookup=lookup)``.
"""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import quote

from proton import ProtonException

from router.client.hops import HopPlan
from router.client.blocking import connect_following_redirects
from router.client.blocking import RouterRefusedClosed

log = logging.getLogger("router.client")


@dataclass(frozen=True)
class Answer:
    """What the management API said for one key: where to connect (or None: use the front door)."""

    host: str | None
    port: int | None
    tls: bool
    node_id: str | None
    outcome: str


@dataclass
class AnswerCache:
    """Answers per key, each kept ``ttl_s`` seconds after it was fetched (pure: takes ``now``)."""

    ttl_s: float
    entries: dict[str, tuple[float, Answer]] = field(default_factory=dict)

    def get(self, key: str, now: float) -> Answer | None:
        hit = self.entries.get(key)
        if hit is None:
            return None
        if now - hit[0] >= self.ttl_s:
            del self.entries[key]
            return None
        return hit[1]

    def put(self, key: str, answer: Answer, now: float) -> None:
        self.entries[key] = (now, answer)

    def invalidate(self, key: str) -> None:
        self.entries.pop(key, None)


def parse_answer(body) -> Answer:
    """An :class:`Answer` from the JSON body of ``/target?key=``; malformed → a refusing answer."""
    if not isinstance(body, dict):
        return Answer(None, None, False, None, "MALFORMED")
    outcome = str(body.get("outcome", "OK" if body.get("connector") else "REFUSED_UNAVAILABLE"))
    connector = body.get("connector")
    params = connector.get("params") if isinstance(connector, dict) else None
    if outcome != "OK" or not isinstance(params, dict):
        return Answer(None, None, False, body.get("nodeID"), outcome if outcome != "OK" else "LOCAL")
    host, port = params.get("host"), params.get("port")
    try:
        port = int(port)
    except (TypeError, ValueError):
        return Answer(None, None, False, body.get("nodeID"), "MALFORMED")
    if not isinstance(host, str) or not host:
        return Answer(None, None, False, body.get("nodeID"), "MALFORMED")
    tls = str(params.get("sslEnabled", False)).lower() == "true"
    return Answer(host, port, tls, body.get("nodeID"), "OK")


class TargetLookup:
    """Asks ``<management_url>/api/v1/routers/<router>/target?key=`` and caches the answers.

    ``auth``: (user, password) for HTTP Basic. ``timeout_s`` bounds each request. Failed
    requests are not cached (the next call asks again).
    """

    def __init__(self, management_url: str, router: str, *, auth: tuple[str, str] | None = None,
                 ttl_s: float = 30.0, timeout_s: float = 2.0, clock=time.monotonic):
        self.base = management_url.rstrip("/")
        self.router = router
        self.auth = auth
        self.timeout_s = timeout_s
        self.cache = AnswerCache(ttl_s)
        self.clock = clock
        self.requests = 0  # HTTP requests made (a cache hit makes none)
        self.last_error: str | None = None

    def answer(self, key: str) -> Answer | None:
        """The (cached) answer for ``key``, or None when the API could not be asked."""
        now = self.clock()
        hit = self.cache.get(key, now)
        if hit is not None:
            return hit
        url = f"{self.base}/api/v1/routers/{quote(self.router, safe='')}/target?key={quote(key, safe='')}"
        req = urllib.request.Request(url)
        if self.auth is not None:
            token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
            req.add_header("Authorization", "Basic " + token)
        self.requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            self.last_error = f"HTTP {exc.code}"
            exc.close()
            log.info("management lookup of %r failed: %s", key, self.last_error)
            return None
        except (OSError, ValueError) as exc:  # refused, unreachable, timeout, bad JSON
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.info("management lookup of %r failed: %s", key, self.last_error)
            return None
        answer = parse_answer(body)
        self.last_error = None if answer.outcome == "OK" else answer.outcome
        if answer.outcome == "OK":   # a refusal (not ready) is not kept: ask again next time
            self.cache.put(key, answer, now)
        return answer

    def url_for(self, key: str, front_door: str) -> str | None:
        """The URL of the broker for ``key`` (the front door's scheme unless the connector says
        TLS, its credentials and path), or None: use the front door."""
        a = self.answer(key)
        if a is None or a.outcome != "OK":
            return None
        plan = HopPlan(front_door)
        return plan.url_for(a.host, a.port, scheme="amqps" if a.tls else None)

    def invalidate(self, key: str) -> None:
        """Forget the answer for ``key`` (its broker did not take the connection)."""
        self.cache.invalidate(key)


def connect_via_management(lookup: TargetLookup, front_door: str, *, key: str | None = None, **kwargs):
    """A ``BlockingConnection`` straight to the broker the management API names for ``key``
    (default: the ``container_id`` keyword); when the API cannot help, or that broker does not
    take the connection, through ``front_door`` with redirect following
    (:func:`~router.client.blocking.connect_following_redirects`); when the front door stays
    "not ready", the API is asked once more. The connection's ``lodestone_route`` is
    ``"direct"`` or ``"front-door"``."""

    key = key if key is not None else kwargs.get("container_id")
    if key is None:
        raise ValueError("connect_via_management needs key= (or container_id=)")
    direct = lookup.url_for(key, front_door)
    if direct is not None:
        try:
            conn = connect_following_redirects(direct, **kwargs)
            conn.lodestone_route = "direct"
            return conn
        except ProtonException as exc:
            lookup.invalidate(key)
            log.info("direct connection to %s failed (%s); using the front door", direct, exc)

    try:
        conn = connect_following_redirects(front_door, **kwargs)
    except RouterRefusedClosed as refused:
        if not refused.transient:
            raise
        # not ready after the retries: Artemis' other way in — ask the API once more
        lookup.invalidate(key)
        direct = lookup.url_for(key, front_door)
        if direct is None:
            raise
        conn = connect_following_redirects(direct, **kwargs)
        conn.lodestone_route = "direct"
        return conn
    conn.lodestone_route = "front-door"
    return conn
