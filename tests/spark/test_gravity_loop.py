"""The data-gravity loop end to end on the local deployment: ``loadtest/gravity_loop.py --start``
runs ``lodestone-local`` on a private copy of etc/ (free ports; the brokers' activity flushed every
2 s instead of 10 so the test waits less), the fixed workload through the front door, the job,
the pins into the running router, the workload again, and prints cross-broker bytes and skew
before and after, measured from the logs of each phase."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.integration.test_local_deployment import FIXED_PORTS
from tests.serverproc import REPO, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def test_loop_on_the_local_deployment(tmp_path):
    etc = tmp_path / "etc"
    etc.mkdir()
    mapping = dict(zip(FIXED_PORTS, free_ports(len(FIXED_PORTS))))
    for f in (REPO / "etc").glob("*.toml"):
        text = f.read_text()
        for old, new in mapping.items():
            text = re.sub(rf"(?<![0-9]){old}(?![0-9])", str(new), text)
        (etc / f.name).write_text(text.replace("flush-interval-s = 10", "flush-interval-s = 2"))
    r = subprocess.run([sys.executable, str(REPO / "loadtest" / "gravity_loop.py"), "--etc", str(etc), "--start",
                        "--scale", "0.5", "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    print(r.stdout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^cross-broker bytes\s+[\d,]+\s+[\d,]+\s+-\d+\.\d %", r.stdout, re.M), r.stdout
    res = json.loads((tmp_path / "out" / "loop.json").read_text())
    before, after, predicted = res["before"], res["after"], res["predicted"]
    assert res["workload"]["phase1"]["messages"] == res["workload"]["phase2"]["messages"] == 945
    assert res["keys"] == 30 and res["keys_moved"] > 0 and predicted["within_bound"]
    # the goal: at least 50 % fewer cross-broker bytes, at most 10 % skew, measured after the change
    assert after["cross_broker_bytes"] <= 0.5 * before["cross_broker_bytes"], res
    for what in ("connections", "bytes"):
        assert after["skew"][what] <= 0.10 + 1e-9, res
        # every key's traffic is the same in both phases: the predicted load is the measured one
        assert after["skew"][what] == pytest.approx(predicted["skew"][what], abs=0.01), res
    assert "goal (>= 50 % fewer cross-broker bytes at <= 10% skew): met" in r.stdout
