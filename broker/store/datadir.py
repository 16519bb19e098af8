"""A broker node's data directory: its identity (``node.id``), its lock, and its journal.

Layout::

    <data-dir>/node.id      UUID4, lowercase, 36 chars + newline; made on first start, then kept
    <data-dir>/lock         flock()ed exclusively while a process uses the directory; holds its pid
    <data-dir>/journal/     journal segments (broker.store.journal)

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``lock``: it is released by the kernel when the
holder dies (even by ``kill -9``), so a stale lock file never blocks a restart. A second process
(or a second ``open_data_dir`` in the same process) gets ``DataDirLocked`` naming the directory and
the pid written in the file by the holder.
"""

from __future__ import annotations

import fcntl
import os
import re
import uuid
from pathlib import Path

from broker.store.errors import DataDirError, DataDirLocked
from broker.store.journal import Journal, JournalConfig

__all__ = ["DataDir", "open_data_dir"]

_UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


class DataDir:
    """An open, locked data directory. Close it (or use ``with``) to release the lock."""

    def __init__(self, path: Path, node_id: str, lock_fd: int):
        self.path = path
        self.node_id = node_id
        self._lock_fd: int | None = lock_fd

    @property
    def journal_dir(self) -> Path:
        return self.path / "journal"

    def open_journal(self, config: JournalConfig | None = None, *, repair: bool = False) -> Journal:
        """Open this node's journal (``<data-dir>/journal``); see ``Journal.open``."""
        if self._lock_fd is None:
            raise DataDirError(f"data directory {self.path} is closed")
        return Journal.open(self.journal_dir, config, repair=repair)

    def close(self) -> None:
        """Release the lock (closing the fd drops the flock)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "DataDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_data_dir(path: str | Path) -> DataDir:
    """Create (if needed) and lock a data directory, creating ``node.id`` on first start.

    Raises ``DataDirLocked`` if another process holds it, ``DataDirError`` if it is unusable.
    """
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd = os.open(p / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise DataDirError(f"data directory {p}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_pid(fd)
        os.close(fd)
        raise DataDirLocked(p, holder) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        node_id = _node_id(p)
    except BaseException:
        os.close(fd)
        raise
    return DataDir(p, node_id, fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _node_id(p: Path) -> str:
    f = p / "node.id"
    try:
        text = f.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        node_id = str(uuid.uuid4())
        tmp = p / "node.id.tmp"
        with tmp.open("w", encoding="ascii") as fh:
            fh.write(node_id + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, f)
        dfd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        return node_id
    except (OSError, UnicodeDecodeError) as exc:
        raise DataDirError(f"{f}: cannot read node id: {exc}") from None
    if not _UUID_RE.match(text):
        raise DataDirError(f"{f}: {text[:60]!r} is not a lowercase UUID")
    return text
