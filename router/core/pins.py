"""Pinned routes: key (exact) or regex (full match) → node id, consulted before the cache.

The data-gravity analytics write them. File format: JSON Lines, one object per line, blank lines
and lines starting with ``#`` ignored::

    {"key": "orders-eu", "node_id": "6c1b...-..."}
    {"pattern": "^EQ_.*", "node_id": "broker-2"}

``node_id`` may also be a target's config name. Exact keys win over patterns; patterns are tried
in file order. A pin whose node is not ready is skipped (normal routing continues).

``parse_pins`` is strict by default (the first bad line raises ``PinFileError``); given a
``bad_lines`` list it skips each bad line and appends its message (``file:line: why``) instead,
which is how the router loads the file: one bad line written by the analytics loses only itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from router.errors import FilterError, PinFileError

from .filters import Filter


@dataclass(frozen=True)
class PinTable:
    """Immutable pin table; ``lookup(key) -> (node_id, rule) | None``."""

    exact: dict[str, str] = field(default_factory=dict)
    patterns: tuple[tuple[Filter, str], ...] = ()
    source: str = ""

    def __len__(self) -> int:
        return len(self.exact) + len(self.patterns)

    def lookup(self, key: str) -> tuple[str, str] | None:
        """The pinned node id and the rule text (``key`` or ``/pattern/``) for ``key``."""
        node = self.exact.get(key)
        if node is not None:
            return node, key
        for flt, node in self.patterns:
            if flt.matches(key):
                return node, f"/{flt.pattern}/"
        return None


def parse_pins(text: str, source: str = "<pins>", *,
               bad_lines: list[str] | None = None) -> PinTable:
    """Parse JSON Lines pin records; errors name ``source`` and the line number.

    Without ``bad_lines`` the first bad line raises ``PinFileError``; with it, bad lines are
    skipped and their messages appended to the list.
    """
    exact: dict[str, str] = {}
    patterns: list[tuple[Filter, str]] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            _parse_line(s, f"{source}:{lineno}", exact, patterns)
        except PinFileError as exc:
            if bad_lines is None:
                raise
            bad_lines.append(str(exc))
    return PinTable(exact, tuple(patterns), source)


def _parse_line(s: str, where: str, exact: dict[str, str],
                patterns: list[tuple[Filter, str]]) -> None:
    """Parse one record into ``exact`` / ``patterns``; PinFileError names ``where``."""
    try:
        rec = json.loads(s)
    except json.JSONDecodeError as exc:
        raise PinFileError(f"{where}: invalid JSON: {exc.msg}") from None
    if not isinstance(rec, dict):
        raise PinFileError(f"{where}: {s!r} must be a JSON object")
    node = rec.get("node_id")
    if not isinstance(node, str) or not node:
        raise PinFileError(f"{where}: node_id {node!r} must be a non-empty string")
    unknown = set(rec) - {"key", "pattern", "node_id", "comment", "score"}
    if unknown:
        raise PinFileError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    if ("key" in rec) == ("pattern" in rec):
        raise PinFileError(f"{where}: give exactly one of \"key\" or \"pattern\"")
    if "key" in rec:
        if not isinstance(rec["key"], str):
            raise PinFileError(f"{where}: key {rec['key']!r} must be a string")
        exact[rec["key"]] = node
    else:
        pat = rec["pattern"]
        if not isinstance(pat, str):
            raise PinFileError(f"{where}: pattern {pat!r} must be a string")
        try:
            patterns.append((Filter(pat), node))
        except FilterError as exc:
            raise PinFileError(f"{where}: {exc}") from None
