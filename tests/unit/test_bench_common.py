"""bench/common's pure helpers, restore_speed's run specs, and the rule that keeps the bench
scripts apart: a script imports bench.common (or bench.drill, bench.workloads), never another
script, and every ``python -m bench.X`` the repository runs names a module that is there."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import restore_speed
from bench.common import disk, model, plugin, results, targets
from bench.common.units import GIB
from bench.common.workload import CASES, CONTAINER, Workload
from runtime import control
from runtime.pages import uffd

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SCRIPTS = {p.stem for p in BENCH.glob("*.py") if p.stem != "__init__"}


# --- the rule ---------------------------------------------------------------------------------

def _bench_imports(path: Path) -> set[str]:
    """The bench.* modules a file imports (``from bench import x`` counts as bench.x)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "bench"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "bench":
                found |= {f"bench.{a.name}" for a in node.names}
            elif node.module.startswith("bench."):
                found.add(node.module)
    return found


def _script_imports(path: Path) -> list[str]:
    return sorted(m for m in _bench_imports(path) if m.split(".")[1] in SCRIPTS)


def test_no_bench_script_imports_another() -> None:
    files = [*BENCH.glob("*.py"), *(BENCH / "common").glob("*.py")]
    assert len(files) > len(SCRIPTS) > 10
    bad = {str(p.relative_to(REPO)): got for p in files if (got := _script_imports(p))}
    assert bad == {}


def test_the_rule_sees_every_import_form(tmp_path: Path) -> None:
    src = tmp_path / "x.py"
    src.write_text("import bench.gpu_restore\nfrom bench import llm_restore\nfrom bench.scale_out import Round\n"
                   "from bench.common import disk\nfrom bench.drill.rig import Rig\nimport json\n")
    assert _script_imports(src) == ["bench.gpu_restore", "bench.llm_restore", "bench.scale_out"]


def test_every_bench_module_the_repository_runs_is_there() -> None:
    run = set()
    for top in ("hack", "tests", "docs", "bench"):
        for p in (REPO / top).rglob("*"):
            if p.is_file() and p.suffix in (".sh", ".py", ".md"):
                run |= set(re.findall(r"-m\s+\"?(bench(?:\.[a-z0-9_]+)+)", p.read_text(errors="replace")))
    run |= set(re.findall(r"-m\s+(bench(?:\.[a-z0-9_]+)+)", (REPO / "README.md").read_text()))
    assert {"bench.llm_restore", "bench.restore_speed", "bench.scale_out", "bench.entry_fill"} <= run
    assert sorted(m for m in run if importlib.util.find_spec(m) is None) == []


# --- disk ---------------------------------------------------------------------------------------

def test_read_file_reads_the_range_and_stops_at_the_end(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(os.urandom(3 * disk.READ_BUFFER + 5))
    size = f.stat().st_size
    assert disk.read_file(f, 0, size) == size
    assert disk.read_file(f, 7, 100) == 100
    assert disk.read_file(f, size - 10, 1 << 20) == 10  # past the end: what is there
    assert disk.read_file(f, size, 10) == 0


def test_read_ranges_sums_every_range(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"y" * 300)
    assert disk.read_ranges([(a, 0, 500), (a, 500, 500), (b, 0, 300), (b, 200, 500)], threads=3) == 1400


def test_pick_image_root_takes_the_first_with_room(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    assert disk.pick_image_root([missing, str(tmp_path)], 0) == tmp_path
    with pytest.raises(SystemExit, match="no image dir among"):
        disk.pick_image_root([missing, str(tmp_path)], 1 << 62)


# --- results ------------------------------------------------------------------------------------

def test_host_facts() -> None:
    assert set(results.host()) == {"kernel", "cpus"}
    assert set(results.host(python=True)) == {"kernel", "cpus", "python"}


def test_gpu_line_parsed() -> None:
    assert results.parse_gpu_line("NVIDIA H200, 580.95.05") == {"name": "NVIDIA H200", "driver": "580.95.05"}


def test_criu_version_is_the_first_line(tmp_path: Path) -> None:
    criu = tmp_path / "criu"
    criu.write_text("#!/bin/sh\necho \"Version: 4.1 $FLAVOUR\"\necho GitID: v4.1\n")
    criu.chmod(criu.stat().st_mode | stat.S_IXUSR)
    assert results.criu_version(str(criu)) == "Version: 4.1"
    assert results.criu_version(str(criu), env={"FLAVOUR": "patched"}) == "Version: 4.1 patched"


def test_write_json_makes_the_dir(tmp_path: Path) -> None:
    out = tmp_path / "deep" / "r.json"
    results.write_json(out, {"b": 1, "a": [2]})
    assert out.read_text() == '{\n "b": 1,\n "a": [\n  2\n ]\n}\n'
    results.write_json(out, {"b": 1, "a": 2}, sort_keys=True)
    assert list(json.loads(out.read_text())) == ["a", "b"]


# --- model --------------------------------------------------------------------------------------

def test_a_made_model_is_found_not_made_again(tmp_path: Path) -> None:
    (tmp_path / model.MARKER).write_text(json.dumps({"bytes": 123, "files": 2}))
    assert model.make_model(tmp_path) == {"bytes": 123, "files": 2, "made_now": False}
    made, error = model.make_in_child(tmp_path)  # the child finds it too: no torch needed
    assert (made, error) == ({"bytes": 123, "files": 2, "made_now": False}, "")


# --- targets ------------------------------------------------------------------------------------

def test_split_covers_the_region_in_page_multiples() -> None:
    addr, length = 1 << 40, 10 * uffd.PAGE
    for ranges in (1, 3, 100):
        runs = targets.split(addr, length, ranges).ranges
        assert runs[0].vaddr == addr and runs[0].offset == 0
        assert sum(r.length for r in runs) == length
        assert all(b.vaddr == a.vaddr + a.length and b.offset == a.offset + a.length for a, b in zip(runs, runs[1:]))
    assert [r.length // uffd.PAGE for r in targets.split(addr, length, 3).ranges] == [3, 3, 3, 1]
    assert len(targets.split(addr, length, 100).ranges) == 10  # a page at least


def test_make_file_sums_each_chunk(tmp_path: Path) -> None:
    from runtime.layout import SUM_CHUNK
    path, sums = targets.make_file(str(tmp_path), SUM_CHUNK + 10)
    assert os.path.getsize(path) == SUM_CHUNK + 10
    assert len(sums) == 2 * 32


# --- the restore benches' plugin side and workloads ---------------------------------------------

def _fake_plugin(tmp_path: Path) -> SimpleNamespace:
    return SimpleNamespace(control_dir=lambda uid, name: tmp_path / "ctl" / uid / name, state_dir=str(tmp_path / "st"))


def test_read_timings(tmp_path: Path) -> None:
    p, pod = _fake_plugin(tmp_path), SimpleNamespace(uid="u1")
    assert plugin.read_timings(p, pod) is None  # not written yet
    ctl = tmp_path / "ctl" / "u1" / CONTAINER
    ctl.mkdir(parents=True)
    (ctl / control.TIMINGS).write_text("{half")
    assert plugin.read_timings(p, pod) is None
    (ctl / control.TIMINGS).write_text("[1]")
    assert plugin.read_timings(p, pod) is None
    doc = {"restore": {"criu_restore": 1.0}, "route": {"path": "stream", "kind": "stream", "reason": "r"}}
    (ctl / control.TIMINGS).write_text(json.dumps(doc))
    assert plugin.read_timings(p, pod) == doc


def test_cache_entries_are_the_complete_ones_by_name(tmp_path: Path) -> None:
    p = _fake_plugin(tmp_path)
    assert plugin.cache_entries(p) == []
    cache = plugin.cache_dir(p)
    assert cache == tmp_path / "st" / "cache" / "v1"
    for name, done in (("b", True), ("a", True), (".tmp-c", False)):
        (cache / name).mkdir(parents=True)
        if done:
            (cache / name / "entry.json").write_text("{}")
    assert [e.name for e in plugin.cache_entries(p)] == ["a", "b"]


def test_workload_kinds() -> None:
    args = SimpleNamespace(compile_mode="default", model_dir=Path("/m"))
    assert [Workload(c, args).ready_file() for c in ("synthetic-16gib", "llm-7b", "cpu-1gib")] == [
        "checksums.json", "worker-startup.json", "ready-for-checkpoint"]
    assert Workload("cpu-1gib", args).cpu and not Workload("llm-7b", args).cpu
    assert CASES["synthetic-16gib"] == 16.0 and CASES["llm-7b"] is None
    assert GIB == 1 << 30


# --- restore_speed's runs -------------------------------------------------------------------------

def test_default_runs_are_the_default_route_from_each_place() -> None:
    assert restore_speed.DEFAULT_RUNS == "auto:page-cache,auto:disk,auto:node-cache"
    # auto from the store: the node cache off; from the node cache: the plugin's own cache settings
    assert restore_speed.plugin_env("auto", "") == {"REKINDLE_RESTORE_PATH": "auto", "REKINDLE_CACHE_BYTES": "0"}
    assert restore_speed.plugin_env("auto", "", node_cache=True) == {"REKINDLE_RESTORE_PATH": "auto"}


def test_forced_paths_keep_their_environment() -> None:
    env = restore_speed.plugin_env
    assert env("bulk", "16") == {"REKINDLE_RESTORE_PATH": "bulk", "REKINDLE_FILL_THREADS": "16",
                                 "REKINDLE_CACHE_BYTES": "0"}
    assert env("stock", "") == {"REKINDLE_RESTORE_PATH": "stock", "REKINDLE_CACHE_BYTES": "0"}
    assert env("map", "", map_all=True) == {"REKINDLE_RESTORE_PATH": "bulk", "REKINDLE_CACHE_TMPFS": "1",
                                            "REKINDLE_MAP": "all"}
    assert env("stream+cache", "", node_cache=True) == {"REKINDLE_RESTORE_PATH": "stream", "REKINDLE_CACHE_TMPFS": "1"}


def test_bytes_are_counted_by_the_route_taken() -> None:
    moved = restore_speed.moved_as
    assert moved("auto", {"path": "stream", "kind": "stream-build"}) == "stream"
    assert moved("auto", {"path": "bulk", "kind": "mapped"}) == "map"
    assert moved("auto", {"path": "bulk", "kind": "bulk"}) == "bulk"
    assert moved("stream", {"path": "bulk", "kind": "bulk"}) == "bulk"  # the node could not stream
    assert moved("stock", {"path": "stock", "kind": "stock"}) == "stock"
    # no route recorded: the path asked for
    assert [moved(p, None) for p in ("stock", "stream", "stream+cache", "map", "bulk", "auto")] == [
        "stock", "stream", "stream", "map", "bulk", "bulk"]


def test_summary_names_the_route() -> None:
    rec = {"case": "llm-7b", "path": "auto", "cache": "disk", "cold_start_s": 30.0, "restore_s": 3.0,
           "route": {"path": "stream", "kind": "stream", "reason": "the CUDA driver reads its host copy"}}
    head = restore_speed.summary(rec).splitlines()[0]
    assert head.startswith("llm-7b auto (disk), route stream/stream (the CUDA driver reads its host copy): restore 3.0 s")
    assert "route not recorded" in restore_speed.summary({**rec, "route": None})
