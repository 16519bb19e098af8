"""Errors of the broker's durable store (journal and data directory).

Split as in STYLE.md: a *Local* error means the caller misused the API (a bug in the broker);
a *Remote* error means something outside the process misbehaved (the disk, another process, a
replication peer). Each carries the AMQP condition the broker reports if the error surfaces on a
link or connection (AMQP 1.0 §2.8.15).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


class StoreError(Exception):
    """Base of every store error."""

    condition = "amqp:internal-error"


class LocalStoreError(StoreError):
    """The caller misused the store (closed journal, bad argument, out-of-order replica apply)."""


class RemoteStoreError(StoreError):
    """The environment misbehaved: corrupt files, a held lock, a replication gap."""


class JournalClosed(LocalStoreError):
    """An operation on a journal after :meth:`Journal.close`."""


class JournalCorrupt(RemoteStoreError):
    """A journal file is damaged somewhere other than a torn tail of the last segment.

    ``file`` and ``offset`` locate the first bad byte; ``reason`` says what was wrong.
    Reopen with ``repair=True`` to drop the damaged region (it is reported, then compacted away).
    """

    def __init__(self, file: str | Path, offset: int, reason: str):
        self.file = str(file)
        self.offset = offset
        self.reason = reason
        super().__init__(
            f"journal corrupt: {self.file} at byte {offset}: {reason} "
            f"(valid records follow, so this is not a torn write; reopen with repair to drop it)"
        )


class JournalFailed(RemoteStoreError):
    """A write or fsync failed: the journal refuses further work (nothing after it can be
    trusted to be durable). The broker must stop; a restart recovers from what is on disk."""


class JournalGap(RemoteStoreError):
    """Records a replica asked for are no longer in the journal (compacted away) or a replica
    received a record whose seq is not the next one. The replica must install a snapshot."""


class BadRecord(RemoteStoreError):
    """A record's bytes do not parse (bad length, unknown type, CRC mismatch)."""

    condition = "amqp:decode-error"


class DataDirError(RemoteStoreError):
    """The data directory is unusable (cannot be created, malformed ``node.id``)."""


class DataDirLocked(DataDirError):
    """Another process holds the data directory's lock."""

    def __init__(self, path: str | Path, holder_pid: int | None):
        self.path = str(path)
        self.holder_pid = holder_pid
        who = f"process {holder_pid}" if holder_pid is not None else "another process (pid unknown)"
        super().__init__(f"data directory {self.path} is locked by {who}")
