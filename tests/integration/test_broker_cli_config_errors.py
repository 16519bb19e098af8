"""``lodestone-broker run`` and ``check`` on a bad ``[cluster]`` or ``[routers.<name>]`` section,
as a real process: one line naming file, key and value, status 2. What parses and every bad value
are unit tests (tests/unit/broker/cluster/test_cluster_config.py,
tests/unit/broker/test_embedded_router_config.py), whose config texts these use."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.paths import REPO
from tests.unit.broker import test_embedded_router_config as embedded
from tests.unit.broker.cluster import test_cluster_config as cluster

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("command", ["run", "check"])
def test_cli_exits_2_naming_file_key_and_value(tmp_path, command):
    p = cluster.write(tmp_path, cluster.CLUSTER + "max-hops = -3\n")
    out = subprocess.run([sys.executable, "-m", "broker", command, str(p)], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert lines == [f"lodestone-broker: {p}: cluster.max-hops: -3 must be >= 0"] and out.stdout == ""


def test_cli_exits_2_with_one_line(tmp_path):
    p = embedded.write(tmp_path, embedded.CLUSTER)
    out = subprocess.run([sys.executable, "-m", "broker", "check", str(p)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.strip().splitlines() == [
        f"lodestone-broker: {p}: acceptors.amqp.router: 'gravity' is not a router defined in [routers] "
        "(defined: none)"]
