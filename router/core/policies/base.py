"""The policy plug-in contract: ``Target``, ``Policy`` and property parsing helpers.

A policy sees the pool's *ready* targets, in pool order, and the already-transformed key
(Artemis ``Policy.selectTarget``). It is plain logic: any randomness comes from the seeded
``random.Random`` it was built with, and it never reads a clock.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from router.errors import PolicyError

NULL_KEY = "NULL"
"""The key of a connection that has no value for the key type (or failed the key filter)."""


@dataclass(frozen=True, slots=True)
class Target:
    """A broker a connection can be sent to.

    ``name`` is the config name; ``node_id`` is the broker's node UUID, ``None`` until a probe
    learns it. ``identity`` (node id, else name, else host:port) is what the hash policies hash and
    what the sticky cache stores.

    ``pair`` names the HA pair this target is a member of (a primary and its backups serve one
    node id, whichever is active; ``router.core.pool``): ``None`` for a target on its own.
    ``backup`` marks a backup member (the primary is preferred when both are active).
    """

    node_id: str | None
    host: str
    port: int
    tls: bool = False
    management_url: str | None = None
    name: str = ""
    pair: str | None = None
    backup: bool = False

    @property
    def identity(self) -> str:
        """Stable id used by hash rings, caches and pins: node id, else config name, else host:port."""
        return self.node_id or self.name or f"{self.host}:{self.port}"

    @property
    def slot(self) -> str:
        """The config slot this target fills (name, else host:port): survives learning the node id."""
        return self.name or f"{self.host}:{self.port}"

    @property
    def group(self) -> str:
        """The routing identity group this target belongs to: its pair, else its own slot. The
        pool offers policies one target per group."""
        return self.pair or self.name or f"{self.host}:{self.port}"


class Policy:
    """Base class of routing policies; subclass it and register the class (or any factory).

    A factory is called as ``factory(properties, rng)`` with the policy's string properties and a
    seeded ``random.Random``; a ``Policy`` subclass is itself a valid factory.

    Override:
      * ``transform_key(key) -> str`` — change the key before the local filter, cache and
        selection (default: unchanged). The router never passes the ``NULL`` key.
      * ``select_target(targets, key) -> Target | None`` — pick one of ``targets`` (the ready ones
        in pool order; may be empty) or ``None`` to refuse (REFUSED_UNAVAILABLE).
      * ``observe(target, connection_count)`` — called by the pool after every probe of a target
        (``connection_count`` is ``None`` when the probe failed). Default: ignored.
    ``PROPERTIES`` lists the accepted property names; any other name is rejected.
    """

    name: ClassVar[str] = "CUSTOM"
    PROPERTIES: ClassVar[frozenset[str]] = frozenset()
    key_deterministic: ClassVar[bool] = False
    """True when the target depends only on the key and the ready-target set (dry runs need it)."""

    def __init__(self, properties: Mapping[str, str] | None = None,
                 rng: random.Random | None = None) -> None:
        self.properties: dict[str, str] = {str(k): str(v) for k, v in (properties or {}).items()}
        unknown = sorted(set(self.properties) - self.PROPERTIES)
        if unknown:
            known = ", ".join(sorted(self.PROPERTIES)) or "none"
            raise PolicyError(f"{self.name}: unknown property {unknown[0]!r} (known: {known})")
        self.rng = rng if rng is not None else random.Random(0)

    def transform_key(self, key: str) -> str:
        """Return the key used for the local filter, cache and selection (default: ``key``)."""
        return key

    def select_target(self, targets: Sequence[Target], key: str) -> Target | None:
        """Choose a target among the ready ``targets`` (pool order) for ``key``; None refuses."""
        return None

    def observe(self, target: Target, connection_count: int | None) -> None:
        """Probe feedback from the pool (live connection count, or None on a failed probe)."""

    # -- helpers for subclasses ---------------------------------------------------------------
    def int_property(self, key: str, default: int | None = None, *, min: int | None = None) -> int:
        """Parse an integer property; a missing required one or a bad value raises PolicyError."""
        raw = self.properties.get(key)
        if raw is None:
            if default is None:
                raise PolicyError(f"{self.name}: property {key} is required")
            return default
        try:
            value = int(raw.strip())
        except ValueError:
            raise PolicyError(f"{self.name}: property {key}={raw!r} must be an integer") from None
        if min is not None and value < min:
            raise PolicyError(f"{self.name}: property {key}={raw!r} must be >= {min}")
        return value

    def float_property(self, key: str, default: float | None = None, *,
                       min: float | None = None) -> float | None:
        """Parse a float property (``None`` default means optional)."""
        raw = self.properties.get(key)
        if raw is None:
            return default
        try:
            value = float(raw.strip())
        except ValueError:
            raise PolicyError(f"{self.name}: property {key}={raw!r} must be a number") from None
        if value != value or (min is not None and value < min):
            raise PolicyError(f"{self.name}: property {key}={raw!r} must be >= {min}")
        return value

    def choice_property(self, key: str, choices: Sequence[str], default: str) -> str:
        """Parse an enumerated property (case-insensitive, returned upper-case)."""
        raw = self.properties.get(key, default).strip().upper()
        if raw not in choices:
            raise PolicyError(f"{self.name}: property {key}={self.properties.get(key)!r} must be "
                              f"one of {', '.join(choices)}")
        return raw

    #: True when the policy counts live assignments (CONSISTENT_HASH with LOAD_FACTOR): the
    #: router then calls ``choose_target`` for management lookups and ``release`` when an
    #: assignment ends (its cache entry goes, or without a cache its connection closes).
    tracks_assignments = False
    #: True when the policy needs each target's connection count (LEAST_CONNECTIONS): a probe
    #: without one makes the target not ready, as Artemis's policy probe fails then
    needs_connection_count = False
    #: True when the choice follows pool order (FIRST_ELEMENT): a new connection whose first
    #: choice is an HA pair failing over waits for it (``Pool.first_failing_over``)
    follows_pool_order = False

    def choose_target(self, targets: Sequence[Target], key: str) -> Target | None:
        """The target ``select_target`` would pick, without counting it as an assignment."""
        return self.select_target(targets, key)

    def acquire(self, slot: str) -> None:
        """Count one live assignment to the target in ``slot`` (no-op unless tracking)."""

    def release(self, slot: str) -> None:
        """One live assignment to the target in ``slot`` ended (no-op unless tracking)."""

    def describe(self) -> dict[str, Any]:
        """Name and properties, for explanations and the management API."""
        return {"name": self.name, "properties": dict(self.properties)}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.properties}>"
