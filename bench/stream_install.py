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
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import asdict, dataclass

import blake3

from runtime.digests import PIECE
from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file
from runtime.pages import bulk, serve, source, uffd

GB = 1e9
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child: map the region (registered with a uffd it hands over, or plain), then on "read"
# touch one byte a page in address order and answer the seconds it took.
CHILD = textwrap.dedent("""
    import ctypes, mmap, os, socket, sys, time
    sys.path.insert(0, sys.argv[1])
    from runtime.pages import uffd
    sk = socket.socket(fileno=int(sys.argv[2]))
    length, register = int(sys.argv[3]), sys.argv[4] == "1"
    m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    fds = []
    if register:
        fd = uffd.open_uffd(uffd.NEEDED_FEATURES)
        uffd.register(fd, addr, length)
        fds = [fd]
    socket.send_fds(sk, [addr.to_bytes(8, "little")], fds)
    for fd in fds:
        os.close(fd)
    f = sk.makefile("rw")
    for line in f:
        t0 = time.monotonic()
        touched = memoryview(m)[0:length:uffd.PAGE].tobytes()  # one byte a page, in C
        f.write(f"{time.monotonic() - t0} {sum(touched)}\\n")
        f.flush()
""")


class Child:
    def __init__(self, length: int, register: bool) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, REPO, str(theirs.fileno()), str(length),
                                      "1" if register else "0"], pass_fds=(theirs.fileno(),))
        theirs.close()
        msg, fds, _, _ = socket.recv_fds(ours, 8, 1)
        self.addr, self.fd = int.from_bytes(msg, "little"), (fds[0] if fds else -1)
        self.sock, self.io = ours, ours.makefile("rw")

    def read(self) -> float:
        self.io.write("read\n")
        self.io.flush()
        return float(self.io.readline().split()[0])

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait(10)


@dataclass
class Result:
    shape: str
    seconds: float
    gbps: float
    ratio_to_baseline: float | None = None
    reader_s: float | None = None
    faults: int | None = None
    pieces_by_fault: int | None = None


def make_file(directory: str, length: int) -> tuple[str, bytes]:
    path = os.path.join(directory, "pages.bulk")
    sums = []
    with open(path, "wb") as f:
        for off in range(0, length, SUM_CHUNK):
            chunk = os.urandom(min(SUM_CHUNK, length - off))
            f.write(chunk)
            sums.append(blake3.blake3(chunk).digest())
    return path, b"".join(sums)


def split(addr: int, length: int, ranges: int) -> BulkFile:
    """The region as ``ranges`` bulk ranges (a restored process has many: heaps, arenas, tensors)."""
    step = max(uffd.PAGE, length // ranges // uffd.PAGE * uffd.PAGE)
    out = [BulkRange(addr + off, min(step, length - off), off) for off in range(0, length, step)]
    return BulkFile(1, bulk_file(1), 1, tuple(out))


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
