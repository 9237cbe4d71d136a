"""Which step between a process's CUDA checkpoint and its resume ends it: a lab on a bare GPU
node (no containerd, no plugin), one fresh worker per variant, each in the plugin's order
(lock, checkpoint, <step>, restore, unlock; the process running when the driver restores it):

- ``driver``: no step (the driver's own round trip);
- ``seize``: every thread PTRACE_SEIZEd, interrupted, waited for and detached (what CRIU does
  to a tree before its parasite, and nothing else);
- ``criu``: ``criu dump --leave-running`` of the process (what the plugin runs);
- ``criu-norseq``: the same, the worker started with glibc's rseq registration off;
- ``criu-stopped``: ``criu dump --leave-stopped``, then SIGCONT before the restore;
- ``criu-after-stop``: the worker stopped and continued (SIGSTOP, SIGCONT) before the lock, so
  a timed wait goes on as restart_syscall, then as ``criu``.

For each: the seconds of each step, whether the process lives and the driver's state for it
after the step, the answer before and after, the threads (name, state, syscall) as the step
found them, the worker's exit and last stderr lines (faulthandler), CRIU's errors.

  python -m bench.cuda_dump_lab --worker "python3 tests/gpu/workloads/jax_worker.py" \\
      --env XLA_PYTHON_CLIENT_MEM_FRACTION=0.10 --variants driver,seize,criu --out lab.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from runtime.gpu.cuda import CudaCheckpointer

PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT = 17, 0x4206, 0x4207
WALL = 0x40000000
VARIANTS = ("driver", "seize", "criu", "criu-norseq", "criu-stopped", "criu-after-stop")


def threads(pid: int) -> list[dict[str, str]]:
    out = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        def read(name: str) -> str:
            try:
                return Path(f"/proc/{pid}/task/{tid}/{name}").read_text(errors="replace").strip()
            except OSError as exc:
                return f"({exc.strerror})"
        stat = read("stat")
        state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
        out.append({"tid": tid, "comm": read("comm"), "state": state,
                    "syscall": read("syscall").split(" ")[0], "wchan": read("wchan")})
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def seize_all(pid: int) -> dict[str, Any]:
    """PTRACE_SEIZE + INTERRUPT every thread, wait for each stop, detach: CRIU's seize alone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    seized, errors = [], []
    for tid in tids:
        if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
            errors.append(f"seize {tid}: {os.strerror(ctypes.get_errno())}")
            continue
        seized.append(tid)
        libc.ptrace(PTRACE_INTERRUPT, tid, None, None)
    for tid in seized:
        try:
            os.waitpid(tid, WALL)
        except ChildProcessError as exc:
            errors.append(f"wait {tid}: {exc}")
    time.sleep(1.0)
    for tid in seized:
        if libc.ptrace(PTRACE_DETACH, tid, None, None) != 0:
            errors.append(f"detach {tid}: {os.strerror(ctypes.get_errno())}")
    return {"seized": len(seized), "errors": errors}


def criu_dump(pid: int, images: Path, extra: list[str]) -> dict[str, Any]:
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True)
    argv = ["criu", "dump", "-t", str(pid), "--shell-job", "-D", str(images), "-o", "dump.log", "-v4", *extra]
    rc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    log = (images / "dump.log").read_text(errors="replace") if (images / "dump.log").exists() else ""
    lines = log.splitlines()
    info = {"argv": argv, "rc": rc.returncode, "stderr": rc.stderr[-2000:],
            "errors": [ln for ln in lines if "Error" in ln or "Warn" in ln][-40:], "tail": lines[-25:],
            "image_bytes": sum(f.stat().st_size for f in images.iterdir() if f.is_file())}
    (images.parent / f"{images.name}.dump.log").write_text(log)
    for f in images.iterdir():  # the images themselves are not needed: keep the disk free
        if f.name != "dump.log":
            f.unlink()
    return info


def read_line(proc: subprocess.Popen[str], timeout: float) -> str | None:
    assert proc.stdout is not None
    r, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if r else None


def run_variant(name: str, worker: list[str], env: dict[str, str], work: Path, cuda: CudaCheckpointer) -> dict[str, Any]:
    res: dict[str, Any] = {"variant": name, "steps": {}}
    wenv = {**os.environ, **env}
    if name == "criu-norseq":
        wenv["GLIBC_TUNABLES"] = "glibc.pthread.rseq=0"
    stderr = open(work / f"{name}.stderr", "w")
    proc = subprocess.Popen(worker, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                            env=wenv, start_new_session=True)
    pid = proc.pid

    def step(label: str, fn: Any) -> Any:
        t = time.monotonic()
        try:
            out = fn()
            res["steps"][label] = {"s": round(time.monotonic() - t, 2), "ok": True}
            return out
        except Exception as exc:  # noqa: BLE001 - recorded
            res["steps"][label] = {"s": round(time.monotonic() - t, 2), "ok": False, "error": repr(exc)}
            return None

    try:
        ready = read_line(proc, 300)
        res["ready"] = ready
        if not ready or not ready.startswith("ready"):
            return res
        if name == "criu-after-stop":
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.5)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.5)
            res["threads_after_stop"] = threads(pid)
        step("lock", lambda: cuda.lock([pid], 10_000))
        step("checkpoint", lambda: cuda.checkpoint([pid]))
        res["threads_after_checkpoint"] = threads(pid)
        if name == "seize":
            res["seize"] = step("seize", lambda: seize_all(pid))
        elif name.startswith("criu"):
            extra = ["--leave-stopped"] if name == "criu-stopped" else ["--leave-running"]
            res["criu"] = step("criu_dump", lambda: criu_dump(pid, work / f"images-{name}", extra))
            if name == "criu-stopped":
                res["threads_stopped"] = threads(pid) if alive(pid) else None
                os.kill(pid, signal.SIGCONT)
        time.sleep(1.0)
        res["alive_after_step"] = alive(pid)
        res["state_after_step"] = str(step("get_state", lambda: cuda.state(pid)))
        if res["alive_after_step"]:
            res["threads_after_step"] = threads(pid)
            step("restore", lambda: cuda.restore([pid]))
            step("unlock", lambda: cuda.unlock([pid]))
            assert proc.stdin is not None
            proc.stdin.write("compute\n")
            proc.stdin.flush()
            res["after"] = read_line(proc, 120)
            proc.stdin.write("jit-new\n")
            proc.stdin.flush()
            res["jit_new"] = read_line(proc, 120)
            res["same"] = res["after"] is not None and res["after"].split()[-1] == ready.split()[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        res["exit"] = proc.returncode
        stderr.close()
        res["stderr_tail"] = (work / f"{name}.stderr").read_text(errors="replace").splitlines()[-40:]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", required=True, help="the worker's command line")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the worker")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--work", default="/dev/shm/cuda-dump-lab")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(e.split("=", 1) for e in args.env)
    results = []
    with CudaCheckpointer(call_timeout=240) as cuda:
        for name in args.variants.split(","):
            if name not in VARIANTS:
                raise SystemExit(f"unknown variant {name}")
            r = run_variant(name, shlex.split(args.worker), env, work, cuda)
            print(json.dumps({k: r.get(k) for k in ("variant", "steps", "alive_after_step", "state_after_step",
                                                    "ready", "after", "jit_new", "same", "exit")}), flush=True)
            results.append(r)
            Path(args.out).write_text(json.dumps({"worker": args.worker, "env": env, "results": results}, indent=1))
    try:
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout.splitlines()[-40:]
    except OSError as exc:
        dmesg = [str(exc)]
    Path(args.out).write_text(json.dumps({"worker": args.worker, "env": env, "results": results,
                                          "dmesg": dmesg}, indent=1))


if __name__ == "__main__":
    main()
