"""Layering: the engine (runtime/) never depends on the NRI side (nri_plugin/), the transport
never depends on Rekindle's policy or engine (kept swappable and testable alone), and neither
the engine nor the plugin depends on the dev harness (devtools/: it is not shipped) or on the
tests and benchmarks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                out.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                out.add(node.module)
    return out


HARNESS = ("devtools", "tests", "bench")


@pytest.mark.parametrize(
    "package, forbidden",
    [("runtime", ("nri_plugin", *HARNESS)),
     ("nri_plugin", HARNESS),
     ("devtools", ("tests", "bench")),
     ("nri_plugin/transport", ("runtime", "nri_plugin.handlers", "nri_plugin.policy", "nri_plugin.jobs",
                               "nri_plugin.stub", "nri_plugin.agent"))],
    ids=["engine-below-plugin-and-harness", "plugin-below-harness", "harness-below-tests-and-bench",
         "transport-below-everything"],
)
def test_lower_layers_do_not_import_higher_ones(package, forbidden):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("library, allowed", [
    ("kubernetes", {"nri_plugin/events_k8s.py"}),
    ("prometheus_client", {"nri_plugin/metrics.py", "nri_plugin/httpd.py"}),
], ids=["kubernetes-client", "prometheus-client"])
def test_outside_libraries_stay_in_their_one_module(library, allowed):
    """The engine never imports the Kubernetes client; each library has one home, so the rest of
    the plugin (outcomes, jobs, handlers) stays plain data and decisions."""
    bad = []
    for package in ("runtime", "nri_plugin"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in allowed:
                continue
            if any(name == library or name.startswith(library + ".") for name in imports_of(path)):
                bad.append(rel)
    assert not bad, f"{library} imported by {bad}"
