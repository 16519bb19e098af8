"""The routing policies: one module per policy plus a registry (see ``router.policies``)."""

from .base import NULL_KEY, Policy, Target
from .consistent_hash import ConsistentHashPolicy
from .consistent_hash_modulo import ConsistentHashModuloPolicy
from .first_element import FirstElementPolicy
from .hashing import HASHES, fnv1a_utf16, murmur3
from .least_connections import LeastConnectionsPolicy
from .registry import PolicyFactory, create_policy, policy_names, register_policy
from .round_robin import RoundRobinPolicy

__all__ = [
    "NULL_KEY", "Policy", "Target", "PolicyFactory", "create_policy", "register_policy",
    "policy_names", "FirstElementPolicy", "RoundRobinPolicy", "LeastConnectionsPolicy",
    "ConsistentHashPolicy", "ConsistentHashModuloPolicy", "HASHES", "fnv1a_utf16", "murmur3",
]
