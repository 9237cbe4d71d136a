"""Fault drill and load figure on a CPU node, through containerd 1.7 + runc + CRIU + CNI and the
real plugin process.

Usage (root): ``python -m bench.fault_drill [--only faults|load] [--out-dir bench/results/cpu]``

Faults: for each phase of a checkpoint (inspect, criu_dump, rootfs_capture, shm_capture, split,
publish) and of a restore (open/inspect, stage, rootfs_apply, criu_restore, and the serve while
the tree runs, stream_start/stream, on the streamed path, the default; the fill with
``--restore-path bulk``), and for each
fault (the plugin killed with SIGKILL, then restarted; the sandbox's containerd restarted in
place; the store's tmpfs filled to the last byte), one cell (bench/drill/cells.py): the fault is
landed while the phase runs, then the drill checks that the pod runs (restored, or cold started
exactly once), that the store shows no partial artifact and keeps only leftovers its sweep
removes (and then runs the sweep), that nothing leaks (no stopped process, no CRIU process, no
stale mount, no private restore copies, nothing left in a removed pod's pid namespace), and that
a source keeps serving after a failed checkpoint, while a published artifact restores.

Load: 100 pods at once, half restoring one artifact, half plain (bench/drill/load.py), after the
same burst with the plugin stopped (what the plugin adds to CRI latencies).

Holds /run/lock/rekindle-e2e.lock while it runs (never beside the e2e tests), uses the default
sandbox (reused when it runs containerd 1.7), writes ``OUT_DIR/fault-drill.json`` after every
cell and the tables into ``OUT_DIR/README.md`` between the drill's markers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import results
from bench.drill import report
from bench.drill.cells import CHECKPOINT_PHASES, checkpoint_cell, restore_cell, restore_rows
from bench.drill.faults import Fault
from bench.drill.load import load_figure
from bench.drill.rig import Rig, Workload, dump_json, fields
from devtools.sandbox import hold_e2e_lock
from runtime.status import Phase

log = logging.getLogger("bench.fault_drill")

BASE = "base"


def _pick(all_names: tuple[str, ...], wanted: str | None) -> list[str]:
    if not wanted:
        return list(all_names)
    names = wanted.split(",")
    unknown = [n for n in names if n not in all_names]
    if unknown:
        raise SystemExit(f"unknown: {unknown}; choose from {list(all_names)}")
    return names


def run_faults(rig: Rig, args: argparse.Namespace, doc: dict[str, Any], save: Any) -> None:
    wl = Workload(args.warmup_mib, args.blob_mib, args.shm_mib)
    faults = [Fault(f) for f in _pick(tuple(f.value for f in Fault), args.faults)]
    cells: list[dict[str, Any]] = doc.setdefault("cells", [])

    def record(cell: Any) -> None:
        cells.append(cell.to_json())
        print(f"{cell.flow:10} {cell.phase:14} {cell.fault:10} -> {report._cell_text(cells[-1])} "
              f"[{cell.seconds:.0f} s]", flush=True)
        save()

    for phase in [] if args.checkpoint_phases == "none" else _pick(CHECKPOINT_PHASES, args.checkpoint_phases):
        for fault in faults:
            record(checkpoint_cell(rig, wl, phase, fault))
    rows = _pick(restore_rows(rig.restore_path), args.restore_phases)
    if rows:
        src = rig.start_pod("drill-base-src", wl, {"rekindle.dev/checkpoint": BASE})
        st = rig.wait_status(src, {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 300)
        ref = fields(rig.wait_serving(src) or "")
        tokens, _journal = rig.layer(src)
        ref["token"] = next(iter(tokens), "") if len(tokens) == 1 else ""
        rig.stop_pod(src.pod)
        if st is None or st.phase is not Phase.PUBLISHED:
            doc["restore_error"] = f"base artifact not published: {st.reason if st else 'no status'}"
            return
        for row in rows:
            for fault in faults:
                record(restore_cell(rig, wl, BASE, ref, row, fault))
        ok, version = rig.artifact_ok(BASE)
        doc["base_artifact_after_restore_cells"] = f"{version}: every digest matches" if ok else "damaged"
        rig.store.delete("default", BASE)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["faults", "load"], default=None)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results" / "cpu")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/rekindle-fault-drill"),
                    help="plugin state dir and store mount point (removed at the start)")
    ap.add_argument("--warmup-mib", type=int, default=1024, help="live memory of the drill's server")
    ap.add_argument("--blob-mib", type=int, default=256, help="file in the writable layer")
    ap.add_argument("--shm-mib", type=int, default=48, help="file in /dev/shm (its tmpfs holds 64 MiB)")
    ap.add_argument("--store-mib", type=int, default=None, help="the store's tmpfs (default: two artifacts)")
    ap.add_argument("--restore-path", choices=("stream", "bulk"), default="stream",
                    help="the plugin's restore path: its rows (the serve, or the fill) are drilled")
    ap.add_argument("--checkpoint-phases", default=None, help="comma list (default: all; none: no checkpoint cell)")
    ap.add_argument("--restore-phases", default=None, help="comma list (default: all)")
    ap.add_argument("--faults", default=None, help="comma list of kill,containerd,disk-full (default: all)")
    ap.add_argument("--load-pods", type=int, default=100)
    ap.add_argument("--load-warmup-mib", type=int, default=16)
    ap.add_argument("--no-load-baseline", action="store_true", help="skip the same burst without the plugin")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if os.geteuid() != 0:
        print("fault_drill: run as root (containerd, CRIU, mounts)", file=sys.stderr)
        return 2
    store_mib = args.store_mib or 2 * (args.warmup_mib + args.blob_mib + args.shm_mib) + 768
    out = args.out_dir
    json_path = out / "fault-drill.json"
    doc: dict[str, Any] = {
        "what": "bench/fault_drill.py: containerd 1.7 + runc + CRIU + CNI + the plugin process, CPU only",
        "host": {**results.host(), "criu": results.criu_version("/usr/local/sbin/criu")},
        "config": {"restore_path": args.restore_path, "warmup_mib": args.warmup_mib, "blob_mib": args.blob_mib,
                   "shm_mib": args.shm_mib,
                   "store_mib": store_mib, "load_pods": args.load_pods, "load_warmup_mib": args.load_warmup_mib},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    def save() -> None:
        dump_json(json_path, doc)

    lock = hold_e2e_lock()
    t0 = time.monotonic()
    rig = Rig(args.work, store_mib, args.restore_path)
    try:
        rig.up()
        if args.only in (None, "faults"):
            run_faults(rig, args, doc, save)
        if args.only in (None, "load"):
            doc["load"] = load_figure(rig, args.load_pods, args.load_warmup_mib, not args.no_load_baseline)
            print(report.load_table(doc["load"]), flush=True)
    finally:
        doc["wall_s"] = round(time.monotonic() - t0, 1)
        save()
        rig.down()
        lock.close()
    cells = doc.get("cells", [])
    block = _readme_block(doc, cells)
    print(block, flush=True)
    report.update_readme(out / "README.md", block)
    bad = [c for c in cells if not c["ok"]]
    return 1 if bad or doc.get("restore_error") or "error" in doc.get("load", {}) else 0


def _readme_block(doc: dict[str, Any], cells: list[dict[str, Any]]) -> str:
    c = doc["config"]
    parts = [f"Run {doc['started']} on {doc['host']['cpus']} CPUs, kernel {doc['host']['kernel']}, "
             f"CRIU {doc['host']['criu'].removeprefix('Version: ')}; {doc['wall_s']} s in all.", ""]
    if cells:
        parts += [f"Workload: counter server with {c['warmup_mib']} MiB of live memory, {c['blob_mib']} MiB in its "
                  f"writable layer, {c['shm_mib']} MiB in /dev/shm; store: a {c['store_mib']} MiB tmpfs.", "",
                  report.fault_tables(cells), "Checks (each cell runs those that apply to it; ✓: all held):", "", report.checks_list(cells),
                  "", "Failed checks:", "", report.failures(cells), "", "Each cell:", "", report.details_table(cells)]
        if doc.get("base_artifact_after_restore_cells"):
            parts += [f"Base artifact after all restore cells: {doc['base_artifact_after_restore_cells']}.", ""]
    if "load" in doc:
        parts += [report.load_table(doc["load"])]
    return "\n".join(parts)


if __name__ == "__main__":
    sys.exit(main())
