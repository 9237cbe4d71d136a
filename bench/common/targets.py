"""The target of a fill or a serve outside containerd: a child process holding a fresh region,
the bulk file its bytes come from (with its chunk digests), and the region cut into bulk ranges."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import blake3

from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file
from runtime.pages import uffd

REPO = str(Path(__file__).resolve().parents[2])

# The child: map the region (registered with a uffd it hands over, or plain; or shared, as CRIU
# restores a shared anonymous segment: a memfd), then on "read" touch one byte a page in address
# order and answer the seconds it took.
CHILD = textwrap.dedent("""
    import ctypes, mmap, os, socket, sys, time
    sys.path.insert(0, sys.argv[1])
    from runtime.pages import uffd
    sk = socket.socket(fileno=int(sys.argv[2]))
    length, register, shared = int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
    if shared:
        seg = os.memfd_create("")
        os.ftruncate(seg, length)
        m = mmap.mmap(seg, length, flags=mmap.MAP_SHARED)
    else:
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
    """A child process holding a fresh private anonymous region of ``length`` bytes (registered
    with a userfaultfd it hands over when ``register``; a memfd's shared mapping when ``shared``):
    the target a fill or a serve writes into."""

    def __init__(self, length: int, register: bool, shared: bool = False) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, REPO, str(theirs.fileno()), str(length),
                                      "1" if register else "0", "1" if shared else "0"], pass_fds=(theirs.fileno(),))
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


def make_file(directory: str, length: int) -> tuple[str, bytes]:
    """A bulk file of ``length`` random bytes in ``directory`` (page cache), and its chunk digests."""
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
