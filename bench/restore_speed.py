"""Benchmark: restore speed through containerd and the plugin, bulk path against stock, with
the speed of light of every phase measured in the same run.

Usage (root, on a GPU node set up by hack/gpu-node-setup.sh):
``python -m bench.restore_speed --case synthetic-16gib|synthetic-49gib|llm-7b [--out-dir DIR]``

For the case's workload (tests/gpu/workloads/gpu_holder.py holding N GiB, or the Qwen2-7B-shaped
bench/workloads/llm_worker.py), one source pod is cold-started (timed) and checkpointed by
annotation; the source pod is stopped; then the ceilings are measured: reading the artifact once
from disk with the page cache dropped (16 threads of 8 MiB reads, and 4 of 2 MiB: the faster
counts), reading it from the page cache, copying into
fresh memory, and pinned host-to-device copies. Then restores into new pods, one after the other
on the same artifact: ``--runs`` (default ``bulk:page-cache,bulk:disk,stock:page-cache``), where
``disk`` drops the page cache first and ``page-cache`` reads the artifact in first, and
``bulk@16`` fills on 16 threads (default: one per core, up to 16). Each restore
is timed from container create to the plugin's ``restored`` and to the first answer, which must be
the source's (tokens, or GPU checksums). The stock path restarts the plugin with
``REKINDLE_RESTORE_PATH=stock`` (CRIU restores every page); ``stream:page-cache`` with
``REKINDLE_RESTORE_PATH=stream`` (the tree runs right after CRIU, the bulk pages served through
userfaultfd while it and its CUDA restore run; ``restored`` comes once the last piece is in, so
its ``stream`` phase is the serve's tail after the CUDA restore). ``map:page-cache``: the
plugin with its node cache on a ``huge=always`` tmpfs (``REKINDLE_CACHE_TMPFS=1``), one untimed
restore writing the entry first: the runs then map the driver's host copy from it and fill the
rest from it (``runtime.pages.mapping``). ``stream+cache:page-cache``: the streamed path with the
node cache on such a tmpfs and no entry yet (any entry is removed first): the restore maps the
driver's host copy from the entry's file as its serve writes it (``runtime.pages.stream``'s
mapped ranges), and the entry it made is timed until finished (``cache_written_s``). Every other
path runs with the cache off.

Writes ``--json`` (default OUT_DIR/restore-speed.json) after every step: ``runs`` holds one object
per restore: ``case``, ``path``, ``cache``, ``cold_start_s``, ``restore_s``, ``first_answer_s``,
``phases`` (seconds), ``bytes`` (per phase), ``sol_s``, ``identical``, and ``table`` (each phase
with its bytes, GB/s, ceiling and speed of light). Prints the tables.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.gpu_restore import GB, GIB, measure_h2d, pick_image_root
from bench.llm_restore import drop_caches
from devtools import phases
from devtools.cri import Mount, Pod
from devtools.sandbox import Runtime, Sandbox, SandboxConfig
from runtime import control
from runtime.store import readahead
from tests.gpu import gpu_pods
from tests.gpu.workloads import gpu_holder  # client helpers; torch is not imported

REPO = Path(__file__).resolve().parents[1]

log = logging.getLogger(__name__)

CONTAINER = "worker"
PORT = 8080
CASES = {"synthetic-16gib": 16.0, "synthetic-49gib": 49.0, "llm-7b": None, "cpu-1gib": 1.0}
COUNTER = "localhost/rekindle/counter:1"  # cpu-1gib: the demo's server, no GPU (checks the runner)


class Workload:
    """Start, readiness and 'is it the same' for one kind of worker."""

    def __init__(self, case: str, args: argparse.Namespace) -> None:
        self.case, self.args = case, args
        self.gib = CASES[case]
        self.reference: Any = None

    @property
    def cpu(self) -> bool:
        return self.case.startswith("cpu-")

    def start(self, cri: Any, pod: Pod) -> str:
        if self.cpu:
            cid = cri.create_container(pod, CONTAINER, COUNTER, command=["/usr/local/bin/counter-server", str(PORT)],
                                       env={"WARMUP_MIB": str(int(self.gib * 1024)), "WARMUP_PASSES": "20"})
            cri.start_container(cid)
            return cid
        if self.gib is None:
            cmd = [sys.executable, "/workload/llm_worker.py"]
            env = {"MODEL_DIR": "/model", "COMPILE_MODE": self.args.compile_mode, "PORT": str(PORT)}
            mounts = [Mount("/workload", str(REPO / "bench" / "workloads"), readonly=True),
                      Mount("/model", str(self.args.model_dir), readonly=True),
                      *[Mount(d, d, readonly=True) for d in ("/usr/include", "/usr/libexec") if os.path.isdir(d)]]
        else:
            cmd = [sys.executable, "/workload/gpu_holder.py", "--gib", str(self.gib)]
            env = {}
            mounts = [Mount("/workload", str(REPO / "tests" / "gpu" / "workloads"), readonly=True)]
        return gpu_pods.run_gpu_container(cri, pod, 0, cmd, mounts, CONTAINER, env)

    def ready_file(self) -> str:
        if self.cpu:
            return "ready-for-checkpoint"
        return "checksums.json" if self.gib else "worker-startup.json"

    def cold_record(self, ctl: Path, cri: Any = None, pod: Pod | None = None) -> dict[str, Any]:
        if self.cpu:
            self.reference = _get(cri.pod_ip(pod.id), "/verify")
            return {"gpu_bytes": 0}
        doc = json.loads((ctl / self.ready_file()).read_text())
        if self.gib:
            self.reference = doc["checksums"]
            return {"import_torch_s": doc["import_torch_s"], "fill_s": doc["fill_s"],
                    "gpu_bytes": doc["checksums"]["bytes"]}
        self.reference = doc["reference_tokens"]
        return {"phases_s": doc.get("phases_s"), "gpu_bytes": int(doc.get("gpu_reserved_gib", 0) * GIB),
                "compile_error": doc.get("compile_error")}

    def answer(self, cri: Any, pod: Pod, ctl: Path) -> tuple[bool, dict[str, Any]]:
        if self.cpu:
            got = _get(cri.pod_ip(pod.id), "/verify")
            return got == self.reference, {"verify": got.strip()}
        if self.gib:
            got = gpu_holder.request_verify(ctl, timeout=300)
            return bool(got["same"]) and got["checksums"] == self.reference, {"compute_s": got["compute_s"]}
        ip = cri.pod_ip(pod.id)
        t0 = time.monotonic()
        last: Exception | None = None
        while time.monotonic() - t0 < 180:
            try:
                with urllib.request.urlopen(f"http://{ip}:{PORT}/generate", timeout=120) as r:
                    got = json.loads(r.read())
                return got.get("tokens") == self.reference, {"generate_s": got.get("seconds")}
            except OSError as e:
                last = e
                time.sleep(0.05)
        raise AssertionError(f"no answer from {ip}: {last}")


def read_timings(plugin: Any, pod: Pod) -> dict[str, Any] | None:
    """The engine's figures for the pod's restore (control dir's timings.json), None before it wrote them."""
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads((Path(plugin.control_dir(pod.uid, CONTAINER)) / control.TIMINGS).read_text())
        return doc if isinstance(doc, dict) else None
    return None


def restart_plugin(plugin: Any, env: dict[str, str]) -> None:
    """Stop the plugin and start it again with ``env``, back once it synchronized with containerd."""
    plugin.stop()
    plugin.env = env
    plugin.start(wait=False)
    plugin.wait_log("synchronized:", count=plugin.log().count("synchronized:") + 1, timeout=60)


def plugin_env(path: str, threads: str, map_all: bool = False) -> dict[str, str]:
    """The plugin's environment for a run of ``path``: the node cache (on a ``huge=always``
    tmpfs) only for ``map`` and ``stream+cache``; the other paths read the artifact from the
    store every time. ``map_all``: every large range maps (a CPU workload has no CUDA driver's
    host copy, the default's one range)."""
    cached = path in ("map", "stream+cache")
    restore_path = {"map": "bulk", "stream+cache": "stream"}.get(path, path)
    return {"REKINDLE_RESTORE_PATH": restore_path, **({"REKINDLE_FILL_THREADS": threads} if threads else {}),
            **({"REKINDLE_CACHE_TMPFS": "1"} if cached else {"REKINDLE_CACHE_BYTES": "0"}),
            **({"REKINDLE_MAP": "all"} if cached and map_all else {})}


def _cache_dir(plugin: Any) -> Path:
    return Path(plugin.state_dir) / "cache" / "v1"


def cache_entries(plugin: Any) -> list[Path]:
    return [p.parent for p in _cache_dir(plugin).glob("*/entry.json")]


def await_entry(plugin: Any, timeout: float = 300.0) -> float:
    """Seconds until the node cache holds a finished entry (and nothing half-written)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cache_entries(plugin) and not list(_cache_dir(plugin).glob(".tmp-*")):
            break
        time.sleep(0.1)
    return round(time.monotonic() - t0, 2)


def clear_cache(plugin: Any) -> None:
    """Every entry removed (once no writer is mid-entry): the next restore finds none."""
    t0 = time.monotonic()
    while list(_cache_dir(plugin).glob(".tmp-*")) and time.monotonic() - t0 < 300:
        time.sleep(0.1)
    for entry in _cache_dir(plugin).glob("*"):
        shutil.rmtree(entry, ignore_errors=True)


def _get(ip: str, path: str) -> str:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://{ip}:{PORT}{path}", timeout=10) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.doc: dict[str, Any] = {
            "what": "bench/restore_speed.py through containerd 1.7 + runc + CRIU + CNI + the plugin",
            "host": {"kernel": platform.release(), "cpus": os.cpu_count()}, "case": args.case, "runs": []}
        self.pods: list[Pod] = []

    def save(self) -> None:
        self.args.json.parent.mkdir(parents=True, exist_ok=True)
        self.args.json.write_text(json.dumps(self.doc, indent=1) + "\n")

    def stop(self, cri: Any, pod: Pod) -> None:
        try:
            cri.stop_pod(pod.id)
            cri.remove_pod(pod.id)
        except Exception as e:  # noqa: BLE001 - clean-up goes on
            log.warning("clean-up of %s: %s", pod.name, e)
        if pod in self.pods:
            self.pods.remove(pod)

    def source(self, cri: Any, plugin: Any, wl: Workload) -> dict[str, Any]:
        rec: dict[str, Any] = {}
        rec["drop_caches_s"] = drop_caches()
        a = cri.run_pod_sandbox(f"speed-src-{self.args.case}", annotations={"rekindle.dev/checkpoint": self.args.case})
        self.pods.append(a)
        cid = wl.start(cri, a)
        ctl = plugin.control_dir(a.uid, CONTAINER)
        try:
            rec["cold_start_s"] = round(gpu_pods.wait_file(ctl / wl.ready_file(), self.args.cold_timeout,
                                                           gpu_pods.running(cri, cid)), 3)
        finally:
            (self.args.out_dir / "worker-source.log").write_text(gpu_pods.container_logs(cri, cid)[-100_000:])
        rec["cold"] = wl.cold_record(ctl, cri, a)
        st = gpu_pods.wait_status(plugin, a, CONTAINER, {"published", "checkpoint-failed"}, 600)
        rec["checkpoint_phase"], rec["checkpoint"] = st["phase"], st["timings"]
        if st["phase"] != "published":
            raise AssertionError(f"checkpoint failed: {st.get('reason')}")
        again = getattr(self.args, "recheckpoint", "")  # bench.scale_out shares this, without it
        if again:
            rec["checkpoints"] = [self.recheckpoint(plugin, cid, i, thp) for i, thp in enumerate(again.split(","))]
            self.save()
        self.stop(cri, a)  # frees the GPU and the source's host memory before the measurements
        return rec

    def recheckpoint(self, plugin: Any, cid: str, i: int, thp: str) -> dict[str, Any]:
        """The running source checkpointed once more through the CLI with ``--checkpoint-thp
        thp`` (same code, same source, same run: the THP modes side by side); the artifact is
        deleted after, the disk holds one more at most."""
        name = f"{self.args.case}-again-{i}"
        paths = ["--state-dir", str(plugin.state_dir), "--store", str(plugin.store),
                 "--containerd-state", str(plugin.sandbox.state_dir),
                 "--containerd-socket", str(plugin.sandbox.containerd_socket)]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "nri_plugin", "checkpoint", *paths, "--container-id", cid,
                            "--namespace", "default", "--name", name, "--checkpoint-thp", thp, "-o", "json"],
                           cwd=REPO, capture_output=True, text=True, timeout=600)
        rec: dict[str, Any] = {"thp": thp, "seconds": round(time.monotonic() - t0, 3)}
        if r.returncode:
            rec["error"] = r.stderr[-2000:]
        else:
            rec["timings"] = json.loads(r.stdout)["timings"]
        (self.args.out_dir / f"checkpoint-again-{i}.log").write_text(r.stderr[-200_000:])
        subprocess.run([sys.executable, "-m", "nri_plugin", "artifacts", "delete", *paths[:4], "--namespace",
                        "default", name], cwd=REPO, capture_output=True, timeout=120)
        print(f"checkpoint again ({thp}): {rec.get('timings') or rec.get('error')}", flush=True)
        return rec

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

    def await_restore(self, cri: Any, plugin: Any, wl: Workload, b: Pod, path: str, t0: float,
                      rec: dict[str, Any]) -> bool:
        """After ``wl.start`` (at ``t0``) in a pod annotated to restore: the plugin's verdict, then
        the first answer, into ``rec`` (restore_s, phases, first_answer_s, identical, answer; on
        the streamed path its serve's figures). False when the plugin cold-started the pod."""
        early: concurrent.futures.Future[tuple[tuple[bool, dict[str, Any]], float]] | None = None
        if path.startswith("stream"):  # it runs (and answers) before the last page is in: ask at once
            early = concurrent.futures.ThreadPoolExecutor(1).submit(
                lambda: (wl.answer(cri, b, plugin.control_dir(b.uid, CONTAINER)), time.monotonic() - t0))
        st = gpu_pods.wait_status(plugin, b, CONTAINER, {"restored", "cold-start"}, 600)
        rec["restore_s"] = round(time.monotonic() - t0, 3)
        rec["phases"] = st["timings"]
        if st["phase"] != "restored":
            rec["failure"] = st.get("reason")
            rec["identical"] = False
            return False
        if early is not None:
            (same, extra), answered = early.result(timeout=600)
        else:
            same, extra = wl.answer(cri, b, plugin.control_dir(b.uid, CONTAINER))
            answered = time.monotonic() - t0
        rec["first_answer_s"] = round(answered, 3)
        rec["identical"] = same
        rec["answer"] = extra
        doc = read_timings(plugin, b)
        if doc is not None:
            if path.startswith("stream"):  # the serve's own figures: faults, the time they waited, threads
                rec["stream"] = doc.get("stream")
            rec["node_cache"] = doc.get("cache")  # warm (mapped, filled from it), cold or off
        return True

    def restore(self, cri: Any, plugin: Any, wl: Workload, path: str, cache: str, art: Path,
                src: dict[str, Any], ceil: dict[str, float]) -> dict[str, Any]:
        rec: dict[str, Any] = {"case": self.args.case, "path": path, "cache": cache,
                               "cold_start_s": src["cold_start_s"]}
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
            (self.args.out_dir / f"worker-{path}-{cache}.log").write_text(gpu_pods.container_logs(cri, cid)[-100_000:])
            self.stop(cri, b)
        moved = phases.phase_bytes(art)
        gpu_bytes = src["cold"].get("gpu_bytes", 0)
        moved["cuda_restore"] = gpu_bytes
        if path == "stock":  # CRIU restores the bulk pages too, and the stage copies them
            moved["criu_restore"] += moved["fill"]
            moved["stage"] += moved["fill"]
        elif path.startswith("stream"):  # the bulk pages arrive while the tree runs (and the CUDA restore)
            moved["stream"] = moved.pop("fill")
        elif path == "map":  # mapped from the node cache: only the rest is filled
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
            current = ("", "")  # every path starts in a fresh plugin: no run finds caches warmed by another
            for spec in args.runs.split(","):
                how, cache = spec.split(":")
                path, _, threads = how.partition("@")  # bulk@16: the fill on 16 threads
                if (path, threads) != current:
                    restart_plugin(plugin, plugin_env(path, threads, map_all=wl.cpu))
                    current = (path, threads)
                    if path == "map" and not cache_entries(plugin):  # one restore writes the entry first
                        warm = self.restore(cri, plugin, wl, "bulk", "page-cache", art, doc["source"], ceil)
                        warm["warm_up"] = True
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

    def describe(self, wl: Workload) -> bool:
        """The node's GPUs, CRIU's version and (llm-7b) the model, into the doc; False (saved)
        when the model could not be made."""
        doc, args = self.doc, self.args
        if not wl.cpu:
            doc["gpus"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                         capture_output=True, text=True).stdout.strip().splitlines()
        doc["criu"] = subprocess.run([os.environ.get("REKINDLE_CRIU", "criu"), "--version"], capture_output=True,
                                     text=True).stdout.split("\n")[0].strip()
        if wl.gib is None:
            r = subprocess.run([sys.executable, "-m", "bench.llm_restore", "make-model", "--model-dir",
                                str(args.model_dir)], cwd=REPO, capture_output=True, text=True)
            if r.returncode:
                doc["failure"] = f"make-model: {r.stderr[-3000:]}"
                self.save()
                return False
            doc["model"] = json.loads(r.stdout.strip().splitlines()[-1])
        return True

    def clean_up(self, cri: Any, plugin: Any, work: Path) -> None:
        """Every pod left stopped, the plugin stopped, its and CRIU's logs copied out, the store removed."""
        args = self.args
        for p in list(self.pods):
            self.stop(cri, p)
        plugin.stop()
        shutil.copy(plugin.log_path, args.out_dir / f"plugin-{args.case}.log")
        # CRIU's own logs (timestamped, -v4): where its dump and restore time goes
        for log_file in (work / "plugin" / "state" / "logs").glob("*/*.log"):
            shutil.copy(log_file, args.out_dir / f"{log_file.parent.name}-{log_file.name}")
        cri.close()
        shutil.rmtree(work / "plugin" / "store", ignore_errors=True)
        cache = work / "plugin" / "state" / "cache"
        if os.path.ismount(cache):  # the plugin's tmpfs (--cache-tmpfs), mounted on this host
            subprocess.run(["umount", "-l", str(cache)], check=False)


def summary(rec: dict[str, Any]) -> str:
    head = (f"{rec['case']} {rec['path']} ({rec['cache']}): restore {rec.get('restore_s')} s, first answer "
            f"{rec.get('first_answer_s')} s, cold start {rec.get('cold_start_s')} s "
            f"({(rec['cold_start_s'] / rec['restore_s']) if rec.get('restore_s') else 0:.1f}x), "
            f"speed of light {rec.get('sol_s')} s, identical {rec.get('identical')}"
            + (f", FAILED: {rec['failure']}" if rec.get("failure") else ""))
    return head + ("\n" + phases.format_rows(rec["table"]) if rec.get("table") else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--runs", default="bulk:page-cache,bulk:disk,stock:page-cache")
    ap.add_argument("--model-dir", type=Path, default=Path("/var/tmp/rekindle-llm-model"))
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
