"""runtime.pages.serve.Server against a real process: a child maps a region, registers it with a
userfaultfd of its own (missing mode, the FORK/REMAP/REMOVE/UNMAP events CRIU asks for) and
hands the uffd over; the server installs the verified pieces while the child reads them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import blake3
import pytest

from runtime.fs import holes
from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file
from runtime.pages import serve, stream, uffd
from runtime.pages.source import PIECE

pytestmark = pytest.mark.skipif(uffd.probe() is not None, reason=f"no userfaultfd: {uffd.probe()}")

# The child: map LENGTH bytes (plus a hole page after them), register, send the uffd, then on
# each command read what it is asked and print a digest of it.
CHILD = textwrap.dedent("""
    import mmap, os, socket, sys, ctypes, blake3
    sys.path.insert(0, sys.argv[1])
    from runtime.pages import uffd
    sk = socket.socket(fileno=int(sys.argv[2]))
    length = int(sys.argv[3])
    m = mmap.mmap(-1, length + uffd.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    fd = uffd.open_uffd(uffd.NEEDED_FEATURES)
    uffd.register(fd, addr, length + uffd.PAGE)
    socket.send_fds(sk, [addr.to_bytes(8, "little")], [fd])
    os.close(fd)
    f = sk.makefile("rw")
    for line in f:
        cmd = line.split()
        if cmd[0] == "hash":
            out = blake3.blake3(m[:length]).hexdigest()
        elif cmd[0] == "byte":  # one byte: faults only its piece
            out = str(m[int(cmd[1])])
        elif cmd[0] == "hole":
            out = m[length:length + 16].hex()
        elif cmd[0] == "discard":  # MADV_DONTNEED the first page: it must read zero after
            m.madvise(mmap.MADV_DONTNEED, 0, uffd.PAGE)
            out = m[:8].hex()
        elif cmd[0] == "move":  # mremap the whole region elsewhere (REMAP), then hash it there
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
            libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            size = length + uffd.PAGE
            spot = libc.mmap(None, size, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS
            new = libc.mremap(addr, size, size, 3, spot)  # MREMAP_MAYMOVE|MREMAP_FIXED
            assert new == spot, ctypes.get_errno()
            out = blake3.blake3(ctypes.string_at(new, length)).hexdigest()
        elif cmd[0] == "pingpong":  # mremap the region away and back N times, then hash it
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
            libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
            size = length + uffd.PAGE
            spot = libc.mmap(None, size, 0, 0x22, -1, 0)
            for _ in range(int(cmd[1])):
                assert libc.mremap(addr, size, size, 3, spot) == spot, ctypes.get_errno()
                assert libc.mremap(spot, size, size, 3, addr) == addr, ctypes.get_errno()
            out = blake3.blake3(m[:length]).hexdigest()
        elif cmd[0] == "forks":  # N children at once: each exits at once, or ("keep") on "release"
            kids, keep = [], len(cmd) > 2
            gate_r, gate_w = os.pipe()
            for _ in range(int(cmd[1])):
                pid = os.fork()
                if pid == 0:
                    os.close(gate_w)
                    if keep:
                        os.read(gate_r, 1)
                    os._exit(0)
                kids.append(pid)
            os.close(gate_r)
            held = (gate_w, kids)
            if not keep:
                cmd = ["release"]
            out = "ok"
        if cmd[0] == "release":
            os.close(held[0])
            for k in held[1]:
                os.waitpid(k, 0)
            out = "ok"
        elif cmd[0] == "fork":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, blake3.blake3(m[:length]).hexdigest().encode())
                os._exit(0)
            os.close(w)
            out = os.read(r, 100).decode()
            os.waitpid(pid, 0)
        f.write(out + "\\n")
        f.flush()
""")


class Child:
    def __init__(self, length: int) -> None:
        ours, theirs = socket.socketpair()
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, repo, str(theirs.fileno()), str(length)],
                                     pass_fds=(theirs.fileno(),))
        theirs.close()
        msg, fds, _, _ = socket.recv_fds(ours, 8, 1)
        self.addr, self.fd = int.from_bytes(msg, "little"), fds[0]
        self.sock = ours
        self.io = ours.makefile("rw")

    def ask(self, cmd: str) -> str:
        self.io.write(cmd + "\n")
        self.io.flush()
        return self.io.readline().strip()

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


def _bulk(tmp_path, length: int, addr: int, pid: int = 7,
          zero: tuple[int, ...] = ()) -> tuple[BulkFile, int, bytes, bytes]:
    """The bulk file; the pieces ``zero`` are zeros punched out (as the checkpoint leaves them)."""
    buf = bytearray(os.urandom(length))
    for i in zero:
        buf[i * PIECE:(i + 1) * PIECE] = bytes(PIECE)
    data = bytes(buf)
    path = tmp_path / "pages.bulk"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    assert all(holes.punch(fd, [(i * PIECE, PIECE)]) for i in zero)
    sums = b"".join(blake3.blake3(data[off:off + SUM_CHUNK]).digest() for off in range(0, length, SUM_CHUNK))
    return BulkFile(pid, bulk_file(pid), 1, (BulkRange(addr, length, 0),)), fd, sums, data


@pytest.fixture
def served(tmp_path):
    made = []

    def make(length: int, threads: int, corrupt: bool = False, zero: tuple[int, ...] = ()):
        child = Child(length)
        f, fd, sums, data = _bulk(tmp_path, length, child.addr, zero=zero)
        if corrupt:
            sums = sums[:-32] + bytes(32)
        killed = []
        server = serve.Server("test", [f], [fd], [sums], lambda: killed.append(child.proc.kill()),
                               threads=threads)
        os.close(fd)
        server.add(f.pid, child.fd)
        made.append((child, server))
        return child, server, data, killed

    yield make
    for child, server in made:
        server.close()
        child.proc.kill()
        child.close()


def test_installs_every_piece_verified_and_the_process_reads_the_dump(served) -> None:
    length = PIECE + (8 << 20)  # two pieces
    child, server, data, _ = served(length, threads=2)
    server.start()
    stats = server.wait(60)
    assert stats.bytes_verified == length and stats.bytes_installed == length
    assert child.ask("hash") == blake3.blake3(data).hexdigest()
    assert child.ask("hole") == "00" * 16  # the hole after the range: zero pages


def test_a_piece_of_zero_chunks_that_are_holes_is_installed_as_zero_pages(served) -> None:
    length = 3 * PIECE
    child, server, data, _ = served(length, threads=2, zero=(1,))
    server.start()
    stats = server.wait(60)
    assert stats.bytes_verified == length and stats.bytes_installed == length
    assert stats.zero_bytes == PIECE  # neither read nor hashed: mapped as zero pages
    assert child.ask("hash") == blake3.blake3(data).hexdigest()


def test_faults_are_served_first_with_no_installer(served) -> None:
    """No install thread: the process touches one byte of the second piece; only that piece
    is served (by the fault), and the serve is not done."""
    length = PIECE + (8 << 20)
    child, server, data, _ = served(length, threads=0)
    server.start()
    assert child.ask(f"byte {PIECE + 5}") == str(data[PIECE + 5])
    assert server.counters.by_fault == 1 and server.counters.faults >= 1
    assert not server.finished.is_set()
    assert child.ask("hash") == blake3.blake3(data).hexdigest()  # faults bring in the rest
    assert server.finished.wait(10)


def test_a_piece_that_does_not_match_kills_the_process_and_is_never_installed(served) -> None:
    length = PIECE + (8 << 20)
    child, server, data, killed = served(length, threads=1, corrupt=True)
    server.start()
    with pytest.raises(serve.StreamError, match="does not match"):
        server.wait(60)
    assert killed
    assert child.proc.wait(10) == -9


def test_a_fork_mid_serve_gets_its_pages_from_the_fork_event(served) -> None:
    length = 8 << 20
    child, server, data, _ = served(length, threads=0)
    server.start()
    assert child.ask("fork") == blake3.blake3(data).hexdigest()  # the grandchild, through its own uffd
    assert server.counters.forks == 1
    assert child.ask("hash") == blake3.blake3(data).hexdigest()


def test_a_discarded_page_reads_zero_not_the_dump(served) -> None:
    length = 8 << 20
    child, server, data, _ = served(length, threads=0)
    server.start()
    assert child.ask("discard") == "00" * 8  # REMOVE event: that page is a hole from then on
    assert child.ask("byte 4096") == str(data[4096])


def test_an_install_never_overwrites_a_page_already_there(served) -> None:
    """UFFDIO_COPY onto a present page installs nothing (EEXIST) and leaves it as it is: what
    the kernel or the process wrote since CRIU stays."""
    import ctypes
    import mmap
    length = 8 << 20
    child, server, data, _ = served(length, threads=0)
    server.start()
    assert child.ask("byte 0") == str(data[0])  # served: present now
    other = mmap.mmap(-1, 2 * uffd.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    other[:] = bytes([(data[0] + 1) % 256]) * (2 * uffd.PAGE)
    src = ctypes.addressof(ctypes.c_char.from_buffer(other))
    # the first page is there, the next one of another piece's range is not: only that one goes in
    assert uffd.copy(child.fd, child.addr, src, uffd.PAGE) == 0
    assert child.ask("byte 0") == str(data[0])


def test_a_criu_without_the_hand_off_makes_the_stream_path_fall_back_with_the_reason(tmp_path) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'uffd-noncoop is not supported' >&2\nexit 1\n")
    fake.chmod(0o755)
    why = stream.unsupported(str(fake))
    assert why is not None and "non-cooperative userfaultfd" in why and "not supported" in why
    assert stream.unsupported() is None  # this node's CRIU and kernel have it


def test_a_region_moved_by_mremap_mid_serve_is_served_where_it_is_now(served) -> None:
    length = 8 << 20
    child, server, data, _ = served(length, threads=0)
    server.start()
    assert child.ask("move") == blake3.blake3(data).hexdigest()
    assert server.finished.wait(10)


def test_the_driver_host_copy_is_installed_before_the_rest(tmp_path) -> None:
    """The pieces of the ``first`` spans (the CUDA driver's host copy, which its restore reads
    while the serve runs) go first, in address order; then the rest."""
    length = 4 * PIECE
    path = tmp_path / "pages.bulk"
    path.write_bytes(bytes(length))
    sums = blake3.blake3(bytes(SUM_CHUNK)).digest() * (length // SUM_CHUNK)
    f = BulkFile(7, bulk_file(7), 1, (BulkRange(0x10000000, 2 * PIECE, 0), BulkRange(0x20000000, 2 * PIECE, 2 * PIECE)))
    fd = os.open(path, os.O_RDONLY)
    server = serve.Server("test", [f], [fd], [sums], lambda: None, threads=0,
                           first=[(7, 0x20000000 + PIECE, 0x20000000 + 2 * PIECE), (7, 0x20000000, 0x20000000 + 1)])
    os.close(fd)
    try:
        assert server.order == [2, 3, 0, 1] and server.first_pieces == 2
        other = serve.Server("test", [f], [os.open(path, os.O_RDONLY)], [sums], lambda: None, threads=0,
                              first=[(8, 0x20000000, 0x20000000 + 2 * PIECE)])  # another process's span
        assert other.order == [0, 1, 2, 3] and other.first_pieces == 0
        other.close()
    finally:
        server.close()


def test_a_chunk_that_holds_no_range_is_not_checked(tmp_path) -> None:
    """A node cache entry's fill file has holes where its ranges are mapped instead, whose chunk
    digests are the bulk file's: a chunk holding no range of the served file is neither read nor
    checked (nothing of it is installed), the rest is served whole."""
    child = Child(2 * SUM_CHUNK)
    data = os.urandom(3 * SUM_CHUNK)
    sums = b"".join(blake3.blake3(data[o:o + SUM_CHUNK]).digest() for o in range(0, len(data), SUM_CHUNK))
    holed = data[:SUM_CHUNK] + bytes(SUM_CHUNK) + data[2 * SUM_CHUNK:]  # chunk 1: mapped elsewhere
    path = tmp_path / "fill.bin"
    path.write_bytes(holed)
    fd = os.open(path, os.O_RDONLY)
    f = BulkFile(7, bulk_file(7), 1, (BulkRange(child.addr, SUM_CHUNK, 0),
                                      BulkRange(child.addr + SUM_CHUNK, SUM_CHUNK, 2 * SUM_CHUNK)))
    killed: list[object] = []
    server = serve.Server("test", [f], [fd], [sums], lambda: killed.append(child.proc.kill()), threads=1)
    os.close(fd)
    try:
        server.add(7, child.fd)
        server.start()
        stats = server.wait(60)
        assert not killed and stats.bytes_verified == 2 * SUM_CHUNK, stats
        assert child.ask("hash") == blake3.blake3(data[:SUM_CHUNK] + data[2 * SUM_CHUNK:]).hexdigest()
    finally:
        server.close()
        child.proc.kill()
        child.close()
