"""YAML for the CLI's ``-o yaml``: JSON-shaped data (dict, list, str, int, float, bool, None) only.

The project has no YAML library at run time (PyYAML comes with the test extra only), and the
CLI prints nothing but what it would print as JSON, so a small emitter does: block style,
every string and key double-quoted with YAML's escapes (so no value can turn into another
type, a comment or an anchor), floats spelled so that YAML 1.1 readers (PyYAML) read floats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r", "\0": "\\0"}


def quote(text: str) -> str:
    out = []
    for ch in text:
        code = ord(ch)
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif 0x20 <= code <= 0x7E:
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def scalar(value: object) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan"
        if math.isinf(value):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        if "e" in text and "." not in text:  # 1e+20: PyYAML's float needs the dot
            mantissa, _, exp = text.partition("e")
            text = f"{mantissa}.0e{exp}"
        return text
    if isinstance(value, str):
        return quote(value)
    raise TypeError(f"not JSON-shaped: {type(value).__name__}")


def _lines(value: object, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, Mapping):
        if not value:
            return [pad + "{}"]
        out = []
        for k, v in value.items():
            key = quote(str(k))
            if isinstance(v, (Mapping, list, tuple)) and v:
                out.append(f"{pad}{key}:")
                out.extend(_lines(v, indent + 2))
            else:
                out.append(f"{pad}{key}: {_inline(v)}")
        return out
    if isinstance(value, Sequence) and not isinstance(value, str):
        if not value:
            return [pad + "[]"]
        out = []
        for v in value:
            if isinstance(v, (Mapping, list, tuple)) and v:
                inner = _lines(v, indent + 2)
                out.append(f"{pad}- {inner[0][indent + 2:]}")
                out.extend(inner[1:])
            else:
                out.append(f"{pad}- {_inline(v)}")
        return out
    return [pad + scalar(value)]


def _inline(value: object) -> str:
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, (list, tuple)):
        return "[]"
    return scalar(value)


def dumps(value: object) -> str:
    """One YAML document (no ``---``), ending in a newline."""
    return "\n".join(_lines(value, 0)) + "\n"
