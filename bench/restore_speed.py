"""Benchmark: restore speed through containerd and the plugin, the default route from each
place a restore reads, with the speed of light of every phase measured in the same run.

Usage (root, on a GPU node set up by hack/gpu-node-setup.sh):
``python -m bench.restore_speed --case synthetic-16gib|synthetic-49gib|llm-7b [--out-dir DIR]``

For the case's workload (tests/gpu/workloads/gpu_holder.py holding N GiB, or the Qwen2-7B-shaped
bench/workloads/llm_worker.py), one source pod is cold-started (timed) and checkpointed by
annotation; the source pod is stopped; then the ceilings are measured: reading the artifact once
from disk with the page cache dropped (16 threads of 8 MiB reads, and 4 of 2 MiB: the faster
counts), reading it from the page cache, copying into
fresh memory, and pinned host-to-device copies. Then restores into new pods, one after the other
on the same artifact: ``--runs`` (default ``auto:page-cache,auto:disk,auto:node-cache``: the
plugin's default path, ``auto``, which ``runtime.route`` turns into a streamed restore for a CUDA
tree), where ``disk`` drops the page cache first, ``page-cache`` reads the artifact in first, and
``node-cache`` runs the plugin with its node cache as a node has it by default (on, in its state
dir), one untimed restore writing the entry first; ``bulk@16`` fills on 16 threads (default: one
per core, up to 16). Each restore
is timed from container create to the plugin's ``restored`` and to the first answer, which must be
the source's (tokens, or GPU checksums), and prints the route it took (``path/kind (reason)``, from
its ``timings.json``), by which its bytes are counted. The other paths force one way:
``stock`` restarts the plugin with
``REKINDLE_RESTORE_PATH=stock`` (CRIU restores every page); ``bulk`` with
``REKINDLE_RESTORE_PATH=bulk`` (the bulk pages filled beside CRIU first); ``stream:page-cache`` with
``REKINDLE_RESTORE_PATH=stream`` (the tree runs right after CRIU, the bulk pages served through
userfaultfd while it and its CUDA restore run; ``restored`` comes once the last piece is in, so
its ``stream`` phase is the serve's tail after the CUDA restore). ``map:page-cache``: the
plugin with its node cache on a ``huge=always`` tmpfs (``REKINDLE_CACHE_TMPFS=1``), one untimed
restore writing the entry first: the runs then map the driver's host copy from it and fill the
rest from it (``runtime.pages.mapping``). ``stream+cache:page-cache``: the streamed path with the
node cache on such a tmpfs and no entry yet (any entry is removed first): the restore maps the
driver's host copy from the entry's file as its serve writes it (``runtime.pages.stream``'s
mapped ranges), and the entry it made is timed until finished (``cache_written_s``). Every other
run has the cache off.

Writes ``--json`` (default OUT_DIR/restore-speed.json) after every step: ``runs`` holds one object
per restore: ``case``, ``path``, ``cache``, ``route``, ``cold_start_s``, ``restore_s``,
``first_answer_s``, ``phases`` (seconds), ``bytes`` (per phase), ``sol_s``, ``identical``, and
``table`` (each phase with its bytes, GB/s, ceiling and speed of light). Prints the tables.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import model, results
from bench.common.disk import drop_caches, pick_image_root
from bench.common.h2d import measure_h2d
from bench.common.plugin import cache_dir, cache_entries, restart_plugin
from bench.common.restore_rig import RestoreRig
from bench.common.units import GB, GIB
from bench.common.workload import CASES, Workload
from devtools import phases
from devtools.sandbox import Runtime, Sandbox, SandboxConfig
from runtime.store import readahead
from tests.gpu import gpu_pods

log = logging.getLogger(__name__)

# The product's default route (``auto``) from each place a restore reads: the page cache, the
# disk (page cache dropped) and a node cache entry.
NODE_CACHE = "node-cache"
DEFAULT_RUNS = "auto:page-cache,auto:disk,auto:node-cache"


def plugin_env(path: str, threads: str, map_all: bool = False, node_cache: bool = False) -> dict[str, str]:
    """The plugin's environment for a run of ``path``: the node cache on a ``huge=always`` tmpfs
    for ``map`` and ``stream+cache``; for a run from the node cache (``node_cache``) on any other
    path, the plugin's own cache settings (on, in its state dir: what a node gets by default);
    every other run reads the artifact from the store. ``map_all``: every large range maps (a CPU
    workload has no CUDA driver's host copy, the default's one range)."""
    tmpfs = path in ("map", "stream+cache")
    restore_path = {"map": "bulk", "stream+cache": "stream"}.get(path, path)
    cache_env = {"REKINDLE_CACHE_TMPFS": "1"} if tmpfs else {} if node_cache else {"REKINDLE_CACHE_BYTES": "0"}
    return {"REKINDLE_RESTORE_PATH": restore_path, **({"REKINDLE_FILL_THREADS": threads} if threads else {}),
            **cache_env, **({"REKINDLE_MAP": "all"} if tmpfs and map_all else {})}


def moved_as(path: str, route: dict[str, Any] | None) -> str:
    """How a run's bulk pages moved, for its table: ``stock``, ``stream``, ``map`` (ranges mapped
    from the node cache, the rest filled) or ``bulk``; from the route the restore recorded
    (``runtime.route``), else from the path it was asked for."""
    if route:
        if route.get("path") in ("stock", "stream"):
            return str(route["path"])
        return "map" if route.get("kind") == "mapped" else "bulk"
    if path.startswith("stream"):
        return "stream"
    return path if path in ("stock", "map") else "bulk"


def route_text(route: dict[str, Any] | None) -> str:
    """The route a run took, for its summary line: ``path/kind (reason)``."""
    if not route:
        return "not recorded"
    return f"{route.get('path')}/{route.get('kind')} ({route.get('reason')})"


def await_entry(plugin: Any, timeout: float = 300.0) -> float:
    """Seconds until the node cache holds a finished entry (and nothing half-written)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cache_entries(plugin) and not list(cache_dir(plugin).glob(".tmp-*")):
            break
        time.sleep(0.1)
    return round(time.monotonic() - t0, 2)


def clear_cache(plugin: Any) -> None:
    """Every entry removed (once no writer is mid-entry): the next restore finds none."""
    t0 = time.monotonic()
    while list(cache_dir(plugin).glob(".tmp-*")) and time.monotonic() - t0 < 300:
        time.sleep(0.1)
    for entry in cache_dir(plugin).glob("*"):
        shutil.rmtree(entry, ignore_errors=True)


class Bench(RestoreRig):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args, {
            "what": "bench/restore_speed.py through containerd 1.7 + runc + CRIU + CNI + the plugin",
            "host": results.host(), "case": args.case, "runs": []})

    def ceilings(self, art: Path, disk: bool) -> dict[str, float]:
        files = [p for p in art.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
        c: dict[str, float] = {}
        if disk:  # reading the artifact once from the disk, page cache dropped, in two shapes:
            # deep (16 threads of 8 MiB) and shallow (4 of 2 MiB, the prefetch's); the faster counts
            for label, threads, chunk in (("deep", 16, 8 << 20), ("shallow", readahead.THREADS, readahead.CHUNK)):
                c["drop_caches_s"] = drop_caches()
                t = time.perf_counter()
                c[f"disk_read_gbps_{label}"] = phases.read_gbps(files, threads, limit=size, chunk=chunk)
                c[f"read_once_s_{label}"] = round(time.perf_counter() - t, 3)
            c["disk_read_gbps"] = max(c["disk_read_gbps_deep"], c["disk_read_gbps_shallow"])
            c["read_once_s"] = min(c["read_once_s_deep"], c["read_once_s_shallow"])
        phases.read_gbps(files, 16, limit=size)  # warm
        c["cache_read_gbps"] = phases.read_gbps(files, 16, limit=size)
        threads = min(16, os.cpu_count() or 1)
        c["copy_gbps"] = phases.copy_gbps(threads, min(8 << 30, max(1 << 30, size)))
        if shutil.which("nvidia-smi"):
            c.update(measure_h2d(sys.executable, 4.0))
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in c.items()}

    def restore(self, cri: Any, plugin: Any, wl: Workload, path: str, cache: str, art: Path,
                src: dict[str, Any], ceil: dict[str, float], warm_up: bool = False) -> dict[str, Any]:
        """One restore of ``path`` from ``cache`` into a new pod, timed; ``warm_up``: an untimed
        one that writes the node cache's entry for the runs after it."""
        rec: dict[str, Any] = {"case": self.args.case, "path": path, "cache": cache,
                               "cold_start_s": src["cold_start_s"], **({"warm_up": True} if warm_up else {})}
        self.doc["runs"].append(rec)
        if cache == "disk":
            rec["drop_caches_s"] = drop_caches()
        else:
            phases.read_gbps([p for p in art.rglob("*") if p.is_file()], 16, limit=1 << 62)
        b = cri.run_pod_sandbox(f"speed-{path.replace('+', '-')}-{cache}-{len(self.doc['runs'])}",
                                annotations={"rekindle.dev/restore": self.args.case})
        self.pods.append(b)
        t0 = time.monotonic()
        cid = wl.start(cri, b)
        try:
            if not self.await_restore(cri, plugin, wl, b, path, t0, rec):
                return rec
        finally:
            log_name = f"worker-{path}-{cache}{'-warm-up' if warm_up else ''}.log"
            (self.args.out_dir / log_name).write_text(gpu_pods.container_logs(cri, cid)[-100_000:])
            self.stop(cri, b)
        moved = phases.phase_bytes(art)
        gpu_bytes = src["cold"].get("gpu_bytes", 0)
        moved["cuda_restore"] = gpu_bytes
        how = moved_as(path, rec.get("route"))
        if how == "stock":  # CRIU restores the bulk pages too, and the stage copies them
            moved["criu_restore"] += moved["fill"]
            moved["stage"] += moved["fill"]
        elif how == "stream":  # the bulk pages arrive while the tree runs (and the CUDA restore)
            moved["stream"] = moved.pop("fill")
        elif how == "map":  # mapped from the node cache: only the rest is filled
            moved["fill"] = int((rec.get("node_cache") or {}).get("filled_bytes", 0))
        rec["bytes"] = moved
        read = ceil["disk_read_gbps"] if cache == "disk" else ceil["cache_read_gbps"]
        copy = min(read, ceil["copy_gbps"])
        h2d = ceil.get("h2d_pinned_gbps") or 0.0
        c = {"stage": read, "rootfs_apply": read, "criu_restore": copy, "fill": copy, "stream": copy,
             "cuda_restore": h2d}
        rec["table"] = phases.rows(rec["phases"], moved, c)
        # The restore must at least read the artifact once and copy the GPU state to the GPU.
        rec["sol_s"] = round(max(moved["artifact"] / GB / read, gpu_bytes / GB / h2d if h2d else 0.0), 3)
        return rec

    def run(self) -> int:
        args = self.args
        wl = Workload(args.case, args)
        doc = self.doc
        if not self.describe(wl):
            return 1
        # the artifact, and a private copy of it for a stock restore
        need = int((wl.gib or 15) * GIB * 1.15 * (2 if "stock:" in args.runs else 1)) + 4 * GIB
        work = args.work or pick_image_root(["/var/tmp", "/dev/shm"], need) / "rekindle-speed"
        doc["store_dir"] = str(work)
        sb = Sandbox(SandboxConfig(runtime=Runtime.V1_7))
        started = not sb.is_running()  # one it starts it stops: a test session after it owns its own
        sb.up()
        cri = sb.cri(timeout=120.0)
        shutil.rmtree(work, ignore_errors=True)
        plugin = gpu_pods.start_plugin(sb, work / "plugin")
        status = 0
        try:
            doc["source"] = self.source(cri, plugin, wl)
            self.save()
            art = phases.artifact_dir(plugin.store, "default", args.case)
            doc["artifact_bytes"] = phases.phase_bytes(art)
            doc["ceilings"] = ceil = self.ceilings(art, disk=":disk" in args.runs)
            self.save()
            # every path starts in a fresh plugin: no run finds caches warmed by another
            current: tuple[str, str, bool] = ("", "", False)
            for spec in args.runs.split(","):
                how, cache = spec.split(":")
                path, _, threads = how.partition("@")  # bulk@16: the fill on 16 threads
                from_entry = cache == NODE_CACHE
                if (path, threads, from_entry) != current:
                    restart_plugin(plugin, plugin_env(path, threads, map_all=wl.cpu, node_cache=from_entry))
                    current = (path, threads, from_entry)
                    # a run from the node cache: one restore writes the entry first
                    if (path == "map" or from_entry) and not cache_entries(plugin):
                        warm = self.restore(cri, plugin, wl, "bulk" if path == "map" else path, "page-cache", art,
                                            doc["source"], ceil, warm_up=True)
                        warm["cache_written_s"] = await_entry(plugin)
                if path == "stream+cache":
                    clear_cache(plugin)  # each run makes the entry as it restores
                try:
                    rec = self.restore(cri, plugin, wl, path, cache, art, doc["source"], ceil)
                    if path == "stream+cache":
                        rec["cache_written_s"] = await_entry(plugin)
                    if threads:
                        rec["fill_threads"] = int(threads)
                    print(summary(rec), flush=True)
                except Exception as exc:  # noqa: BLE001 - record it, go on with the next run
                    log.exception("run %s failed", spec)
                    doc["runs"].append({"case": args.case, "path": path, "cache": cache, "error": str(exc)[-2000:]})
                    status = 1
                self.save()
        finally:
            self.clean_up(cri, plugin, work)
            if started:
                sb.down()
        return status


def summary(rec: dict[str, Any]) -> str:
    head = (f"{rec['case']} {rec['path']} ({rec['cache']}), route {route_text(rec.get('route'))}: "
            f"restore {rec.get('restore_s')} s, first answer "
            f"{rec.get('first_answer_s')} s, cold start {rec.get('cold_start_s')} s "
            f"({(rec['cold_start_s'] / rec['restore_s']) if rec.get('restore_s') else 0:.1f}x), "
            f"speed of light {rec.get('sol_s')} s, identical {rec.get('identical')}"
            + (f", FAILED: {rec['failure']}" if rec.get("failure") else ""))
    return head + ("\n" + phases.format_rows(rec["table"]) if rec.get("table") else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help="PATH[@THREADS]:CACHE,... (PATH auto|bulk|stream|stock|map|stream+cache, "
                         "CACHE page-cache|disk|node-cache; default %(default)s)")
    ap.add_argument("--model-dir", type=Path, default=model.DEFAULT_DIR)
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--work", type=Path, default=None, help="plugin state + store (default: disk if room)")
    ap.add_argument("--out-dir", type=Path, default=Path("speed-out"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cold-timeout", type=float, default=400.0)
    ap.add_argument("--recheckpoint", default="",
                    help="THP modes (keep,always) to checkpoint the running source with once more each")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.json = args.json or args.out_dir / "restore-speed.json"
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
