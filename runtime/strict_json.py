"""Strict JSON <-> frozen dataclasses, for files Rekindle signs or hashes and later reads back.

:func:`canonical_json` gives canonical bytes (sorted keys, compact separators, UTF-8, no NaN).
:func:`loads` parses untrusted bytes: no duplicate keys, no NaN/Infinity (nor a number too large
for a float, such as ``1e999``, which Python reads as infinity), no lone surrogate in a string
(``"\\ud800"``: no UTF-8 encodes it, so nothing Rekindle writes holds one), a size cap, and nesting
deeper than a bound is an error, not a RecursionError. :func:`from_obj` converts JSON to a
dataclass type with exact key sets and strict JSON types (a bool is not an int, a float field takes
an int). Every problem raises ``ValueError`` / ``TypeError`` naming where it is; callers turn that
into their own error type once.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

MAX_DEPTH = 64


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


# The closing quote is optional: an unterminated string is consumed to the end in one match
# (json.loads refuses it afterwards), where a required quote made the regex rescan from every
# later quote: quadratic on '"\\"\\"...' (40 KB took 6.7 s).
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_BRACKETS_ONLY = {c: None for c in range(128) if chr(c) not in "[]{}"}
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def _depth(text: str) -> int:
    """Deepest nesting of brackets outside strings (a cheap scan before json.loads recurses):
    strings dropped by one regex, then the brackets' running sum, all in C loops."""
    brackets = _STRING.sub("", text).translate(_BRACKETS_ONLY)
    # non-ASCII characters outside strings are not JSON; json.loads refuses them afterwards
    return max(itertools.accumulate(_STEP.get(ch, 0) for ch in brackets), default=0)


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:40]!r} is too large for a float")
    return value


# A surrogate can only come from a \u escape (the UTF-8 decoder refuses encoded ones); a pair of
# them is one character, a lone one is not text. The escape is looked for first (one scan), the
# parsed strings only when there is one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_NOT_A_BYTE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def _no_lone_surrogates(obj: Any, bad: re.Pattern[str]) -> None:
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if (m := bad.search(value)) is not None:
                raise ValueError(f"lone surrogate U+{ord(m.group()):04X} in string {value[:40]!r}")
        elif isinstance(value, list):
            stack += value
        elif isinstance(value, dict):
            stack += value.keys()
            stack += value.values()


def loads(data: bytes, *, max_bytes: int, max_depth: int = MAX_DEPTH, escaped_bytes: bool = False) -> Any:
    """Parse untrusted JSON bytes; ValueError on anything off.

    ``escaped_bytes``: lone surrogates U+DC80..U+DCFF are let through, Python's stand-ins for the
    bytes of a file name that are not UTF-8 (``os.fsdecode``); what names files only."""
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8: {exc}") from exc
    if _depth(text) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants,
                         parse_float=_finite)
    except RecursionError:  # pragma: no cover - the depth scan catches it first
        raise ValueError("nested too deeply") from None
    if _SURROGATE_ESCAPE.search(text):
        _no_lone_surrogates(obj, _SURROGATE_NOT_A_BYTE if escaped_bytes else _SURROGATE)
    return obj


def to_obj(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_obj(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [to_obj(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_obj(v) for k, v in value.items()}
    return value


@functools.cache
def _fields(tp: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A dataclass's field types and names (resolving the hints is slow; plans hold thousands)."""
    return typing.get_type_hints(tp), frozenset(f.name for f in dataclasses.fields(tp))


def from_obj(tp: Any, value: Any, where: str) -> Any:
    """Convert JSON to ``tp`` with strict types; raise TypeError/ValueError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else from_obj(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object")
        hints, names = _fields(typing.cast(type, tp))
        if value.keys() != names:
            extra, missing = sorted(set(value) - names), sorted(names - set(value))
            raise ValueError(f"{where}: unknown keys {extra}, missing keys {missing}")
        make = typing.cast("Callable[..., Any]", tp)  # a dataclass type (is_dataclass also takes instances)
        return make(**{n: from_obj(hints[n], value[n], f"{where}.{n}") for n in names})
    if origin is tuple:
        if not isinstance(value, list):
            raise TypeError(f"{where}: expected a list")
        inner = typing.get_args(tp)
        if len(inner) == 2 and inner[1] is Ellipsis:
            return tuple(from_obj(inner[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(inner) != len(value):
            raise ValueError(f"{where}: expected {len(inner)} items")
        return tuple(from_obj(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(inner, value)))
    if origin in (Mapping, dict):
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object")
        inner = typing.get_args(tp)[1]
        return {k: from_obj(inner, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if type(value) not in (int, float):
            raise TypeError(f"{where}: expected a number")
        try:
            return float(value)
        except OverflowError:  # an int past a float's range
            raise ValueError(f"{where}: number too large") from None
    if tp in (str, int, bool):
        if type(value) is not tp:
            raise TypeError(f"{where}: expected {tp.__name__}")
        return value
    raise TypeError(f"{where}: unsupported type {tp!r}")  # pragma: no cover
