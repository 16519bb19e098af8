"""Regex filters with Artemis's matching rules (spec §3).

* key-filter: Java ``Matcher.find()`` keeping the whole match (group 0) → ``re.search(...).group(0)``.
* local-target-filter: Java ``Matcher.matches()`` → ``re.fullmatch``.

Patterns are Java ``java.util.regex`` syntax in Artemis; Python ``re`` accepts the common subset
(including possessive quantifiers and atomic groups on 3.11+). We compile with ``re.ASCII`` because
Java's ``\\d``, ``\\w``, ``\\s`` and ``\\b`` are ASCII-only unless UNICODE_CHARACTER_CLASS is set.
Known remaining difference: Java's ``.`` also excludes ``\\r``, U+0085, U+2028 and U+2029.
"""

from __future__ import annotations

import re

from router.errors import FilterError


class Filter:
    """A compiled filter; ``pattern`` is the source text as configured."""

    __slots__ = ("pattern", "regex", "_search", "_fullmatch")

    def __init__(self, pattern: str) -> None:
        try:
            regex = re.compile(pattern, re.ASCII)
        except re.error as exc:
            raise FilterError(f"invalid regular expression {pattern!r}: {exc}") from None
        self.pattern = pattern
        self.regex = regex
        self._search = regex.search
        self._fullmatch = regex.fullmatch

    def find(self, value: str) -> str | None:
        """Whole match of the first ``search`` hit (Java ``find()`` + ``group()``), else None."""
        m = self._search(value)
        return None if m is None else m.group(0)

    def matches(self, value: str) -> bool:
        """True when the whole value matches (Java ``matches()``)."""
        return self._fullmatch(value) is not None

    def __repr__(self) -> str:
        return f"Filter({self.pattern!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Filter) and other.pattern == self.pattern

    def __hash__(self) -> int:
        return hash(self.pattern)


def compile_key_filter(pattern: str | None) -> Filter | None:
    """A key-filter: ``None`` or blank means no filter (Artemis ``KeyResolver.setKeyFilter``)."""
    if pattern is None or not pattern.strip():
        return None
    return Filter(pattern)


def compile_local_filter(pattern: str | None, *, from_config: bool = False) -> Filter | None:
    """A local-target-filter.

    From the management API (``from_config=False``) a blank pattern clears the filter, as
    ``ConnectionRouter.setLocalTargetFilter`` does; from config any non-None pattern compiles, so a
    configured ``""`` only full-matches the empty key (the Artemis constructor).
    """
    if pattern is None:
        return None
    if not from_config and not pattern.strip():
        return None
    return Filter(pattern)
