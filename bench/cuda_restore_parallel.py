"""Lab: the CUDA driver's own restores, one alone against N at once, with no container, CRIU or
plugin: the floor under "N pods restored at once" (bench/scale_out.py).

N processes (tests/gpu/workloads/gpu_holder.py, ``--gib`` each) are CUDA-checkpointed (their
device memory moves into host memory, with the node's THP mode ``--thp`` meanwhile, as the
plugin's ``--checkpoint-thp`` does). Then, per round of ``--rounds`` (default ``1,4,1,4``): that
many of them are restored at once (``cuCheckpointProcessRestore`` + unlock, each on its own
thread, as the plugin's ``--cuda-parallel``), each restore timed, their GPU checksums compared
with the ones taken before the checkpoint, and checkpointed again for the next round. Prints
each round's slowest restore and its ratio to the latest single restore, the aggregate GB/s,
and writes ``--json``.

Usage (root, GPU node): ``python -m bench.cuda_restore_parallel --gib 15 --procs 4``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runtime.gpu.cuda import CudaCheckpointer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests/gpu/workloads"))
from gpu_holder import request_verify, wait_ready  # noqa: E402

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def checkpoint(cuda: CudaCheckpointer, pids: list[int], thp: str) -> float:
    was = thp_mode()
    if thp != "keep":
        THP.write_text(thp)
    try:
        t = time.monotonic()
        with ThreadPoolExecutor(len(pids)) as pool:
            list(pool.map(lambda p: cuda.checkpoint_all([p], 30_000), pids))
        return time.monotonic() - t
    finally:
        THP.write_text(was)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=15)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rounds", default="1,4,1,4")
    ap.add_argument("--thp", default="always", choices=["keep", "always", "madvise"])
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cuda-parallel-"))
    procs, dirs = [], []
    out: dict = {"what": __doc__.split("\n")[0], "gib": a.gib, "thp": a.thp, "rounds": []}
    try:
        for i in range(a.procs):
            d = work / f"p{i}"
            d.mkdir()
            dirs.append(d)
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "tests/gpu/workloads/gpu_holder.py"), "--gib", str(a.gib),
                 "--work-dir", str(d), "--seed", str(100 * i)],
                stdin=subprocess.DEVNULL, stdout=open(d / "log", "w"), stderr=subprocess.STDOUT))
        for p, d in zip(procs, dirs):
            wait_ready(d, lambda p=p: p.poll() is None, timeout=600)
        pids = [p.pid for p in procs]
        with CudaCheckpointer(parallel=a.procs) as cuda:
            out["checkpoint_s"] = round(checkpoint(cuda, pids, a.thp), 3)
            print(f"{a.procs} x {a.gib} GiB checkpointed in {out['checkpoint_s']:.2f} s (THP {a.thp})", flush=True)
            single = None
            for n in (int(x) for x in a.rounds.split(",")):
                chosen = pids[:n]
                times: dict[int, float] = {}

                def one(pid: int) -> None:
                    t = time.monotonic()
                    cuda.restore_all([pid])
                    times[pid] = time.monotonic() - t

                t0 = time.monotonic()
                with ThreadPoolExecutor(n) as pool:
                    list(pool.map(one, chosen))
                wall = time.monotonic() - t0
                same = all(request_verify(dirs[pids.index(p)])["same"] for p in chosen)
                if n == 1:
                    single = wall
                gb = n * a.gib * (1 << 30) / 1e9
                row = {"at_once": n, "wall_s": round(wall, 3), "each_s": [round(times[p], 3) for p in chosen],
                       "aggregate_gbps": round(gb / wall, 2), "x_single": round(wall / single, 2) if single else None,
                       "identical": same}
                out["rounds"].append(row)
                print(f"{n} at once: {wall:.2f} s (each {', '.join(f'{x:.2f}' for x in row['each_s'])}), "
                      f"{row['aggregate_gbps']} GB/s" + (f", {row['x_single']}x one alone" if single else "")
                      + f", identical {same}", flush=True)
                if a.json:
                    Path(a.json).write_text(json.dumps(out, indent=1))
                checkpoint(cuda, chosen, a.thp)
    finally:
        for p in procs:
            p.kill()
        subprocess.run(["rm", "-rf", str(work)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
