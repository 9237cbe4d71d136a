"""Benchmark: an LLM server's cold start vs its restore, through containerd and the plugin, on a GPU node.

Usage (root, on a node set up by hack/gpu-node-setup.sh; the node's Python has torch + transformers):
``python -m bench.llm_restore [--model-dir DIR] [--work DIR] [--out-dir DIR] [--compile-mode reduce-overhead]``

1. Makes a Qwen2-7B-shaped causal LM once (7.6 B parameters, random bf16 weights initialised on the
   GPU, ``save_pretrained`` as safetensors into ``--model-dir``, on local disk), then drops the page
   cache (``sync``; ``echo 3 > /proc/sys/vm/drop_caches``).
2. Brings up the sandbox (containerd 1.7 + runc + CRIU + CNI) and the plugin, the artifact store
   under ``--work`` (local disk when it has room, else /dev/shm).
3. Pod A (``rekindle.dev/checkpoint``) runs bench/workloads/llm_worker.py (import, load, eager
   generate, torch.compile warm-up): cold start = container create -> ``worker-startup.json``; the
   plugin checkpoints it (its status timings); the resumed source must answer ``GET /generate`` with
   its reference tokens.
4. Page cache dropped again; pod B (``rekindle.dev/restore``, same container) -> restored (status)
   -> first ``GET /generate`` answer, which must be A's reference tokens.
5. Speed of light in the same run: artifact bytes / min(cold read of the artifact files on 16
   threads, pinned host-to-device), with bench.common's measurements (``disk``, ``h2d``).
If the restore fails or the tokens differ, and ``--fallback-mode`` is set and the deadline allows,
steps 3-4 run again with that compile mode. JSON goes to ``--json`` (default
``--out-dir``/llm-restore.json) after every step, worker and plugin logs to ``--out-dir``; the
plot-ready part is ``results`` (``python -m bench.plot llm-restore.json -o x.png``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import model, results
from bench.common.disk import drop_caches, pick_image_root, read_ranges
from bench.common.h2d import measure_h2d
from bench.common.units import GB, GIB
from devtools.cri import Mount, Pod
from devtools.sandbox import Runtime, Sandbox, SandboxConfig
from tests.gpu import gpu_pods

REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)

WORKLOADS = REPO / "bench" / "workloads"
CONTAINER = "llm"
PORT = 8080
# Compilers and headers for Triton's launcher builds (torch.compile), where the node has them.
TOOLCHAIN_DIRS = ("/usr/include", "/usr/libexec")


def http_json(url: str, timeout: float) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the pod's own address
        return json.loads(r.read())


def generate(ip: str, timeout: float) -> tuple[dict[str, Any], float]:
    """First successful GET /generate within timeout; returns it and the seconds waited."""
    t0 = time.monotonic()
    last: Exception | None = None
    while time.monotonic() - t0 < timeout:
        try:
            return http_json(f"http://{ip}:{PORT}/generate", timeout=120), time.monotonic() - t0
        except OSError as e:
            last = e
            time.sleep(0.05)
    raise AssertionError(f"GET /generate on {ip} failed for {timeout:.0f}s: {last}")


class Bench:
    def __init__(self, args: argparse.Namespace, doc: dict[str, Any]) -> None:
        self.args, self.doc = args, doc
        self.t_start = time.monotonic()

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t_start)

    def save(self) -> None:
        self.args.out_dir.mkdir(parents=True, exist_ok=True)
        results.write_json(self.args.json, self.doc)

    def mounts(self) -> list[Mount]:
        extra = [Mount(d, d, readonly=True) for d in TOOLCHAIN_DIRS if os.path.isdir(d)]
        return [Mount("/workload", str(WORKLOADS), readonly=True),
                Mount("/model", str(self.args.model_dir), readonly=True), *extra]

    def start(self, cri: Any, pod: Pod, mode: str) -> str:
        cmd = [sys.executable, "/workload/llm_worker.py"]
        env = {"MODEL_DIR": "/model", "COMPILE_MODE": mode, "PORT": str(PORT)}
        return gpu_pods.run_gpu_container(cri, pod, 0, cmd, self.mounts(), CONTAINER, env)

    def case(self, cri: Any, plugin: Any, pods: list[Pod], mode: str) -> dict[str, Any]:
        """Pod A cold start + checkpoint, pod B restore; the run's record (also on failure)."""
        name = f"llm-{mode}"
        rec: dict[str, Any] = {"artifact": name, "compile_mode": mode}
        self.doc["runs"].append(rec)
        rec["drop_caches_s"] = drop_caches()
        a = cri.run_pod_sandbox(f"llm-src-{mode}", annotations={"rekindle.dev/checkpoint": name})
        pods.append(a)
        t0 = time.monotonic()
        a_cid = self.start(cri, a, mode)
        a_dir = plugin.control_dir(a.uid, CONTAINER)
        try:
            rec["cold_start_s"] = round(gpu_pods.wait_file(a_dir / "worker-startup.json", self.args.cold_timeout,
                                                           gpu_pods.running(cri, a_cid)), 3)
        finally:
            (self.args.out_dir / f"worker-a-{mode}.log").write_text(gpu_pods.container_logs(cri, a_cid)[-200_000:])
        rec["worker"] = json.loads((a_dir / "worker-startup.json").read_text())
        ref = rec["worker"]["reference_tokens"]
        self.save()
        st = gpu_pods.wait_status(plugin, a, CONTAINER, {"published", "checkpoint-failed"}, 400)
        rec["checkpoint_status_s"] = round(time.monotonic() - t0, 3)
        rec["checkpoint"] = st["timings"]
        rec["checkpoint_phase"] = st["phase"]
        if st["phase"] != "published":
            rec["checkpoint_failure"] = st.get("reason")
            self.save()
            raise AssertionError(f"checkpoint failed: {st.get('reason')}")
        artifact = plugin.store / "default" / name
        rec["artifact_files"] = {str(f.relative_to(artifact)): f.stat().st_size
                                 for f in artifact.rglob("*") if f.is_file() and f.stat().st_size > 64 << 20}
        rec["artifact_bytes"] = sum(f.stat().st_size for f in artifact.rglob("*") if f.is_file())
        rec["gpu_memory_mib_a"] = gpu_pods.gpu_memory()
        src, _ = generate(cri.pod_ip(a.id), 60)
        rec["source_after_checkpoint"] = {"same_tokens": src.get("tokens") == ref, "seconds": src.get("seconds")}
        self.save()

        rec["drop_caches_before_restore_s"] = drop_caches()
        b = cri.run_pod_sandbox(f"llm-dst-{mode}", annotations={"rekindle.dev/restore": name})
        pods.append(b)
        t1 = time.monotonic()
        b_cid = self.start(cri, b, mode)
        st = gpu_pods.wait_status(plugin, b, CONTAINER, {"restored", "cold-start"}, 400)
        rec["restore_status_s"] = round(time.monotonic() - t1, 3)
        rec["restore"] = st["timings"]
        rec["restore_phase"] = st["phase"]
        if st["phase"] != "restored":
            rec["restore_failure"] = st.get("reason")
            (self.args.out_dir / f"worker-b-{mode}.log").write_text(gpu_pods.container_logs(cri, b_cid)[-200_000:])
            self.save()
            cri.stop_pod(b.id)  # it would cold start now: not what is measured
            raise AssertionError(f"restore failed: {st.get('reason')}")
        try:
            got, _ = generate(cri.pod_ip(b.id), 120)
        finally:
            (self.args.out_dir / f"worker-b-{mode}.log").write_text(gpu_pods.container_logs(cri, b_cid)[-200_000:])
        rec["restore_to_first_answer_s"] = round(time.monotonic() - t1, 3)
        rec["restored_generate"] = got
        rec["tokens_match"] = got.get("tokens") == ref
        rec["gpu_memory_mib_ab"] = gpu_pods.gpu_memory()
        self.save()
        if not rec["tokens_match"]:
            raise AssertionError(f"restored tokens differ: {got} vs {ref}")
        return rec

    def speed_of_light(self, artifact_files: list[Path], artifact_bytes: int) -> dict[str, Any]:
        """Cold read of (up to --sol-read-gib of) the artifact's files on 16 threads; pinned H2D."""
        sol: dict[str, Any] = {"drop_caches_s": drop_caches()}
        jobs, budget = [], int(self.args.sol_read_gib * GIB)
        for p in sorted(artifact_files, key=lambda f: -f.stat().st_size):
            size = min(p.stat().st_size, budget - sum(j[2] for j in jobs))
            step = 256 << 20
            jobs += [(p, off, min(step, size - off)) for off in range(0, size, step)]
        t = time.perf_counter()
        done = read_ranges(jobs, 16)
        sol["read_bytes"] = done
        sol["read_16_threads_cold_gbps"] = round(done / (time.perf_counter() - t) / GB, 2)
        sol.update(measure_h2d(sys.executable, 4.0))
        sol["sol_gbps"] = min(sol["read_16_threads_cold_gbps"], sol["h2d_pinned_gbps"])
        sol["artifact_bytes"] = artifact_bytes
        sol["sol_s"] = round(artifact_bytes / GB / sol["sol_gbps"], 3)
        return sol


def plot_entry(rec: dict[str, Any], sol: dict[str, Any] | None, store_fs: str = "") -> dict[str, Any]:
    """The run in bench/plot.py's shape: cold start by worker phase, checkpoint and restore by phase."""
    w = rec.get("worker", {}).get("phases_s", {})
    ph: dict[str, float] = {f"cold_{k}": v for k, v in w.items()}
    if "cold_start_s" in rec:
        ph["cold_start"] = rec["cold_start_s"]
        ph["cold_other"] = max(0.0, rec["cold_start_s"] - sum(w.values()))
    for k in ("cuda_checkpoint", "criu_dump", "publish"):
        if k in rec.get("checkpoint", {}):
            ph[k] = rec["checkpoint"][k]
    r = rec.get("restore", {})
    for k in ("verify", "criu_restore", "cuda_restore"):
        if k in r:
            ph[k] = r[k]
    if "restore_status_s" in rec:
        ph["restore_other"] = max(0.0, rec["restore_status_s"] - sum(r.get(k, 0.0) for k in
                                                                     ("verify", "criu_restore", "cuda_restore")))
    gib = rec.get("worker", {}).get("gpu_reserved_gib", 0.0)
    where = "artifact in tmpfs" if store_fs == "tmpfs" else "artifact on disk"
    out = {"label": f"Qwen2-7B-shaped, {rec['compile_mode']}, {where}", "gib": gib, "phases_s": ph}
    if sol:
        out.update(sol_s=sol["sol_s"], sol_gbps=sol["sol_gbps"])
    return out


def table(doc: dict[str, Any]) -> str:
    lines = []
    for rec in doc["runs"]:
        w = rec.get("worker", {})
        c, r = rec.get("checkpoint", {}), rec.get("restore", {})
        lines.append(f"mode {rec['compile_mode']}: cold start {rec.get('cold_start_s')} s "
                     f"(worker {w.get('phases_s')}, compile path {w.get('compile_path')}, "
                     f"error {w.get('compile_error')})")
        lines.append(f"  checkpoint: {c} status after {rec.get('checkpoint_status_s')} s; "
                     f"artifact {rec.get('artifact_bytes', 0) / GB:.2f} GB")
        lines.append(f"  restore: {r} -> restored {rec.get('restore_status_s')} s, first answer "
                     f"{rec.get('restore_to_first_answer_s')} s, tokens match {rec.get('tokens_match')} "
                     f"{rec.get('restore_failure') or ''}")
    sol = doc.get("sol")
    if sol:
        lines.append(f"speed of light: {sol['artifact_bytes'] / GB:.2f} GB / {sol['sol_gbps']} GB/s = {sol['sol_s']} s "
                     f"(cold read {sol['read_16_threads_cold_gbps']} GB/s, pinned H2D {sol['h2d_pinned_gbps']} GB/s)")
        for rec in doc["runs"]:
            if "restore_status_s" in rec:
                lines.append(f"  {rec['compile_mode']}: restore {rec['restore_status_s'] / sol['sol_s']:.1f}x SOL; "
                             f"cold start / restore {rec['cold_start_s'] / rec['restore_status_s']:.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {"what": "bench/llm_restore.py through containerd 1.7 + runc + CRIU + CNI + the plugin",
                           "host": results.host(), "runs": [], "results": []}
    bench = Bench(args, doc)
    doc["gpus"] = results.gpus()
    doc["criu"] = results.criu_version()
    t = time.monotonic()
    made, error = model.make_in_child(args.model_dir)
    if made is None:
        doc["failure"] = f"make-model: {error}"
        bench.save()
        return 1
    doc["model"] = {**made, "wall_s": round(time.monotonic() - t, 2)}
    need = int(doc["model"]["bytes"] * 1.8) + 4 * GIB
    work = args.work or pick_image_root(["/var/tmp", "/dev/shm"], need) / "rekindle-llm"
    doc["store_dir"] = str(work)
    doc["store_fs"] = subprocess.run(["stat", "-fc", "%T", str(work.parent)], capture_output=True,
                                     text=True).stdout.strip()
    bench.save()
    log.info("model %s; store %s (%s)", doc["model"], work, doc["store_fs"])

    sb = Sandbox(SandboxConfig(runtime=Runtime.V1_7))
    sb.up()
    cri = sb.cri(timeout=120.0)
    shutil.rmtree(work, ignore_errors=True)
    plugin = gpu_pods.start_plugin(sb, work / "plugin")
    pods: list[Pod] = []
    status = 0
    try:
        for mode in [args.compile_mode, args.fallback_mode]:
            if not mode:
                continue
            if doc["runs"] and (doc["runs"][-1].get("tokens_match") or bench.left() < args.case_s):
                break
            try:
                bench.case(cri, plugin, pods, mode)
                status = 0
            except Exception as exc:  # noqa: BLE001 - record, maybe try the fallback mode
                log.exception("mode %s failed", mode)
                doc["runs"][-1]["error"] = str(exc)[-3000:]
                status = 1
            finally:
                bench.save()
        for p in reversed(pods):  # free the GPU before the H2D measurement
            try:
                cri.stop_pod(p.id)
                cri.remove_pod(p.id)
            except Exception as e:  # noqa: BLE001
                log.warning("cleanup of pod %s: %s", p.name, e)
        pods.clear()
        done = [r for r in doc["runs"] if r.get("artifact_bytes")]
        if done:
            art = plugin.store / "default" / done[-1]["artifact"]
            files = [f for f in art.rglob("*") if f.is_file()]
            doc["sol"] = bench.speed_of_light(files, done[-1]["artifact_bytes"])
        doc["results"] = [plot_entry(r, doc.get("sol"), doc["store_fs"]) for r in doc["runs"] if "cold_start_s" in r]
        bench.save()
    finally:
        for p in reversed(pods):
            try:
                cri.stop_pod(p.id)
                cri.remove_pod(p.id)
            except Exception:  # noqa: BLE001, S110 - best effort
                pass
        plugin.stop()
        shutil.copy(plugin.log_path, args.out_dir / "plugin-llm.log")
        cri.close()
        if not args.keep:
            shutil.rmtree(work / "plugin" / "store", ignore_errors=True)
    print(table(doc))
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs="?", default="run", choices=["run", "make-model"])
    ap.add_argument("--model-dir", type=Path, default=model.DEFAULT_DIR)
    ap.add_argument("--work", type=Path, default=None, help="plugin state + store (default: disk if room)")
    ap.add_argument("--out-dir", type=Path, default=Path("llm-out"))
    ap.add_argument("--json", type=Path, default=None, help="the results (default OUT_DIR/llm-restore.json)")
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--fallback-mode", default="default", help="'' for none")
    ap.add_argument("--cold-timeout", type=float, default=400.0)
    ap.add_argument("--deadline-s", type=float, default=1e9, help="no fallback run after this many seconds")
    ap.add_argument("--case-s", type=float, default=240.0, help="seconds one case needs (for the deadline)")
    ap.add_argument("--sol-read-gib", type=float, default=8.0, help="GiB of the artifact read for the SOL")
    ap.add_argument("--keep", action="store_true", help="keep the artifact store")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.command == "make-model":
        print(json.dumps(model.make_model(args.model_dir)))
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.json = args.json or args.out_dir / "llm-restore.json"
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
