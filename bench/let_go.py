"""Benchmark: letting a node cache file's pieces go in several processes that map it at once.

Usage (root): ``python -m bench.let_go [--dir /dev/shm] [--mib 2048] [--procs 1,4] [--threads 12]
[--rounds 2] [--json OUT]``

A restore that makes a version's node cache entry registers each mapped range (a private
mapping of the entry's tmpfs file) on the tree's uffd and lets each 2 MiB piece go once it is in
the file. With four pods restored at once and no entry yet, the H100 measured each serve's
let-go at 16-36 thread-seconds against 2.7 alone, for the same 7,350 pieces. Here, P child
processes map one tmpfs file of ``--mib`` bytes privately, registered in missing and minor
mode, and read it while the pieces are let go (``--reader``: ``populate``, ``MADV_POPULATE_READ``
over the range as a driver pins host memory, then a byte a page; or ``touch``, a byte a page in
address order), each way:

- ``unregister`` (today's ``uffd.release``): ``UFFDIO_UNREGISTER`` and ``UFFDIO_WAKE`` per piece;
  each splits the registered VMA, under the file's mapping lock, which every process mapping the
  file shares;
- ``continue``: ``UFFDIO_CONTINUE`` per piece (``uffd.map_cached``, the serve's ``MapCached``): the file's pages mapped
  read-only, 4 KiB at a time, the VMA left whole;

and by who lets go:

- ``each``: every process has ``--threads`` threads of its own going over its pieces (today's:
  one serve per restore);
- ``one``: ``--threads`` threads in all, each piece let go in every process in turn (one writer
  for the entry).

Prints, per case, the seconds until every piece was let go everywhere and until the slowest
process read its range, the summed thread-seconds in the let-go calls, and each case's ratio to
``unregister``/``each`` at the same P; every process's bytes are compared with the file.
"""

from __future__ import annotations

import argparse
import itertools
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.pages import uffd

PIECE = 2 << 20
REPO = str(Path(__file__).resolve().parents[1])
MODES = ("unregister", "continue")
SHAPES = ("each", "one")

# The child: map the file privately at a 2 MiB boundary, register it in missing and minor mode on
# a uffd it hands over, then on "read" touch one byte a page and answer the seconds and a sum.
CHILD = textwrap.dedent("""
    import ctypes, mmap, os, socket, sys, time, zlib
    sys.path.insert(0, sys.argv[1])
    from runtime.pages import uffd
    sk = socket.socket(fileno=int(sys.argv[2]))
    fd, length, how = os.open(sys.argv[3], os.O_RDONLY), int(sys.argv[4]), sys.argv[5]
    m = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    u = uffd.open_uffd(uffd.NEEDED_FEATURES)
    uffd.register(u, addr, length, uffd.REGISTER_MODE_MISSING | uffd.REGISTER_MODE_MINOR)
    socket.send_fds(sk, [addr.to_bytes(8, "little")], [u])
    os.close(u)
    f = sk.makefile("rw")
    for line in f:
        t0 = time.monotonic()
        if how == "populate":  # as a driver pins host memory: the kernel faults the range in, in bulk
            m.madvise(22)  # MADV_POPULATE_READ
        touched = memoryview(m)[0:length:uffd.PAGE].tobytes()
        took = time.monotonic() - t0
        f.write(f"{took} {zlib.crc32(touched)}\\n")
        f.flush()
""")


class Mapper:
    """A child mapping the file privately, registered; ``fd`` its uffd, ``addr`` the mapping."""

    def __init__(self, path: str, length: int, how: str) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, REPO, str(theirs.fileno()), path, str(length), how],
                                     pass_fds=(theirs.fileno(),))
        theirs.close()
        msg, fds, _, _ = socket.recv_fds(ours, 8, 1)
        self.addr, self.fd = int.from_bytes(msg, "little"), fds[0]
        self.sock, self.io = ours, ours.makefile("rw")
        self.answer: tuple[float, int] | None = None

    def read(self) -> None:
        self.io.write("read\n")
        self.io.flush()
        took, crc = self.io.readline().split()
        self.answer = float(took), int(crc)

    def close(self) -> None:
        os.close(self.fd)
        self.sock.close()
        self.proc.kill()
        self.proc.wait(10)


def make_file(directory: str, length: int) -> tuple[str, int]:
    """A file of ``length`` bytes, every page different, in the page cache of ``directory``;
    its path and the crc32 of one byte a page (what each child must read)."""
    import zlib  # noqa: PLC0415

    path = os.path.join(directory, f"let-go-{os.getpid()}.bin")
    block = bytearray(os.urandom(PIECE))
    with open(path, "wb") as f:
        for n in range(length // PIECE):
            block[:8] = n.to_bytes(8, "little")
            f.write(block)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), length, prot=mmap.PROT_READ) as m:
        crc = zlib.crc32(memoryview(m)[0:length:uffd.PAGE].tobytes())
    return path, crc


def let_go_call(mode: str) -> Callable[[int, int, int], None]:
    if mode == "unregister":
        return uffd.release
    return lambda fd, start, length: None if uffd.map_cached(fd, start, length) else None


def run_case(path: str, length: int, crc: int, procs: int, threads: int, mode: str, shape: str,
             how: str) -> dict[str, Any]:
    mappers = [Mapper(path, length, how) for _ in range(procs)]
    call = let_go_call(mode)
    pieces = length // PIECE
    spent: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def work(jobs: list[tuple[Mapper, int]]) -> None:
        t_in = 0.0
        try:
            for m, k in jobs:
                t = time.monotonic()
                call(m.fd, m.addr + k * PIECE, PIECE)
                t_in += time.monotonic() - t
        except Exception as exc:  # noqa: BLE001 - reported with the case
            errors.append(f"{type(exc).__name__}: {exc}")
        with lock:
            spent.append(t_in)

    if shape == "each":  # each process's pieces over its own threads, interleaved
        groups = [[(m, k) for k in range(i, pieces, threads)] for m in mappers for i in range(threads)]
    else:  # every piece in every process, by one set of threads
        groups = [[(m, k) for k in range(i, pieces, threads) for m in mappers] for i in range(threads)]
    readers = [threading.Thread(target=m.read) for m in mappers]
    workers = [threading.Thread(target=work, args=(g,)) for g in groups]
    t0 = time.monotonic()
    for t in itertools.chain(readers, workers):
        t.start()
    for t in workers:
        t.join()
    let_go_s = time.monotonic() - t0
    for t in readers:
        t.join()
    read_s = time.monotonic() - t0
    answers = [m.answer for m in mappers]
    for m in mappers:
        m.close()
    return {"mode": mode, "shape": shape, "procs": procs, "threads": len(workers), "pieces": pieces * procs,
            "let_go_s": round(let_go_s, 3), "read_s": round(read_s, 3),
            "call_thread_s": round(sum(spent), 3),
            "call_ms_per_piece": round(sum(spent) / (pieces * procs) * 1000, 3),
            "child_read_s": [round(a[0], 3) for a in answers if a],
            "identical": all(a is not None and a[1] == crc for a in answers), "errors": errors[:3]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/dev/shm",
                    help="a tmpfs; the node cache's is mounted huge=always, where a let-go piece maps as one 2 MiB page")
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--procs", default="1,4")
    ap.add_argument("--threads", type=int, default=12, help="let-go threads per process (each) or in all (one)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reader", choices=("populate", "touch"), default="populate",
                    help="how each child reads its range: MADV_POPULATE_READ first (as a driver pins it), or a touch a page")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    length = args.mib << 20
    why = uffd.probe_minor(args.dir)
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 1
    d = tempfile.mkdtemp(dir=args.dir)
    path, crc = make_file(d, length)
    out: list[dict[str, Any]] = []
    try:
        for r, procs in itertools.product(range(args.rounds), [int(p) for p in args.procs.split(",")]):
            for mode, shape in itertools.product(MODES, SHAPES):
                if shape == "one" and procs == 1:
                    continue
                rec = run_case(path, length, crc, procs, args.threads, mode, shape, args.reader)
                rec["round"] = r
                out.append(rec)
                print(f"P={procs} {mode:10s} {shape:4s} round {r}: let go {rec['let_go_s']:.3f} s, read "
                      f"{rec['read_s']:.3f} s, {rec['call_ms_per_piece']:.3f} ms a piece in the call "
                      f"({rec['threads']} threads){'' if rec['identical'] else ' NOT IDENTICAL'}"
                      f"{' ' + str(rec['errors']) if rec['errors'] else ''}", flush=True)
    finally:
        os.unlink(path)
        os.rmdir(d)
    print("best of rounds, against unregister/each at the same P:")
    for procs in sorted({o["procs"] for o in out}):
        def best(mode: str, shape: str, key: str, procs: int = procs) -> float | None:
            v = [o[key] for o in out if (o["procs"], o["mode"], o["shape"]) == (procs, mode, shape)]
            return min(v) if v else None
        base = best("unregister", "each", "read_s")
        for mode, shape in itertools.product(MODES, SHAPES):
            b = best(mode, shape, "read_s")
            if b is None or base is None:
                continue
            print(f"  P={procs} {mode:10s} {shape:4s} read {b:.3f} s ({b / base:.2f}x), let go "
                  f"{best(mode, shape, 'let_go_s'):.3f} s, {best(mode, shape, 'call_ms_per_piece'):.3f} ms a piece")
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "threads": args.threads, "dir": args.dir, "reader": args.reader,
                                         "cpus": os.cpu_count(), "runs": out}, indent=1) + "\n")
    return 0 if all(o["identical"] and not o["errors"] for o in out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
