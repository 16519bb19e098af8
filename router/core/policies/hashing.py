"""Hash functions used by the hash policies.

* ``fnv1a_utf16`` — Artemis's ``ConsistentHashPolicy.getHash``: 32-bit FNV-1a over the UTF-16 code
  units of the Java String, returned as a signed int32 (spec §2.1). Not murmur3.
* ``murmur3`` — ``mmh3.hash(key)`` (seed 0, UTF-8, signed int32): our default; C speed.
  mmh3 5.x **segfaults** on a ``str`` holding a lone surrogate (it does not check its UTF-8
  conversion), and keys can come from JSON (management API, routing logs), where ``"\ud800"``
  is legal: such keys are encoded here with ``surrogatepass`` first.
"""

from __future__ import annotations

import sys
from typing import Callable

import mmh3

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193
_UTF16_NATIVE = "utf-16-le" if sys.byteorder == "little" else "utf-16-be"


def fnv1a_utf16(key: str) -> int:
    """32-bit FNV-1a over the UTF-16 code units of ``key`` as a signed int32 (Artemis getHash)."""
    h = _FNV_OFFSET
    if key.isascii():
        units = key.encode("ascii")  # an ASCII char is one code unit equal to its byte
    else:
        # Native-endian UTF-16 viewed as unsigned shorts = the Java chars, surrogates included.
        units = memoryview(key.encode(_UTF16_NATIVE, "surrogatepass")).cast("H")
    for c in units:
        h = ((h ^ c) * _FNV_PRIME) & 0xFFFFFFFF
    return h - 0x100000000 if h & 0x80000000 else h


def murmur3(key: str, _hash=mmh3.hash) -> int:
    """MurmurHash3 x86 32-bit of the UTF-8 key, seed 0, signed int32 (= ``mmh3.hash(key)``)."""
    if key.isascii():
        return _hash(key)
    return _hash(key.encode("utf-8", "surrogatepass"))  # same bytes mmh3 hashes, never a crash


HASHES: dict[str, Callable[[str], int]] = {"MURMUR3": murmur3, "FNV1A": fnv1a_utf16}
"""Name → function for the ``HASH`` policy property."""
