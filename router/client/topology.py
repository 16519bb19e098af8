"""Pure decisions of the topology-aware client: which broker a new connection goes to.

Theory of operation. A Lodestone cluster node lists the cluster's live members in the Open of
every connection it accepts (property ``lodestone:cluster-members``, a list of maps
``{"node-id": …, "connector": "amqp://host:port"}``, the answering node first; docs/cluster.md
"Topology to clients"). A client starts from one URL or a list of them — Artemis's syntax
``(amqp://a:5672,amqp://b:5672)`` — and :class:`Topology` keeps what it learned from the last
Open: each new connection goes to the member the load-balancing policy picks, then (if that
one does not answer) to the other members in order, then to the starting URLs it has not tried.
A connection whose Open carries no member list (a node without a cluster, another broker)
leaves what is known as it is. So a client learns a change (a member joined, one left) on its
next connection, as an Artemis client does from its topology.

The policies are Artemis's connection load-balancing policies
(``connection-load-balancing-policy-class-name``), each with ``select(n) -> index``:

* ``round-robin`` (Artemis's default, ``RoundRobinConnectionLoadBalancingPolicy``): starts at a
  random member, then the next one each time;
* ``random`` (``RandomConnectionLoadBalancingPolicy``): a random member each time;
* ``random-sticky`` (``RandomStickyConnectionLoadBalancingPolicy``): a random member, then the
  same one as long as it is in the list;
* ``first-element`` (``FirstElementConnectionLoadBalancingPolicy``): always the first member.

Members are kept in node-id order, whichever node answered, so the rotation does not jump when
the answering node changes. Nothing here does I/O or reads a clock; randomness comes from the
``random.Random`` the caller passes (seeded in tests). The shell is :mod:`router.client.balanced`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

from broker.wire.frames import CLUSTER_MEMBERS, MAX_CLUSTER_MEMBERS

#: The Open property a cluster node lists its live members in (``broker.cluster.bridge``), and
#: the most entries read from one Open (the broker sends at most as many).
TOPOLOGY_PROPERTY, MAX_MEMBERS = CLUSTER_MEMBERS, MAX_CLUSTER_MEMBERS
_SCHEMES = ("amqp", "amqps")


class UrlListError(ValueError):
    """A starting URL (list) the client cannot use (a Local error: fix the argument)."""


@dataclass(frozen=True)
class Member:
    """One broker a new connection may go to (``node_id`` None for a starting URL)."""

    url: str
    node_id: str | None = None


def _check_url(url: str, where: str) -> str:
    url = url.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise UrlListError(f"{where}: {url!r}: {exc}") from None
    if parts.scheme not in _SCHEMES or not parts.hostname:
        raise UrlListError(f"{where}: {url!r} is not amqp://host[:port] or amqps://host[:port]")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise UrlListError(f"{where}: {url!r}: a broker URL has no path, query or fragment")
    return url


def parse_urls(spec: str | Sequence[str]) -> list[str]:
    """The starting URLs: one URL, Artemis's list syntax ``(amqp://a:1,amqp://b:2)``, or a
    sequence of URLs. Raises :class:`UrlListError` for anything else (an empty list, an empty
    entry, a scheme other than ``amqp``/``amqps``, text after the closing parenthesis)."""
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("("):
            if not text.endswith(")"):
                raise UrlListError(f"{spec!r}: a URL list is (url,url,...) with nothing after the ')'")
            entries = text[1:-1].split(",")
        else:
            entries = [text]
    else:
        entries = list(spec)
    if not entries or entries == [""]:
        raise UrlListError(f"{spec!r}: no URL")
    out: list[str] = []
    for e in entries:
        if not isinstance(e, str) or not e.strip():
            raise UrlListError(f"{spec!r}: an empty entry")
        url = _check_url(e, "starting URL")
        if url not in out:
            out.append(url)
    return out


def _text(v) -> str | None:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return str(v) if isinstance(v, str) else None


def members_from_properties(properties) -> list[Member] | None:
    """The members an Open's properties list (``lodestone:cluster-members``), in node-id order,
    or None when the Open carries no such list. Entries that are not a map with an
    ``amqp``/``amqps`` connector are skipped; at most :data:`MAX_MEMBERS` are read."""
    if not properties:
        return None
    try:
        raw = properties.get(TOPOLOGY_PROPERTY)
    except AttributeError:
        return None
    if not isinstance(raw, (list, tuple)):
        return None
    seen: dict[str, Member] = {}
    for entry in raw[:MAX_MEMBERS]:
        if not isinstance(entry, dict):
            continue
        connector, node_id = _text(entry.get("connector")), _text(entry.get("node-id"))
        if not connector:
            continue
        try:
            url = _check_url(connector, "member connector")
        except UrlListError:
            continue
        key = node_id or url
        if key not in seen:
            seen[key] = Member(url, node_id)
    return sorted(seen.values(), key=lambda m: (m.node_id or "", m.url))


def with_userinfo(url: str, like: str) -> str:
    """``url`` with the ``user:password@`` of ``like`` when it has none of its own (a member's
    connector never carries credentials; the starting URL may)."""
    target, source = urlsplit(url), urlsplit(like)
    if target.username is not None or source.username is None:
        return url
    userinfo = source.netloc.rsplit("@", 1)[0]
    return urlunsplit(target._replace(netloc=f"{userinfo}@{target.netloc}"))


def redacted(url: str) -> str:
    """``url`` without its password, for logs and errors."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


# -- policies (Artemis's ConnectionLoadBalancingPolicy: select(max) -> index) -------------------

class RoundRobin:
    """A random first member, then the next one each time (Artemis's default)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.pos: int | None = None

    def select(self, n: int) -> int:
        if self.pos is None:
            self.pos = self.rng.randrange(n)
        else:
            self.pos = (self.pos + 1) % n
        return self.pos


class Random:
    """A random member each time."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def select(self, n: int) -> int:
        return self.rng.randrange(n)


class RandomSticky:
    """A random member, then that one as long as the list is as long (Artemis keeps the index;
    a shorter list draws again rather than running past its end)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.pos: int | None = None

    def select(self, n: int) -> int:
        if self.pos is None or self.pos >= n:
            self.pos = self.rng.randrange(n)
        return self.pos


class FirstElement:
    """Always the first member."""

    def __init__(self, rng: random.Random | None = None):
        pass

    def select(self, n: int) -> int:
        return 0


#: Policy names (and Artemis's class names, for a client configured from an Artemis URL) to
#: factories taking a ``random.Random``; add an entry to plug in another policy.
POLICIES: dict[str, Callable[[random.Random], object]] = {
    "round-robin": RoundRobin, "random": Random, "random-sticky": RandomSticky, "first-element": FirstElement,
    "RoundRobinConnectionLoadBalancingPolicy": RoundRobin, "RandomConnectionLoadBalancingPolicy": Random,
    "RandomStickyConnectionLoadBalancingPolicy": RandomSticky,
    "FirstElementConnectionLoadBalancingPolicy": FirstElement,
}


def make_policy(name: str, rng: random.Random):
    """The policy called ``name`` (see :data:`POLICIES`); an unknown name is a :class:`ValueError`."""
    short = name.rsplit(".", 1)[-1]
    try:
        return POLICIES[short](rng)
    except KeyError:
        raise ValueError(f"unknown connection load-balancing policy {name!r}; "
                         f"known: round-robin, random, random-sticky, first-element") from None


class Topology:
    """What one client knows: its starting URLs and the members the last Open listed."""

    def __init__(self, urls: str | Sequence[str], *, policy: str = "round-robin", rng: random.Random | None = None):
        self.starting = [Member(u) for u in parse_urls(urls)]
        self.policy_name = policy
        self.policy = make_policy(policy, rng if rng is not None else random.Random())
        self.members: list[Member] = []   # learned; empty until an Open lists them

    def plan(self) -> list[Member]:
        """The brokers to try for a new connection, in order: the policy's pick among the known
        members (the starting URLs while none is known), the other members after it, then the
        starting URLs not already in the list."""
        pool = self.members or self.starting
        first = self.policy.select(len(pool))
        order = pool[first:] + pool[:first]
        urls = {m.url for m in order}
        order += [m for m in self.starting if m.url not in urls]
        return order

    def learn(self, properties) -> bool:
        """Take the member list of an Open's properties; True if it changed what is known. An
        Open without one (or with none usable) changes nothing."""
        members = members_from_properties(properties)
        if not members or members == self.members:
            return False
        self.members = members
        return True

    def urls(self) -> list[str]:
        return [m.url for m in (self.members or self.starting)]


__all__ = ["TOPOLOGY_PROPERTY", "MAX_MEMBERS", "Member", "Topology", "UrlListError", "parse_urls",
           "members_from_properties", "with_userinfo", "redacted", "make_policy", "POLICIES",
           "RoundRobin", "Random", "RandomSticky", "FirstElement"]
