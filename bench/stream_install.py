"""Benchmark: the streamed restore's install rate against the bulk fill, same bytes, same run.

Usage: ``python -m bench.stream_install [--mib 2048] [--threads 2] [--json OUT]``

A child process maps a fresh private anonymous region (the restored process's bulk range), and
reads it in address order one byte a page (the way the driver's CUDA restore reads its host
copy); the bytes come from a bulk file with its 1 MiB chunk digests (page cache), as a restore's do:

- ``fill-then-read`` (the bulk path's order, the baseline): ``runtime.pages.bulk``'s fill pattern
  (read, hash, ``process_vm_writev``) on N threads, then the reader;
- ``uffdio-copy`` (the speed of light of the streamed install): the region registered with
  userfaultfd, one private buffer already holding the bytes, ``UFFDIO_COPY`` of 2 MiB pieces
  on N threads; nothing read, nothing hashed, no reader;
- ``stream``: ``runtime.pages.serve.Server`` (read, hash, ``UFFDIO_COPY``, faults served first) on N
  threads while the reader runs; the figure is until the reader is done and the serve is over.

Prints seconds, GB/s and the ratio to the baseline, and the server's fault counts.
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
from runtime.pages import bulk, serve, source, uffd


@dataclass
class Result:
    shape: str
    seconds: float
    gbps: float
    ratio_to_baseline: float | None = None
    reader_s: float | None = None
    faults: int | None = None
    pieces_by_fault: int | None = None




def fill_then_read(path: str, sums: bytes, length: int, threads: int, ranges: int) -> Result:
    child = Child(length, register=False)
    fd = os.open(path, os.O_RDONLY)
    try:
        f = split(child.addr, length, ranges)
        pieces = [bulk._Piece(0, off, min(PIECE, length - off)) for off in range(0, length, PIECE)]
        t0 = time.monotonic()
        bulk.write_pieces([fd], [child.proc.pid], [f], pieces, threads=threads, progress=None, sums=[sums],
                          sizes=[length])
        reader = child.read()
        seconds = time.monotonic() - t0
    finally:
        os.close(fd)
        child.close()
    return Result("fill-then-read", seconds, length / GB / seconds, reader_s=reader)


def uffdio_copy(path: str, length: int, threads: int) -> Result:
    child = Child(length, register=True)
    try:
        offsets = iter(range(0, length, source.PIECE))
        lock = threading.Lock()

        def work() -> None:
            # one piece-sized buffer per thread, hot in its core's cache, as the server's are
            src = mmap.mmap(-1, source.PIECE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with open(path, "rb") as f:
                f.readinto(src)
            base = ctypes.addressof(ctypes.c_char.from_buffer(src))
            while True:
                with lock:
                    off = next(offsets, None)
                if off is None:
                    return
                uffd.copy(child.fd, child.addr + off, base, min(source.PIECE, length - off))

        t0 = time.monotonic()
        ths = [threading.Thread(target=work) for _ in range(threads)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        seconds = time.monotonic() - t0
    finally:
        os.close(child.fd)
        child.close()
    return Result("uffdio-copy", seconds, length / GB / seconds)


def streamed(path: str, sums: bytes, length: int, threads: int, ranges: int) -> Result:
    child = Child(length, register=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        f = split(child.addr, length, ranges)
        server = serve.Server("bench", [f], [fd], [sums], child.proc.kill, threads=threads)
        server.add(1, child.fd)
        t0 = time.monotonic()
        server.start()
        reader = child.read()
        stats = server.wait(600)
        seconds = time.monotonic() - t0
    finally:
        os.close(fd)
        child.close()
    return Result("stream", seconds, length / GB / seconds, reader_s=reader, faults=stats.faults,
                  pieces_by_fault=stats.pieces_by_fault)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--ranges", type=int, default=1, help="bulk ranges the region is cut into")
    ap.add_argument("--dir", default=None, help="where the bulk file goes (default: a temporary dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    length = args.mib << 20
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path, sums = make_file(d, length)
        results = [fill_then_read(path, sums, length, args.threads, args.ranges),
                   uffdio_copy(path, length, args.threads),
                   streamed(path, sums, length, args.threads, args.ranges)]
    base = results[0].seconds
    for r in results:
        r.ratio_to_baseline = round(base / r.seconds, 2)
        extra = f"  reader {r.reader_s:.3f}s" if r.reader_s is not None else ""
        if r.faults is not None:
            extra += f"  faults {r.faults}, pieces by fault {r.pieces_by_fault}"
        print(f"{r.shape:16s} {r.seconds:7.3f}s {r.gbps:6.2f} GB/s  x{r.ratio_to_baseline} of fill-then-read{extra}")
    print(f"speed of light of the streamed install (UFFDIO_COPY, nothing read or hashed): {results[1].gbps:.2f} GB/s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"mib": args.mib, "threads": args.threads, "ranges": args.ranges, "cpus": os.cpu_count(),
                       "runs": [asdict(r) for r in results]}, out, indent=1)


if __name__ == "__main__":
    main()
