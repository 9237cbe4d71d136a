"""Benchmark: a bulk file whose zero chunks are stored as data (before) or punched out (now).

Usage (root): ``python -m bench.zero_chunks [--mib 1024] [--zero 0.6] [--rounds 3] [--json OUT]``

An inference engine reserves most of the GPU and fills its KV cache with zeros; the CUDA
checkpoint moves it to the host, CRIU dumps it, and every zero byte used to be stored, read,
hashed and written again. The checkpoint now punches each whole zero chunk out of the bulk file
(``runtime.pages.bulk``), and a zero chunk that is a hole is neither read, hashed nor written
(``runtime.pages.chunks``). Here, on one file of ``--mib`` in ``/dev/shm`` (the page cache: no
disk in the figures), ``--zero`` of its chunks zero (one run at the end, as a KV cache after the
weights, plus every seventh chunk of the rest, as scattered zero pages), it prints:

- what the file takes (allocated bytes) with the zeros stored and punched, and the punch's own
  seconds at checkpoint beside the time to hash the file once (what the checkpoint paid anyway);
- the verified fill (``runtime.pages.bulk.write_pieces`` with the chunk digests: read, hash,
  ``process_vm_writev``) into a fresh target process, from each file, rounds interleaved, with
  the ratio of the punched file's time to the stored file's, and the speed of light of the
  punched fill: the stored file's time for its non-zero bytes only.

Every target's memory is compared with the file after its round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import blake3

from bench.common.targets import Child, split
from bench.common.units import GB
from runtime.digests import PIECE
from runtime.layout import SUM_CHUNK
from runtime.pages import bulk


def _make(path: str, length: int, zero: float) -> tuple[bytes, int]:
    """The file, its chunk digests, and how many of its bytes are zero chunks."""
    chunks = -(-length // SUM_CHUNK)
    tail = int(chunks * zero * 6 / 7)  # the KV cache: one run at the end
    scattered = {i for i in range(0, chunks - tail, 7)} if zero > 0 else set()
    sums, zeros = [], 0
    with open(path, "wb") as f:
        for i in range(chunks):
            n = min(SUM_CHUNK, length - i * SUM_CHUNK)
            is_zero = i >= chunks - tail or i in scattered
            data = bytes(n) if is_zero else os.urandom(n)
            zeros += n if is_zero else 0
            f.write(data)
            sums.append(blake3.blake3(data).digest())
    return b"".join(sums), zeros


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def _fill(path: str, sums: bytes, length: int, threads: int) -> float:
    child = Child(length, register=False)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        pieces = [bulk._Piece(0, off, min(PIECE, length - off)) for off in range(0, length, PIECE)]
        t0 = time.monotonic()
        bulk.write_pieces([fd], [child.proc.pid], [split(child.addr, length, 1)], pieces, threads=threads,
                          progress=None, sums=[sums], sizes=[length])
        seconds = time.monotonic() - t0
        with open(f"/proc/{child.proc.pid}/mem", "rb", buffering=0) as mem, open(path, "rb") as f:
            for off in range(0, length, 64 << 20):
                mem.seek(child.addr + off)
                if mem.read(min(64 << 20, length - off)) != f.read(min(64 << 20, length - off)):
                    raise SystemExit(f"zero_chunks: the target differs from {path} at {off}")
        return seconds
    finally:
        os.close(fd)
        child.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="the bulk file's size, in MiB")
    ap.add_argument("--zero", type=float, default=0.6, help="the fraction of its chunks that are zero")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=bulk.fill_threads(), help="threads of the fill")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    length = args.mib << 20
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        stored, punched = os.path.join(d, "stored.bulk"), os.path.join(d, "punched.bulk")
        sums, zeros = _make(stored, length, args.zero)
        shutil.copyfile(stored, punched)
        t0 = time.monotonic()
        bulk.write_sums(stored, os.path.join(d, "again.sums"))  # what the checkpoint pays anyway
        hash_s = time.monotonic() - t0
        t0 = time.monotonic()
        gone = bulk._punch_zero(punched, sums, {})
        punch_s = time.monotonic() - t0
        assert gone == zeros, (gone, zeros)
        _fill(stored, sums, length, args.threads)  # untimed: imports, pools, the child's start
        runs: dict[str, list[float]] = {"stored": [], "punched": []}
        for _ in range(args.rounds):
            for name, path in (("stored", stored), ("punched", punched)):  # interleaved
                runs[name].append(round(_fill(path, sums, length, args.threads), 4))
        sizes = {"stored": _allocated(stored), "punched": _allocated(punched)}
    med = {k: statistics.median(v) for k, v in runs.items()}
    light = med["stored"] * (length - zeros) / length
    out = {
        "what": "bench/zero_chunks.py: a bulk file with its zero chunks stored, and punched out",
        "mib": args.mib, "zero_bytes": zeros, "threads": args.threads, "cpus": os.cpu_count(),
        "allocated": sizes, "hash_once_s": round(hash_s, 3), "punch_s": round(punch_s, 4),
        "fill_s": runs, "fill_median_s": med, "punched_vs_stored": round(med["punched"] / med["stored"], 3),
        "speed_of_light_s": round(light, 4),
    }
    print(f"{args.mib} MiB bulk file in /dev/shm, {zeros / length:.0%} zero chunks, {args.threads} fill threads, "
          f"{os.cpu_count()} CPUs; medians of {args.rounds}")
    print(f"allocated: stored {sizes['stored'] / GB:.3f} GB, punched {sizes['punched'] / GB:.3f} GB "
          f"(non-zero bytes {(length - zeros) / GB:.3f} GB)")
    print(f"checkpoint: the punch {punch_s:.3f} s, beside hashing the file once {hash_s:.3f} s")
    print(f"verified fill: stored {med['stored']:.3f} s, punched {med['punched']:.3f} s "
          f"= {out['punched_vs_stored']:.2f}x; speed of light (non-zero bytes at the stored rate) {light:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
