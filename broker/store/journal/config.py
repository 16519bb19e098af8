"""The journal's settings: :class:`JournalConfig`, the ``[journal]`` table of a broker config.

The sync modes are explained in the package docstring (``broker.store.journal``), segments in
``segments`` and compaction in ``compaction``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SYNC_MODES = ("batch", "always", "never")


@dataclass(frozen=True)
class JournalConfig:
    """Journal settings (the ``[journal]`` table of a broker config).

    ``sync``: ``"batch"`` | ``"always"`` | ``"never"`` (see the package docstring).
    ``segment_bytes``: roll the active segment once it reaches this size.
    ``compact_min_bytes``: never compact a journal smaller than this.
    ``compact_dead_ratio``: compact when dead bytes / total bytes reaches this (0 < r < 1).
    ``auto_compact``: let ``flush()`` compact (after it has made its records durable).
    """

    sync: str = "batch"
    segment_bytes: int = 16 * 1024 * 1024
    compact_min_bytes: int = 32 * 1024 * 1024
    compact_dead_ratio: float = 0.5
    auto_compact: bool = True

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync {self.sync!r} must be one of {', '.join(SYNC_MODES)}")
        if self.segment_bytes < 4096:
            raise ValueError(f"segment_bytes {self.segment_bytes} must be >= 4096")
        if not 0.0 < self.compact_dead_ratio < 1.0:
            raise ValueError(f"compact_dead_ratio {self.compact_dead_ratio} must be between 0 and 1")

    @classmethod
    def from_table(cls, t: "Any") -> "JournalConfig":
        """Read a ``broker.wire.io.tomlconfig.Table`` (keys: sync, segment-bytes, compact-min-bytes,
        compact-dead-ratio, auto-compact); calls ``t.done()``."""
        ratio = t.float("compact-dead-ratio", cls.compact_dead_ratio, min=0.01)
        if ratio >= 1.0:
            raise t.error("compact-dead-ratio", f"{ratio} must be < 1")
        cfg = cls(
            sync=t.choice("sync", SYNC_MODES, "batch"),
            segment_bytes=t.int("segment-bytes", cls.segment_bytes, min=4096),
            compact_min_bytes=t.int("compact-min-bytes", cls.compact_min_bytes, min=0),
            compact_dead_ratio=ratio,
            auto_compact=t.bool("auto-compact", True),
        )
        t.done()
        return cfg
