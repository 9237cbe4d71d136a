"""Rules of the code's shape that no linter here checks: a string statement anywhere but first in
a module, class or function body is no docstring (a class attribute put above a docstring turned
seven exception classes' docstrings into dead code once)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "nri_plugin", "devtools", "bench")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "_pb2" not in p.name)


def pointless_strings(source: str) -> list[tuple[int, str]]:
    """(line, owner) of each string statement that is not its body's first statement."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body[1:]:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) \
                        and isinstance(stmt.value.value, str):
                    found.append((stmt.lineno, getattr(node, "name", "<module>")))
    return found


def test_the_rule_finds_a_docstring_below_an_attribute() -> None:
    src = 'class E(Exception):\n    reason = 1\n    """dead"""\n\n\ndef f():\n    """live"""\n'
    assert pointless_strings(src) == [(3, "E")]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_string_statement_but_docstrings(path: Path) -> None:
    assert pointless_strings(path.read_text()) == [], path
