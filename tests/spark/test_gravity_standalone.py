"""The job on a real Spark standalone cluster: a master and a worker started here from the pyspark
install's ``bin/spark-class`` on OS-chosen ports (REST server off, loopback only), the job
submitted with the install's ``bin/spark-submit`` and ``--master spark://…``; its summary equals the
local-mode answer on the same logs. One run: the cluster costs ~20 s to start."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spark.jobs.gravity import parse_args, run
from tests.serverproc import REPO
from tests.spark.gravity_logs import HAND, write_hand_case
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, SPARK_HOME=str(_spark_home()), SPARK_LOCAL_IP="127.0.0.1",
               SPARK_LOG_DIR=str(tmp_path / "logs"), SPARK_CONF_DIR=str(tmp_path / "conf"),
               PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
               PYTHONPATH=str(REPO))
    (tmp_path / "conf").mkdir(exist_ok=True)
    (tmp_path / "conf" / "spark-defaults.conf").write_text(
        "spark.master.rest.enabled false\nspark.ui.enabled false\nspark.executor.memory 1g\n")
    return env


def _start(argv: list[str], env: dict, log: Path, pattern: str, timeout_s: float = 90) -> tuple[subprocess.Popen, str]:
    """Start a Spark daemon; wait for ``pattern`` in its output; the first group of the match."""
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # the pattern, or the daemon's exit (then no use waiting longer)
    m = wait_for(lambda: re.search(pattern, log.read_text()) or proc.poll() is not None, timeout_s, interval_s=0.2,
                 raise_on_timeout=False)
    if isinstance(m, re.Match):
        return proc, m.group(1)
    proc.kill()
    raise AssertionError(f"{argv[1]} did not print {pattern!r}:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_standalone_master_gives_the_local_answer(spark, tmp_path):
    logs = write_hand_case(tmp_path / "in")
    local = run(spark, parse_args([str(logs), "--out", str(tmp_path / "local"), "--quiet",
                                   "--max-skew", str(HAND["tight"]["max_skew"])]))
    env = _env(tmp_path)
    spark_class = str(_spark_home() / "bin" / "spark-class")
    master = worker = None
    try:
        master, url = _start([spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                              "--port", "0", "--webui-port", "0"], env, tmp_path / "master.log",
                             r"Starting Spark master at (spark://127\.0\.0\.1:\d+)")
        worker, _ = _start([spark_class, "org.apache.spark.deploy.worker.Worker", url, "--host", "127.0.0.1",
                            "--port", "0", "--webui-port", "0", "--cores", "2", "--memory", "1500m",
                            "--work-dir", str(tmp_path / "work")], env, tmp_path / "worker.log",
                           r"(Successfully registered with master)")
        r = subprocess.run([str(_spark_home() / "bin" / "spark-submit"), str(REPO / "spark" / "jobs" / "gravity.py"),
                            str(logs), "--out", str(tmp_path / "standalone"), "--master", url,
                            "--max-skew", str(HAND["tight"]["max_skew"])],
                           env=env, capture_output=True, text=True, timeout=240)
        (tmp_path / "submit.log").write_text(r.stderr)
        assert r.returncode == 0, r.stderr[-4000:]
        assert "cross-broker bytes 600 measured" in r.stdout
        assert f"gravity: [8/8] done: {HAND['lines_read']} lines" in r.stdout  # progress (spark-submit merges the driver's stderr)
        assert re.search(r"Registered app lodestone-gravity", (tmp_path / "master.log").read_text())
        assert "Asked to launch executor" in (tmp_path / "worker.log").read_text()
    finally:
        _stop(worker)
        _stop(master)
    remote = json.loads((tmp_path / "standalone" / "summary.json").read_text())
    local = json.loads((tmp_path / "local" / "summary.json").read_text())
    for s in (remote, local):
        s.pop("elapsed_s")
    assert remote == local
    assert remote["recommended_cross_broker_bytes"] == HAND["tight"]["cross"]
    for f in ("pins.jsonl", "filters.json"):
        assert (tmp_path / "standalone" / f).read_text() == (tmp_path / "local" / f).read_text()
