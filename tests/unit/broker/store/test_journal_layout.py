"""The journal package keeps the single-file module's names (its rings: tests/unit/test_architecture.py)."""

from __future__ import annotations

import pytest

import broker.store.journal as journal
from broker.store.journal import compaction, config, records, recovery, replication, segments, state

# Every module-level name of broker/store/journal.py before the split (main, f5841f0).
OLD_NAMES = """
__all__ _REC_HEAD _REC_CRC REC_HEADER_BYTES MAX_PAYLOAD_BYTES _SEG_HEAD _SEG_MAGIC _SEG_VERSION
SEG_HEADER_BYTES FLAG_COMPACTED _SEG_NAME _U16 _U32 _U64 _ID_COUNT SYNC_MODES RecordType _TYPES
_GROUP_OP_TYPES _GROUP_OP_HEAD _str16 _read_str16 encode_record Record _payload_add_message
_payload_queue_id _payload_kv _payload_group _decode_group _decode_payload _op_size GroupOp _parse_at
decode_record _segment_header _parse_segment_header _segment_name _fsync_dir _datasync StoredMessage
_KV JournalConfig RecoveryReport Snapshot _Segment Journal _write_all
""".split()


@pytest.mark.parametrize("name", OLD_NAMES)
def test_every_old_name_is_still_importable_from_the_package(name):
    assert hasattr(journal, name)
    # the same object as in the module that now defines it
    homes = [m for m in (records, state, segments, recovery, compaction, replication, config) if name in vars(m)]
    assert all(vars(m)[name] is getattr(journal, name) for m in homes), name
