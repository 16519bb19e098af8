"""``lodestone-router dry-run`` as a real process (``python -m router dry-run``): the command line
reaches the dry run. The dry run itself is tested in-process in tests/unit/router/test_dryrun_cli.py,
whose router config, keys and targets this uses; on a real router's log in
tests/integration/test_dryrun_real_router.py."""

import subprocess
import sys

import pytest

from tests.unit.router.test_dryrun_cli import IDS, ROUTER_TOML, _keys

pytestmark = pytest.mark.slow


def test_the_router_cli_runs_the_dry_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "router", "dry-run", ROUTER_TOML, "--keys", str(_keys(tmp_path, 10)),
                          "--remove", "broker-3", *IDS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "of 10 keys move" in out.stdout
