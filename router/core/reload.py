"""What a new router configuration changes, and whether all of it can change while serving.

``plan_reload(old, new)`` compares two checked process configurations (``router.config``'s
``RouterProcessConfig``; read here by attribute only, so this module stays pure) and returns a
:class:`ReloadPlan`: every difference, each either *live* (applied to a running router without
dropping a connection) or *refused* (only a restart can apply it). A reload is all or nothing:
one refused change refuses the whole new configuration, and the running one stays in force.

Files whose content matters but whose path may not change (TLS certificates and keys, the
pins file) are compared by the digests the caller read (``old_files`` / ``new_files``: path →
digest): a certificate renewed in place is a change.

What changes live:

* the process name, the routing log's settings, the management credentials;
* acceptors added or removed, and every setting of an existing acceptor but its address
  (mode, router, timeouts, limits, SASL, upstream TLS, its certificate files and their content:
  new handshakes use the new certificate);
* routers added or removed; a router's key filter, local-target filter, maximum key length,
  policy, pins (file or content), cache timeout, size and fail-back;
* a static pool's targets (added, removed; a changed target is removed and added), and a pool's
  check period and probe credentials (a static pool's only), quorum and failback rule.

What does not (a restart): ``workers``, the management address, the users file's path, an
acceptor's host or port (add one under a new name and remove the old), a router's key type or
Artemis key compatibility (every cached key would mean something else), its local target, a
cache added or removed, its store (backend, file, Redis URL or prefix: its entries would be
lost) and Redis timeouts; a pool added or removed, its membership source, its options, its
state file, and a dynamic pool's check period and credentials.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

#: dataclass fields whose TOML key is not the field name with dashes
_TOML_KEYS = {"check_period_ms": "check-period", "quorum_timeout_ms": "quorum-timeout",
              "timeout_ms": "timeout", "users_file": "users-file"}

#: values never shown (a change says only "changed")
_SECRETS = frozenset({"password", "redis-url"})

#: fields never compared (where a configuration was read from)
_IGNORED = frozenset({"file"})


def _key(field: str) -> str:
    return _TOML_KEYS.get(field) or field.replace("_", "-")


@dataclass(frozen=True)
class Change:
    """One difference: ``part`` is the TOML path (``routers.main.pool.targets.b3``),
    ``detail`` what happened, ``reason`` why it cannot apply live (None: it can)."""

    part: str
    detail: str
    reason: str | None = None

    @property
    def live(self) -> bool:
        return self.reason is None

    def __str__(self) -> str:
        text = f"{self.part}: {self.detail}"
        return text if self.reason is None else f"{text} (cannot change live: {self.reason})"


@dataclass(frozen=True)
class ReloadPlan:
    changes: tuple[Change, ...]

    @property
    def refused(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if not c.live)

    @property
    def ok(self) -> bool:
        """Every change applies live (an empty plan is a reload that changes nothing)."""
        return not self.refused

    def summary(self) -> str:
        """One line: what changed, or why the whole reload is refused."""
        if not self.changes:
            return "no changes"
        if self.refused:
            return "refused: " + "; ".join(str(c) for c in self.refused)
        return f"{len(self.changes)} change{'s' if len(self.changes) != 1 else ''}: " + \
            "; ".join(str(c) for c in self.changes)


def _show(v: Any) -> str:
    if v is None:
        return "none"
    if isinstance(v, (tuple, list)) and v and dataclasses.is_dataclass(v[0]):
        return f"{len(v)} entries"
    if dataclasses.is_dataclass(v):
        return "changed"
    if hasattr(v, "value") and hasattr(v, "name"):      # an enum
        return str(v.value)
    return repr(str(v)) if not isinstance(v, (bool, int, float)) else str(v).lower() if isinstance(v, bool) else str(v)


class _Planner:
    def __init__(self, old_files: Mapping[str, str], new_files: Mapping[str, str]) -> None:
        self.old_files, self.new_files = old_files, new_files
        self.out: list[Change] = []

    def add(self, part: str, detail: str, reason: str | None = None) -> None:
        self.out.append(Change(part, detail, reason))

    def value(self, part: str, old: Any, new: Any, reason: str | None = None) -> None:
        if old != new:
            secret = part.rpartition(".")[2] in _SECRETS
            self.add(part, "changed" if secret else f"{_show(old)} -> {_show(new)}", reason)

    def content(self, part: str, old_path: Any, new_path: Any) -> None:
        """A file named in both configurations: its path, else its content."""
        if old_path != new_path:
            self.value(part, old_path, new_path)
        elif old_path is not None:
            o, n = self.old_files.get(str(old_path)), self.new_files.get(str(new_path))
            if o != n:
                self.add(part, f"{str(new_path)!r}: content changed")

    def fields(self, prefix: str, old: Any, new: Any, *, refused: Mapping[str, str] = {},
               files: tuple[str, ...] = (), skip: tuple[str, ...] = ()) -> None:
        """Compare two dataclasses field by field (``refused``: field → reason)."""
        for f in dataclasses.fields(old):
            name = f.name
            if name in _IGNORED or name in skip:
                continue
            part = f"{prefix}.{_key(name)}" if prefix else _key(name)
            o, n = getattr(old, name), getattr(new, name)
            if name in files:
                self.content(part, o, n)
            else:
                self.value(part, o, n, refused.get(name))

    def named(self, prefix: str, old: Mapping[str, Any], new: Mapping[str, Any], what: str, compare) -> None:
        for name in old:
            if name not in new:
                self.add(f"{prefix}.{name}", f"{what} removed")
        for name in new:
            if name not in old:
                self.add(f"{prefix}.{name}", f"{what} added")
            else:
                compare(f"{prefix}.{name}", old[name], new[name])


_RESTART = "restart the router"


def plan_reload(old: Any, new: Any, *, old_files: Mapping[str, str] | None = None,
                new_files: Mapping[str, str] | None = None) -> ReloadPlan:
    """Every difference between two process configurations, each live or refused (with why)."""
    p = _Planner(old_files or {}, new_files or {})
    p.value("name", old.name, new.name)
    p.value("workers", old.workers, new.workers, "the worker processes are forked at start; " + _RESTART)
    p.value("users-file", old.users_file, new.users_file, "the login gate reads it at start; " + _RESTART)
    p.fields("management", old.management, new.management,
             refused={"host": "the management socket is bound at start",
                      "port": "the management socket is bound at start"})
    p.fields("routing-log", old.routing_log, new.routing_log)
    p.named("acceptors", {a.name: a for a in old.acceptors}, {a.name: a for a in new.acceptors},
            "acceptor", lambda part, o, n: _acceptor(p, part, o, n))
    p.named("routers", dict(old.routers), dict(new.routers), "router",
            lambda part, o, n: _router(p, part, o, n))
    return ReloadPlan(tuple(p.out))


def _acceptor(p: _Planner, part: str, old: Any, new: Any) -> None:
    moved = "an acceptor keeps its socket: add one under a new name and remove this one"
    p.fields(part, old, new, refused={"host": moved, "port": moved},
             files=("tls_cert", "tls_key", "tls_client_ca", "upstream_ca"), skip=("limits",))
    if old.limits != new.limits:              # written in the acceptor's own table
        p.fields(part, old.limits, new.limits)


def _router(p: _Planner, part: str, old: Any, new: Any) -> None:
    keys = "every cached key would mean something else"
    p.fields(part, old, new,
             refused={"key_type": keys, "artemis_keys": keys,
                      "local_target": "the local target is the process's own broker"},
             skip=("policy", "cache", "pool", "pins"))
    if old.policy != new.policy:
        if old.policy is None or new.policy is None:
            p.value(f"{part}.policy", old.policy and old.policy.name, new.policy and new.policy.name)
        else:
            p.value(f"{part}.policy.name", old.policy.name, new.policy.name)
            p.value(f"{part}.policy.properties", dict(old.policy.properties), dict(new.policy.properties))
    _optional(p, f"{part}.pins", old.pins, new.pins,
              lambda: p.content(f"{part}.pins.file", old.pins.file, new.pins.file))
    store = "its entries would be lost; " + _RESTART
    redis = "the Redis client is made at start; " + _RESTART
    _optional(p, f"{part}.cache", old.cache, new.cache,
              lambda: p.fields(f"{part}.cache", old.cache, new.cache,
                               refused={"backend": store, "persisted": store, "path": store,
                                        "redis_url": store, "redis_key_prefix": store,
                                        "redis_timeout_ms": redis, "redis_connect_timeout_ms": redis}),
              reason="a router's cache is made with it; " + _RESTART)
    _optional(p, f"{part}.pool", old.pool, new.pool, lambda: _pool(p, f"{part}.pool", old.pool, new.pool),
              reason="a router's pool is created with it; remove the router and add a new one")


def _optional(p: _Planner, part: str, old: Any, new: Any, compare, reason: str | None = None) -> None:
    """A section that may be absent on either side."""
    if old is None and new is None:
        return
    if old is None:
        p.add(part, "added", reason)
    elif new is None:
        p.add(part, "removed", reason)
    else:
        compare()


def _pool(p: _Planner, part: str, old: Any, new: Any) -> None:
    source = "the membership source is started with the pool"
    refused = {"source": source, "source_options": source,
               "state_path": "the held targets are read from it at start"}
    if old.source != "static":    # the membership follower keeps the period and credentials it started with
        refused.update(check_period_ms=source, username=source, password=source)
    p.fields(part, old, new, refused=refused, skip=("targets",))
    if old.source != "static" or new.source != "static":
        return                    # a dynamic source's targets are not in the file
    olds = {t.name: t for t in old.targets}
    news = {t.name: t for t in new.targets}
    for name in olds:
        if name not in news:
            p.add(f"{part}.targets.{name}", "target removed")
    for name in news:
        if name not in olds:
            p.add(f"{part}.targets.{name}", "target added")
        elif olds[name] != news[name]:
            changed = [_key(f.name) for f in dataclasses.fields(olds[name])
                       if getattr(olds[name], f.name) != getattr(news[name], f.name)]
            p.add(f"{part}.targets.{name}", f"target changed ({', '.join(changed)}): removed and added")
