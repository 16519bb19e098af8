"""Topology-aware connections for proton's ``BlockingConnection``: learn the cluster's members
from each broker's Open and balance new connections over them.

    connector = ClusterConnector("(amqp://b1:5672,amqp://b2:5672)", policy="round-robin",
                                 user="app", password="app", timeout=10)
    conn = connector.connect()        # a proton BlockingConnection, to the member the policy picked
    connector.members                 # what the last Open said: [Member(url, node_id), ...]

Each :meth:`ClusterConnector.connect` asks the pure :class:`~router.client.topology.Topology`
for the brokers to try (the policy's pick among the known members, the other members, then the
starting URLs), opens a ``BlockingConnection`` to the first that takes it, and learns the
member list (``lodestone:cluster-members``) from that broker's Open. A broker that refuses or
does not answer (proton's ``ConnectionException`` — ``ConnectionClosed`` included — or
``Timeout``) is skipped; when none is left :class:`NoBrokerReachable` says what each one did.
Connections already open are not moved: only new ones follow the policy (as Artemis clients).
A member's connector carries no credentials: those of the starting URL (``user:pw@``) are used,
or ``user``/``password`` keyword arguments.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Sequence

from proton import ConnectionException, Timeout
from proton.utils import BlockingConnection

from router.client.errors import NoBrokerReachable
from router.client.topology import Member, Topology, redacted, with_userinfo
from router.client.discovered import Discoverer, parse_discovery_url

log = logging.getLogger("router.client")


class ClusterConnector:
    """New ``BlockingConnection`` objects spread over a cluster's live members.

    ``urls``: one URL, Artemis's list ``(amqp://a:1,amqp://b:2)`` or a sequence of URLs — the
    starting point, used until an Open lists the members and whenever none of them answers — or
    ``udp://group:port?…``: the brokers heard on that discovery group (:mod:`router.client.discovered`).
    ``policy``: ``round-robin`` (default), ``random``, ``random-sticky``, ``first-element``
    (Artemis's class names work too). ``rng``: a ``random.Random`` (seed it for repeatable
    choices). ``kwargs`` go to every ``BlockingConnection`` (``timeout``, ``user``, ``password``,
    ``allowed_mechs``, ``ssl_domain``, ``container_id``, …); :meth:`connect` takes more for one
    connection. Safe to share between threads (one connection is chosen at a time).
    """

    def __init__(self, urls: str | Sequence[str], *, policy: str = "round-robin",
                 rng: random.Random | None = None, **kwargs):
        self.discoverer = None
        if isinstance(urls, str) and urls.strip().startswith("udp://"):
            # a discovery group (router.client.discovered): the brokers heard are the starting point
            self.discoverer = Discoverer(parse_discovery_url(urls))
            urls = "amqp://0.0.0.0:0"  # a placeholder: replaced by what is heard before each plan
        self.topology = Topology(urls, policy=policy, rng=rng)
        if self.discoverer is not None:
            self.topology.starting = []
        self._waited = False
        self.kwargs = kwargs
        self._credentials_from = next((m.url for m in self.topology.starting if "@" in m.url), None)
        self._lock = threading.Lock()

    @property
    def members(self) -> list[Member]:
        """The members the last Open listed (empty until one did)."""
        return list(self.topology.members)

    def connect(self, **kwargs) -> BlockingConnection:
        """Open a ``BlockingConnection`` to the broker the policy picks (see the class doc). The
        connection has ``lodestone_url`` (where it went, without a password) and ``lodestone_node_id`` (the Open's
        ``node-id``, or None). Raises :class:`NoBrokerReachable`."""
        if self.discoverer is not None:
            heard = self.discoverer.members(wait=not self._waited)
            self._waited = True
            with self._lock:
                self.topology.starting = heard
            if not heard and not self.topology.members:
                spec = self.discoverer.spec
                raise NoBrokerReachable([(f"udp://{spec.group_address}:{spec.group_port}",
                                          TimeoutError("no broker heard on the discovery group"))])
        with self._lock:
            plan = self.topology.plan()
        options = {**self.kwargs, **kwargs}
        attempts: list[tuple[str, Exception]] = []
        for member in plan:
            url = with_userinfo(member.url, self._credentials_from) if self._credentials_from else member.url
            try:
                conn = BlockingConnection(url, **options)
            except (ConnectionException, Timeout) as exc:
                log.info("broker %s did not take the connection: %s", redacted(member.url), exc)
                attempts.append((redacted(member.url), exc))
                continue
            props = conn.conn.remote_properties
            with self._lock:
                if self.topology.learn(props):
                    log.info("cluster members: %s", ", ".join(self.topology.urls()))
            conn.lodestone_url = redacted(member.url)
            node_id = props.get("node-id") if props else None
            conn.lodestone_node_id = str(node_id) if node_id is not None else None
            return conn
        raise NoBrokerReachable(attempts)


    def close(self) -> None:
        """Stop listening to the discovery group (a ``udp://`` starting point); nothing otherwise."""
        if self.discoverer is not None:
            self.discoverer.close()


__all__ = ["ClusterConnector", "NoBrokerReachable"]
