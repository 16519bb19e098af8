"""Artemis address wildcards, shared by address settings and permissions (pure).

Addresses are words separated by ``.``; in a pattern ``#`` matches zero or more words and ``*``
exactly one word, and both must be whole words (``ord#`` is an error, as in Artemis). When several
patterns match an address, the most specific wins. Specificity compares the patterns word by word
from the left: a literal word beats ``*``, which beats ``#``; the first differing word decides;
where one pattern has ended, the ended one ranks below a literal or ``*`` (longer beats shorter)
but above ``#``. E.g. for ``orders.eu``: ``orders.eu`` > ``orders.*`` > ``orders.#`` > ``*.eu`` > ``#``.
"""

from __future__ import annotations

__all__ = ["check_pattern", "wildcard_match", "match_specificity"]


def check_pattern(pattern: str) -> None:
    """Raise ValueError unless every wildcard in ``pattern`` is a whole word."""
    for word in pattern.split("."):
        if word not in ("#", "*") and ("#" in word or "*" in word):
            raise ValueError(f"wildcards must be whole words: {word!r} in {pattern!r}")


def wildcard_match(pattern: str, address: str, delimiter: str = ".", any_words: str = "#",
                   single_word: str = "*") -> bool:
    """Artemis wildcard match: ``#`` = zero or more words, ``*`` = exactly one word (the three
    characters configurable as Artemis's ``wildcard-addresses``)."""
    pw = pattern.split(delimiter)
    aw = address.split(delimiter)
    # reachable[j]: the pattern prefix processed so far can consume exactly aw[:j]
    reachable = [True] + [False] * len(aw)
    for word in pw:
        nxt = [False] * (len(aw) + 1)
        if word == any_words:
            seen = False
            for j in range(len(aw) + 1):
                seen = seen or reachable[j]
                nxt[j] = seen
        else:
            for j in range(len(aw)):
                if reachable[j] and (word == single_word or word == aw[j]):
                    nxt[j + 1] = True
        reachable = nxt
        if not any(reachable):
            return False
    return reachable[len(aw)]


_RANK = {"#": 0.0, "*": 1.0}
_END_RANK = 0.5   # a pattern that has ended: below `*` and literals, above `#`


def match_specificity(pattern: str) -> tuple[float, ...]:
    """Sort key: a higher key is more specific (see the module docstring for the rule)."""
    return tuple(_RANK.get(w, 2.0) for w in pattern.split(".")) + (_END_RANK,)
