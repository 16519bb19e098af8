"""The pure routing core: keys, filters, policies, pool, cache, pins, decisions, dry runs.

No I/O, no clocks, no ``trio``: callers pass ``now`` and a seeded ``random.Random``.
"""

from .cache import StickyCache
from .decide import Decision, Explanation, Outcome, Router
from .keys import ConnectionInfo, KeyResolver, KeyType
from .policies import Policy, Target, create_policy, register_policy
from .pool import Pool, TargetState

__all__ = ["StickyCache", "Decision", "Explanation", "Outcome", "Router", "ConnectionInfo",
           "KeyResolver", "KeyType", "Policy", "Target", "create_policy", "register_policy",
           "Pool", "TargetState"]
