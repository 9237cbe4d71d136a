"""The tests' one polling helper: returns what held, names what it waited for when time runs out."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from tests.waiting import WaitTimeout, wait_for, wait_for_async


def test_returns_the_first_truthy_value():
    calls = itertools.count()
    assert wait_for(lambda: next(calls) >= 3 and "done", 5, "three calls", interval=0.001) == "done"


def test_times_out_naming_what_and_the_last_value():
    with pytest.raises(WaitTimeout, match=r"waiting for the impossible; last value: 0"):
        wait_for(lambda: 0, 0.05, "the impossible", interval=0.01)


@pytest.mark.parametrize("ignore, raised", [((OSError,), WaitTimeout), ((), ConnectionRefusedError)],
                         ids=["listed-errors-mean-not-yet", "other-errors-propagate"])
def test_only_listed_errors_count_as_not_yet(ignore, raised):
    def refuse():
        raise ConnectionRefusedError("not listening")
    with pytest.raises(raised, match="not listening"):
        wait_for(refuse, 0.05, "a server", interval=0.01, ignore=ignore)


def test_async_variant_waits_on_the_loop():
    async def body() -> str:
        flag: list[str] = []
        asyncio.get_running_loop().call_later(0.05, flag.append, "set")
        got = await wait_for_async(lambda: flag and flag[0], 5, "the flag", interval=0.01)
        with pytest.raises(WaitTimeout, match="never"):
            await wait_for_async(lambda: None, 0.05, "never", interval=0.01)
        return got
    assert asyncio.run(body()) == "set"
