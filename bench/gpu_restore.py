"""Benchmark: cold start vs CUDA checkpoint/restore of a PyTorch process, phase by phase.

Usage: ``python -m bench.gpu_restore --sizes 4,16 [--criu PATH [--criu-lib DIR]] [--out FILE.json]``

For each size N (GiB) it starts ``tests/gpu/workloads/gpu_holder.py --gib N`` and measures:

- ``cold_start``: spawn python, import torch, fill N GiB, checksum (until checksums.json appears);
- ``cuda_lock``, ``cuda_checkpoint`` (device -> host) through :class:`runtime.gpu.cuda.CudaCheckpointer`;
- ``criu_dump``, ``criu_restore`` when ``--criu`` names a binary (``--criu-lib`` is put on its
  ``LD_LIBRARY_PATH`` only), else skipped and reported as such;
- ``cuda_restore`` (host -> device), ``cuda_unlock``; then the holder recomputes its checksums,
  which must match (``verified``).

In the same run it measures the speed of light: read bandwidth of the image dir (the CRIU page
images when dumped, else a scratch file; one thread and 8 threads; these files are in page cache or
tmpfs, so this is the memory-speed bound) and pinned / pageable host-to-device bandwidth with torch.
``sol_s = N GiB / min(best read GB/s, pinned H2D GB/s)``. Prints a table; writes JSON (``--out``)
after every size. Must run as root (CUDA checkpoint of another process, CRIU).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import results
from bench.common.disk import pick_image_root, read_ranges
from bench.common.h2d import measure_h2d
from bench.common.units import GB, GIB
from runtime.gpu import CudaCheckpointer

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
HOLDER = REPO / "tests" / "gpu" / "workloads" / "gpu_holder.py"
PR_SET_CHILD_SUBREAPER = 36


def _holder_module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_holder", HOLDER)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure_read(files: list[Path], threads: int) -> float:
    """GB/s reading ``files`` whole, split into ``threads`` ranges."""
    jobs: list[tuple[Path, int, int]] = []
    for p in files:
        size = p.stat().st_size
        step = max(64 << 20, -(-size // threads))
        jobs += [(p, off, min(step, size - off)) for off in range(0, size, step)]
    t = time.perf_counter()
    total = read_ranges(jobs, threads)
    return total / (time.perf_counter() - t) / GB


def _subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        log.warning("PR_SET_CHILD_SUBREAPER failed: restored processes will not be reaped here")


def _wait_pid(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            if not Path(f"/proc/{pid}").exists():
                return
            done = 0
        if done:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)


def _criu(args: argparse.Namespace, cmd: list[str], img: Path, logname: str) -> float:
    env = dict(os.environ)
    if args.criu_lib:
        env["LD_LIBRARY_PATH"] = os.path.abspath(args.criu_lib)
    t = time.perf_counter()
    r = subprocess.run([args.criu, *cmd, "-D", str(img), "-o", logname, "-v2"], env=env,
                       capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        tail = (img / logname).read_text(errors="replace")[-3000:] if (img / logname).exists() else ""
        raise RuntimeError(f"criu {cmd[0]} failed ({r.returncode}): {r.stderr[-1000:]}\n{tail}")
    return dt


def run_size(gib: float, args: argparse.Namespace, ckpt: CudaCheckpointer, hc: Any,
             h2d: dict[str, float]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"rk-bench-{gib:g}g-"))
    res: dict[str, Any] = {"gib": gib, "phases_s": {}, "notes": []}
    ph = res["phases_s"]
    logf = open(work / "holder.log", "wb")  # noqa: SIM115 - closed in finally
    t0 = time.perf_counter()
    proc = subprocess.Popen([args.python, str(HOLDER), "--gib", str(gib), "--work-dir", str(work)],
                            stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                            start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pid, img, ok = proc.pid, None, False
    try:
        info = hc.wait_ready(work, lambda: proc.poll() is None, timeout=600)
        ph["cold_start"] = time.perf_counter() - t0
        res["holder"] = {k: info[k] for k in ("import_torch_s", "fill_s")}
        res["state_bytes"] = info["checksums"]["bytes"]
        t = time.perf_counter(); ckpt.lock([pid], args.lock_timeout_ms); ph["cuda_lock"] = time.perf_counter() - t
        t = time.perf_counter(); ckpt.checkpoint([pid]); ph["cuda_checkpoint"] = time.perf_counter() - t
        res["state_after_checkpoint"] = str(ckpt.state(pid))
        img = pick_image_root(args.image_dirs, int(gib * GIB * 1.1)) / f"rk-img-{pid}"
        img.mkdir(parents=True)
        res["image_dir"] = str(img.parent)
        if args.criu:
            ph["criu_dump"] = _criu(args, ["dump", "-t", str(pid), "--file-locks", "--network-lock", "skip"],
                                    img, "dump.log")
            proc.wait(60)
            files = sorted(img.glob("pages-*.img"))
            res["image_bytes"] = sum(p.stat().st_size for p in img.iterdir())
        else:
            res["notes"].append("CRIU phases skipped: no --criu binary given")
            files = [img / "scratch.bin"]
            chunk = os.urandom(16 << 20)
            with open(files[0], "wb") as f:
                for _ in range(max(1, int(min(gib, 4) * GIB) // len(chunk))):
                    f.write(chunk)
        res["read_gbps"] = {"1_thread": round(measure_read(files, 1), 2),
                            "8_threads": round(measure_read(files, 8), 2)}
        if args.criu:
            ph["criu_restore"] = _criu(args, ["restore", "-d", "--pidfile", str(img / "restore.pid"),
                                              "--file-locks"], img, "restore.log")
            rpid = int((img / "restore.pid").read_text())
            if rpid != pid:
                raise RuntimeError(f"criu restored pid {rpid}, expected {pid}")
        t = time.perf_counter(); ckpt.restore([pid]); ph["cuda_restore"] = time.perf_counter() - t
        t = time.perf_counter(); ckpt.unlock([pid]); ph["cuda_unlock"] = time.perf_counter() - t
        v = hc.request_verify(work, timeout=300)
        res["verified"] = bool(v["same"])
        res["first_compute_after_restore_s"] = v["compute_s"]
        ok = True
    finally:
        (work / "stop").write_text("")
        if not ok and Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)  # it may be locked or checkpointed: it could not exit
        if proc.poll() is None:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        elif Path(f"/proc/{pid}").exists():
            _wait_pid(pid, 30)
        logf.close()
        res["holder_log_tail"] = (work / "holder.log").read_text(errors="replace")[-500:]
        if img is not None:
            shutil.rmtree(img, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    _summarise(res, h2d)
    return res


def _summarise(res: dict[str, Any], h2d: dict[str, float]) -> None:
    ph = res["phases_s"]
    res["checkpoint_total_s"] = sum(ph.get(k, 0.0) for k in ("cuda_lock", "cuda_checkpoint", "criu_dump"))
    res["restore_total_s"] = sum(ph.get(k, 0.0) for k in ("criu_restore", "cuda_restore", "cuda_unlock"))
    read = max(res["read_gbps"].values())
    link = min(read, h2d["h2d_pinned_gbps"])
    res["sol_gbps"] = link
    res["sol_s"] = res["state_bytes"] / GB / link
    res["restore_vs_sol"] = res["restore_total_s"] / res["sol_s"]
    res["speedup_vs_cold"] = ph["cold_start"] / res["restore_total_s"]


COLUMNS = ["cold_start", "cuda_lock", "cuda_checkpoint", "criu_dump", "criu_restore", "cuda_restore",
           "cuda_unlock"]


def table(runs: list[dict[str, Any]]) -> str:
    head = ["GiB", *COLUMNS, "restore_total", "SOL", "x SOL", "speedup", "ok"]
    rows = [head]
    for r in runs:
        ph = r["phases_s"]
        rows.append([f"{r['gib']:g}", *(f"{ph[c]:.2f}" if c in ph else "skip" for c in COLUMNS),
                     f"{r['restore_total_s']:.2f}", f"{r['sol_s']:.2f}", f"{r['restore_vs_sol']:.1f}",
                     f"{r['speedup_vs_cold']:.2f}", str(r.get("verified"))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,16", help="GiB of GPU state per run, comma-separated")
    ap.add_argument("--criu", default=None, help="criu binary; without it the CRIU phases are skipped")
    ap.add_argument("--criu-lib", default=None, help="LD_LIBRARY_PATH for the criu binary only")
    ap.add_argument("--image-dirs", default="/dev/shm,/var/tmp", help="where images go (first with room)")
    ap.add_argument("--python", default=sys.executable, help="python with torch, for the workload")
    ap.add_argument("--lock-timeout-ms", type=int, default=30_000)
    ap.add_argument("--h2d-gib", type=float, default=4.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    args.image_dirs = [d for d in args.image_dirs.split(",") if d]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.criu:
        args.criu = os.path.abspath(args.criu)
    _subreaper()
    hc = _holder_module()
    ckpt = CudaCheckpointer()
    gpus = ckpt.gpus()
    doc: dict[str, Any] = {
        "host": results.host(python=True),
        "driver_version": ckpt.driver_version(), "cuda_version": ckpt.cuda_version(),
        "gpus": [{"uuid": g.uuid, "name": g.name} for g in gpus], "criu": None, "results": []}
    if args.criu:
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.abspath(args.criu_lib)) if args.criu_lib else None
        doc["criu"] = results.criu_version(args.criu, env)
    doc["h2d"] = measure_h2d(args.python, args.h2d_gib)
    log.info("driver %s, %s, criu %s, h2d %s", doc["driver_version"], gpus[0].name if gpus else "-",
             doc["criu"], doc["h2d"])
    status = 0
    for size in (float(s) for s in args.sizes.split(",") if s):
        try:
            doc["results"].append(run_size(size, args, ckpt, hc, doc["h2d"]))
        except Exception as exc:  # noqa: BLE001 - record and go on to the next size
            log.exception("size %g GiB failed", size)
            doc.setdefault("failures", []).append({"gib": size, "error": str(exc)[-3000:]})
            status = 1
        if args.out:
            results.write_json(args.out, doc, sort_keys=True)
    ckpt.close()
    print(table(doc["results"]))
    for r in doc["results"]:
        for n in r["notes"]:
            print(f"{r['gib']:g} GiB: {n}")
    return status


if __name__ == "__main__":
    sys.exit(main())
