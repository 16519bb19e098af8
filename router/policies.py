"""Public plug-in API for routing policies.

A policy chooses a target among the pool's ready targets for a key. Register your own::

    from router.policies import Policy, register_policy

    class EvenOddPolicy(Policy):
        name = "EVEN_ODD"
        PROPERTIES = frozenset({"OFFSET"})
        key_deterministic = True

        def __init__(self, properties=None, rng=None):
            super().__init__(properties, rng)
            self.offset = self.int_property("OFFSET", 0)

        def select_target(self, targets, key):
            return targets[(len(key) + self.offset) % len(targets)] if targets else None

    register_policy("EVEN_ODD", EvenOddPolicy)   # then: [routers.x.policy] name = "EVEN_ODD"

* ``create_policy(name, properties: dict[str, str], rng=None) -> Policy`` — build a registered policy.
* ``register_policy(name, factory)`` — ``factory(properties, rng) -> Policy``.
* ``Target(node_id, host, port, tls=False, management_url=None, name="")`` — frozen.
* ``Policy.transform_key(key) -> str``; ``Policy.select_target(targets, key) -> Target | None``
  (``targets`` = the ready ones in pool order); ``Policy.observe(target, connection_count)``.

Built-ins: FIRST_ELEMENT, ROUND_ROBIN, LEAST_CONNECTIONS (``CONNECTION_COUNT_THRESHOLD``),
CONSISTENT_HASH (``HASH`` = MURMUR3 | FNV1A, ``VIRTUAL_NODES`` = 128, ``LOAD_FACTOR``),
CONSISTENT_HASH_MODULO (``MODULO``, ``HASH``). ``HASH=FNV1A`` + ``VIRTUAL_NODES=1`` is Artemis exactly.
"""

from router.core.policies import (
    HASHES,
    NULL_KEY,
    ConsistentHashModuloPolicy,
    ConsistentHashPolicy,
    FirstElementPolicy,
    LeastConnectionsPolicy,
    Policy,
    PolicyFactory,
    RoundRobinPolicy,
    Target,
    create_policy,
    fnv1a_utf16,
    murmur3,
    policy_names,
    register_policy,
)

ARTEMIS_HASH_PROPERTIES = {"HASH": "FNV1A", "VIRTUAL_NODES": "1"}
"""CONSISTENT_HASH properties that reproduce Artemis bit for bit."""

__all__ = [
    "Policy", "Target", "PolicyFactory", "create_policy", "register_policy", "policy_names",
    "NULL_KEY", "FirstElementPolicy", "RoundRobinPolicy", "LeastConnectionsPolicy",
    "ConsistentHashPolicy", "ConsistentHashModuloPolicy", "HASHES", "fnv1a_utf16", "murmur3",
    "ARTEMIS_HASH_PROPERTIES",
]
