"""Fixtures the multi-process integration tests share."""

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def procs():
    """A list the test appends its server processes to; whatever still runs is killed at the end."""
    made = []
    yield made
    for p in made:
        if p.proc is not None and p.proc.poll() is None:
            p.kill()


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(name, size)`` mounts a tmpfs of that size under tmp_path (unmounted at the
    end); skips the test when mounting is not possible here."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        mnt = tmp_path / name
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
        mounted.append(mnt)
        return mnt

    try:
        yield mount
    finally:
        for mnt in mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill_disk(path: Path) -> None:
    """Write until the filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    try:
        while True:
            os.write(fd, b"\0")
    except OSError:
        pass
    finally:
        os.close(fd)
