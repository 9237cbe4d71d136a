"""The streamed restore: bulk pages served through userfaultfd while the restored tree runs.

The bulk path (``runtime.pages.bulk.fill``) writes every bulk page before the tree may run. Here the
tree is resumed right after CRIU, and the bulk ranges arrive while it runs:

- :func:`prepare_images` (restore side, on the private copy of CRIU's images): each bulk range
  goes back into its process's pagemap as an entry flagged ``PE_LAZY`` and not ``PE_PRESENT``
  (CRIU 4.2.1's ``--lazy-pages`` restore skips lazy entries without moving its pages-file
  offset, so the pages file CRIU keeps stays as the split wrote it), and every other entry loses
  ``PE_LAZY`` (a dump tags all private anonymous pages lazy: CRIU then restores them itself).
  Refused (the caller falls back to the bulk path) when a bulk range lies in a VMA CRIU would
  not register with userfaultfd (``vma_entry_can_be_lazy``: locked, hugetlb, not anonymous).
- :class:`Listener`: ``criu restore --lazy-pages`` connects to ``lazy-pages.socket`` in its
  work dir and sends, per task, an int32 pid (in the restored pid namespace; negative for a
  zombie, which has no uffd) and that task's uffd by SCM_RIGHTS, then ``RSTF`` (0x52535446);
  it expects no reply. The socket listens before CRIU starts (CRIU fails without it).
- :class:`Server`: N threads install the bulk files' 2 MiB pieces in address order, and a
  fault-serving thread installs first the piece holding an address the tree touched; an
  event-reading thread keeps the address-space events (FORK, REMAP, REMOVE, UNMAP) apace, so
  an install that the kernel refuses while the space changes (EAGAIN) goes on as soon as the
  event is read. Every piece is read into private memory, each chunk hashed and compared with its
  digest before any of its bytes is installed; installs use ``UFFDIO_COPY``,
  which leaves a page already present alone (EEXIST): nothing the kernel or the process wrote
  after CRIU is overwritten. A fault outside every bulk range (a hole, or a range the process
  discarded since) gets zero pages. A mismatch kills the tree before the next piece.
- Fail closed: when the last holder of a uffd closes it, the kernel unregisters the range and
  the process reads zero pages from then on. A holder process (``runtime.pages.holder``, its
  own session) keeps a copy of every uffd until the server says it is done; if the server goes
  away first, the tasks block on their faults, and the holder kills them and tells the init to
  start cold.

Mapped ranges (the first restore of a version on a node whose cache is a tmpfs:
``runtime.pages.nodecache.Building``): CRIU maps such a range ``MAP_PRIVATE`` from a file of the
cache entry being made (``runtime.pages.mapping``), empty yet, and the server registers it in
missing and minor mode on the task's uffd before the tree runs (:meth:`Server.register_mapped`), so every
touch of it is the server's, whether its page is in the file yet or not. Its pieces are 2 MiB
of the file, which are 2 MiB of address space (the file holds the range at ``vaddr % 2 MiB``):
each is read from the bulk file whole chunk by chunk, every chunk checked against its digest,
written into the file, and then let go (``uffd.release``: unregistered, its waiters woken).
The process's next touch maps the file's pages as any private file mapping does, 2 MiB at a time
on a ``huge=always`` tmpfs, with nothing copied into the process: the CUDA driver's copy reads
huge pages, and the file becomes the node cache's entry once the restore is done. Restores of
one version at once share the files and one :class:`MappedBook`: a piece is written once, by
whichever serve needs it first, and each serve lets it go in its own tree.

Digests: each 1 MiB chunk of a bulk file has its BLAKE3 digest in ``bulk/pages-<pid>.sums``
(written at checkpoint, signed through the manifest: ``runtime.pages.bulk.read_sums``), as the bulk
fill uses them; the server installs 2 MiB pieces, each chunk checked before any byte of it goes in.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import functools
import logging
import mmap
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runtime.containers import ContainerInfo
from runtime.control import ControlDir
from runtime.criu import CRIU
from runtime.criu import image_files as img
from runtime.criu.proto import pagemap_pb2
from runtime.digests import WORKERS, new_hash
from runtime.errors import Reason, RekindleError
from runtime.layout import DIGEST_BYTES, SUM_CHUNK, BulkFile
from runtime.namespaces import enter_cgroups_argv
from runtime.pagecache import is_cached
from runtime.pages import holder as holder_mod
from runtime.pages import uffd
from runtime.pages.filemap import FileMap
from runtime.pages.mapping import Span

log = logging.getLogger(__name__)

SOCKET_NAME = "lazy-pages.socket"
RESTORE_FINISHED = 0x52535446  # "RSTF"
PIECE = 2 << 20  # what one install takes, and what a fault brings in at once: whole chunks
MAPPED_SCRATCH = 2 * SUM_CHUNK  # the neighbours' parts of a mapped piece's first and last chunks
FAULT_THREADS = 2
HOLDER_SEND_TIMEOUT = 10.0  # seconds: the holder always reads; one that does not fails the serve
MOVE_ROUNDS = 8  # copies of one piece into one space moved meanwhile, before it waits its turn again
# flags of a VMA CRIU registers with userfaultfd (criu/include/vma.h vma_entry_can_be_lazy)
MAP_PRIVATE, MAP_ANONYMOUS, MAP_LOCKED, MAP_HUGETLB = 0x02, 0x20, 0x2000, 0x40000
_NOT_LAZY_STATUS = img.VMA_AREA_VDSO | img.VMA_AREA_VVAR | img.VMA_AREA_VSYSCALL


class StreamError(RekindleError):
    """The streamed restore failed: the tree was killed (or never ran)."""

    reason_class = Reason.CRIU  # most: CRIU's lazy-pages hand-off


class StreamIntegrityError(StreamError):
    """A bulk file off its ranges or chunk digests while served."""

    reason_class = Reason.INTEGRITY


def _can_be_lazy(vma: object) -> bool:
    flags, status = getattr(vma, "flags"), getattr(vma, "status")
    return (bool(flags & MAP_ANONYMOUS) and bool(flags & MAP_PRIVATE) and not flags & (MAP_LOCKED | MAP_HUGETLB)
            and not status & _NOT_LAZY_STATUS)


def prepare_images(images: str, files: Sequence[BulkFile]) -> None:
    """Rewrite the pagemaps of CRIU's images in ``images`` for ``criu restore --lazy-pages``:
    the bulk ranges lazy (no data), everything else eager. StreamError when a bulk range lies
    where CRIU registers no userfaultfd (then nothing was written)."""
    rewritten = []
    by_pid = {f.pid: f for f in files}
    # Every process CRIU restores, not only those with bulk files: a dump tags each private
    # anonymous page lazy, and a lazy page nobody serves would read zero (a tree's pages kept
    # with CRIU: a forked child's inherited VMAs, short runs).
    for proc in img.read_pstree(images):
        if proc.pid in by_pid or not os.path.exists(os.path.join(images, f"pagemap-{proc.pid}.img")):
            continue
        pagemap = img.read_pagemap(images, proc.pid)
        entries = list(pagemap.entries)
        if any(e.HasField("flags") and e.flags & img.PE_LAZY for e in entries):
            for e in entries:
                if e.HasField("flags"):
                    e.flags &= ~img.PE_LAZY
            rewritten.append((pagemap, entries))
    for f in files:
        pagemap = img.read_pagemap(images, f.pid)
        vmas = sorted(img.read_mm(images, f.pid).entry.vmas, key=lambda v: v.start)
        starts = [v.start for v in vmas]
        entries = []
        for e in pagemap.entries:
            if e.HasField("flags"):
                e.flags &= ~img.PE_LAZY
            entries.append(e)
        for r in f.ranges:
            i = bisect.bisect_right(starts, r.vaddr) - 1
            if i < 0 or r.vaddr + r.length > vmas[i].end or not _can_be_lazy(vmas[i]):
                raise StreamError(f"pid {f.pid}: bulk range {r.vaddr:#x}+{r.length} is not in a VMA "
                                  "CRIU registers with userfaultfd")
            e = pagemap_pb2.pagemap_entry()
            # compat_nr_pages is required (proto2); CRIU reads nr_pages when it is there
            e.vaddr, e.nr_pages, e.flags = r.vaddr, r.length // img.PAGE, img.PE_LAZY
            e.compat_nr_pages = min(e.nr_pages, 0xFFFFFFFF)
            entries.append(e)
        entries.sort(key=lambda e: e.vaddr)
        rewritten.append((pagemap, entries))
    for pagemap, entries in rewritten:
        img.write_pagemap(pagemap, entries)


class Listener:
    """The lazy-pages socket in ``work_dir``, listening before CRIU starts; :meth:`receive`
    takes CRIU's hand-off (pid in the restored namespace -> uffd)."""

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, SOCKET_NAME)
        self._dir = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # through the directory fd: the work dir's path may exceed sun_path's 108 bytes
        short = f"/proc/self/fd/{self._dir}/{SOCKET_NAME}"
        try:
            os.unlink(SOCKET_NAME, dir_fd=self._dir)  # a stale socket would take CRIU elsewhere
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.conn: socket.socket | None = None
        try:
            self.sock.bind(short)
            os.chmod(SOCKET_NAME, 0o600, dir_fd=self._dir)
            self.sock.listen(1)
        except OSError:
            self.close()
            raise

    def receive(self, take: Callable[[int, int], None], timeout: float = 1800.0) -> None:
        """Hand each (pid, uffd) CRIU sends to ``take`` (which owns the fd from then on);
        return at RSTF. StreamError otherwise."""
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except OSError as exc:
            raise StreamError(f"CRIU did not connect to {SOCKET_NAME}: {exc}") from exc
        self.conn = conn
        try:
            conn.settimeout(timeout)
            while True:
                raw = _recv_exact(conn, 4)
                value = int.from_bytes(raw, sys.byteorder, signed=True)
                if value == RESTORE_FINISHED:
                    return
                if value <= 0:  # a zombie: no memory, no uffd
                    continue
                _msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 1)
                if len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise StreamError(f"CRIU sent pid {value} without its uffd")
                take(value, fds[0])
        except (OSError, ValueError) as exc:
            raise StreamError(f"lazy-pages hand-off from CRIU failed: {exc}") from exc
        finally:
            conn.close()

    def interrupt(self) -> None:
        """Make a :meth:`receive` in progress return (with StreamError)."""
        for sk in (self.sock, self.conn):
            if sk is not None:
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(SOCKET_NAME, dir_fd=self._dir)
        except FileNotFoundError:
            pass
        os.close(self._dir)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise StreamError(f"CRIU closed the lazy-pages socket before RSTF ({len(buf)} of {n} bytes)")
        buf += got
    return buf


# --- the holder ----------------------------------------------------------------------------------

class Holder:
    """The second holder of every uffd (``runtime.pages.holder``), in its own session and in
    the target's cgroups, so that it outlives this process and this process's container. :meth:`hold` hands it uffds; :meth:`done` lets it close them."""

    def __init__(self, pidns: int, init_pid: int, control_dir: str | None, cgroups: Sequence[str] = ()) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock = ours
        argv = [sys.executable, "-m", "runtime.pages.holder", "--fd", str(theirs.fileno()),
                "--pidns", str(pidns), "--init-pid", str(init_pid)]
        if control_dir is not None:
            argv += ["--control", control_dir]
        if cgroups:
            # In the target's cgroups: it lives as long as the pod does, not as the agent's
            # container (a DaemonSet pod deleted mid-serve takes the agent's whole cgroup along).
            argv = enter_cgroups_argv(cgroups, argv)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        try:
            self.proc = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), start_new_session=True,
                                         stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._lock = threading.Lock()
        self._numbered = 0  # uffds handed over so far: the holder numbers its copies alike
        # Every send is bounded: the holder answers only SYNC, read at once below, so it always
        # reads; one that stops reading fails the serve instead of stalling whoever sends.
        self.sock.settimeout(HOLDER_SEND_TIMEOUT)

    def hold(self, fds: Sequence[int], wait: bool = False) -> list[int]:
        """Hand ``fds`` over (``wait``: until the holder has them); their copy numbers.
        StreamError when the holder does not take them in time."""
        with self._lock:
            try:
                socket.send_fds(self.sock, [holder_mod.HOLD], list(fds))
                numbers = list(range(self._numbered, self._numbered + len(fds)))
                self._numbered += len(fds)
                if wait:
                    self.sock.sendall(holder_mod.SYNC)
                    if self.sock.recv(1) != holder_mod.ACK:
                        raise StreamError("the uffd holder did not take the uffds")
            except OSError as exc:
                raise StreamError(f"the uffd holder did not take the uffds: {exc}") from exc
        return numbers

    def drop(self, number: int) -> None:
        """Let the holder close its copy ``number`` (its task exited)."""
        with self._lock:
            try:
                self.sock.sendall(holder_mod.DROP + number.to_bytes(holder_mod.NUMBER_BYTES, "little"))
            except OSError as exc:
                raise StreamError(f"the uffd holder did not take a drop: {exc}") from exc

    def done(self) -> None:
        with self._lock:
            try:
                self.sock.sendall(holder_mod.DONE)
                while self.sock.recv(4096):  # its copies are closed when it closes its end
                    pass
            except OSError:
                pass
        self.close()

    def abort(self) -> None:
        """The serve failed: the holder kills what is left; the caller tells the init."""
        with self._lock:
            try:
                self.sock.sendall(holder_mod.GIVE_UP)
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("uffd holder %d did not exit", self.proc.pid)


# --- the server ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Limits:
    """What one serve may cost the agent, whatever the restored tree does (it forks, moves its
    memory with mremap): past any of these the serve fails closed (the tree is killed, the pod
    starts cold with the reason). All are derived from the artifact's own work: ``work``, the
    bytes one pass over its pieces reads and hashes."""

    # forked address spaces still owed pieces at once: each holds a uffd here and in the holder
    fork_targets: int = 128
    # bytes read and hashed, and bytes installed, at most this many passes over the pieces...
    passes: float = 4.0
    slack: int = 64 << 20  # ... and this much more (refaults, pieces moved mid-copy)
    # installs the kernel refused while the space changed (each waits for the next event batch)
    retries_per_piece: int = 16
    retries_slack: int = 1000
    # wall clock from the first install, with install threads (faults only: the tree decides)
    seconds: float = 30.0
    rate: float = 50e6  # ... plus ``work`` at this many bytes per second

    def deadline_s(self, work: int) -> float:
        return self.seconds + work / self.rate

    def bytes_cap(self, work: int) -> int:
        return int(self.passes * work) + self.slack

    def retries_cap(self, pieces: int) -> int:
        return self.retries_per_piece * pieces + self.retries_slack


@dataclass(frozen=True)
class _Piece:
    id: int
    file: int  # a bulk file's index; past them, a mapped range's (its offset: in its map file)
    offset: int
    length: int
    digests: bytes  # of its chunks, in order (a mapped piece: none, read from its source's)


class MappedBook:
    """Which pieces of the mapped ranges' files are in their files, verified there: shared by
    every streamed restore of one version in this process that maps those files
    (``runtime.pages.nodecache.Building``). Whoever comes first writes a piece (under its lock
    here); every restore lets it go in its own tree. A piece is a 2 MiB-aligned window of its
    file: its index is its offset // 2 MiB."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self._locks = {s.name: [threading.Lock() for _ in range(-(-s.file_size // PIECE))] for s in spans}
        self._written: set[tuple[str, int]] = set()
        self._total = sum(len(locks) for locks in self._locks.values())

    def lock(self, name: str, index: int) -> threading.Lock:
        return self._locks[name][index]

    def written(self, name: str, index: int) -> bool:
        return (name, index) in self._written

    def mark(self, name: str, index: int) -> None:
        self._written.add((name, index))

    def whole(self) -> bool:
        """Every piece of every file written."""
        return len(self._written) == self._total


@dataclass(frozen=True)
class Mapped:
    """A bulk range the tree maps privately from ``out``, a node-local tmpfs file the serve
    writes (its bytes at ``span.file_offset``): registered, written piece by piece, let go."""

    span: Span
    out: int


@dataclass
class _Target:
    """One address space (a restored task, or a child forked since). Its ranges are looked up
    by address (a fault) and by file offset (a piece) through two sorted indexes, rebuilt only
    when the space changes (an event): a restored process has thousands of ranges, and both
    look-ups run once per piece or fault."""

    fd: int
    ranges: list[tuple[int, int, int, int]]  # (vaddr, length, file, file offset), by vaddr
    pending: set[int]  # pieces not yet installed here
    name: str
    alive: bool = True  # False: forgotten (exited, or a fork owed nothing more); its fd closes once unused
    moves: int = 0  # REMAP events seen: an install that overlapped one is redone
    forked: bool = False  # a child forked mid-serve (not one CRIU handed over)
    number: int = -1  # its copy's number in the holder
    busy: int = 0  # threads using fd now: it is closed (by the event thread) only at 0
    woken: set[int] = field(default_factory=set)  # pages woken with their piece already in
    starts: list[int] = field(default_factory=list)  # of ranges
    by_offset: list[tuple[int, int, int, int]] = field(default_factory=list)  # (file, offset, vaddr, length)

    def __post_init__(self) -> None:
        self.reindex(self.ranges)

    def reindex(self, ranges: list[tuple[int, int, int, int]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [r[0] for r in self.ranges]
        self.by_offset = sorted((f, off, vaddr, length) for vaddr, length, f, off in self.ranges)

    def at(self, address: int) -> tuple[int, int] | None:
        """(file, offset in it) of the byte at ``address``, or None (not a bulk range now)."""
        i = bisect.bisect_right(self.starts, address) - 1
        if i < 0:
            return None
        vaddr, length, f, off = self.ranges[i]
        return (f, off + address - vaddr) if address < vaddr + length else None

    def spans(self, file: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(vaddr, offset, length) of the parts of ``file``'s [lo, hi) mapped here now."""
        out = []
        # ranges of one file do not overlap in the file: only the one before lo may reach in
        i = max(bisect.bisect_left(self.by_offset, (file, lo)) - 1, 0)
        while i < len(self.by_offset):
            f, off, vaddr, length = self.by_offset[i]
            i += 1
            if f < file or off + length <= lo:
                continue
            if f > file or off >= hi:
                break
            a, b = max(off, lo), min(off + length, hi)
            out.append((vaddr + (a - off), a, b - a))
        return out


@dataclass(frozen=True)
class StreamStats:
    bytes_verified: int
    bytes_installed: int
    faults: int
    pieces_by_fault: int
    forks: int
    seconds: float
    threads: int
    # from each fault's event read to its wake, summed over faults (threads wait in parallel)
    # and the longest: a lower bound of what the tree waited on pages
    fault_wait_s: float = 0.0
    fault_wait_max_s: float = 0.0
    # thread-seconds spent reading pieces into private memory, hashing them, installing them
    read_s: float = 0.0
    hash_s: float = 0.0
    install_s: float = 0.0
    first_pieces: int = 0  # installed before the rest: the CUDA driver's host copy
    retries: int = 0  # installs the kernel refused while the address space changed (EAGAIN)
    mapped_bytes: int = 0  # of those verified: written into mapped files and let go, not copied
    mapped_whole: bool = True  # every piece of every mapped file written (none skipped: a task gone)
    # of install_s: letting mapped pieces go (their bytes are read straight into their files: read_s)
    release_s: float = 0.0


@dataclass
class _Counters:
    verified: int = 0
    installed: int = 0
    faults: int = 0
    by_fault: int = 0
    forks: int = 0
    fault_wait: float = 0.0
    fault_wait_max: float = 0.0
    read: float = 0.0
    hash: float = 0.0
    install: float = 0.0
    retries: int = 0
    mapped: int = 0
    release: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Server:
    """Serves the bulk files ``files`` (read through ``fds``) into the tasks whose uffds are
    handed over by :meth:`add` (pid in the image, uffd: this object owns it from then on).
    Faults are served from the first uffd on (CRIU's restorer, and the kernel for it, may touch
    lazy memory before CRIU is done); :meth:`start` begins the installs (after CRIU's RSTF:
    every range is registered at its place then)."""

    def __init__(self, label: str, files: Sequence[BulkFile], fds: Sequence[int],
                 sums: Sequence[bytes], kill: Callable[[], object],
                 threads: int = WORKERS, holder: Holder | None = None,
                 progress: Callable[[int], None] | None = None,
                 first: Sequence[tuple[int, int, int]] = (), mapped: Sequence[Mapped] = (),
                 book: MappedBook | None = None, limits: Limits = Limits()) -> None:
        """``first``: (pid, start, end) address spans whose pieces are installed before the rest
        (the CUDA driver's host copy, which its restore reads while the pieces arrive).
        ``mapped``: ranges of ``files`` the tree maps from files the serve writes (each a whole
        range of its process's bulk file): let go, not copied; they go first of all. ``book``: the
        state of their files' pieces, when other restores write them too (else this serve's own).
        ``limits``: what the serve may cost before it fails closed."""
        self.label, self.kill, self.holder, self.progress = label, kill, holder, progress
        self.limits = limits
        self.threads = max(0, threads)
        self.fds = [os.dup(fd) for fd in fds]  # the caller's may close before the serve ends
        self.sums = list(sums)
        self.pieces: list[_Piece] = []
        self.first: list[int] = []  # of each file's pieces: its piece at offset o is first + o // PIECE
        self.sizes: list[int] = []
        for i, (f, fd, ds) in enumerate(zip(files, self.fds, sums, strict=True)):
            self.first.append(len(self.pieces))
            size = os.fstat(fd).st_size
            self.sizes.append(size)
            if len(ds) != -(-size // SUM_CHUNK) * DIGEST_BYTES or any(r.offset + r.length > size for r in f.ranges):
                raise StreamIntegrityError(f"{label}: {f.path} does not match its ranges or chunk digests")
            for off in range(0, size, PIECE):
                n = min(PIECE, size - off)
                d = ds[off // SUM_CHUNK * DIGEST_BYTES:-(-(off + n) // SUM_CHUNK) * DIGEST_BYTES]
                self.pieces.append(_Piece(len(self.pieces), i, off, n, d))
        self.files = list(files)
        # each file's ranges as (offset, end), by offset: a chunk that holds none is neither read
        # nor checked (a node cache entry's fill file has a hole there: that range is mapped)
        self._extents = [sorted((r.offset, r.offset + r.length) for r in f.ranges) for f in self.files]
        # Mapped ranges: a pseudo-file each (index len(files) + k), its pieces 2 MiB of its map file.
        self.mapped: list[tuple[Mapped, int]] = []  # (range, its bulk file's index); out: our dup
        self._shared: list[FileMap] = []  # each mapped range's file, mapped shared: where it is written
        for m in mapped:
            src = next((i for i, f in enumerate(self.files)
                        if f.pid == m.span.pid and any((r.vaddr, r.length, r.offset) ==
                                                       (m.span.vaddr, m.span.length, m.span.offset)
                                                       for r in f.ranges)), -1)
            if src < 0:
                raise StreamIntegrityError(f"{label}: mapped range {m.span.vaddr:#x} of pid {m.span.pid} "
                                           "is no bulk range")
            self.mapped.append((Mapped(m.span, os.dup(m.out)), src))
            self._shared.append(FileMap(m.out, m.span.file_size, writable=True))
            self.first.append(len(self.pieces))
            for off in range(0, m.span.file_size, PIECE):
                lo, hi = max(off, m.span.file_offset), min(off + PIECE, m.span.file_size)
                self.pieces.append(_Piece(len(self.pieces), len(self.files) + len(self.mapped) - 1, lo, hi - lo, b""))
        self.book = book if book is not None else MappedBook([m.span for m, _src in self.mapped])
        self.work = sum(p.length for p in self.pieces)  # one pass: what the limits scale with
        self.order, self.first_pieces = self._order(first)  # of the installs
        self.targets: list[_Target] = []
        self.table = threading.Lock()  # targets, their ranges and pending sets
        self.locks = [threading.Lock() for _ in self.pieces]
        self.counters = _Counters()
        self.failure: str | None = None
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._faults: collections.deque[tuple[_Target, int, float]] = collections.deque()  # with when read
        self._fault_cv = threading.Condition()
        self._events_read = threading.Condition()  # notified after each batch of events is read
        self._events_batches = 0  # batches read so far: a retry waits only for a batch after its own try
        self._next = 0
        self._again: collections.deque[int] = collections.deque()  # pieces pending again (fork, move)
        self._queued: set[int] = set()  # those in _again: each once, however often it is pended
        self._busy = 0
        self._threads: list[threading.Thread] = []
        self._t0 = time.monotonic()
        self._local = threading.local()
        self._installing = False
        self._installers = 0  # install threads running
        self._spawn("rekindle-uffd-events", self._read_events)
        # more than one: a fault waiting on a piece an installer holds keeps no other waiting
        for i in range(FAULT_THREADS):
            self._spawn(f"rekindle-uffd-faults-{i}", self._serve_faults)

    def _order(self, first: Sequence[tuple[int, int, int]]) -> tuple[list[int], int]:
        """The pieces in install order, and how many of them come first: those holding bytes
        of a ``first`` span, then the rest, each in file (= address) order."""
        ahead: set[int] = set()
        for i, f in enumerate(self.files):
            for pid, start, end in first:
                if pid != f.pid:
                    continue
                for r in f.ranges:
                    lo, hi = max(r.vaddr, start), min(r.vaddr + r.length, end)
                    if lo < hi:
                        ahead.update(self._pieces_of(i, r.offset + lo - r.vaddr, r.offset + hi - r.vaddr))
        maps = [p.id for p in self.pieces if p.file >= len(self.files)]
        front = maps + sorted(ahead)
        return front + [p.id for p in self.pieces if p.id not in ahead and p.file < len(self.files)], len(front)

    def _is_mapped(self, p: _Piece) -> bool:
        return p.file >= len(self.files)

    # -- lifecycle

    def _spawn(self, name: str, fn: Callable[[], None]) -> None:
        th = threading.Thread(target=self._guard, args=(fn,), name=name, daemon=True)
        th.start()
        self._threads.append(th)

    def add(self, pid: int, fd: int) -> None:
        """Serve task ``pid``'s uffd ``fd`` (held by the holder first: it must never be the
        only copy while the task can run)."""
        number = -1
        try:
            if self.holder is not None:
                number = self.holder.hold([fd], wait=True)[0]
        except BaseException:
            os.close(fd)
            raise
        i = next((i for i, f in enumerate(self.files) if f.pid == pid), -1)
        mine = [(k, m) for k, (m, _src) in enumerate(self.mapped) if m.span.pid == pid]
        skip = {(m.span.vaddr, m.span.length) for _k, m in mine}
        spans = sorted((r.vaddr, r.length, i, r.offset) for r in self.files[i].ranges
                       if (r.vaddr, r.length) not in skip) if i >= 0 else []
        pending: set[int] = set()
        for vaddr, length, f, off in spans:  # pieces holding bytes it lacks: not the CRIU-kept rest
            pending.update(self._pieces_of(f, off, off + length))
        for k, m in mine:
            f = len(self.files) + k
            spans.append((m.span.vaddr, m.span.length, f, m.span.file_offset))
            pending.update(self._pieces_of(f, m.span.file_offset, m.span.file_size))
        with self.table:
            self.targets.append(_Target(fd, spans, pending, f"pid {pid}", number=number))
        try:
            os.write(self._wake_w, b"x")  # poll it too
        except OSError:
            pass

    def register_mapped(self) -> None:
        """Register every mapped range on its task's uffd (missing and minor: any touch is
        ours, whether its page is in the file or not). After CRIU's RSTF, when each range is at
        its place, and while the tree is stopped: until now nothing can have touched it, and
        from now on nothing does until the range's piece is let go (the caller checks the first)."""
        with self.table:
            targets = list(self.targets)
        for t in targets:
            for vaddr, length, f, _off in t.ranges:
                if f < len(self.files):
                    continue
                try:
                    uffd.register(t.fd, vaddr, length, uffd.REGISTER_MODE_MISSING | uffd.REGISTER_MODE_MINOR)
                except (OSError, uffd.Gone) as exc:
                    raise StreamError(f"{t.name}: mapped range {vaddr:#x}+{length:#x} cannot be registered: "
                                      f"{exc or 'gone'}") from exc

    def start(self) -> None:
        self._t0 = time.monotonic()  # the serve's seconds count from here (faults before: CRIU's)
        self._installing = True
        for i in range(self.threads):
            with self.table:
                self._installers += 1
            self._spawn(f"rekindle-stream-{i}", self._install_loop)
        self._check_done()

    def wait(self, timeout: float | None = None) -> StreamStats:
        """Wait until every piece is installed everywhere (then the uffds are closed) or the
        serve failed (then the tree is dead): StreamStats, or StreamError."""
        limit, bounded = timeout, False
        if self.threads > 0:  # with install threads the artifact, not the tree, says how long
            allowed = self.limits.deadline_s(self.work)
            left = max(0.0, self._t0 + allowed - time.monotonic())
            if limit is None or left < limit:
                limit, bounded = left, True
        if not self.finished.wait(limit):
            if bounded:
                self._fail(f"not served within {allowed:.0f}s, what {self.work / 2**20:.0f} MiB of pieces "
                           "allow (the restored tree keeps changing its memory?)")
            else:
                self._fail(f"not served within {timeout}s")
        self.close()
        if self.failure is not None:
            raise StreamError(f"{self.label}: streamed restore failed: {self.failure}")
        c = self.counters
        stats = StreamStats(c.verified, c.installed, c.faults, c.by_fault, c.forks,
                            round(time.monotonic() - self._t0, 3), self.threads,
                            round(c.fault_wait, 3), round(c.fault_wait_max, 4),
                            round(c.read, 3), round(c.hash, 3), round(c.install, 3), self.first_pieces, c.retries,
                            c.mapped, self.book.whole(),
                            round(c.release, 3))
        log.info("stream: %.1f MiB verified, %.1f MiB installed, %d faults (%d pieces first by fault, "
                 "waited %.2fs in all, %.3fs at most), %d forks, %d threads, %.2fs (%.2f GB/s; thread-seconds: "
                 "read %.2f, hash %.2f, install %.2f; %d retries; %.1f MiB mapped)",
                 stats.bytes_verified / 2**20, stats.bytes_installed / 2**20, stats.faults,
                 stats.pieces_by_fault, stats.fault_wait_s, stats.fault_wait_max_s, stats.forks,
                 stats.threads, stats.seconds, stats.bytes_verified / 1e9 / max(stats.seconds, 1e-9),
                 stats.read_s, stats.hash_s, stats.install_s, stats.retries, stats.mapped_bytes / 2**20)
        return stats

    def close(self) -> None:
        """Stop serving and close every uffd (after the holder closed its copies, when all is
        installed; else the holder kills the tree when it sees this end go)."""
        self._stop.set()
        self.finished.set()
        with self._fault_cv:
            self._fault_cv.notify_all()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        for th in self._threads:
            if th is not threading.current_thread():
                th.join()
        self._threads = []
        if self.holder is not None:
            if self.failure is None:
                self.holder.done()
            else:
                self.holder.abort()  # the holder kills what is left; our caller tells the init
            self.holder = None
        with self.table:
            for t in self.targets:
                if t.fd >= 0:
                    os.close(t.fd)
                    t.fd = -1
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        for m, _src in self.mapped:
            if m.out >= 0:
                os.close(m.out)
        for sh in self._shared:
            sh.close()
        self.mapped = [(Mapped(m.span, -1), src) for m, src in self.mapped]
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # any failure fails the restore closed
            log.exception("stream: %s failed", threading.current_thread().name)
            self._fail(f"{threading.current_thread().name}: {exc}")

    def _fail(self, reason: str) -> None:
        with self.table:
            first = self.failure is None
            if first:
                self.failure = reason
        if first:
            log.error("%s: streamed restore fails: %s; killing the restored tree", self.label, reason)
            self.kill()
        self._stop.set()
        self.finished.set()

    def _check_done(self) -> None:
        with self.table:
            done = (self._installing and self._busy == 0
                    and not any(t.pending for t in self.targets if t.alive))
        if done:
            self.finished.set()

    # -- pieces

    def _buffer(self, size: int = PIECE) -> tuple[memoryview, int]:
        """This thread's buffer of ``size`` bytes (one per size)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        buf = bufs.get(size)
        if buf is None:
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = bufs[size] = (memoryview(m), ctypes.addressof(ctypes.c_char.from_buffer(m)), m)
        return buf[0], buf[1]

    def _read_verified(self, p: _Piece) -> int:
        """Our address of piece ``p``'s bytes, read into private memory and verified."""
        view, addr = self._buffer()
        fd = self.fds[p.file]
        if not is_cached(fd, p.offset, p.length):
            try:
                os.posix_fadvise(fd, p.offset, p.length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
        got = skipped = 0
        reading = hashing = 0.0
        while got < p.length:  # chunk by chunk, each hashed while still in the core's cache
            start, want = got, min(p.length, got + SUM_CHUNK)
            if not self._holds_range(p.file, p.offset + start, p.offset + want):
                got = want  # no byte of it is installed
                skipped += want - start
                continue
            t0 = time.perf_counter()
            while got < want:
                n = os.preadv(fd, [view[got:want]], p.offset + got)
                if n <= 0:
                    raise StreamIntegrityError(f"bulk file shrank while read (at {p.offset + got})")
                got += n
            t1 = time.perf_counter()
            digest = new_hash()
            digest.update(view[start:want])
            k = start // SUM_CHUNK * DIGEST_BYTES
            if digest.digest() != p.digests[k:k + DIGEST_BYTES]:
                raise StreamIntegrityError(f"chunk at {p.offset + start} of {self.files[p.file].path} does not match its digest")
            reading, hashing = reading + (t1 - t0), hashing + (time.perf_counter() - t1)
        self._verified(p.length - skipped, reading, hashing)
        return addr

    def _holds_range(self, file: int, lo: int, hi: int) -> bool:
        """Whether [lo, hi) of bulk file ``file`` holds any byte of one of its ranges."""
        ext = self._extents[file]
        i = bisect.bisect_right(ext, (lo, 1 << 64)) - 1
        return any(a < hi and lo < b for a, b in ext[max(i, 0):i + 2])

    def _verified(self, length: int, reading: float, hashing: float) -> None:
        """``length`` more bytes verified (read and hashed in those thread-seconds): counted, reported."""
        with self.counters.lock:
            self.counters.verified += length
            self.counters.read += reading
            self.counters.hash += hashing
            verified = self.counters.verified
        if verified > self.limits.bytes_cap(self.work):
            self._fail(f"{verified / 2**20:.0f} MiB read and hashed to serve {self.work / 2**20:.0f} MiB "
                       "(the restored tree keeps moving or refaulting its memory)")
        if self.progress is not None:
            self.progress(verified)

    def _write_mapped(self, p: _Piece) -> None:
        """Mapped piece ``p`` into its file, verified there: its bytes read from its bulk file
        straight into the file (through a shared mapping: a tmpfs write() holds the file's inode
        lock, and every thread writes the one file; measured on the H200, 16.8 GB went in at
        4.8 GB/s however many threads), then each chunk that holds them hashed from the file
        with the chunk's other bytes, read into private memory at the same time. The file is
        ours alone: what is hashed there is what the process will map. A chunk off its digest
        fails the serve before the piece is let go (and the entry is never finished)."""
        k = p.file - len(self.files)
        m, src = self.mapped[k]
        at = m.span.offset + (p.offset - m.span.file_offset)  # its bytes in the bulk file
        end = at + p.length
        lo, hi = at // SUM_CHUNK * SUM_CHUNK, min(-(-end // SUM_CHUNK) * SUM_CHUNK, self.sizes[src])
        here = memoryview((ctypes.c_char * p.length).from_address(self._shared[k].addr + p.offset)).cast("B")
        scratch, _addr = self._buffer(MAPPED_SCRATCH)
        fd, sums = self.fds[src], self.sums[src]
        if not is_cached(fd, lo, hi - lo):
            try:
                os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass
        reading = hashing = 0.0
        for c in range(lo, hi, SUM_CHUNK):
            t0 = time.perf_counter()
            ce = min(c + SUM_CHUNK, hi)
            a, b = max(c, at), min(ce, end)  # this piece's part of the chunk; the rest is a neighbour's
            parts = (scratch[:a - c], here[a - at:b - at], scratch[SUM_CHUNK:SUM_CHUNK + ce - b])
            pos = c
            for view in parts:
                _read_into(fd, view, pos)
                pos += len(view)
            t1 = time.perf_counter()
            digest = new_hash()
            for view in parts:
                digest.update(view)
            k2 = c // SUM_CHUNK * DIGEST_BYTES
            if digest.digest() != sums[k2:k2 + DIGEST_BYTES]:
                raise StreamIntegrityError(f"chunk at {c} of {self.files[src].path} does not match its digest")
            reading, hashing = reading + (t1 - t0), hashing + (time.perf_counter() - t1)
        here.release()
        self._verified(p.length, reading, hashing)

    def _release_into(self, t: _Target, p: _Piece) -> None:
        """Let mapped piece ``p`` go in ``t``: wherever its bytes are mapped there now."""
        t0 = time.perf_counter()
        fd = self._enter(t)
        if fd < 0:
            return
        released = 0
        try:
            with self.table:
                segs = t.spans(p.file, p.offset, p.offset + p.length)
                moves = t.moves
            for dst, _off, n in segs:
                if self._stop.is_set():
                    return
                try:
                    uffd.release(fd, dst, n)
                    released += n
                except uffd.Gone:
                    pass  # unmapped since, or the process exited
            with self.table:
                if t.moves == moves:
                    t.pending.discard(p.id)
                    self._settle(t)
                else:  # moved while we let it go: again, where it is now
                    self._repend(p.id)
        finally:
            self._leave(t)
        self._kick()
        with self.counters.lock:
            self.counters.mapped += released
            self.counters.install += time.perf_counter() - t0
            self.counters.release += time.perf_counter() - t0

    def _install(self, pid: int, by_fault: bool) -> None:
        """Install piece ``pid`` wherever it is still pending (once: its lock)."""
        p = self.pieces[pid]
        with self.locks[pid]:
            if self._stop.is_set():
                return
            with self.table:
                needing = [t for t in self.targets if t.alive and pid in t.pending]
            if not needing:
                return
            if self._is_mapped(p):  # into its file (once, by whichever restore comes first), then let go
                name, index = self.mapped[p.file - len(self.files)][0].span.name, p.offset // PIECE
                with self.book.lock(name, index):
                    if not self.book.written(name, index):
                        try:
                            self._write_mapped(p)
                        except (StreamError, OSError) as exc:
                            self._fail(str(exc))
                            return
                        self.book.mark(name, index)
                if by_fault:
                    with self.counters.lock:
                        self.counters.by_fault += 1
                for t in needing:
                    self._release_into(t, p)
                return
            try:
                addr = self._read_verified(p)
            except StreamError as exc:
                self._fail(str(exc))
                return
            if by_fault:
                with self.counters.lock:
                    self.counters.by_fault += 1
            for t in needing:
                self._install_into(t, p, addr)

    def _segments(self, t: _Target, p: _Piece) -> list[tuple[int, int, int]]:
        """(dst, offset in the piece, length) of ``p``'s bytes in ``t`` now."""
        return [(dst, off - p.offset, n) for dst, off, n in t.spans(p.file, p.offset, p.offset + p.length)]

    def _pieces_of(self, file: int, lo: int, hi: int) -> range:
        """The ids of ``file``'s pieces holding any of [lo, hi)."""
        return range(self.first[file] + lo // PIECE, self.first[file] + -(-hi // PIECE))

    def _install_into(self, t: _Target, p: _Piece, addr: int) -> None:
        installed = 0
        t0 = time.perf_counter()
        fd = self._enter(t)
        if fd < 0:
            return
        try:
            for _round in range(MOVE_ROUNDS):
                with self.table:
                    segs = self._segments(t, p)
                    moves = t.moves
                i = 0
                while i < len(segs):
                    if self._stop.is_set():
                        return
                    dst, rel, length = segs[i]
                    batches = self._events_batches
                    try:
                        installed += uffd.copy(fd, dst, addr + rel, length)
                        i += 1
                    except uffd.Changing:
                        # the space changes under us: once the event is read, redo what is left as
                        # the (maybe moved or shrunk) ranges say; a page installed already is skipped
                        # (EEXIST)
                        self._await_events(batches)
                        with self.table:
                            segs = self._segments(t, p)
                        i = 0
                    except uffd.Exited:
                        self._forget(t)
                        return
                    except uffd.Gone:
                        i += 1  # unmapped since
                with self.table:
                    if t.moves == moves:
                        t.pending.discard(p.id)
                        self._settle(t)
                        return
                # part of it may have moved away before its copy: again where it is now, from
                # the bytes still at hand (what moved along with its pages is there: EEXIST)
                self._charge_retry()
            with self.table:  # moved on every round: its turn comes again
                self._repend(p.id)
        finally:
            self._leave(t)
            with self.counters.lock:
                self.counters.installed += installed
                self.counters.install += time.perf_counter() - t0
                over = self.counters.installed > self.limits.bytes_cap(self.work)
            if over:
                self._fail(f"more than {self.limits.bytes_cap(self.work) / 2**20:.0f} MiB installed to serve "
                           f"{self.work / 2**20:.0f} MiB")
            self._kick()

    # -- the targets' lifecycle and what the serve may cost (Limits)

    def _enter(self, t: _Target) -> int:
        """``t``'s uffd, held open until :meth:`_leave`; -1 when ``t`` is forgotten (nothing to do)."""
        with self.table:
            if not t.alive or t.fd < 0:
                return -1
            t.busy += 1
            return t.fd

    def _leave(self, t: _Target) -> None:
        with self.table:
            t.busy -= 1
            reap = not t.alive and t.busy == 0
        if reap:
            self._poke()

    def _poke(self) -> None:
        """Wake the event thread (it reaps forgotten targets, polls new ones)."""
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def _forget(self, t: _Target) -> None:
        """``t``'s process exited: nothing is owed there; its fd goes once no thread uses it."""
        with self.table:
            if not t.alive:
                return
            t.alive = False
            t.pending.clear()
            t.woken.clear()
        log.debug("stream: %s is gone", t.name)
        self._poke()
        self._check_done()

    def _settle(self, t: _Target) -> None:
        """A forked target owed nothing more is forgotten (caller holds the table): with every
        copy of its uffd closed its faults are the kernel's, as everyone's after the serve."""
        if t.forked and not t.pending and t.alive:
            t.alive = False
            self._poke()

    def _reap(self, poller: select.poll, polled: dict[int, _Target]) -> None:
        """Close the fds of forgotten targets no thread uses (the event thread's alone: it polls
        them, and a closed fd's number may come back as another file)."""
        with self.table:
            gone = [t for t in self.targets if not t.alive and t.busy == 0 and t.fd >= 0]
            self.targets = [t for t in self.targets if t.alive or t.busy > 0]
        for t in gone:
            if polled.get(t.fd) is t:
                poller.unregister(t.fd)
                del polled[t.fd]
            os.close(t.fd)
            t.fd = -1
            if t.number >= 0 and self.holder is not None:
                self.holder.drop(t.number)

    def _repend(self, pid: int) -> None:
        """Queue piece ``pid`` again (caller holds the table): once, however often it is pended."""
        if pid not in self._queued:
            self._queued.add(pid)
            self._again.append(pid)

    def _kick(self) -> None:
        """An install thread for pieces pended again after the threads were done."""
        with self.table:
            respawn = (self._installing and self.threads > 0 and self._installers == 0 and bool(self._again)
                       and not self._stop.is_set())
            if respawn:
                self._installers += 1
        if respawn:
            self._spawn("rekindle-stream-again", self._install_loop)

    def _charge_retry(self) -> None:
        with self.counters.lock:
            self.counters.retries += 1
            retries = self.counters.retries
        if retries > self.limits.retries_cap(len(self.pieces)):
            self._fail(f"{retries} installs refused while the restored tree changed its memory "
                       f"(at most {self.limits.retries_cap(len(self.pieces))} for {len(self.pieces)} pieces)")

    def _install_loop(self) -> None:
        try:
            self._install_pieces()
        finally:
            with self.table:
                self._installers -= 1
        self._check_done()

    def _install_pieces(self) -> None:
        while not self._stop.is_set():
            with self.table:
                if self._next < len(self.order):
                    pid = self.order[self._next]
                    self._next += 1
                elif self._again:  # a child forked, or a range moved, mid-serve: what it lacks
                    pid = self._again.popleft()
                    self._queued.discard(pid)
                elif any(t.pending for t in self.targets if t.alive):
                    pid = -1  # the last pieces are being installed now: look again shortly
                else:
                    break
                if pid >= 0:
                    self._busy += 1
            if pid < 0:
                self._stop.wait(0.01)
                continue
            try:
                self._install(pid, by_fault=False)
            finally:
                with self.table:
                    self._busy -= 1
            self._check_done()

    # -- events and faults

    def _piece_at(self, t: _Target, address: int) -> int | None:
        with self.table:
            where = t.at(address)
        return None if where is None else self.first[where[0]] + where[1] // PIECE

    def _serve_faults(self) -> None:
        while True:
            with self._fault_cv:
                while not self._faults and not self._stop.is_set():
                    self._fault_cv.wait()
                if self._stop.is_set():
                    return
                t, address, seen = self._faults.popleft()
            fd = self._enter(t)
            if fd < 0:
                continue
            try:
                if not self._serve_fault(t, fd, address, seen):
                    return
            finally:
                self._leave(t)

    def _serve_fault(self, t: _Target, fd: int, address: int, seen: float) -> bool:
        """Serve one fault of ``t``'s (its uffd ``fd``); False once the serve stops."""
        page = address & ~(uffd.PAGE - 1)
        pid = self._piece_at(t, page)
        if pid is not None:
            with self.table:
                if pid not in t.pending:
                    if page in t.woken:  # woken once and back: missing after all, install again
                        t.woken.discard(page)
                        t.pending.add(pid)
                        self._repend(pid)
                    else:  # likely a fault queued as its piece went in: a wake is all it needs
                        t.woken.add(page)
        while True:
            batches = self._events_batches
            try:
                if pid is None:
                    uffd.zeropage(fd, page, uffd.PAGE)  # a hole, or discarded since
                else:
                    self._install(pid, by_fault=True)
                    self._check_done()
                uffd.wake(fd, page, uffd.PAGE)
                waited = time.monotonic() - seen
                with self.counters.lock:
                    self.counters.fault_wait += waited
                    self.counters.fault_wait_max = max(self.counters.fault_wait_max, waited)
                return True
            except uffd.Changing:
                self._await_events(batches)
                pid = self._piece_at(t, page)
            except uffd.Exited:
                self._forget(t)
                return True
            except uffd.Gone:
                return True
            if self._stop.is_set():
                return False

    def _read_events(self) -> None:
        poller = select.poll()
        polled: dict[int, _Target] = {}
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            self._reap(poller, polled)
            with self.table:
                for t in self.targets:
                    if t.alive and t.fd >= 0 and t.fd not in polled:
                        poller.register(t.fd, select.POLLIN)
                        polled[t.fd] = t
            for fd, mask in poller.poll(1000):
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                t = polled[fd]
                events = uffd.read_events(fd) if mask & select.POLLIN else []
                if mask & (select.POLLHUP | select.POLLERR | select.POLLNVAL) and not events:
                    poller.unregister(fd)
                    del polled[fd]
                    continue
                for ev in events:
                    self._event(t, ev)
            with self._events_read:
                self._events_batches += 1
                self._events_read.notify_all()

    def _await_events(self, batches: int) -> None:
        """Wait until a batch of events was read after ``batches`` (the count before a try that
        the kernel refused while the space changed): at once if one was read meanwhile."""
        self._charge_retry()
        with self._events_read:
            self._events_read.wait_for(lambda: self._events_batches != batches or self._stop.is_set(), 0.05)

    def _forked(self, t: _Target, fd: int) -> None:
        """``t`` forked: the child's uffd ``fd`` is ours now (the child runs from the event's
        read on). The child's missing pages are the parent's: it is served them too."""
        with self.counters.lock:
            self.counters.forks += 1
        with self.table:
            pending = set(t.pending)
        if not pending:
            # nothing owed there: with no copy of its uffd left its faults are the kernel's own,
            # as everyone's once the serve ends (a tree forking after its pieces cost nothing)
            os.close(fd)
            return
        number = -1
        if self.holder is not None:  # before anything can fail: never the only copy while it runs
            try:
                number = self.holder.hold([fd])[0]
            except BaseException:
                os.close(fd)
                raise
        with self.table:
            child = _Target(fd, list(t.ranges), pending, f"child of {t.name}", forked=True, number=number)
            self.targets.append(child)  # over the limit too: close() closes it
            live = sum(1 for x in self.targets if x.forked and x.alive)
            over = live > self.limits.fork_targets
            if not over:
                for pid in sorted(pending):
                    self._repend(pid)
        if over:
            self._fail(f"the restored tree forked more than {self.limits.fork_targets} processes still owed "
                       "pages while its memory was served")
            return
        log.log(logging.INFO if self.counters.forks <= 8 else logging.DEBUG,  # a storm is not logged whole
                "stream: %s forked; %d pieces pending there", t.name, len(pending))
        self._kick()

    def _event(self, t: _Target, ev: uffd.Event) -> None:
        if ev.kind == uffd.EVENT_PAGEFAULT:
            with self.counters.lock:
                self.counters.faults += 1
            with self._fault_cv:
                self._faults.append((t, ev.address, time.monotonic()))
                self._fault_cv.notify()
        elif ev.kind == uffd.EVENT_FORK:
            self._forked(t, ev.fd)
        elif ev.kind == uffd.EVENT_REMAP:
            # Only the index follows the move: pages installed before it moved along with it,
            # pending pieces are installed where their ranges are when their turn comes, and an
            # install that overlapped the move copies again (its moves count). Pending every
            # moved piece again would let a tree that moves its memory in a loop have it read,
            # hashed and installed again as often as it likes.
            with self.table:
                t.reindex(_moved(t.ranges, ev.start, ev.end, ev.to))
                t.moves += 1
        elif ev.kind in (uffd.EVENT_REMOVE, uffd.EVENT_UNMAP):
            with self.table:
                t.reindex(_cut(t.ranges, ev.start, ev.end))
        self._check_done()


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise StreamIntegrityError(f"bulk file shrank while read (at {offset + got})")
        got += n


def _cut(ranges: list[tuple[int, int, int, int]], start: int, end: int) -> list[tuple[int, int, int, int]]:
    """``ranges`` without [start, end) (discarded or unmapped: a later fault there is a hole)."""
    out = []
    for vaddr, length, f, off in ranges:
        if vaddr + length <= start or vaddr >= end:
            out.append((vaddr, length, f, off))
            continue
        if vaddr < start:
            out.append((vaddr, start - vaddr, f, off))
        if vaddr + length > end:
            out.append((end, vaddr + length - end, f, off + (end - vaddr)))
    return out


def _moved(ranges: list[tuple[int, int, int, int]], start: int, end: int,
           to: int) -> list[tuple[int, int, int, int]]:
    """``ranges`` after mremap moved [start, end) to ``to``."""
    out = _cut(ranges, start, end)
    out = _cut(out, to, to + (end - start))  # whatever was mapped there is gone
    for vaddr, length, f, off in ranges:
        lo, hi = max(vaddr, start), min(vaddr + length, end)
        if lo < hi:
            out.append((to + (lo - start), hi - lo, f, off + (lo - vaddr)))
    return sorted(out)


@functools.cache
def _criu_lacks(criu: str) -> str | None:
    """Why ``criu`` cannot hand uffds over with the events the server needs (None: it can);
    asked once per process (CRIU and the kernel do not change under a running agent)."""
    try:
        p = subprocess.run([criu, "check", "--feature", "uffd-noncoop"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{criu} check --feature uffd-noncoop: {exc}"
    if p.returncode != 0:
        return f"{criu} lacks non-cooperative userfaultfd: {(p.stdout + p.stderr).strip()[-200:]}"
    return None


def unsupported(criu: str = CRIU) -> str | None:
    """Why this node cannot stream a restore (None: it can): the kernel's userfaultfd with the
    FORK, REMAP, REMOVE and UNMAP events, and CRIU's ``--lazy-pages`` with them."""
    return uffd.probe() or _criu_lacks(criu)


# --- one streamed restore, as runtime.restore drives it -------------------------------------------

# Measured on 16 cores beside the driver's CUDA restore (bench/results/h200): 8 and 12 threads
# serve 5.9-6.4 GB/s, 4 serve 4.5-5.0, and 16 fewer than 8 (they take the driver's cores).
DEFAULT_THREADS = min(12, WORKERS)


def threads(asked: int | None, serve: int | None = None) -> int:
    """Install threads: ``serve`` when given (the restore's serve threads), else ``asked`` (its
    fill threads), else :data:`DEFAULT_THREADS`. 0 serves faults only (a measurement setting:
    the restore completes only once every piece was touched)."""
    if serve is not None:
        return serve
    return asked if asked else DEFAULT_THREADS


def driver_spans(images: str, cuda_pids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(pid, start, end) of the CUDA driver's host copy in CRIU's images: the VMAs the
    checkpoint marked MADV_HUGEPAGE in the CUDA processes (``runtime.pages.bulk``'s split). An order
    only: which pieces the serve installs first."""
    spans = []
    for pid in cuda_pids:
        try:
            vmas = img.read_mm(images, pid).entry.vmas
        except (OSError, ValueError):
            continue
        spans += [(pid, v.start, v.end) for v in vmas
                  if v.madv & (1 << img.MADV_HUGEPAGE) and img.is_private_anon_writable(v)]
    return spans


def prepare(files: Sequence[BulkFile], images: str) -> str | None:
    """Make CRIU's images lazy for ``files``, or say why this restore cannot stream (then
    nothing was changed: the bulk path can run)."""
    why = unsupported()
    if why is not None:
        return why
    try:
        prepare_images(images, files)
    except StreamError as exc:
        return str(exc)
    return None


class Session:
    """One streamed restore: :meth:`begin` before CRIU (the holder starts, the socket listens,
    faults are served as the uffds arrive), :meth:`start` after CRIU returned (the tree still
    stopped: installs begin), :meth:`wait` once it runs; :meth:`abort` (idempotent, a no-op
    once served) on any failure kills the tree."""

    def __init__(self, listener: Listener, server: Server) -> None:
        self.listener: Listener | None = listener
        self.server: Server | None = server
        self.served = False
        self.handed: threading.Event = threading.Event()
        self.error: BaseException | None = None
        self._receiver = threading.Thread(target=self._receive, name="rekindle-lazy-pages", daemon=True)
        self._receiver.start()

    @classmethod
    def begin(cls, work_dir: str, target: ContainerInfo, control: ControlDir | None, label: str,
              files: Sequence[BulkFile], fds: Sequence[int], sums: Sequence[bytes],
              threads: int, progress: Callable[[int], None] | None = None,
              first: Sequence[tuple[int, int, int]] = (), mapped: Sequence[Mapped] = (),
              book: MappedBook | None = None) -> Session:
        from runtime.pages.holder import kill_namespace, now_ticks
        pidns, init_pid = target.namespaces["pid"].inode, target.init_pid
        holder = Holder(pidns, init_pid, str(control.path) if control is not None else None,
                        cgroups=list(target.cgroups.values()))
        try:
            listener = Listener(work_dir)
        except OSError:
            holder.close()
            raise
        try:
            # whatever the tree forked since is in its pid namespace: kill all of it, but the init
            server = Server(label, files, fds, sums, lambda: kill_namespace(pidns, init_pid, now_ticks()),
                            threads=threads, holder=holder, progress=progress, first=first, mapped=mapped,
                            book=book)
        except BaseException:
            listener.close()
            holder.close()
            raise
        return cls(listener, server)

    def _receive(self) -> None:
        assert self.listener is not None and self.server is not None
        try:
            self.listener.receive(self.server.add)
        except BaseException as exc:
            self.error = exc
        self.handed.set()

    def start(self, timeout: float = 60.0, check: Callable[[], object] | None = None) -> None:
        """CRIU returned: every uffd was handed over; register the mapped ranges, run ``check``
        (nothing touched them before: they were registered while the tree was stopped, so
        nothing can touch them from now on), then begin the installs."""
        assert self.server is not None
        if not self.handed.wait(timeout):
            raise StreamError(f"CRIU did not finish its lazy-pages hand-off within {timeout}s")
        if self.error is not None:
            raise StreamError(str(self.error))
        self._close_listener()
        self.server.register_mapped()
        if check is not None:
            check()
        self.server.start()

    def wait(self, timeout: float = 3600.0) -> StreamStats:
        assert self.server is not None
        stats = self.server.wait(timeout)
        self.served = True
        return stats

    def _close_listener(self) -> None:
        if self.listener is not None:
            self.listener.interrupt()
            self._receiver.join(5)
            self.listener.close()
            self.listener = None

    def abort(self) -> None:
        if self.server is not None and not self.served:
            self.server._fail("the restore failed")
            self.server.close()
        self.server = None
        self._close_listener()
