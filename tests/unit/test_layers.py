"""Layering: the engine (runtime/) never depends on the NRI side (nri_plugin/), the transport
never depends on Rekindle's policy or engine (kept swappable and testable alone), and neither
the engine nor the plugin depends on the dev harness (devtools/: it is not shipped) or on the
tests and benchmarks. Inside the engine, each wing (runtime/criu, overlay, store, gpu, pages)
has its contract: what it may not import; and no two modules share a name."""

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
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.add(module)
            # ``from runtime import restore`` imports the module runtime.restore
            out.update(f"{module}.{a.name}" for a in node.names)
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


FLOWS = ("runtime.checkpoint", "runtime.restore", "runtime.doctor", "runtime.housekeeping")
WINGS = ("runtime.criu", "runtime.overlay", "runtime.store", "runtime.gpu", "runtime.pages")


def _others(*allowed: str) -> tuple[str, ...]:
    return tuple(w for w in WINGS if w not in allowed)


@pytest.mark.parametrize("wing, forbidden", [
    # CRIU and its images know nothing of what is stored, mapped or on a GPU
    ("runtime/criu", _others("runtime.criu")),
    # the writable layer: files and tar only
    ("runtime/overlay", _others("runtime.overlay")),
    # the shared store: bytes and manifests; how pages go into a process is not its business
    ("runtime/store", _others("runtime.store")),
    # the GPUs: the driver and the devices; the pages it restores from are the caller's
    ("runtime/gpu", _others("runtime.gpu")),
    # the bulk pages read CRIU's images and the store's versions, nothing of the GPU or the layer
    ("runtime/pages", _others("runtime.pages", "runtime.criu", "runtime.store")),
    # containerd's clients and its default paths: under everything
    ("runtime/containerd", WINGS),
], ids=["criu", "overlay", "store", "gpu", "pages", "containerd"])
def test_each_wing_keeps_to_its_contract(wing, forbidden):
    """A wing never imports a flow (checkpoint, restore, doctor, housekeeping), the plugin, or a
    wing its contract leaves out; the flows compose the wings."""
    bad = []
    for path in sorted((ROOT / wing).rglob("*.py")):
        if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in (*FLOWS, "nri_plugin", *forbidden)):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


SHARED_HOMES = ("proc", "container", "fs", "pod")


def _shared_modules() -> list[Path]:
    homes = [p for h in SHARED_HOMES for p in sorted((ROOT / "runtime" / h).glob("*.py"))]
    return sorted((ROOT / "runtime").glob("*.py")) + homes


def test_the_shared_modules_import_no_flow():
    """``runtime/*.py`` outside the flows, and the homes of the shared plumbing (``proc``,
    ``container``, ``fs``, ``pod``), are what the flows and the wings share: never a flow."""
    bad = []
    assert all((ROOT / "runtime" / h / "__init__.py").exists() for h in SHARED_HOMES)
    for path in _shared_modules():
        if ".".join(path.relative_to(ROOT).with_suffix("").parts) in FLOWS:
            continue
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in FLOWS):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_no_two_modules_share_a_name():
    """``preflight.py`` on both sides once meant two different things; a name says one."""
    seen: dict[str, list[str]] = {}
    for package in ("runtime", "nri_plugin", "devtools", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py") or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not shared, shared


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
