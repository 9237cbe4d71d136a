"""The layers hold: no import cycle among runtime/ and nri_plugin/ modules, and runtime/ (the
mechanics) never imports nri_plugin/ (the plugin). Every import counts, those inside functions
and under ``TYPE_CHECKING`` too: a cycle hidden there is still a cycle of what the modules know."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("runtime", "nri_plugin")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(name: str, known: set[str]) -> str | None:
    """The most specific known module ``name`` is, or lies in (``a.b.C`` names module ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The known modules that ``module``'s source imports anywhere in its body."""
    package = module if is_package else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # ``from pkg import sub`` names the module pkg.sub when there is one
            targets = [f"{origin}.{alias.name}" for alias in node.names]
        for target in targets:
            found = _resolve(target, known)
            if found is not None and found != module:
                out.add(found)
    return out


def build_graph(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")
             if "_pb2" not in p.name}
    known = set(files)
    return {m: imports_of(m, p.read_text(), known, p.name == "__init__.py") for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_rules_find_a_cycle_and_resolve_relative_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import X\n")
    (pkg / "sub" / "__init__.py").write_text("from .c import X\n")
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import Y\n")
    graph = build_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


def test_no_import_cycle() -> None:
    assert cycles(build_graph()) == []


def test_runtime_never_imports_the_plugin() -> None:
    graph = build_graph()
    wrong = {m: sorted(t for t in targets if t.split(".")[0] == "nri_plugin")
             for m, targets in graph.items() if m.split(".")[0] == "runtime"}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_the_uffd_holder_loads_only_what_it_runs() -> None:
    """The holder is a Python started for each streamed restore, and the tree's first uffd waits
    for it: CRIU's protobufs and the node cache (0.4 s of imports on a 2-core node) stay out."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    probe = ("import sys, runtime.pages.holder; "
             "print(','.join(m for m in sys.modules if m.startswith(('google', 'runtime.criu', 'runtime.pages.'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout.strip()
    assert sorted(m for m in out.split(",") if m) == ["runtime.pages.holder"], out
