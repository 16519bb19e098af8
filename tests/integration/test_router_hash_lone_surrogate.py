"""A key with a lone surrogate through the MURMUR3 policies, in a child process: mmh3 5.x
segfaults on such a str, so a regression must kill the child, not the test run. The other policy
properties are unit tests (tests/unit/router/core/policies/test_policy_properties.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def test_murmur3_policies_survive_a_lone_surrogate_key():
    """mmh3 5.x segfaults on a str with a lone surrogate, and MURMUR3 is the default hash: one
    management lookup of the JSON key "\\ud800" killed the whole router process. Run in a child
    process so a regression fails this test instead of the test run."""
    code = textwrap.dedent("""
        from router.core.decide import Router
        from router.core.keys import KeyResolver, KeyType
        from router.core.pool import Pool
        from router.policies import Target, create_policy, murmur3
        import mmh3
        pool = Pool([Target(f"n{i}", "h", i, name=f"t{i}") for i in range(3)])
        for i in range(3):
            pool.set_ready(f"t{i}", True)
        for name, props in (("CONSISTENT_HASH", {}), ("CONSISTENT_HASH_MODULO", {"MODULO": "3"})):
            r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy(name, props),
                       pool=pool)
            r.decide_for_key("\\ud800", 0.0)
            r.decide_for_key("x\\udfffy", 0.0)
        assert murmur3("é中😀") == mmh3.hash("é中😀") and murmur3("abc") == mmh3.hash("abc")
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", (res.returncode, res.stderr)
