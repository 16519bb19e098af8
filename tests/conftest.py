"""Shared pytest configuration: hypothesis profiles.

``fast`` (default, ~200 examples) runs in every test run; ``deep`` is selected with
``HYPOTHESIS_PROFILE=deep`` for long fuzzing sessions.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "fast", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "deep", max_examples=20000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))
