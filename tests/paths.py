"""Where things are, for a test module at any depth of tests/ (tests/unit mirrors the packages, so
``Path(__file__).parents[n]`` would change with every move)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: the Artemis sample vectors (copied from ../shared/artemis-vectors)
VECTORS = REPO / "tests" / "vectors"
