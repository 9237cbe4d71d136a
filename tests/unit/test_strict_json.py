"""Strict JSON parsing of untrusted bytes: the nesting scan is right and stays linear."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from runtime import strict_json


@pytest.mark.parametrize("text, depth", [
    ("[]", 1), ('{"a":[1,{"b":"[[["}]}', 3), ('"x\\"[["', 0), ("[[[[", 4),
    ('{"a\\\\":[[1]]}', 3), ('["abc', 1), ('["a\\', 1),
])
def test_nesting_is_counted_outside_strings(text: str, depth: int) -> None:
    assert strict_json._depth(text) == depth


@pytest.fixture
def deadline() -> Iterator[None]:
    """A hang fails the test instead of stalling the run."""
    def expired(*_: object) -> None:
        raise TimeoutError("strict_json took more than 20 s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_an_unterminated_string_of_escaped_quotes_is_refused_not_rescanned(deadline: None) -> None:
    # '"\"\"\"...' never closes: a scan that restarted at every quote was quadratic (1 MB: hours)
    data = ('"' + '\\"' * 500_000).encode()
    assert strict_json._depth(data.decode()) == 0
    with pytest.raises(ValueError):
        strict_json.loads(data, max_bytes=2 << 20)


def test_too_deep_is_refused() -> None:
    with pytest.raises(ValueError, match="nested deeper"):
        strict_json.loads(b"[" * 100 + b"]" * 100, max_bytes=1 << 20)
