"""Node.js and rhea for the tests that drive rhea clients (``clients/node``).

``node_executable(what)`` returns the ``node`` executable, after installing the packages of
``clients/node/package-lock.json`` (``npm ci``) when rhea or minimist is missing; without node
it skips the calling test loudly (``bash etc/run-tests.sh`` installs nodejs and npm).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[1] / "clients" / "node"
PACKAGES = ("rhea", "minimist")


def node_executable(what: str) -> str:
    """``what``: the tests that would be skipped, for the message (e.g. "rhea client tests")."""
    exe = shutil.which("node")
    if exe is None:
        msg = (f"NODE IS NOT INSTALLED: the {what} are SKIPPED. Run `bash etc/run-tests.sh` "
               "(it installs nodejs and npm) or install them yourself.")
        print("\n" + "!" * 20 + " " + msg + " " + "!" * 20, file=sys.stderr)
        pytest.skip(msg)
    if not all((NODE_DIR / "node_modules" / pkg).is_dir() for pkg in PACKAGES):
        npm = shutil.which("npm")
        assert npm is not None, "node is installed but npm is not: cannot install rhea and minimist"
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=300)
    return exe
