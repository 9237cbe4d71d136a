"""The one way tests wait: poll a condition until a deadline, never sleep and hope.

``wait_for(predicate, timeout, what)`` calls ``predicate`` every ``interval`` seconds until it
returns something truthy and returns that value; after ``timeout`` seconds it raises
:class:`WaitTimeout` (an AssertionError, so pytest reports it as a failed check) naming ``what``
and the last value seen. Exceptions of the types in ``ignore`` (a server not listening yet, a
file not there yet) count as "not yet" and are named too if the time runs out.
``wait_for_async`` is the same for code on an event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The condition did not hold before the deadline."""


def _give_up(what: str, timeout: float, last: object, error: BaseException | None) -> WaitTimeout:
    seen = f"; last error: {type(error).__name__}: {error}" if error is not None else f"; last value: {last!r}"
    return WaitTimeout(f"timed out after {timeout:g} s waiting for {what}{seen}")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.02,
             ignore: tuple[type[BaseException], ...] = ()) -> T:
    deadline = time.monotonic() + timeout
    while True:
        error: BaseException | None = None
        value: T | None = None
        try:
            value = predicate()
        except ignore as exc:
            error = exc
        if error is None and value:
            return value
        if time.monotonic() >= deadline:
            raise _give_up(what, timeout, value, error)
        time.sleep(interval)


async def wait_for_async(predicate: Callable[[], T], timeout: float, what: str, *, interval: float = 0.02) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _give_up(what, timeout, value, None)
        await asyncio.sleep(interval)
