"""Policy registry: name → factory (Artemis ``PolicyFactoryResolver``), five built-ins."""

from __future__ import annotations

import random
from typing import Callable, Mapping

from router.errors import PolicyError

from .base import Policy
from .consistent_hash import ConsistentHashPolicy
from .consistent_hash_modulo import ConsistentHashModuloPolicy
from .first_element import FirstElementPolicy
from .least_connections import LeastConnectionsPolicy
from .round_robin import RoundRobinPolicy

PolicyFactory = Callable[[Mapping[str, str], random.Random], Policy]

_FACTORIES: dict[str, PolicyFactory] = {}


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``name`` usable in config. ``factory(properties, rng)`` returns a ``Policy``.

    Re-registering a name replaces it (tests use this); names are case-sensitive, like Artemis.
    """
    if not name or not isinstance(name, str):
        raise PolicyError(f"policy name {name!r} must be a non-empty string")
    _FACTORIES[name] = factory


def policy_names() -> list[str]:
    """Registered policy names, built-ins first."""
    return list(_FACTORIES)


def create_policy(name: str, properties: Mapping[str, str] | None = None,
                  rng: random.Random | None = None) -> Policy:
    """Build the policy registered as ``name`` with string ``properties``.

    Raises ``PolicyError`` for an unknown name (message lists the known ones) or bad properties.
    ``rng`` seeds ROUND_ROBIN's start (default ``random.Random(0)``; the shell passes a seeded one).
    """
    factory = _FACTORIES.get(name)
    if factory is None:
        raise PolicyError(f"no policy named {name!r} (known: {', '.join(_FACTORIES)})")
    policy = factory(dict(properties or {}), rng if rng is not None else random.Random(0))
    if not isinstance(policy, Policy):
        raise PolicyError(f"policy factory for {name!r} returned {type(policy).__name__}, "
                          "not a router.policies.Policy")
    if policy.name == Policy.name:
        policy.name = name  # custom factories: report the registered name
    return policy


for _cls in (FirstElementPolicy, RoundRobinPolicy, ConsistentHashPolicy, LeastConnectionsPolicy,
             ConsistentHashModuloPolicy):
    register_policy(_cls.name, _cls)
