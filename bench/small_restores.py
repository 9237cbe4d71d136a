"""Small and concurrent restores: the default route against the bulk path, in one run.

  python -m bench.small_restores [--json bench/results/cpu/small-concurrent-restores.json]   (root)

Holds /run/lock/rekindle-e2e.lock while it runs (it uses the default sandbox).

Cases (the CPU drill's counter server, containerd 1.7 + the plugin, `bench.drill`'s rig):
- ``64mib-among-40``: 40 pods created at once, 20 of them restoring one 64 MiB artifact;
- ``256mib-5-at-once``: 9 pods at once, 5 of them restoring one 256 MiB artifact;
- ``1gib-alone``: one restore of 1 GiB (the demo's size: the default route streams it).
Each case runs twice with the plugin on the default route (``auto``) and twice on ``bulk``, in
the order auto, bulk, bulk, auto, the artifact published again each time. Per restore: its ``total`` from the status record,
the route its ``timings.json`` recorded. Per case: the medians over both runs of a path, and
``default_vs_bulk`` (the ratio of the medians: below 1.2 is the target), and each path's phases.
``--against stream`` sets the streamed path against bulk on every case instead of the default
route (the ``default_*`` figures are then the streamed path's; ``against_bulk`` says which).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.drill.load import ARTIFACT, _answers, _burst, _remove_all
from bench.drill.rig import CONTAINER, Rig, Workload, dump_json
from devtools.sandbox import hold_e2e_lock
from runtime.status import Phase

CASES = {"64mib-among-40": (40, 64), "256mib-5-at-once": (9, 256), "1gib-alone": (1, 1024)}
ORDER = ("auto", "bulk", "bulk", "auto")  # ABBA: what the run's order and the node's drift add falls on both


def _publish(rig: Rig, wl: Workload, tag: str) -> str | None:
    """The artifact restored by the burst, from a fresh source pod (None: published)."""
    src = rig.start_pod(f"small-src-{tag}", wl, {"rekindle.dev/checkpoint": ARTIFACT, "rekindle.dev/overwrite": "true"})
    st = rig.wait_status(src, {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 300)
    rig.stop_pod(src.pod)
    if st is None or st.phase is not Phase.PUBLISHED:
        return f"not published: {st.reason if st else 'no status'}"
    return None


def run(rig: Rig, case: str, path: str) -> dict[str, Any]:
    pods, mib = CASES[case]
    rig.plugin.stop()
    rig.plugin.env = {"REKINDLE_RESTORE_PATH": path}
    rig.restart_plugin()
    wl = Workload(mib, layer_files=0)
    tag = f"{case}-{path}"
    problem = _publish(rig, wl, tag)
    if problem is not None:
        return {"case": case, "path": path, "error": problem}
    recs, t0 = _burst(rig, wl, pods, tag)
    deadline = t0 + 600
    totals: list[float] = []
    routes: list[str] = []
    phases: dict[str, int] = {}
    phase_times: dict[str, list[float]] = {}
    for r in recs:
        if "cid" not in r or not r["restore"]:
            continue
        st = rig.status.wait("default", r["pod"].name, CONTAINER, {Phase.RESTORED, Phase.COLD_START},
                             max(0.0, deadline - time.monotonic()), poll=0.1)
        phases[st.phase.value if st else "no status"] = phases.get(st.phase.value if st else "no status", 0) + 1
        if st is not None and st.phase is Phase.RESTORED:
            totals.append(st.timings.get("total", 0.0))
            for k, v in st.timings.items():
                phase_times.setdefault(k, []).append(v)
            try:
                doc = json.loads((rig.plugin.control_dir(r["pod"].uid, CONTAINER) / "timings.json").read_text())
                routes.append(doc.get("route", {}).get("kind", "?"))
            except (OSError, ValueError):
                routes.append("?")
    _answers(rig, recs, t0, deadline)
    restored = [r for r in recs if r["restore"] and "ready_s" in r]
    out = {"case": case, "path": path, "pods": pods, "restores": sum(r["restore"] for r in recs), "mib": mib,
           "outcomes": phases, "routes": {k: routes.count(k) for k in sorted(set(routes))},
           "restore_total_s": sorted(round(x, 3) for x in totals),
           "median_restore_s": round(statistics.median(totals), 3) if totals else None,
           "median_phases_s": {k: round(statistics.median(v), 3) for k, v in phase_times.items()},
           "slowest_first_answer_s": round(max(r["ready_s"] for r in restored), 3) if restored else None}
    _remove_all(rig, recs)
    return out


def _phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per phase, the median over the runs' medians (where the default's time goes against bulk's)."""
    keys = {k for r in runs for k in r.get("median_phases_s", {})}
    return {k: round(statistics.median([r["median_phases_s"][k] for r in runs if k in r.get("median_phases_s", {})]), 3)
            for k in sorted(keys)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/rekindle-small-restores"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=1, help="times the ABBA order is run per case")
    ap.add_argument("--against", choices=("auto", "stream"), default="auto",
                    help="the path set against bulk (stream: the streamed path on every case, as before the route)")
    args = ap.parse_args()
    lock = hold_e2e_lock()  # the default sandbox: never beside the e2e tests
    rig = Rig(args.work, store_mib=4096)
    runs: list[dict[str, Any]] = []
    try:
        rig.up()
        for case in args.cases.split(","):
            for path in ORDER * args.rounds:
                path = args.against if path == "auto" else path
                runs.append(run(rig, case, path))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        rig.down()
        lock.close()
    cases = []
    paths = (args.against, "bulk")
    for case in args.cases.split(","):
        totals = {p: [t for r in runs if r["case"] == case and r["path"] == p for t in r.get("restore_total_s", [])]
                  for p in paths}
        d, b = (round(statistics.median(totals[p]), 3) if totals[p] else None for p in paths)
        routes: dict[str, int] = {}
        for r in runs:
            if r["case"] == case and r["path"] == args.against:
                for k, n in r.get("routes", {}).items():
                    routes[k] = routes.get(k, 0) + n
        cases.append({"case": case, "against_bulk": args.against, "default_median_s": d, "bulk_median_s": b,
                      "default_vs_bulk": round(d / b, 2) if d and b else None, "default_routes": routes,
                      "phases_s": {p: _phases([r for r in runs if r["case"] == case and r["path"] == p])
                                   for p in paths}})
    doc = {"what": "bench/small_restores.py: the default route against the bulk path, same run",
           "host": "2-core CPU machine, containerd 1.7.24 + runc + CRIU 4.2.1 + CNI + the plugin",
           "cases": cases, "runs": runs}
    for c in cases:
        print(f"{c['case']:<20} default {c['default_median_s']} s  bulk {c['bulk_median_s']} s  "
              f"default_vs_bulk {c['default_vs_bulk']}  routes {c['default_routes']}")
        a, b = c["phases_s"][args.against], c["phases_s"]["bulk"]
        for k in sorted(set(a) | set(b), key=lambda k: -max(a.get(k, 0.0), b.get(k, 0.0))):
            print(f"    {k:<16} default {a.get(k, 0.0):7.3f} s  bulk {b.get(k, 0.0):7.3f} s")
    if args.json is not None:
        dump_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
