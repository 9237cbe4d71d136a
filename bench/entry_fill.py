"""Benchmark: the fill from a node cache entry, hashed again (as before) or copied from its mapping.

Usage (root): ``python -m bench.entry_fill [--mib 1024] [--pods 4] [--rounds 3] [--json OUT]``

A restore mapped from the node's entry still fills the bulk ranges it does not map (the LLM
worker's heap runs: 1.3 GB a pod). On the H200 that fill took 0.29 s alone and 1.06-1.26 s each
with four pods at once (``bench/results/h200/scale-out-llm-warm.json``): the plugin's fills share
one bound of :data:`runtime.digests.WORKERS` pieces at a time, and each piece was read into a
buffer, hashed and written. The entry is sealed (root-only, read-only, its identity checked
before use) and was verified when written, the trust its mapped ranges already have, so the fill
now copies it straight from a read-only mapping: one copy, no hash. Here, on one file of
``--mib`` on a ``huge=always`` tmpfs (as the node cache's; ``/dev/shm`` when it cannot mount one)
and fresh target processes (a private anonymous region each, as a restored heap):

- ``verified`` (the baseline): ``runtime.pages.bulk.write_pieces`` with the chunk digests: read,
  hash, ``process_vm_writev``;
- ``sealed``: the same call without digests: ``process_vm_writev`` from the file's mapping;
- ``copy`` (the speed of light of one copy): ``memmove`` from the file's mapping into fresh
  private memory of this process, on as many threads; no syscall, no other process.

Each shape runs for 1 target and for ``--pods`` targets at once (each its own fill, all in this
process, as in the plugin: they share the pieces bound). Prints seconds, GB/s, CPU seconds per GB
and the ratio to ``verified`` of the same number of targets; every target's memory is compared
with the file after its round.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

from bench.common.targets import Child, make_file, split
from bench.common.units import GB
from runtime.digests import PIECE
from runtime.pages import bulk
from runtime.pages.filemap import FileMap

SHAPES = ("verified", "sealed", "copy")


@dataclass
class Result:
    shape: str
    pods: int
    round: int
    seconds: float
    gbps: float  # all the targets' bytes over the round's seconds
    cpu_s_per_gb: float  # this process's CPU time (every thread) per GB written
    ratio_to_verified: float | None = None


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pieces(length: int) -> list[bulk._Piece]:
    return [bulk._Piece(0, off, min(PIECE, length - off)) for off in range(0, length, PIECE)]


def _check(child: Child, path: str, length: int) -> None:
    with open(f"/proc/{child.proc.pid}/mem", "rb", buffering=0) as mem, open(path, "rb") as f:
        for off in range(0, length, 64 << 20):
            n = min(64 << 20, length - off)
            mem.seek(child.addr + off)
            if mem.read(n) != f.read(n):
                raise SystemExit(f"entry_fill: target {child.proc.pid} differs from the file at {off}")


def _fill_round(shape: str, pods: int, path: str, sums: bytes, length: int, threads: int) -> tuple[float, float]:
    """The round's seconds and this process's CPU seconds, both of the fills alone."""
    children = [Child(length, register=False) for _ in range(pods)]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        errors: list[BaseException] = []

        def one(child: Child) -> None:
            try:
                bulk.write_pieces([fd], [child.proc.pid], [split(child.addr, length, 1)], _pieces(length),
                                  threads=threads, progress=None, sums=[sums] if shape == "verified" else None,
                                  sizes=[length])
            except BaseException as exc:  # reported below
                errors.append(exc)

        t0, cpu0 = time.monotonic(), _cpu()
        ths = [threading.Thread(target=one, args=(c,)) for c in children]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        seconds, cpu = time.monotonic() - t0, _cpu() - cpu0
        if errors:
            raise errors[0]
        for c in children:
            _check(c, path, length)
        return seconds, cpu
    finally:
        os.close(fd)
        for c in children:
            c.close()


def _copy_round(pods: int, path: str, length: int, threads: int) -> tuple[float, float]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    src = FileMap(fd, length, writable=False)
    dests = [mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(pods)]
    views = [ctypes.c_char.from_buffer(d) for d in dests]
    try:
        addrs = [ctypes.addressof(v) for v in views]
        work = iter([(a, off) for a in addrs for off in range(0, length, PIECE)])
        lock = threading.Lock()

        def run() -> None:
            while True:
                with lock:
                    job = next(work, None)
                if job is None:
                    return
                dst, off = job
                ctypes.memmove(dst + off, src.addr + off, min(PIECE, length - off))  # drops the GIL

        t0, cpu0 = time.monotonic(), _cpu()
        ths = [threading.Thread(target=run) for _ in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return time.monotonic() - t0, _cpu() - cpu0
    finally:
        src.close()
        os.close(fd)
        del views  # (an mmap with a buffer exported does not close)
        for d in dests:
            d.close()


def _huge_tmpfs(parent: str) -> str | None:
    """A ``huge=always`` tmpfs mounted under ``parent`` (the node cache's kind), or None."""
    at = tempfile.mkdtemp(prefix="entry-fill-", dir=parent)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,mode=0700", "tmpfs", at],
                          capture_output=True)
    if done.returncode != 0:
        os.rmdir(at)
        return None
    return at


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="bytes each target gets, in MiB")
    ap.add_argument("--pods", type=int, default=4, help="targets filled at once in the second set of rounds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=bulk.fill_threads(), help="threads of each fill")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    length = args.mib << 20
    mount = _huge_tmpfs(tempfile.gettempdir())
    where = mount or "/dev/shm"
    results: list[Result] = []
    try:
        with tempfile.TemporaryDirectory(dir=where) as d:
            path, sums = make_file(d, length)
            # untimed: the first round of each shape pays for imports, pools and the file's mapping
            _copy_round(1, path, length, args.threads)
            for shape in ("verified", "sealed"):
                _fill_round(shape, 1, path, sums, length, args.threads)
            for pods in sorted({1, args.pods}):
                for rnd in range(args.rounds):
                    for shape in SHAPES:  # interleaved: a drift of the machine hits each shape alike
                        seconds, cpu = (_copy_round(pods, path, length, args.threads) if shape == "copy"
                                        else _fill_round(shape, pods, path, sums, length, args.threads))
                        results.append(Result(shape, pods, rnd, round(seconds, 4), round(pods * length / GB / seconds, 3),
                                              round(cpu / (pods * length / GB), 3)))
    finally:
        if mount:
            subprocess.run(["umount", mount], check=False)
            os.rmdir(mount)
    summary = []
    print(f"{args.mib} MiB a target, {args.threads} threads a fill, file on "
          f"{'a huge=always tmpfs' if mount else '/dev/shm'}, {os.cpu_count()} CPUs; medians of {args.rounds}")
    print(f"{'shape':9s} {'pods':>4s} {'seconds':>8s} {'GB/s':>6s} {'CPU s/GB':>8s} {'x verified':>10s}")
    for pods in sorted({1, args.pods}):
        base = statistics.median(r.seconds for r in results if r.pods == pods and r.shape == "verified")
        for shape in SHAPES:
            mine = [r for r in results if r.pods == pods and r.shape == shape]
            for r in mine:
                r.ratio_to_verified = round(base / r.seconds, 2)
            med = statistics.median(r.seconds for r in mine)
            row = {"shape": shape, "pods": pods, "seconds": med, "gbps": round(pods * length / GB / med, 3),
                   "cpu_s_per_gb": statistics.median(r.cpu_s_per_gb for r in mine),
                   "ratio_to_verified": round(base / med, 2)}
            summary.append(row)
            print(f"{shape:9s} {pods:4d} {med:8.3f} {row['gbps']:6.2f} {row['cpu_s_per_gb']:8.2f} "
                  f"{row['ratio_to_verified']:10.2f}")
    one = {r["shape"]: r["seconds"] for r in summary if r["pods"] == 1}
    many = {r["shape"]: r["seconds"] for r in summary if r["pods"] == args.pods}
    if args.pods > 1:
        print("x one target: " + ", ".join(f"{s} {many[s] / one[s]:.2f}" for s in SHAPES))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"what": "fill of a node cache entry's bytes into fresh targets", "mib": args.mib,
                       "threads": args.threads, "cpus": os.cpu_count(), "huge_tmpfs": bool(mount),
                       "summary": summary, "runs": [asdict(r) for r in results]}, out, indent=1)


if __name__ == "__main__":
    main()
