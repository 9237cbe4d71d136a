"""Asking again until done or a deadline (nri_plugin.polling), on a clock the test moves."""

from __future__ import annotations

import pytest

from nri_plugin.polling import ask_until


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_asked_until_done() -> None:
    clock, answers = Clock(), iter([None, None, 7, 8])
    got = ask_until(lambda: next(answers), 10.0, 0.5, done=lambda a: a is not None, clock=clock, sleep=clock.sleep)
    assert got == 7 and clock.slept == [0.5, 0.5]


def test_the_last_answer_at_the_deadline() -> None:
    clock, asked = Clock(), []

    def ask() -> str:
        asked.append(clock.now)
        return ""

    assert ask_until(ask, 1.0, 0.25, done=bool, clock=clock, sleep=clock.sleep) == ""
    assert asked == [100.0, 100.25, 100.5, 100.75, 101.0]


def test_asked_once_with_no_time() -> None:
    clock, asked = Clock(), []
    assert ask_until(lambda: asked.append(1) or 0, 0.0, 1.0, done=bool, clock=clock, sleep=clock.sleep) == 0
    assert asked == [1] and clock.slept == []


def test_a_retried_error_is_asked_again_then_raised() -> None:
    clock, misses = Clock(), []

    def ask() -> int:
        raise ConnectionError("not yet")

    with pytest.raises(ConnectionError):
        ask_until(ask, 1.0, 0.5, retry=(ConnectionError,), missed=lambda n, m: misses.append((n, str(m))),
                  clock=clock, sleep=clock.sleep)
    assert misses == [(1, "not yet"), (2, "not yet")]  # the third, at the deadline, is raised


def test_a_retried_error_then_an_answer() -> None:
    clock, answers = Clock(), iter([ConnectionError("down"), 5])

    def ask() -> int:
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert ask_until(ask, 1.0, 0.5, retry=(ConnectionError,), clock=clock, sleep=clock.sleep) == 5


def test_another_error_is_not_retried() -> None:
    clock = Clock()

    def ask() -> int:
        raise KeyError("x")

    with pytest.raises(KeyError):
        ask_until(ask, 5.0, 0.5, retry=(ConnectionError,), clock=clock, sleep=clock.sleep)
    assert clock.slept == []


def test_missed_is_told_of_each_miss_asked_again() -> None:
    clock, misses = Clock(), []
    ask_until(lambda: 0, 1.0, 0.5, done=bool, missed=lambda n, m: misses.append((n, m)), clock=clock,
              sleep=clock.sleep)
    assert misses == [(1, 0), (2, 0)]
