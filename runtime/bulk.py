"""Bulk pages beside CRIU: split them out of a dump, and fill them into a stopped restore.

CRIU restores a process's memory on one thread (~1-2 GB/s); a GPU process checkpointed by the
driver holds its whole device memory as one private anonymous mapping. So:

- :func:`split` (checkpoint side, after ``criu dump``): for every process, the present pagemap
  entries that lie in one plain private anonymous writable VMA are merged into runs; runs of at
  least ``min_run`` bytes (by default all) move out of CRIU's images. The process's pages file is renamed to
  ``bulk/pages-<pid>.bulk`` (no copy), a new pages file gets the bytes of the entries CRIU keeps,
  and the pagemap loses the moved entries outright (an entry kept with flags 0 makes CRIU's
  restorer spin). An entry straddling two VMAs stays with CRIU. Shared mappings, file mappings
  and read-only ones stay with CRIU (process_vm_writev cannot write read-only mappings). VMAs
  named in ``huge`` (the CUDA driver's host staging copy) get MADV_HUGEPAGE in mm-<pid>.img:
  CRIU applies madvise after its own page reads, so the empty range is THP-eligible before the
  fill; no other VMA changes, so the restored process has the advice the source had.
- :func:`fill` (restore side, CRIU ran with ``--leave-stopped``): N threads read each bulk file
  piece by piece into private buffers, hash exactly those bytes, and write them into the
  stopped process with process_vm_writev. A piece not in the page cache is first asked of the
  disk whole (``POSIX_FADV_WILLNEED``): the threads share one open file, whose readahead state
  their interleaved 1 MiB reads keep resetting; the advice keeps large requests queued however
  the threads interleave (``bench.disk_queue`` measures both). The caller resumes the process only when
  :func:`fill` returned, i.e. every file's digest matched the signed manifest; on any error it
  kills the stopped tree, which then never ran.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import logging
import mmap
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime import criu_image as img
from runtime.errors import RekindleError
from runtime.layout import BULK_DIR, CRIU_DIR, BulkFile, BulkRange, bulk_file, bulk_pagemap
from runtime.artifact import Artifact
from runtime.digests import WORKERS, combine_pieces, new_hash, piece_ranges
from runtime.pagecache import is_cached

log = logging.getLogger(__name__)

# Every run moves by default: CRIU restores small runs at ~1 GB/s (a page fault per 4 KiB page,
# on one thread): an LLM worker's 301 MiB of heap runs below 2 MiB took 0.27-0.64 s of CRIU's
# restore on the H200, and the fill writes them on many threads instead.
MIN_RUN = img.PAGE
CHUNK = 1 << 20  # per-thread buffer: hashed and written while still in the core's cache


class FillError(RekindleError):
    """Bulk pages could not be written into the restored process (or did not verify)."""


@dataclass(frozen=True)
class SplitStats:
    processes: int
    moved_bytes: int
    kept_bytes: int
    seconds: float


@dataclass(frozen=True)
class FillStats:
    bytes_read: int
    bytes_written: int
    seconds: float
    threads: int


# --- split ---------------------------------------------------------------------------------------

MAX_RANGES = 200_000  # per artifact: the restore plan lists each (about 45 bytes) and is capped


def _runs(pagemap: img.Pagemap, vmas: list[Any], min_run: int,
          cap: int = MAX_RANGES) -> tuple[list[BulkRange], set[int]]:
    """Bulk ranges of one process and the indexes of the pagemap entries they replace: at most
    ``cap`` ranges, the longest (shorter runs stay with CRIU)."""
    starts = [v.start for v in vmas]
    runs: list[tuple[int, int, int, list[int], int]] = []  # vaddr, length, offset, entries, vma
    offset = 0
    for idx, e in enumerate(pagemap.entries):
        if not img.has_data(e):
            continue
        length = img.nr_pages(e) * img.PAGE
        i = bisect.bisect_right(starts, e.vaddr) - 1
        vma_ok = i >= 0 and e.vaddr + length <= vmas[i].end and img.is_private_anon_writable(vmas[i])
        if vma_ok:
            last = runs[-1] if runs else None
            if (last is not None and last[4] == i and last[0] + last[1] == e.vaddr
                    and last[2] + last[1] == offset):
                runs[-1] = (last[0], last[1] + length, last[2], [*last[3], idx], i)
            else:
                runs.append((e.vaddr, length, offset, [idx], i))
        else:
            runs.append((e.vaddr, length, offset, [], -1))  # a barrier: nothing merges across it
        offset += length
    chosen = [r for r in runs if r[4] >= 0 and r[1] >= min_run]
    if len(chosen) > cap:
        chosen = sorted(chosen, key=lambda r: -r[1])[:cap]
        chosen.sort(key=lambda r: r[2])
    ranges, moved = [], set()
    for vaddr, length, off, entries, _vma in chosen:
        ranges.append(BulkRange(vaddr, length, off))
        moved.update(entries)
    return ranges, moved


def _kept_by_kind(pagemap: img.Pagemap, vmas: list[Any], moved: set[int], min_run: int) -> dict[str, int]:
    """Bytes left with CRIU, by why: what a benchmark needs to see where CRIU's time goes."""
    starts = [v.start for v in vmas]
    kinds: dict[str, int] = {}
    for idx, e in enumerate(pagemap.entries):
        if idx in moved or not img.has_data(e):
            continue
        length = img.nr_pages(e) * img.PAGE
        i = bisect.bisect_right(starts, e.vaddr) - 1
        if i < 0 or e.vaddr + length > vmas[i].end:
            kind = "straddling"
        elif img.is_private_anon_writable(vmas[i]):
            kind = f"anonymous runs < {min_run >> 10} KiB"
        elif vmas[i].status & img.VMA_ANON_SHARED:
            kind = "shared anonymous"
        elif vmas[i].status & (img.VMA_FILE_PRIVATE | img.VMA_FILE_SHARED):
            kind = "file-backed"
        elif not vmas[i].prot & img.PROT_WRITE:
            kind = "read-only anonymous"
        else:
            kind = "special"
        kinds[kind] = kinds.get(kind, 0) + length
    return kinds


def _copy_kept(pagemap: img.Pagemap, src: str, moved: set[int]) -> int:
    """Write the new pages file: the data of the entries CRIU keeps, in entry order."""
    kept = 0
    tmp = pagemap.pages_path + ".tmp"
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        offset = 0
        for idx, e in enumerate(pagemap.entries):
            if not img.has_data(e):
                continue
            length = img.nr_pages(e) * img.PAGE
            if idx not in moved:
                done = 0
                while done < length:
                    n = os.copy_file_range(fin.fileno(), fout.fileno(), length - done, offset + done)
                    if n <= 0:
                        raise OSError(errno.EIO, f"{src}: short copy at {offset + done}")
                    done += n
                kept += length
            offset += length
        fout.flush()
        os.fsync(fout.fileno())
    os.replace(tmp, pagemap.pages_path)
    return kept


HUGE_FALLBACK_MIN = 1 << 30


def _mark_huge(images: str, pid: int, ranges: Iterable[tuple[int, int]], bulk: list[BulkRange]) -> int:
    spans = list(ranges)
    if not spans and bulk:
        # The driver's staging copy was not seen appear (it may reuse a mapping): it is the
        # process's largest private anonymous run by far; mark that one VMA, if it is large.
        top = max(bulk, key=lambda r: r.length)
        if top.length >= HUGE_FALLBACK_MIN:
            spans = [(top.vaddr, top.vaddr + top.length)]
    if not spans:
        return 0
    mm = img.read_mm(images, pid)
    marked = 0
    for vma in mm.entry.vmas:
        if img.is_private_anon_writable(vma) and any(vma.start < end and start < vma.end for start, end in spans):
            vma.madv |= 1 << img.MADV_HUGEPAGE
            marked += 1
    if marked:
        img.write_mm(mm)
        log.info("pid %d: MADV_HUGEPAGE on %d VMA(s) for the fill: %s", pid, marked,
                 ", ".join(f"{a:#x}+{(b - a) >> 20}MiB" for a, b in spans))
    return marked


def split(artifact_dir: str, huge: Mapping[int, Sequence[tuple[int, int]]] | None = None,
          min_run: int = MIN_RUN) -> tuple[tuple[BulkFile, ...], SplitStats]:
    """Move the bulk page runs of the dump in ``artifact_dir/criu`` to ``artifact_dir/bulk``.

    ``huge`` maps each CUDA process (pid as the image numbers it) to the address ranges whose
    VMAs get MADV_HUGEPAGE (the driver's staging copy, seen appear at the CUDA checkpoint; when
    none was seen, the process's largest bulk run, if at least 1 GiB). Returns the bulk files."""
    t0 = time.monotonic()
    images = os.path.join(artifact_dir, CRIU_DIR)
    files, moved_total, kept_total = [], 0, 0
    pids = [e.pid for e in img.read_pstree(images)
            if os.path.exists(os.path.join(images, f"pagemap-{e.pid}.img"))]  # not zombies
    for pid in pids:
        pagemap = img.read_pagemap(images, pid)
        vmas = sorted(img.read_mm(images, pid).entry.vmas, key=lambda v: v.start)
        ranges, moved = _runs(pagemap, vmas, min_run, cap=MAX_RANGES // max(1, len(pids)))
        kept = _kept_by_kind(pagemap, vmas, moved, min_run)
        if kept:
            log.info("pid %d: left with CRIU: %s", pid, ", ".join(
                f"{v / 2**20:.1f} MiB {k}" for k, v in sorted(kept.items(), key=lambda kv: -kv[1])))
        if not ranges:
            continue
        os.makedirs(os.path.join(artifact_dir, BULK_DIR), mode=0o700, exist_ok=True)
        dest = os.path.join(artifact_dir, bulk_file(pid))
        os.rename(pagemap.pages_path, dest)
        shutil.copyfile(pagemap.path, os.path.join(artifact_dir, bulk_pagemap(pid)))
        kept_total += _copy_kept(pagemap, dest, moved)
        img.write_pagemap(pagemap, [e for i, e in enumerate(pagemap.entries) if i not in moved])
        if huge is not None and pid in huge:  # a CUDA process
            _mark_huge(images, pid, huge[pid], ranges)
        files.append(BulkFile(pid, bulk_file(pid), pagemap.pages_id, tuple(ranges)))
        moved_total += sum(r.length for r in ranges)
    stats = SplitStats(len(files), moved_total, kept_total, time.monotonic() - t0)
    log.info("bulk split: %d processes, %.1f MiB to bulk files, %.1f MiB left with CRIU, %.2fs",
             stats.processes, moved_total / 2**20, kept_total / 2**20, stats.seconds)
    return tuple(files), stats


# --- fill ----------------------------------------------------------------------------------------

class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                               ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
_process_vm_writev.restype = ctypes.c_ssize_t


def write_remote(pid: int, local: int, remote: int, length: int) -> None:
    """Copy ``length`` bytes at our address ``local`` to ``remote`` in process ``pid``
    (ctypes drops the GIL for the call, so threads copy in parallel)."""
    while length:
        liov, riov = _Iovec(local, length), _Iovec(remote, length)
        n = _process_vm_writev(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, f"process_vm_writev(pid {pid}, {remote:#x}+{length}): {os.strerror(err)}")
        if n == 0:
            raise OSError(errno.EFAULT, f"process_vm_writev(pid {pid}, {remote:#x}): nothing written")
        local, remote, length = local + n, remote + n, length - n


@dataclass(frozen=True)
class _Piece:
    file: int
    offset: int
    length: int


class _Filler:
    def __init__(self, fds: list[int], pids: list[int], files: Sequence[BulkFile],
                 progress: Callable[[int], None] | None) -> None:
        self.fds, self.pids = fds, pids
        # (file offset, vaddr, length) of each range, by file, sorted by offset
        self.segments = [sorted((r.offset, r.vaddr, r.length) for r in f.ranges) for f in files]
        self.progress = progress
        self.local = threading.local()
        self.lock = threading.Lock()
        self.read = self.written = 0

    def _buffer(self) -> tuple[mmap.mmap, memoryview, int]:
        buf = getattr(self.local, "buf", None)
        if buf is None:
            m = mmap.mmap(-1, CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
            buf = self.local.buf = (m, memoryview(m), addr)
        return buf

    def piece(self, p: _Piece) -> bytes:
        _m, view, addr = self._buffer()
        fd, pid, segs = self.fds[p.file], self.pids[p.file], self.segments[p.file]
        digest = new_hash()
        pos, end, written = p.offset, p.offset + p.length, 0
        if not is_cached(fd, pos, p.length):
            try:
                os.posix_fadvise(fd, pos, p.length, os.POSIX_FADV_WILLNEED)
            except OSError:  # a hint: the reads below still read it
                pass
        while pos < end:
            want = min(CHUNK, end - pos)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], pos + got)
                if n <= 0:
                    raise FillError(f"bulk file shrank while read (at {pos + got})")
                got += n
            digest.update(view[:want])
            # Write exactly the bytes just hashed: the ones that overlap a range.
            i = max(bisect.bisect_right(segs, (pos, 1 << 64, 0)) - 1, 0)
            while i < len(segs) and segs[i][0] < pos + want:
                off, vaddr, length = segs[i]
                lo, hi = max(off, pos), min(off + length, pos + want)
                if lo < hi:
                    write_remote(pid, addr + (lo - pos), vaddr + (lo - off), hi - lo)
                    written += hi - lo
                i += 1
            pos += want
        with self.lock:
            self.read += p.length
            self.written += written
            done = self.read
        if self.progress is not None:
            self.progress(done)
        return digest.digest()


def fill(artifact: Artifact, files: Sequence[BulkFile], fds: Sequence[int], pid_of: Callable[[int], int],
         threads: int = WORKERS, progress: Callable[[int], None] | None = None) -> FillStats:
    """Write every bulk file (``fds[i]`` is ``files[i]``, opened by the caller through
    ``artifact``) into its stopped process; FillError unless all bytes were written and every
    file's digest matched the manifest."""
    t0 = time.monotonic()
    try:
        pids = [pid_of(f.pid) for f in files]
        pieces: list[_Piece] = []
        sizes = []
        for i, (f, fd) in enumerate(zip(files, fds, strict=True)):
            size = os.fstat(fd).st_size
            if size != artifact.entry(f.path).size:
                raise FillError(f"{artifact.label}: {f.path} is {size} bytes, the manifest says "
                                f"{artifact.entry(f.path).size}")
            if any(r.offset + r.length > size for r in f.ranges):
                raise FillError(f"{artifact.label}: {f.path}: a range lies past the end of the file")
            sizes.append(size)
            pieces.extend(_Piece(i, off, length) for off, length in piece_ranges(size))
        filler = _Filler(list(fds), pids, files, progress)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="rekindle-fill") as pool:
            digests = list(pool.map(filler.piece, pieces))
        by_file: list[list[bytes]] = [[] for _ in files]
        for p, d in zip(pieces, digests):
            by_file[p.file].append(d)
        for f, size, got in zip(files, sizes, by_file):
            artifact.check(f.path, size, combine_pieces(size, got))
    except OSError as exc:
        raise FillError(f"{artifact.label}: bulk fill failed: {exc}") from exc
    stats = FillStats(filler.read, filler.written, time.monotonic() - t0, threads)
    log.info("bulk fill: %.1f MiB read and verified, %.1f MiB written, %d threads, %.2fs (%.2f GB/s)",
             stats.bytes_read / 2**20, stats.bytes_written / 2**20, threads, stats.seconds,
             stats.bytes_read / 1e9 / max(stats.seconds, 1e-9))
    return stats


# --- the stopped tree ----------------------------------------------------------------------------

def _task_states(pid: int) -> list[str]:
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        raise FillError(f"restored process {pid} is gone") from None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
    return states


def wait_stopped(pids: Iterable[int], timeout: float = 10.0) -> None:
    """Wait until every thread of every process is stopped: ``criu restore --leave-stopped`` can
    return before the last thread has stopped, and a thread running on before the fill would
    compute on zero pages."""
    pending = list(pids)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [p for p in pending if any(s not in ("T", "t") for s in _task_states(p))]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise FillError(f"restored processes {pending} did not stop within {timeout}s")
        time.sleep(0.002)


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_all(pids: Iterable[int]) -> None:
    signal_all(pids, signal.SIGKILL)
