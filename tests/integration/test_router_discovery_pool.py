"""``[routers.<r>.pool] source = "discovery"`` (issue 11, part 3): a real router process hears
real brokers' broadcast groups over UDP multicast, in a network namespace the test makes
(tests/netns.py); the scenario runs inside it (discovery_scenarios.router_pool)."""

from __future__ import annotations

import sys

import pytest

from tests.netns import network_namespace, run_in
from tests.serverproc import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_discovery_pool_follows_the_brokers_broadcasts(tmp_path):
    with network_namespace() as ns:
        done = run_in(ns, [sys.executable, "-m", "tests.integration.discovery_scenarios", "router_pool",
                           str(tmp_path)], cwd=str(REPO))
    assert done.returncode == 0, f"scenario failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    assert "left" in done.stdout and "both joined" in done.stdout
