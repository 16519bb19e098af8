"""Discovery (issue 11, part 1): broadcast and discovery groups over UDP multicast, in a network
namespace each test makes (multicast on loopback needs a route the host may not have; tests run as
root). The scenarios themselves are in discovery_scenarios.py and run inside the namespace."""

from __future__ import annotations

import sys

import pytest

from tests.netns import network_namespace, run_in
from tests.serverproc import REPO

pytestmark = pytest.mark.timeout(240)


def _run(scenario: str, tmp_path) -> str:
    with network_namespace() as ns:
        done = run_in(ns, [sys.executable, "-m", "tests.integration.discovery_scenarios", scenario, str(tmp_path)],
                      cwd=str(REPO))
    assert done.returncode == 0, f"scenario {scenario} failed:\n{done.stdout}\n{done.stderr[-6000:]}"
    return done.stdout


def test_a_discovery_group_hears_refreshes_and_expires_entries(tmp_path):
    out = _run("see", tmp_path)
    assert "expired" in out


def test_a_cluster_formed_by_discovery_alone_balances_messages(tmp_path):
    assert "100 / 100 / 100" in _run("balance", tmp_path)


def test_garbage_forged_and_flooding_announcements_are_counted_and_dropped(tmp_path):
    assert "garbage" in _run("flood", tmp_path)


def test_a_client_given_only_a_discovery_group_spreads_its_connections(tmp_path):
    assert "2 / 2" in _run("client_udp", tmp_path)
