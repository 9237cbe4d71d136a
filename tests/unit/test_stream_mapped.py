"""runtime.pages.serve's mapped ranges against a real process: a child maps a node-local tmpfs
file privately (as CRIU does for a range of the node cache's entry being made), empty yet, and
hands over a userfaultfd opened as CRIU opens it (no registration: the server registers the
range in missing and minor mode). The server writes each verified piece into the file and lets
it go; the child reads the dumped bytes, 2 MiB pages on a ``huge=always`` tmpfs, and what it
writes stays its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap

import blake3
import pytest

from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file
from runtime.pages import serve, uffd
from runtime.pages.book import MappedBook
from runtime.pages.mapping import HUGE, Span
from runtime.pages.sink import LetGo, MapCached, Mapped
from runtime.pages.source import PIECE

pytestmark = pytest.mark.skipif(uffd.probe() is not None or os.geteuid() != 0,
                                reason=f"no userfaultfd for root: {uffd.probe()}")

# The child: map LENGTH bytes of PATH privately at an address whose offset in 2 MiB is the
# file offset (the cache's layout), send the address and a fresh uffd, then answer commands.
CHILD = textwrap.dedent("""
    import ctypes, mmap, os, socket, sys, blake3
    sys.path.insert(0, sys.argv[1])
    from runtime.pages import uffd
    sk = socket.socket(fileno=int(sys.argv[2]))
    path, length, at, fixed = sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    huge = 2 << 20
    room = libc.mmap(fixed or None, length + 2 * huge, 0, 0x22 | (0x100000 if fixed else 0), -1, 0)
    assert room != ctypes.c_void_p(-1).value, ctypes.get_errno()
    addr = (room + huge - 1) // huge * huge + at
    fd = os.open(path, os.O_RDONLY)
    got = libc.mmap(addr, length, 3, 0x12, fd, at)  # PROT_READ|WRITE, MAP_PRIVATE|MAP_FIXED
    assert got == addr, ctypes.get_errno()
    os.close(fd)
    view = (ctypes.c_char * length).from_address(addr)
    u = uffd.open_uffd(uffd.NEEDED_FEATURES)
    socket.send_fds(sk, [addr.to_bytes(8, "little")], [u])
    os.close(u)
    f = sk.makefile("rw")
    for line in f:
        cmd = line.split()
        if cmd[0] == "hash":
            out = blake3.blake3(memoryview(view).cast("B")).hexdigest()
        elif cmd[0] == "byte":
            out = str(view[int(cmd[1])][0])
        elif cmd[0] == "write":  # a write: the page becomes this process's own
            view[int(cmd[1])] = b"\\xaa"
            out = "ok"
        elif cmd[0] == "huge":  # KiB of the mapping mapped as 2 MiB pages
            smaps = open("/proc/self/smaps").read().split("\\n")
            i = next(i for i, l in enumerate(smaps) if l.startswith(f"{addr:x}-"))
            out = next(l.split()[1] for l in smaps[i + 1:] if l.startswith("ShmemPmdMapped:"))
        elif cmd[0] == "fork":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, blake3.blake3(memoryview(view).cast("B")).hexdigest().encode())
                os._exit(0)
            os.close(w)
            out = os.read(r, 100).decode()
            os.waitpid(pid, 0)
        f.write(out + "\\n")
        f.flush()
""")


class Child:
    def __init__(self, path: str, length: int, at: int, fixed: int = 0) -> None:
        """``fixed``: where to map (MAP_FIXED_NOREPLACE, 2 MiB-aligned): two processes restored
        from one artifact have its ranges at the same addresses."""
        ours, theirs = socket.socketpair()
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, repo, str(theirs.fileno()), path, str(length),
                                      str(at), str(fixed)], pass_fds=(theirs.fileno(),))
        theirs.close()
        msg, fds, _, _ = socket.recv_fds(ours, 8, 1)
        self.addr, self.fd = int.from_bytes(msg, "little"), fds[0]
        self.sock, self.io = ours, ours.makefile("rw")

    def ask(self, cmd: str) -> str:
        self.io.write(cmd + "\n")
        self.io.flush()
        return self.io.readline().strip()

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def huge_tmpfs():
    """A ``huge=always`` tmpfs, as the plugin mounts its cache (``--cache-tmpfs``)."""
    path = tempfile.mkdtemp(prefix="rekindle-huge-")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=256m,mode=0700", "test", path],
                          capture_output=True)
    if done.returncode:
        pytest.skip(f"no tmpfs mount: {done.stderr!r}")
    yield path
    subprocess.run(["umount", "-l", path], check=False)
    os.rmdir(path)


LET_GO = {"unregister": LetGo, "continue": MapCached}


@pytest.fixture(params=sorted(LET_GO))
def let_go(request):
    """Each way a serve lets a mapped piece go ($REKINDLE_LET_GO)."""
    return request.param


@pytest.fixture
def mapped(tmp_path, huge_tmpfs, let_go):
    made = []

    def make(length: int, threads: int, at: int = 12 << 10, lead: int = 20 << 10, corrupt: bool = False):
        """A bulk file holding other bytes (``lead``), then the range's: its chunks do not start
        where the range's 2 MiB pieces do. The map file (``at`` = vaddr % 2 MiB) is empty."""
        data = os.urandom(lead + length)
        src = tmp_path / "pages.bulk"
        src.write_bytes(data)
        sums = b"".join(blake3.blake3(data[o:o + SUM_CHUNK]).digest() for o in range(0, len(data), SUM_CHUNK))
        if corrupt:
            sums = sums[:-32] + bytes(32)
        out_path = os.path.join(huge_tmpfs, f"map-{len(made)}.bin")
        out = os.open(out_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(out, at + length)
        child = Child(out_path, length, at)
        assert child.addr % HUGE == at
        f = BulkFile(7, bulk_file(7), 1, (BulkRange(child.addr, length, lead),))
        fd = os.open(src, os.O_RDONLY)
        killed: list[object] = []
        server = serve.Server("test", [f], [fd], [sums], lambda: killed.append(child.proc.kill()), threads=threads,
                               mapped=[Mapped(Span(7, child.addr, length, lead), out)], let_go=LET_GO[let_go]())
        os.close(fd)
        server.add(7, child.fd)
        made.append((child, server, out, out_path))
        return child, server, data[lead:], out, killed

    yield make
    for child, server, out, out_path in made:
        server.close()
        child.close()
        os.close(out)
        os.unlink(out_path)


def test_a_mapped_range_is_written_into_its_file_and_let_go(mapped, let_go) -> None:
    length = 3 * PIECE + (64 << 10)
    child, server, data, out, _ = mapped(length, threads=2)
    server.register_mapped()
    server.start()
    stats = server.wait(60)
    assert stats.bytes_verified == length and stats.mapped_bytes == length and stats.bytes_installed == 0
    assert child.ask("hash") == blake3.blake3(data).hexdigest()
    assert os.pread(out, length, 12 << 10) == data  # the entry's bytes, nothing else
    # Unregistered, mapped from the file 2 MiB at a time where a whole 2 MiB of it lies in the
    # range; mapped by the serve (continue), 4 KiB at a time.
    assert int(child.ask("huge")) >= (2 * (PIECE >> 10) if let_go == "unregister" else 0)
    # A write stays the process's own: the file (the node cache's entry) never changes.
    assert child.ask(f"write {PIECE + 3}") == "ok" and child.ask(f"byte {PIECE + 3}") == "170"
    assert os.pread(out, length, 12 << 10) == data


def test_a_touch_before_its_piece_is_written_waits_for_it(mapped) -> None:
    """No install thread: a touch in the third piece brings that piece alone into the file."""
    length = 3 * PIECE
    child, server, data, out, _ = mapped(length, threads=0)
    server.register_mapped()
    server.start()
    at = 2 * PIECE + 77  # of the range: in its file's piece 2 (the range starts 12 KiB into piece 0)
    assert child.ask(f"byte {at}") == str(data[at])
    assert server.counters.by_fault == 1 and not server.finished.is_set()
    assert os.pread(out, 4096, 12 << 10) == bytes(4096)  # the first piece: not written yet
    assert child.ask("hash") == blake3.blake3(data).hexdigest()
    assert server.finished.wait(10)


def test_a_fork_before_the_serve_gets_its_mapped_pages(mapped) -> None:
    length = 2 * PIECE
    child, server, data, _out, _ = mapped(length, threads=0)
    server.register_mapped()
    server.start()
    assert child.ask("fork") == blake3.blake3(data).hexdigest()  # the grandchild, through its own uffd
    assert server.counters.forks == 1
    assert child.ask("hash") == blake3.blake3(data).hexdigest()


def test_a_piece_off_its_digest_is_never_let_go_and_the_process_is_killed(mapped) -> None:
    """The bytes land in the entry's file before they are hashed there; a piece whose chunk
    does not match is never let go (the process never maps it: it is killed), and the serve
    says the file was not written whole (the entry is never finished from it)."""
    length = 2 * PIECE
    child, server, _data, _out, killed = mapped(length, threads=1, corrupt=True)
    server.register_mapped()
    server.start()
    with pytest.raises(serve.StreamError, match="does not match"):
        server.wait(60)
    assert killed and child.proc.wait(10) == -9
    last = max((p for p in server.pieces if server._is_mapped(p)), key=lambda p: p.offset)
    name = server.entry.mapped[0][0].span.name
    assert not server.book.written(name, last.offset // PIECE)  # the bulk file's last chunk is bad
    assert not server.book.whole()
    assert server.counters.mapped < length


def test_a_mapped_range_that_is_no_bulk_range_is_refused(tmp_path) -> None:
    path = tmp_path / "pages.bulk"
    path.write_bytes(bytes(PIECE))
    f = BulkFile(7, bulk_file(7), 1, (BulkRange(0x10000000, PIECE, 0),))
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(serve.StreamIntegrityError, match="no bulk range"):
            serve.Server("test", [f], [fd], [blake3.blake3(bytes(SUM_CHUNK)).digest() * 2], lambda: None,
                          threads=0, mapped=[Mapped(Span(7, 0x10000000, PIECE // 2, 0), fd)])
    finally:
        os.close(fd)


def test_two_restores_of_one_version_share_the_file_and_write_each_piece_once(tmp_path, huge_tmpfs, let_go) -> None:
    """Two processes map one entry's file at the same address (as two pods restored from one
    artifact do); their serves share one book: each piece is written once, by whichever serve
    comes first, and let go in both. One serve has no install thread: its process's touches are
    served by the other serve's writes or by its own fault thread."""
    length, at, lead = 3 * PIECE, 12 << 10, 20 << 10
    data = os.urandom(lead + length)
    src = tmp_path / "pages.bulk"
    src.write_bytes(data)
    sums = b"".join(blake3.blake3(data[o:o + SUM_CHUNK]).digest() for o in range(0, len(data), SUM_CHUNK))
    out_path = os.path.join(huge_tmpfs, "map-shared.bin")
    out = os.open(out_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(out, at + length)
    fixed = 0x7E0000000000
    children = [Child(out_path, length, at, fixed), Child(out_path, length, at, fixed)]
    assert children[0].addr == children[1].addr
    span = Span(7, children[0].addr, length, lead)
    f = BulkFile(7, bulk_file(7), 1, (BulkRange(span.vaddr, length, lead),))
    book = MappedBook([span])
    servers = []
    try:
        for child, threads in zip(children, (0, 2)):
            fd = os.open(src, os.O_RDONLY)
            server = serve.Server("test", [f], [fd], [sums], child.proc.kill, threads=threads,
                                   mapped=[Mapped(span, out)], book=book, let_go=LET_GO[let_go]())
            os.close(fd)
            server.add(7, child.fd)
            server.register_mapped()
            servers.append(server)
        for server in servers:
            server.start()
        want = blake3.blake3(data[lead:]).hexdigest()
        assert children[0].ask("hash") == want and children[1].ask("hash") == want
        stats = [server.wait(60) for server in servers]
        assert all(s.mapped_whole and s.mapped_bytes == length for s in stats)
        assert sum(s.bytes_verified for s in stats) == length  # every piece written (and hashed) once
        assert book.whole()
    finally:
        for server in servers:
            server.close()
        for child in children:
            child.close()
        os.close(out)
        os.unlink(out_path)
