"""Small trio helpers shared by the broker and the router shells."""

from __future__ import annotations

import trio


class Wakeup:
    """A level-triggered flag: synchronous code calls ``set()``, one task ``await wait()``s.

    Several ``set()`` calls before the waiter runs collapse into one wake-up, which is what a
    writer task flushing an engine's output wants.
    """

    __slots__ = ("flag", "event")

    def __init__(self) -> None:
        self.flag = False
        self.event = trio.Event()

    def set(self) -> None:
        if not self.flag:
            self.flag = True
            self.event.set()

    async def wait(self) -> None:
        if not self.flag:
            await self.event.wait()
        self.flag = False
        self.event = trio.Event()


def single_leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) single-member exception groups, or the group itself.

    trio wraps a task's exception in an ExceptionGroup; a CLI wants the config error or OSError
    inside to print its one line.
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
