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


@pytest.mark.parametrize("data, needle", [
    (b"1e999", "too large for a float"),  # json.loads: inf
    (b'{"a": [-1e999]}', "too large for a float"),
    (b'{"a": 1E400}', "too large for a float"),
    (b'"\\ud800"', "lone surrogate U\\+D800"),  # json.loads: a str no UTF-8 encodes
    (b'["ok", "x\\uDFFFy"]', "lone surrogate U\\+DFFF"),
    (b'{"\\udc80": 1}', "lone surrogate U\\+DC80"),  # a key, and a stand-in byte: not here
    (b'"\\ude00\\ud83d"', "lone surrogate"),  # a pair the wrong way round is two lone ones
], ids=["inf", "minus-inf-nested", "exponent", "lone-high", "lone-low-in-list", "key", "reversed-pair"])
def test_numbers_past_a_float_and_lone_surrogates_are_refused(data: bytes, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        strict_json.loads(data, max_bytes=1 << 20)


def test_what_is_still_text_and_numbers_is_accepted() -> None:
    assert strict_json.loads(b'["\\ud83d\\ude00", "\\\\ud800", 1.5, 1e-999, 1e308]', max_bytes=100) == [
        "\U0001F600", "\\ud800", 1.5, 0.0, 1e308]


def test_escaped_bytes_lets_only_a_file_names_stand_ins_through() -> None:
    assert strict_json.loads(b'["gone-\\udcff"]', max_bytes=100, escaped_bytes=True) == ["gone-\udcff"]
    with pytest.raises(ValueError, match="lone surrogate U\\+D800"):
        strict_json.loads(b'["\\ud800"]', max_bytes=100, escaped_bytes=True)


def test_the_depth_bound_is_the_callers() -> None:
    assert strict_json.loads(b"[[1]]", max_bytes=100, max_depth=2) == [[1]]
    with pytest.raises(ValueError, match="nested deeper than 2"):
        strict_json.loads(b"[[[1]]]", max_bytes=100, max_depth=2)


def test_an_integer_past_a_float_is_refused_for_a_float_field() -> None:
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class T:
        x: float

    assert strict_json.from_obj(T, {"x": 3}, "t") == T(3.0)
    with pytest.raises(ValueError, match="t.x: number too large"):  # float(): OverflowError
        strict_json.from_obj(T, {"x": 10**400}, "t")
