"""``lodestone-gravity`` on bad input: one line naming the problem, exit status 2, before Spark
starts (so these run in a fraction of a second each)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from tests.serverproc import REPO


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark.jobs.gravity", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd or REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


@pytest.fixture
def logs(tmp_path):
    (tmp_path / "routing.log").write_text("{}\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "bad.toml").write_text("name = 'r'\n[routers.main]\nkey-type = 'NOPE'\n")
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["{d}/nope.log", "--out", "{d}/o"], "{d}/nope.log: no such file or directory"),
    (["{d}/empty", "--out", "{d}/o"], "{d}/empty: no log files in this directory"),
    (["{d}/routing.log"], "the following arguments are required: --out"),
    (["{d}/routing.log", "--out", "{d}/afile"], "--out {d}/afile: exists and is not a directory"),
    (["{d}/routing.log", "--out", "{d}/o", "--max-skew", "-0.1"], "--max-skew -0.1: must be a finite number >= 0"),
    (["{d}/routing.log", "--out", "{d}/o", "--max-skew", "ten"], "--max-skew 'ten': not a number"),
    (["{d}/routing.log", "--out", "{d}/o", "--master", "spork://x"], "--master 'spork://x': not a Spark master URL"),
    (["{d}/routing.log", "--out", "{d}/o", "--since", "yesterday"], "--since 'yesterday': not an ISO 8601 time"),
    (["{d}/routing.log", "--out", "{d}/o", "--since", "2026-01-02T00:00:00Z", "--until", "2026-01-01T00:00:00Z"],
     "--since 2026-01-02T00:00:00Z is not before --until 2026-01-01T00:00:00Z"),
    (["{d}/routing.log", "--out", "{d}/o", "--router-config", "{d}/missing.toml"],
     "--router-config {d}/missing.toml: no such file"),
    (["{d}/routing.log", "--out", "{d}/o", "--router-config", "{d}/bad.toml"], "--router-config: {d}/bad.toml"),
    (["{d}/routing.log", "--out", "{d}/o", "--router-config", str(REPO / "etc" / "router.toml"), "--router", "x"],
     "--router 'x': not in"),
    (["{d}/routing.log", "--out", "{d}/o", "--shuffle-partitions", "0"], "--shuffle-partitions '0': must be"),
])
def test_bad_input_exits_2_with_one_line(logs, args, message):
    r = _cli(*[a.format(d=logs) for a in args])
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("lodestone-gravity: ") and message.format(d=logs) in lines[0], lines[0]
    assert not (logs / "o").exists()  # nothing started, nothing written


def test_console_script_is_declared():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["lodestone-gravity"] == "spark.jobs.gravity:main"
    deps = " ".join(meta["project"]["optional-dependencies"]["test"])
    assert "pyspark" in deps and "matplotlib" in deps


def test_a_directory_without_logs_is_skipped_beside_one_with_logs(logs, capsys):
    # an HA backup's data directory, before it ever served, has no activity.jsonl: naming it beside the
    # others is not a mistake, so it is skipped with a warning; alone it is still an error (above)
    from spark.jobs.gravity import expand_inputs

    files = expand_inputs([str(logs), str(logs / "empty")])
    assert files == [str(logs / "routing.log")]
    assert capsys.readouterr().err == f"lodestone-gravity: {logs / 'empty'}: no log files in this directory, skipped\n"


@pytest.mark.parametrize("case", ["no-pyspark", "no-java", "bad-java-home"])
def test_missing_runtime_exits_1_with_one_line_before_spark(logs, case):
    # without these checks the user sees PySpark's Java-gateway traceback instead of what to install
    args = [sys.executable, "-m", "spark.jobs.gravity", str(logs / "routing.log"), "--out", str(logs / "o")]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    if case == "no-pyspark":
        # the Lodestone dependencies installed, PySpark (the optional one) not: a package of that
        # name ahead on the path that fails to import as a missing one does
        (logs / "hide" / "pyspark").mkdir(parents=True)
        (logs / "hide" / "pyspark" / "__init__.py").write_text(
            'raise ModuleNotFoundError("No module named \'pyspark\'", name="pyspark")\n')
        env["PYTHONPATH"] = f"{logs / 'hide'}:{REPO}"
        want = "PySpark is not installed in"
    elif case == "no-java":
        (logs / "bin").mkdir()
        env["PATH"] = str(logs / "bin")  # no java on it
        want = "Java not found (no java on PATH, JAVA_HOME unset)"
    else:
        env["JAVA_HOME"] = str(logs / "empty")
        want = f"JAVA_HOME={logs / 'empty'}: no {logs / 'empty' / 'bin' / 'java'}"
    r = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert r.returncode == 1, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lodestone-gravity: ") and want in lines[0], r.stderr
    assert not (logs / "o").exists()
