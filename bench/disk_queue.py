"""Benchmark: how the restore's reads share a disk with the pod that starts beside them.

Usage (root; drops the page cache between shapes):
``python -m bench.disk_queue --file PATH [--gib 4] [--json OUT]``

A restore from a cold page cache reads its artifact while the pod's own start (runc, the shim,
the init, CRIU) reads small files from the same disk. Each shape below reads ``--gib`` GiB of
``PATH`` cold, while a probe thread reads 4 KiB from cold small files every 20 ms and times each:

- ``prefetch`` shapes: N threads, one chunk each at a time, in file order (runtime.store.readahead);
  the baseline is the previous prefetch, 16 threads of 8 MiB;
- ``fill`` shapes: the fill's pattern (runtime.pages.bulk), N threads each reading its own 64 MiB piece
  in 1 MiB reads through one shared fd, with and without ``POSIX_FADV_WILLNEED`` per piece.

Prints GB/s, the probe's median and p90 latency, and the ratios to the baseline; the speed of
light is the disk's best throughput in the same run with the probe's idle latency.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common.disk import drop_caches
from bench.common.units import GB
from runtime.digests import PIECE  # the fill works piece by piece
from runtime.pages import bulk
from runtime.store import readahead

FILL_READ = bulk.CHUNK
SMALL = 64 << 10


@dataclass
class Shape:
    kind: str  # prefetch | fill | idle
    threads: int
    chunk: int
    willneed: bool = False

    @property
    def label(self) -> str:
        if self.kind == "idle":
            return "idle disk (probe alone)"
        extra = " + WILLNEED" if self.willneed else ""
        return f"{self.kind} {self.threads} x {self.chunk >> 20} MiB{extra}"


@dataclass
class Result:
    shape: str
    gbps: float
    probe_median_ms: float
    probe_p90_ms: float
    probes: int


def _reader(fd: int, size: int, shape: Shape) -> tuple[list[int], Callable[[int], int]]:
    local = threading.local()

    def buffer(n: int) -> memoryview:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = memoryview(mmap.mmap(-1, n))
        return buf

    if shape.kind == "prefetch":
        def one(off: int) -> int:
            return os.preadv(fd, [buffer(shape.chunk)[:min(shape.chunk, size - off)]], off)
        return list(range(0, size, shape.chunk)), one

    def piece(off: int) -> int:
        n = min(PIECE, size - off)
        if shape.willneed:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_WILLNEED)
        pos, buf = off, buffer(FILL_READ)
        while pos < off + n:
            got = os.preadv(fd, [buf[:min(FILL_READ, off + n - pos)]], pos)
            if got <= 0:
                break
            pos += got
        return pos - off
    return list(range(0, size, PIECE)), piece


def measure(path: Path, size: int, shape: Shape, smalls: list[Path], idle_s: float = 1.0) -> Result:
    drop_caches()
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        for p in smalls:
            if stop.is_set():
                return
            t = time.perf_counter()
            with open(p, "rb", buffering=0) as f:
                f.read(4096)
            latencies.append(time.perf_counter() - t)
            time.sleep(0.02)

    prober = threading.Thread(target=probe, daemon=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.perf_counter()
        prober.start()
        done = 0
        if shape.kind == "idle":
            time.sleep(idle_s)
        else:
            jobs, one = _reader(fd, size, shape)
            with ThreadPoolExecutor(shape.threads) as pool:
                done = sum(pool.map(one, jobs))
        seconds = time.perf_counter() - t
    finally:
        stop.set()
        prober.join()
        os.close(fd)
    ms = sorted(x * 1e3 for x in latencies) or [0.0]
    return Result(shape.label, round(done / seconds / GB, 3), round(statistics.median(ms), 2),
                  round(ms[int(len(ms) * 0.9)], 2), len(latencies))


def _prepare(path: Path, size: int, smalls_dir: Path) -> list[Path]:
    """The big file (incompressible, written once) and 400 small ones."""
    if not path.exists() or path.stat().st_size < size:
        block = os.urandom(64 << 20)
        with open(path, "wb") as f:
            for _ in range(0, size, len(block)):
                f.write(block)
    smalls_dir.mkdir(parents=True, exist_ok=True)
    smalls = [smalls_dir / f"small-{i}" for i in range(400)]
    for p in smalls:
        if not p.exists():
            p.write_bytes(os.urandom(SMALL))
    os.sync()
    return smalls


SHAPES = [
    Shape("idle", 0, 0),
    Shape("prefetch", 16, 8 << 20),  # baseline: the previous prefetch
    Shape("prefetch", readahead.THREADS, readahead.CHUNK),  # the prefetch now
    Shape("prefetch", 8, 2 << 20),
    Shape("prefetch", 1, 8 << 20),
    Shape("fill", 16, FILL_READ),
    Shape("fill", 16, FILL_READ, willneed=True),  # the fill now
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", type=Path, required=True, help="a scratch file on the disk to measure")
    ap.add_argument("--gib", type=float, default=4.0, help="bytes read by each shape, GiB")
    ap.add_argument("--rounds", type=int, default=2, help="each shape this many times (best and worst kept)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.size = int(args.gib * (1 << 30)) // PIECE * PIECE or PIECE
    smalls = _prepare(args.file, args.size, args.file.parent / (args.file.name + ".small"))
    runs: list[Result] = []
    for _ in range(args.rounds):
        for shape in SHAPES:
            runs.append(measure(args.file, args.size, shape, smalls))
            r = runs[-1]
            print(f"{r.shape:34s} {r.gbps:6.2f} GB/s  4 KiB read beside it: median {r.probe_median_ms:7.2f} ms, "
                  f"p90 {r.probe_p90_ms:7.2f} ms ({r.probes} reads)", flush=True)
    by: dict[str, list[Result]] = {}
    for r in runs:
        by.setdefault(r.shape, []).append(r)
    base = by[SHAPES[1].label]
    base_gbps = statistics.median(r.gbps for r in base)
    base_ms = statistics.median(r.probe_median_ms for r in base)
    best = max(r.gbps for r in runs)
    idle_ms = statistics.median(r.probe_median_ms for r in by[SHAPES[0].label])
    print(f"\nspeed of light: {best:.2f} GB/s (best shape in this run), a 4 KiB read on the idle disk "
          f"{idle_ms:.2f} ms")
    print(f"{'shape':34s} {'GB/s':>6s} {'x base':>7s} {'x SOL':>6s} {'latency ms':>11s} {'x base':>7s}")
    summary = []
    for shape in SHAPES[1:]:
        rs = by[shape.label]
        gbps = statistics.median(r.gbps for r in rs)
        ms = statistics.median(r.probe_median_ms for r in rs)
        summary.append({"shape": shape.label, **asdict(shape), "gbps": gbps, "probe_median_ms": ms,
                        "gbps_x_base": round(gbps / base_gbps, 2), "latency_x_base": round(ms / base_ms, 3)})
        print(f"{shape.label:34s} {gbps:6.2f} {gbps / base_gbps:7.2f} {gbps / best:6.2f} {ms:11.2f} "
              f"{ms / base_ms:7.3f}")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "sol_gbps": best, "idle_probe_ms": idle_ms,
                                         "summary": summary, "runs": [asdict(r) for r in runs]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
