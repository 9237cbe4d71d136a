"""Benchmark: the fill of a shared anonymous segment against the fill of private memory.

Usage (root): ``python -m bench.shared_fill [--mib 4096] [--threads 1,4,16] [--rounds 2] [--json OUT]``

An engine's pinned host buffers are shared anonymous memory, which CRIU restores as a memfd; the
restore fills them through the process's shared mapping (``runtime.pages.bulk``). On the H100 the
engine's 16 GiB of weights filled at 5.3-5.9 GB/s on 16 threads where a private fill reaches
12-14 GB/s. Here, from one file of ``--mib`` random bytes in the page cache into a fresh target
process per round, each at every thread count of ``--threads``:

- ``private`` (the baseline): ``runtime.pages.bulk.write_pieces`` with the chunk digests into a
  private anonymous region (a restored heap: read, hash, ``process_vm_writev``);
- ``shared``: the same call into a memfd's shared mapping (a restored segment);
- ``shared-copy`` (the speed of light of the shared target): ``memmove`` from the file's mapping
  into a memfd's shared mapping of this process, no hash, no syscall.

Prints seconds and GB/s per round, and each shape's best against ``private`` at the same thread
count; every target's memory is compared with the file after its round.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from bench.common.targets import Child, make_file, split
from bench.common.units import GB
from runtime.digests import PIECE
from runtime.pages import bulk
from runtime.pages.filemap import FileMap

SHAPES = ("private", "shared", "shared-copy")


@dataclass
class Result:
    shape: str
    threads: int
    round: int
    seconds: float
    gbps: float


def _pieces(length: int) -> list[bulk._Piece]:
    return [bulk._Piece(0, off, min(PIECE, length - off)) for off in range(0, length, PIECE)]


def _same(pid: int, addr: int, path: str, length: int) -> None:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem, open(path, "rb") as f:
        for off in range(0, length, 64 << 20):
            n = min(64 << 20, length - off)
            mem.seek(addr + off)
            if mem.read(n) != f.read(n):
                raise SystemExit(f"shared_fill: target {pid} differs from the file at {off}")


def _fill(shape: str, path: str, sums: bytes, length: int, threads: int) -> float:
    child = Child(length, register=False, shared=shape == "shared")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        t0 = time.monotonic()
        bulk.write_pieces([fd], [child.proc.pid], [split(child.addr, length, 1)], _pieces(length),
                          threads=threads, progress=None, sums=[sums], sizes=[length])
        seconds = time.monotonic() - t0
        _same(child.proc.pid, child.addr, path, length)
        return seconds
    finally:
        os.close(fd)
        child.close()


def _copy(path: str, length: int, threads: int) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    seg = os.memfd_create("shared-copy", os.MFD_CLOEXEC)
    src = FileMap(fd, length, writable=False)
    os.ftruncate(seg, length)
    dest = mmap.mmap(seg, length, flags=mmap.MAP_SHARED)
    view = ctypes.c_char.from_buffer(dest)
    try:
        base = ctypes.addressof(view)
        work = iter(range(0, length, PIECE))
        lock = threading.Lock()

        def run() -> None:
            while True:
                with lock:
                    off = next(work, None)
                if off is None:
                    return
                ctypes.memmove(base + off, src.addr + off, min(PIECE, length - off))  # drops the GIL

        t0 = time.monotonic()
        ths = [threading.Thread(target=run) for _ in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        seconds = time.monotonic() - t0
        if dest[:1 << 20] != os.pread(fd, 1 << 20, 0):
            raise SystemExit("shared_fill: the copy differs from the file")
        return seconds
    finally:
        del view
        dest.close()
        src.close()
        os.close(seg)
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=4096)
    ap.add_argument("--threads", default=f"1,{min(4, os.cpu_count() or 1)},{bulk.fill_threads()}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    length = args.mib << 20
    counts = sorted({int(t) for t in args.threads.split(",") if t})
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="shared-fill-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        path, sums = make_file(d, length)
        for threads in counts:
            for r in range(args.rounds):
                for shape in SHAPES:
                    s = _copy(path, length, threads) if shape == "shared-copy" else _fill(shape, path, sums, length, threads)
                    results.append(Result(shape, threads, r, round(s, 4), round(length / s / GB, 2)))
                    print(f"{shape:12s} {threads:3d} threads round {r}: {s:7.3f} s {length / s / GB:6.2f} GB/s", flush=True)
    print(f"\n{args.mib} MiB, best of {args.rounds} rounds; ratio = GB/s against private at the same threads")
    print(f"{'threads':>7s} " + " ".join(f"{s:>20s}" for s in SHAPES))
    summary = []
    for threads in counts:
        best = {s: max(x.gbps for x in results if x.shape == s and x.threads == threads) for s in SHAPES}
        summary.append({"threads": threads, **{s: {"gbps": best[s], "ratio": round(best[s] / best["private"], 2)}
                                               for s in SHAPES}})
        print(f"{threads:7d} " + " ".join(f"{best[s]:8.2f} GB/s {best[s] / best['private']:5.2f}x" for s in SHAPES))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "cpus": os.cpu_count(), "results": [asdict(x) for x in results],
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
