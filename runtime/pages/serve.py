"""The page server of a streamed restore: which piece goes where and when, faults, and events.

- N install threads install the bulk files' 2 MiB pieces in address order (the mapped ranges'
  first, then those holding a ``first`` span: the CUDA driver's host copy), and fault-serving
  threads install first the piece holding an address the tree touched; an event-reading thread
  keeps the address-space events (FORK, REMAP, REMOVE, UNMAP) apace, so an install that the
  kernel refuses while the space changes (EAGAIN) goes on as soon as the event is read.
- Every piece comes from its :class:`~runtime.pages.source.PieceSource`, each chunk hashed and
  compared with its digest before any of its bytes goes in, and goes through a
  :mod:`~runtime.pages.sink`: copied (``UFFDIO_COPY`` leaves a page already present alone:
  nothing the kernel or the process wrote after CRIU is overwritten), or, for a mapped range,
  written into its file once and let go in every tree that maps it. A fault outside every bulk
  range (a hole, or a range the process discarded since) gets zero pages. A mismatch kills the
  tree before the next piece.
- Mapped ranges are registered in missing and minor mode on their task's uffd before the tree
  runs (:meth:`Server.register_mapped`), so every touch of them is the server's, whether its
  page is in the file yet or not.
- What a serve may cost, whatever the restored tree does (it forks, moves its memory), is
  bounded (:class:`Limits`): past it the serve fails closed.
"""

from __future__ import annotations

import bisect
import collections
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from runtime.digests import WORKERS
from runtime.errors import Reason, RekindleError
from runtime.layout import BulkFile
from runtime.pages import chunks, uffd
from runtime.pages.book import MappedBook
from runtime.pages.sink import Copy, EntryFiles, LetGo, Mapped, Sink, Zero
from runtime.pages.source import PIECE, Piece, PieceSource

log = logging.getLogger(__name__)

FAULT_THREADS = 2
MOVE_ROUNDS = 8  # copies of one piece into one space moved meanwhile, before it waits its turn again


class StreamError(RekindleError):
    """The streamed restore failed: the tree was killed (or never ran)."""

    reason_class = Reason.CRIU  # most: CRIU's lazy-pages hand-off


class StreamIntegrityError(StreamError):
    """A bulk file off its ranges or chunk digests while served."""

    reason_class = Reason.INTEGRITY


class Holding(Protocol):
    """The second holder of every uffd the server serves (``runtime.pages.stream.Holder``)."""

    def hold(self, fds: Sequence[int], wait: bool = False) -> list[int]: ...

    def drop(self, number: int) -> None: ...

    def done(self) -> None: ...

    def abort(self) -> None: ...


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
    zero_bytes: int = 0  # of those verified: zero chunks that are holes, installed as zero pages


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
    zero: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Server:
    """Serves the bulk files ``files`` (read through ``fds``) into the tasks whose uffds are
    handed over by :meth:`add` (pid in the image, uffd: this object owns it from then on).
    Faults are served from the first uffd on (CRIU's restorer, and the kernel for it, may touch
    lazy memory before CRIU is done); :meth:`start` begins the installs (after CRIU's RSTF:
    every range is registered at its place then)."""

    def __init__(self, label: str, files: Sequence[BulkFile], fds: Sequence[int],
                 sums: Sequence[bytes], kill: Callable[[], object],
                 threads: int = WORKERS, holder: Holding | None = None,
                 progress: Callable[[int], None] | None = None,
                 first: Sequence[tuple[int, int, int]] = (), mapped: Sequence[Mapped] = (),
                 book: MappedBook | None = None, limits: Limits = Limits(), let_go: Sink | None = None) -> None:
        """``first``: (pid, start, end) address spans whose pieces are installed before the rest
        (the CUDA driver's host copy, which its restore reads while the pieces arrive).
        ``mapped``: ranges of ``files`` the tree maps from files the serve writes (each a whole
        range of its process's bulk file): let go, not copied; they go first of all. ``book``: the
        state of their files' pieces, when other restores write them too (else this serve's own).
        ``limits``: what the serve may cost before it fails closed. ``let_go``: how a mapped
        piece in its file is let go (:class:`~runtime.pages.sink.LetGo` unless given)."""
        self.label, self.kill, self.holder, self.progress = label, kill, holder, progress
        self.let_go: Sink = let_go if let_go is not None else LetGo()
        self.limits = limits
        self.threads = max(0, threads)
        self.source = PieceSource(files, fds, sums)
        self.pieces: list[Piece] = []
        self.first: list[int] = []  # of each file's pieces: its piece at offset o is first + o // PIECE
        for i, (f, size) in enumerate(zip(files, self.source.sizes, strict=True)):
            self.first.append(len(self.pieces))
            if not self.source.matches(i):
                self.source.close()
                raise StreamIntegrityError(f"{label}: {f.path} does not match its ranges or chunk digests")
            for off in range(0, size, PIECE):
                self.pieces.append(Piece(len(self.pieces), i, off, min(PIECE, size - off)))
        self.files = list(files)
        # Mapped ranges: a pseudo-file each (index len(files) + k), its pieces 2 MiB of its map file.
        pairs: list[tuple[Mapped, int]] = []  # (range, its bulk file's index)
        for m in mapped:
            src = next((i for i, f in enumerate(self.files)
                        if f.pid == m.span.pid and any((r.vaddr, r.length, r.offset) ==
                                                       (m.span.vaddr, m.span.length, m.span.offset)
                                                       for r in f.ranges)), -1)
            if src < 0:
                self.source.close()
                raise StreamIntegrityError(f"{label}: mapped range {m.span.vaddr:#x} of pid {m.span.pid} "
                                           "is no bulk range")
            pairs.append((m, src))
            self.first.append(len(self.pieces))
            for off in range(0, m.span.file_size, PIECE):
                lo, hi = max(off, m.span.file_offset), min(off + PIECE, m.span.file_size)
                self.pieces.append(Piece(len(self.pieces), len(self.files) + len(pairs) - 1, lo, hi - lo))
        try:
            self.entry = EntryFiles(pairs, book)
        except BaseException:
            self.source.close()
            raise
        self.book = self.entry.book
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

    def _is_mapped(self, p: Piece) -> bool:
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
        mine = [(k, m) for k, (m, _src) in enumerate(self.entry.mapped) if m.span.pid == pid]
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
                            round(c.release, 3), c.zero)
        log.info("stream: %.1f MiB verified, %.1f MiB installed, %d faults (%d pieces first by fault, "
                 "waited %.2fs in all, %.3fs at most), %d forks, %d threads, %.2fs (%.2f GB/s; thread-seconds: "
                 "read %.2f, hash %.2f, install %.2f; %d retries; %.1f MiB mapped; %.1f MiB zero pages)",
                 stats.bytes_verified / 2**20, stats.bytes_installed / 2**20, stats.faults,
                 stats.pieces_by_fault, stats.fault_wait_s, stats.fault_wait_max_s, stats.forks,
                 stats.threads, stats.seconds, stats.bytes_verified / 1e9 / max(stats.seconds, 1e-9),
                 stats.read_s, stats.hash_s, stats.install_s, stats.retries, stats.mapped_bytes / 2**20,
                 stats.zero_bytes / 2**20)
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
        self.source.close()
        self.entry.close()
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

    def _read_verified(self, p: Piece) -> Sink:
        """How to install piece ``p``: its bytes read into private memory and verified, or,
        where every chunk of it is a zero chunk that is a hole, zero pages."""
        addr, spent = self.source.read(p)
        self._verified(spent.verified, spent.read_s, spent.hash_s)
        if spent.zero == spent.verified:
            with self.counters.lock:
                self.counters.zero += spent.zero
            return Zero()
        return Copy(addr)

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

    def _release_into(self, t: _Target, p: Piece) -> None:
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
            for dst, off, n in segs:
                if self._stop.is_set():
                    return
                try:
                    released += self.let_go.put(fd, dst, off - p.offset, n)
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
                try:
                    spent = self.entry.write(p.file - len(self.files), p, self.source)
                except (StreamError, chunks.IntegrityError, OSError) as exc:
                    self._fail(str(exc))
                    return
                if spent is not None:
                    self._verified(p.length, spent.read_s, spent.hash_s)
                if by_fault:
                    with self.counters.lock:
                        self.counters.by_fault += 1
                for t in needing:
                    self._release_into(t, p)
                return
            try:
                sink = self._read_verified(p)
            except (StreamError, chunks.IntegrityError) as exc:
                self._fail(str(exc))
                return
            if by_fault:
                with self.counters.lock:
                    self.counters.by_fault += 1
            for t in needing:
                self._install_into(t, p, sink)

    def _segments(self, t: _Target, p: Piece) -> list[tuple[int, int, int]]:
        """(dst, offset in the piece, length) of ``p``'s bytes in ``t`` now."""
        return [(dst, off - p.offset, n) for dst, off, n in t.spans(p.file, p.offset, p.offset + p.length)]

    def _pieces_of(self, file: int, lo: int, hi: int) -> range:
        """The ids of ``file``'s pieces holding any of [lo, hi)."""
        return range(self.first[file] + lo // PIECE, self.first[file] + -(-hi // PIECE))

    def _install_into(self, t: _Target, p: Piece, sink: Sink) -> None:
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
                        installed += sink.put(fd, dst, rel, length)
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
