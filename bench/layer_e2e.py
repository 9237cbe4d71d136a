"""A big writable layer through containerd and the plugin: restore against the cold start that
writes the same layer.

    python -m bench.layer_e2e [--mib 1024] [--rounds 3] [--source zero|urandom] [--json OUT]

Root; holds the e2e tests' lock (``/run/lock/rekindle-e2e.lock``) and uses their sandbox
(containerd 1.7, runc, CRIU, CNI) and a ``rekindle plugin`` process of this checkout. The
workload is the demo's counter server, started by a shell that first writes ``--mib`` MiB into
16 files under ``/data``: ``dd`` of zeros by default, the cheapest way a workload can make that
layer, so the strictest cold start to beat (zeros are still stored, read, hashed and written as
data); ``--source urandom``: of ``/dev/urandom``, a workload that computes what it writes.

One source pod is checkpointed by annotation, then, interleaved for ``--rounds``: a cold pod
(no annotation: the same command) and a restored pod (``rekindle.dev/restore``), each timed from
its container's create to its first HTTP answer; the restored one also to the plugin's
``restored`` record, whose phases (``stage``, ``rootfs_apply``, ...) and note are kept. Prints
the medians and ``restore_vs_cold`` (restored first answer over cold first answer).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from devtools.cri import Pod
from devtools.sandbox import Runtime, Sandbox, SandboxConfig, hold_e2e_lock
from tests.gpu import gpu_pods

COUNTER = "localhost/rekindle/counter:1"
CONTAINER = "server"
PORT = 8080
NAME = "layer-bench"


def _command(mib: int, source: str) -> list[str]:
    per = max(1, mib // 16)
    return ["/bin/sh", "-c", "mkdir -p /data && i=0; while [ $i -lt 16 ]; do "
            f"dd if=/dev/{source} of=/data/part-$i bs=1M count={per} 2>/dev/null; i=$((i+1)); done; "
            f"exec /usr/local/bin/counter-server {PORT}"]


def _first_answer(cri: Any, pod: Pod, cid: str, t0: float, timeout: float = 300.0) -> float:
    ip = cri.pod_ip(pod.id)
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(f"http://{ip}:{PORT}/healthz", timeout=1.0) as r:
                r.read()
            return time.monotonic() - t0
        except OSError:
            if not gpu_pods.running(cri, cid)():
                raise AssertionError(f"{pod.name} exited: {gpu_pods.container_logs(cri, cid)[-2000:]}")
            time.sleep(0.02)
    raise AssertionError(f"{pod.name}: no answer in {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--source", choices=("zero", "urandom"), default="zero",
                    help="what the workload writes: zeros (no cost to make) or /dev/urandom (a workload "
                         "that computes its data)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lock = hold_e2e_lock()
    work = Path(tempfile.mkdtemp(prefix="layer-e2e-", dir="/var/tmp"))
    sb = Sandbox(SandboxConfig(runtime=Runtime.V1_7))
    started = not sb.is_running()
    sb.up()
    cri = sb.cri(timeout=120.0)
    plugin = gpu_pods.start_plugin(sb, work / "plugin")
    pods: list[Pod] = []
    doc: dict[str, Any] = {"mib": args.mib, "source": args.source, "cold": [], "restored": []}

    def stop(p: Pod) -> None:
        cri.stop_pod(p.id)
        cri.remove_pod(p.id)
        pods.remove(p)

    def run(name: str, annotations: dict[str, str]) -> tuple[Pod, str, float]:
        p = cri.run_pod_sandbox(name, annotations=annotations)
        pods.append(p)
        t0 = time.monotonic()
        cid = cri.create_container(p, CONTAINER, COUNTER, command=_command(args.mib, args.source), env={})
        cri.start_container(cid)
        return p, cid, t0

    try:
        a, cid, t0 = run("layer-src", {"rekindle.dev/checkpoint": NAME})
        doc["source_first_answer_s"] = round(_first_answer(cri, a, cid, t0), 3)
        st = gpu_pods.wait_status(plugin, a, CONTAINER, {"published", "checkpoint-failed"}, 600)
        if st["phase"] != "published":
            raise AssertionError(f"checkpoint failed: {st.get('reason')}")
        doc["checkpoint"] = st["timings"]
        stop(a)
        for i in range(args.rounds):
            c, cid, t0 = run(f"layer-cold-{i}", {})
            doc["cold"].append({"first_answer_s": round(_first_answer(cri, c, cid, t0), 3)})
            stop(c)
            b, cid, t0 = run(f"layer-restored-{i}", {"rekindle.dev/restore": NAME})
            answered = _first_answer(cri, b, cid, t0)
            st = gpu_pods.wait_status(plugin, b, CONTAINER, {"restored", "cold-start"}, 600)
            rec = {"first_answer_s": round(answered, 3), "phase": st["phase"], "timings": st["timings"],
                   "note": st.get("note", ""), "reason": st.get("reason", "")}
            doc["restored"].append(rec)
            print(f"round {i}: cold {doc['cold'][-1]['first_answer_s']} s, restored {rec['first_answer_s']} s {rec['note']} "
                  f"({rec['phase']}; {', '.join(f'{k} {v}' for k, v in rec['timings'].items())})", flush=True)
            stop(b)
        cold = statistics.median(r["first_answer_s"] for r in doc["cold"])
        restored = statistics.median(r["first_answer_s"] for r in doc["restored"])
        doc["median_cold_s"], doc["median_restored_s"] = cold, restored
        doc["restore_vs_cold"] = round(restored / cold, 3)
        for phase in ("stage", "rootfs_apply", "criu_restore", "total"):
            vals = [r["timings"].get(phase) for r in doc["restored"] if phase in r["timings"]]
            if vals:
                doc[f"median_{phase}_s"] = statistics.median(vals)
        print(f"{args.mib} MiB layer: cold start {cold:.2f} s, restored {restored:.2f} s to the first answer: "
              f"restore_vs_cold {doc['restore_vs_cold']:.2f}; restore phases (median): "
              + ", ".join(f"{k[7:-2]} {v:.2f} s" for k, v in doc.items() if k.startswith("median_") and k.endswith("_s")
                          and k not in ("median_cold_s", "median_restored_s")), flush=True)
    finally:
        for p in list(pods):
            try:
                stop(p)
            except Exception:  # noqa: BLE001 - clean-up goes on
                pass
        plugin.stop()
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        cri.close()
        shutil.rmtree(work, ignore_errors=True)
        if started:
            sb.down()
        lock.close()


if __name__ == "__main__":
    main()
