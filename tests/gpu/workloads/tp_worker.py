"""A tensor-parallel job in one container: a launcher (no CUDA) and one rank per GPU joined by a
process group, that can prove its memory and its collectives survived a checkpoint. Also the
example of rekindle_tp.py (runtime/workload/), which must be importable (PYTHONPATH).

Usage: ``python tp_worker.py [--world 2] [--gib G] [--mode rebuild|live] [--backend nccl|gloo]
[--work-dir DIR]``

- The launcher starts ``--world`` ranks (this file with ``--rank R``; ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK`` set), forwards SIGTERM/SIGINT to them and exits with the first failing rank's
  status (0 when all exit 0).
- Each rank fills ``--gib`` GiB of seeded float32 on its device (``cuda:<local rank>`` for nccl,
  the CPU for gloo) and a 1024x1024 matrix, builds the group with rekindle_tp, and checks an
  all-reduce: every rank sums seeded vectors, and knows the exact answer (two float32 addends per
  element for two ranks: the same bits every time).
- It writes ``DIR/rank<R>.json`` (checksums, all-reduce check, pid, timings). Then:
  * ``--mode rebuild``: ``TensorParallelGroup.before_checkpoint()`` (down, ready, wait, rebuilt),
    then ``DIR/rank<R>-outcome.json`` (outcome, generation, seconds it waited);
  * ``--mode live``: the group stays up (NCCL on its default transports); after a barrier rank 0
    writes ``ready-for-checkpoint`` itself. Rekindle must refuse this checkpoint.
- Then it serves, polling every 50 ms: ``DIR/verify-request-<R>`` (content: an id; write one per
  rank, the check is a collective) -> ``DIR/verify-result-<R>.json`` = ``{"id", "checksums",
  "same", "allreduce_ok", "generation", "device"}``; ``DIR/stop`` -> exit 0.
``DIR`` defaults to ``$REKINDLE_CONTROL_DIR``. Keep NVLink multicast off in the environment
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
ELEMS = 1 << 20  # all-reduce vector length


def atomic_write(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def launcher(args: argparse.Namespace) -> int:
    procs = []
    for r in range(args.world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(args.world), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(r), *sys.argv[1:]], env=env))

    def forward(sig: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    failed: int | None = None
    while any(p.poll() is None for p in procs):
        bad = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if bad and failed is None:
            failed = bad[0] if bad[0] > 0 else 128 - bad[0]
            forward(signal.SIGTERM, None)  # one rank down: the job is down
        time.sleep(0.1)
    if failed is None:
        failed = next((c if c > 0 else 128 - c for c in (p.returncode for p in procs) if c), 0)
    return failed


class Rank:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        t0 = time.monotonic()
        import torch  # noqa: PLC0415 - timed on purpose
        import torch.distributed as dist  # noqa: PLC0415
        from rekindle_tp import TensorParallelGroup  # noqa: PLC0415

        self.torch, self.dist, self.args, self.work = torch, dist, args, work
        self.import_s = time.monotonic() - t0
        self.group = TensorParallelGroup.from_env(backend=args.backend)
        self.rank, self.world = self.group.rank, self.group.world_size
        self.device = self.group.device or torch.device("cpu")
        t1 = time.monotonic()
        self.chunks = []
        left, i = int(args.gib * GIB) // 4 * 4, 0
        while left > 0:
            n = min(left, GIB) // 4
            g = torch.Generator(device=self.device).manual_seed(1000 * self.rank + i)
            self.chunks.append(torch.empty(n, dtype=torch.float32, device=self.device).uniform_(generator=g))
            left -= n * 4
            i += 1
        g = torch.Generator(device=self.device).manual_seed(1000 * self.rank + 999)
        self.matrix = torch.randn(1024, 1024, device=self.device, generator=g)
        self.fill_s = time.monotonic() - t1
        t2 = time.monotonic()
        self.group.init()
        self.init_s = time.monotonic() - t2
        self.initial = self.checksums()

    def vector(self, rank: int) -> Any:
        g = self.torch.Generator(device=self.device).manual_seed(77_000 + rank)
        return self.torch.rand(ELEMS, device=self.device, generator=g)

    def allreduce_ok(self) -> bool:
        got = self.vector(self.rank)
        self.dist.all_reduce(got)
        want = self.vector(0)
        for r in range(1, self.world):
            want += self.vector(r)
        return bool(self.torch.equal(got, want))

    def checksums(self) -> dict[str, Any]:
        """Per chunk, and of M @ M: the int64 sum of the float32 bits seen as int32."""
        torch = self.torch

        def bits(t: Any) -> int:
            return int(t.contiguous().view(torch.int32).sum(dtype=torch.int64).item())

        return {"chunks": [bits(c) for c in self.chunks], "bytes": sum(c.numel() * 4 for c in self.chunks),
                "matmul": bits(self.matrix @ self.matrix)}

    def run(self) -> int:
        ok = [self.allreduce_ok() for _ in range(3)]
        info = {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "checksums": self.initial,
                "allreduce_ok": all(ok), "import_torch_s": round(self.import_s, 3),
                "fill_s": round(self.fill_s, 3), "init_group_s": round(self.init_s, 3)}
        atomic_write(self.work / f"rank{self.rank}.json", info)
        if self.args.mode == "rebuild":
            t = time.monotonic()
            outcome = self.group.before_checkpoint()
            atomic_write(self.work / f"rank{self.rank}-outcome.json",
                         {"outcome": outcome.value, "generation": self.group.generation,
                          "waited_s": round(time.monotonic() - t, 3)})
        else:
            self.dist.barrier()
            if self.rank == 0:
                (self.work / "ready-for-checkpoint").write_text(f"{os.getpid()}\n")
        print(f"tp_worker rank {self.rank}: serving", flush=True)
        req, stop = self.work / f"verify-request-{self.rank}", self.work / "stop"
        while not stop.exists():
            if req.exists():
                rid = req.read_text().strip()
                req.unlink()
                now = self.checksums()
                atomic_write(self.work / f"verify-result-{self.rank}.json",
                             {"id": rid, "checksums": now, "same": now == self.initial,
                              "allreduce_ok": self.allreduce_ok(), "generation": self.group.generation,
                              "device": str(self.device)})
            time.sleep(0.05)
        self.dist.destroy_process_group()
        return 0


def request_verify(work: Path, world: int, timeout: float = 120.0) -> list[dict[str, Any]]:
    """Ask every rank to check itself (a collective: all must be asked); returns their answers."""
    rid = str(time.time_ns())
    for r in range(world):
        (work / f"verify-result-{r}.json").unlink(missing_ok=True)
    for r in range(world):
        tmp = work / f".verify-request-{r}"
        tmp.write_text(rid)
        os.replace(tmp, work / f"verify-request-{r}")
    deadline = time.monotonic() + timeout
    out: dict[int, dict[str, Any]] = {}
    while len(out) < world:
        for r in range(world):
            p = work / f"verify-result-{r}.json"
            if r not in out and p.exists():
                got = json.loads(p.read_text())
                if got["id"] == rid:
                    out[r] = got
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(set(range(world)) - set(out))} did not answer in {timeout:.0f}s")
        time.sleep(0.05)
    return [out[r] for r in range(world)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--mode", choices=("rebuild", "live"), default="rebuild")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--rank", type=int, default=None)
    args = ap.parse_args()
    work = args.work_dir or Path(os.environ.get("REKINDLE_CONTROL_DIR") or ".")
    if args.rank is None:
        return launcher(args)
    return Rank(args, work).run()


if __name__ == "__main__":
    raise SystemExit(main())
