"""Asking again until an answer comes or a deadline passes (containerd restarting, an exit it
has seen but not reported yet).

:func:`ask_until` asks at least once; the deadline counts from before the first ask, and an ask
that runs past it is the last one (no ask is cut short).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def _always(_answer: object) -> bool:
    return True


def ask_until(ask: Callable[[], T], timeout: float, interval: float, *,
              done: Callable[[T], bool] = _always,
              retry: tuple[type[Exception], ...] = (),
              missed: Callable[[int, T | Exception], None] | None = None,
              clock: Callable[[], float] = time.monotonic,
              sleep: Callable[[float], None] = time.sleep) -> T:
    """``ask()`` every ``interval`` seconds until ``done(answer)`` or ``timeout`` seconds have
    passed; the last answer, done or not. An exception of a ``retry`` type is asked again, and
    raised when the deadline has passed. ``missed(n, answer or exception)`` is told of each miss
    that is asked again (n from 1), before the wait."""
    deadline = clock() + timeout
    misses = 0
    while True:
        miss: T | Exception
        try:
            answer = ask()
        except retry as exc:
            if clock() >= deadline:
                raise
            miss = exc
        else:
            if done(answer) or clock() >= deadline:
                return answer
            miss = answer
        misses += 1
        if missed is not None:
            missed(misses, miss)
        sleep(interval)
