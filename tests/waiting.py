"""Waiting for a state: the one way the tests do it.

A test that needs something to have happened (a counter reached, a file written, a port open, an
API field set) polls for exactly that state with :func:`wait_for` (plain code, threads) or
:func:`wait_for_async` (trio tests), never with a bare sleep of a guessed length::

    from tests.waiting import wait_for, wait_for_async

    view = wait_for(lambda: http_json(url)[1], 10, what="the management API")
    await wait_for_async(lambda: gate.counters["login_verifications"] == 20, 5, what="20 hashes")

Both call ``predicate()`` at once and then every ``interval_s`` until it returns something truthy,
and return that value. With ``until``, ``predicate`` fetches a value (a view, a file's text) and
``until(value)`` says whether it is the awaited one; the value is returned, and on timeout the last
one fetched is reported::

    view = wait_for(lambda: ha_view(node), 30, until=lambda v: v["phase"] == "active")

After ``timeout_s`` they raise AssertionError that names ``what`` (or the predicate) and the last
value or exception seen; with ``raise_on_timeout=False`` they return that last value instead (a
bounded watch whose outcome the caller reports or asserts itself). An exception from the
predicate propagates at once, unless its type is in ``ignore``: then it counts as "not yet"
(e.g. ``OSError`` while a server restarts) and, on timeout, is the last thing seen (and the
AssertionError's cause). ``RESTARTING`` is the usual ``ignore`` for a server being restarted.

A sleep that remains in a test is itself the thing under test (time passing to show something
does NOT happen, a timeout being approached, load being paced) and says so in a comment.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Awaitable, Callable, TypeVar, Union

T = TypeVar("T")

#: what a node that is restarting raises at a poller: its socket refuses (OSError), or its API
#: answers a status the predicate asserts against (AssertionError)
RESTARTING = (OSError, AssertionError)

_Exc = Union[type, tuple]


class _Poll:
    """The one wait-for-state logic: :func:`wait_for` and :func:`wait_for_async` only call the
    predicate, read their clock and sleep."""

    def __init__(self, predicate: Callable, timeout_s: float, now: float, what: str | None,
                 until: Callable | None, raise_on_timeout: bool) -> None:
        self.predicate, self.timeout_s, self.deadline = predicate, timeout_s, now + timeout_s
        self.what, self.until, self.raise_on_timeout = what, until, raise_on_timeout
        self.last: Any = None

    def accepts(self, value: Any) -> bool:
        self.last = value
        return bool(self.until(value) if self.until is not None else value)

    def failed(self, exc: BaseException) -> None:
        self.last = exc

    def expired(self, now: float) -> bool:
        return now >= self.deadline

    def timed_out(self) -> Any:
        if not self.raise_on_timeout:
            return self.last
        what = self.what or getattr(self.predicate, "__qualname__", None) or repr(self.predicate)
        raise AssertionError(f"timed out after {self.timeout_s}s waiting for {what}; last: {self.last!r}") from (
            self.last if isinstance(self.last, BaseException) else None)


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, *, interval_s: float = 0.05,
             what: str | None = None, ignore: _Exc = (), until: Callable[[T], Any] | None = None,
             raise_on_timeout: bool = True) -> T:
    """Poll ``predicate()`` until it returns something truthy (or, with ``until``, something
    ``until`` accepts) and return that value.

    ``ignore``: exception types the predicate may raise meanwhile (counted as "not yet").
    After ``timeout_s``: AssertionError naming ``what`` and the last value/exception seen (or,
    with ``raise_on_timeout=False``, that last value returned)."""
    poll = _Poll(predicate, timeout_s, time.monotonic(), what, until, raise_on_timeout)
    while True:
        try:
            value = predicate()
        except ignore as exc:
            poll.failed(exc)
        else:
            if poll.accepts(value):
                return value
        if poll.expired(time.monotonic()):
            return poll.timed_out()
        time.sleep(interval_s)


async def wait_for_async(predicate: Callable[[], Union[T, Awaitable[T]]], timeout_s: float = 10.0, *,
                         interval_s: float = 0.05, what: str | None = None, ignore: _Exc = (),
                         until: Callable[[T], Any] | None = None, raise_on_timeout: bool = True) -> T:
    """:func:`wait_for` for trio tests: sleeps with ``trio.sleep`` and measures with trio's clock
    (so it follows a test's MockClock). ``predicate`` may be a plain or an async function."""
    import trio

    poll = _Poll(predicate, timeout_s, trio.current_time(), what, until, raise_on_timeout)
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignore as exc:
            poll.failed(exc)
        else:
            if poll.accepts(value):
                return value
        if poll.expired(trio.current_time()):
            return poll.timed_out()
        await trio.sleep(interval_s)
