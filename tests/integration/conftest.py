"""Fixtures the multi-process integration tests share."""

import pytest


@pytest.fixture
def procs():
    """A list the test appends its server processes to; whatever still runs is killed at the end."""
    made = []
    yield made
    for p in made:
        if p.proc is not None and p.proc.poll() is None:
            p.kill()
