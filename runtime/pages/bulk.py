"""Bulk pages beside CRIU: split them out of a dump, and fill them into a stopped restore.

CRIU restores a process's memory on one thread (~1-2 GB/s); a GPU process checkpointed by the
driver holds its whole device memory as one private anonymous mapping. So:

- :func:`split` (checkpoint side, after ``criu dump``): for every process, the present pagemap
  entries that lie in one plain private anonymous writable VMA are merged into runs; runs of at
  least ``min_run`` bytes (by default all) move out of CRIU's images. The process's pages file is renamed to
  ``bulk/pages-<pid>.bulk`` (no copy), a new pages file gets the bytes of the entries CRIU keeps,
  which are then punched out of the bulk file (``runtime.pages.holes``; its offsets stay, so
  each byte is stored once, where a file system can punch), and the pagemap loses the moved entries outright (an entry kept with flags 0 makes CRIU's
  restorer spin). An entry straddling two VMAs stays with CRIU. File mappings and read-only
  ones stay with CRIU (process_vm_writev cannot write read-only mappings), and so does
  whatever is written into the process after CRIU restored it and before the fill
  (``runtime.criu.image_files.written_after_restore``: the VMAs a pending signal's frame can land in, each
  thread's rseq area), which the fill would otherwise overwrite with the dumped bytes. A shared
  anonymous segment (``pagemap-shmem-<shmid>.img``: an engine's pinned host buffers, which CRIU
  restores on one thread, ~1.6 GB/s) moves the same way to ``bulk/shmem-<shmid>.bulk``,
  addressed through the process whose writable mapping of it holds the most; CRIU then makes
  the segment empty, and every route fills it before the tree runs (CRIU has no lazy pages for
  shared memory). The
  digest of each SUM_CHUNK of the punched bulk file goes to ``bulk/pages-<pid>.sums``. VMAs
  named in ``huge`` (the CUDA driver's host staging copy) get MADV_HUGEPAGE in mm-<pid>.img:
  CRIU applies madvise after its own page reads, so the empty range is THP-eligible before the
  fill; no other VMA changes, so the restored process has the advice the source had.
- :func:`fill` (restore side, CRIU ran with ``--leave-stopped``): first :func:`check_targets`
  (every range in private anonymous writable memory of a process CRIU restored, no stack; a
  segment's in a writable shared mapping of it) and
  :func:`assert_untouched` (no page of a range written yet); then N threads read each bulk file
  1 MiB at a time into private buffers, hash exactly those bytes, compare the digest with the
  signed one, and only then write them into the stopped process with process_vm_writev. A
  piece not in the page cache is first asked of the disk whole (``POSIX_FADV_WILLNEED``): the
  threads share one open file, whose readahead state their interleaved 1 MiB reads keep
  resetting; the advice keeps large requests queued however the threads interleave
  (``bench.disk_queue`` measures both). From a node cache entry (sealed, verified when it was
  written) the bytes are copied straight from a read-only mapping of its file, not hashed again.
  The caller resumes the process only when :func:`fill` returned; on any error it kills the
  stopped tree, which then never ran.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime import digests, layout, libc
from runtime.criu import image_files as img
from runtime.digests import WORKERS, Hashed, new_hash, piece_ranges
from runtime.errors import Reason, RekindleError
from runtime.fs import holes
from runtime.layout import (
    BULK_DIR,
    CRIU_DIR,
    DIGEST_BYTES,
    SUM_CHUNK,
    AnyBulkFile,
    BulkFile,
    BulkRange,
    SharedBulkFile,
    bulk_file,
    bulk_pagemap,
)
from runtime.pages import chunks, tailhash
from runtime.pages.filemap import FileMap
from runtime.store import Artifact

log = logging.getLogger(__name__)

# Every run moves by default: CRIU restores small runs at ~1 GB/s (a page fault per 4 KiB page,
# on one thread): an LLM worker's 301 MiB of heap runs below 2 MiB took 0.27-0.64 s of CRIU's
# restore on the H200, and the fill writes them on many threads instead.
MIN_RUN = img.PAGE
CHUNK = SUM_CHUNK  # per-thread buffer: hashed and written while still in the core's cache


def fill_threads(asked: int = 0) -> int:
    """The fill's threads: ``asked``, else one per core, up to 16 (:data:`WORKERS`). The fill is
    bound by memory bandwidth (zeroing, copying and hashing every page); more did worse: on the
    two-H200 machine (32 vCPUs), 49 GiB filled at 9.5-10.3 GB/s on 32 threads against 14.3 on
    16, and the CUDA restore after it took 8.1-8.2 s against 7.0."""
    return asked if asked > 0 else WORKERS


# Pieces filled at once by all the fills of this process: restores started together (pods
# scaling out on one node) share the cores instead of each running one thread per core.
_FILLING = threading.BoundedSemaphore(WORKERS)


class FillError(RekindleError):
    """Bulk pages could not be written into the restored process (or did not verify)."""

    reason_class = Reason.INTEGRITY  # a chunk off its digest, a range off the restored tree


@dataclass(frozen=True)
class SplitStats:
    processes: int
    moved_bytes: int
    kept_bytes: int
    seconds: float
    punched_bytes: int = 0  # of kept_bytes, punched out of the bulk files (stored once, by CRIU)
    zero_bytes: int = 0  # of moved_bytes, whole zero chunks punched out (stored as nothing)
    # Shared anonymous memory (MAP_SHARED|MAP_ANONYMOUS: an engine's pinned host buffers), as
    # CRIU dumped it, and how much of it moved to bulk files of its own (:func:`split_shared`)
    shared_bytes: int = 0
    shared_moved_bytes: int = 0

    def as_record(self) -> dict[str, int]:
        """The byte counts, for ``timings.json``."""
        return {"processes": self.processes, "moved_bytes": self.moved_bytes, "kept_bytes": self.kept_bytes,
                "punched_bytes": self.punched_bytes, "zero_bytes": self.zero_bytes,
                "shared_bytes": self.shared_bytes, "shared_moved_bytes": self.shared_moved_bytes}


@dataclass(frozen=True)
class FillStats:
    bytes_read: int
    bytes_written: int
    seconds: float
    threads: int


# --- split ---------------------------------------------------------------------------------------

MAX_RANGES = layout.MAX_BULK_RANGES  # per artifact: the restore plan lists each and is capped
# A zero run this long inside a range becomes a range of its own (an engine's KV pool in the
# driver's host copy): the node cache maps no all-zero range (runtime.pages.mapping), so it stays
# anonymous memory, which reads as the zero page, where a mapped cache file would allocate a
# zeroed page for each one read (tmpfs has no zero page for a mapping).
ZERO_APART = 64 << 20
# A shared segment with fewer bytes than this stays with CRIU: its fill's fixed costs (the targets'
# checks, a thread pool: 0.04 s for the LLM worker's seven CUDA segments of 2-8 MiB, 21 MB in all,
# on the H100) exceed CRIU's one thread (~1.6 GB/s: 0.013 s for those).
SHARED_MIN = 16 << 20


_NOTHING = img.Written((), ())


def _movable(vma: Any, written: img.Written) -> bool:
    return img.is_private_anon_writable(vma) and (vma.start, vma.end) not in written.vmas


def _cut(entries: Sequence[Any], pages: Sequence[tuple[int, int]]) -> list[Any]:
    """``entries`` with each one that overlaps a span of ``pages`` cut at the span's edges, so
    that those pages can stay with CRIU alone (the pages file's order is unchanged)."""
    if not pages:
        return list(entries)
    pinned = img.Written((), tuple(pages))
    out = []
    for e in entries:
        lo, hi = e.vaddr, e.vaddr + img.nr_pages(e) * img.PAGE
        if not img.has_data(e) or not pinned.hits(lo, hi):
            out.append(e)
            continue
        cuts = sorted({x for a, b in pages for x in (a, b) if lo < x < hi})
        if not cuts:
            out.append(e)
            continue
        for a, b in zip([lo, *cuts], [*cuts, hi]):
            part = type(e)()
            part.CopyFrom(e)
            part.vaddr, part.compat_nr_pages = a, (b - a) // img.PAGE
            if e.HasField("nr_pages"):
                part.nr_pages = (b - a) // img.PAGE
            out.append(part)
    return out


def _runs(pagemap: img.Pagemap, vmas: list[Any], min_run: int, cap: int = MAX_RANGES,
          written: img.Written = _NOTHING) -> tuple[list[BulkRange], set[int]]:
    """Bulk ranges of one process and the indexes of the pagemap entries they replace: at most
    ``cap`` ranges, the longest (shorter runs stay with CRIU). What is ``written`` after CRIU
    restored the process (:func:`runtime.criu.image_files.written_after_restore`) stays with CRIU: those
    VMAs whole, those pages (entries cut at them, :func:`_cut`)."""
    starts = [v.start for v in vmas]
    runs: list[tuple[int, int, int, list[int], int]] = []  # vaddr, length, offset, entries, vma
    offset = 0
    for idx, e in enumerate(pagemap.entries):
        if not img.has_data(e):
            continue
        length = img.nr_pages(e) * img.PAGE
        i = bisect.bisect_right(starts, e.vaddr) - 1
        vma_ok = (i >= 0 and e.vaddr + length <= vmas[i].end and _movable(vmas[i], written)
                  and not written.hits(e.vaddr, e.vaddr + length))
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


def _shmem_pagemaps(images: str) -> dict[int, str]:
    """CRIU's shared memory pagemaps (``pagemap-shmem-<shmid>.img``), by shmid."""
    out = {}
    for name in sorted(os.listdir(images)):
        if name.startswith("pagemap-shmem-") and name.endswith(".img") and name[14:-4].isdigit():
            out[int(name[14:-4])] = os.path.join(images, name)
    return out


def shared_memory_bytes(images: str) -> int:
    """The bytes of shared memory in CRIU's images (``pagemap-shmem-<id>.img``)."""
    return sum(img.nr_pages(e) * img.PAGE for path in _shmem_pagemaps(images).values()
               for e in img.read_pagemap_at(path).entries if img.has_data(e))


def _segment(vma: Any, memfds: Mapping[int, int]) -> int | None:
    """The shared memory segment a VMA maps (the id of its ``pagemap-shmem-<id>.img``): through
    a memfd (how CRIU 4.x dumps shared anonymous memory too; ``memfds`` from
    :func:`runtime.criu.image_files.memfd_segments`) or as shared anonymous memory itself
    (older CRIU); None for anything else, SysV IPC included."""
    if vma.status & img.VMA_AREA_MEMFD:
        return memfds.get(int(vma.shmid))
    if vma.status & img.VMA_ANON_SHARED and not vma.status & img.VMA_AREA_SYSVIPC:
        return int(vma.shmid)
    return None


def _writable_window(vma: Any, shmid: int, memfds: Mapping[int, int]) -> tuple[int, int] | None:
    """The part of segment ``shmid`` (offsets) that ``vma`` maps shared and writable (not with
    huge pages), or None."""
    if (_segment(vma, memfds) != shmid or not vma.status & img.VMA_AREA_REGULAR
            or vma.status & (img.VMA_EXT_PLUGIN | img.VMA_UNSUPP) or not vma.prot & img.PROT_WRITE
            or not vma.flags & img.MAP_SHARED or vma.flags & img.MAP_HUGETLB):
        return None
    return int(vma.pgoff), int(vma.pgoff) + int(vma.end - vma.start)


def _shared_runs(pagemap: img.Pagemap, vma: Any, min_run: int, cap: int) -> tuple[list[BulkRange], set[int]]:
    """Bulk ranges of a shared segment, at ``vma``'s addresses (its pagemap's vaddr are offsets
    in the segment), and the entries they replace: what lies wholly inside the window ``vma``
    maps; at most ``cap`` ranges, the longest."""
    lo, hi = int(vma.pgoff), int(vma.pgoff) + int(vma.end - vma.start)
    runs: list[tuple[int, int, int, list[int]]] = []  # segment offset, length, file offset, entries
    offset, barrier = 0, True
    for idx, e in enumerate(pagemap.entries):
        if not img.has_data(e):
            continue
        length = img.nr_pages(e) * img.PAGE
        if lo <= e.vaddr and e.vaddr + length <= hi:
            last = runs[-1] if runs and not barrier else None
            if last is not None and last[0] + last[1] == e.vaddr and last[2] + last[1] == offset:
                runs[-1] = (last[0], last[1] + length, last[2], [*last[3], idx])
            else:
                runs.append((int(e.vaddr), length, offset, [idx]))
            barrier = False
        else:
            barrier = True
        offset += length
    chosen = [r for r in runs if r[1] >= min_run]
    if len(chosen) > cap:
        chosen = sorted(sorted(chosen, key=lambda r: -r[1])[:cap], key=lambda r: r[2])
    start = int(vma.start) - lo
    return ([BulkRange(start + seg, length, off) for seg, length, off, _ in chosen],
            {i for *_x, entries in chosen for i in entries})


def zeros_apart(ranges: Sequence[BulkRange], sums: bytes, room: int,
                min_len: int = ZERO_APART) -> list[BulkRange]:
    """``ranges`` with each run of at least ``min_len`` bytes of whole zero chunks inside one
    (by the bulk file's digests ``sums``) a range of its own, the longest first while ``room``
    ranges may be added; the same bytes at the same places."""
    runs = sorted(((b - a, k, a, b) for k, r in enumerate(ranges)
                   for a, b in chunks.zero_runs(sums, r.offset, r.offset + r.length, min_len)), reverse=True)
    cuts: dict[int, list[tuple[int, int]]] = {}
    for _n, k, a, b in runs:
        r = ranges[k]
        added = (a > r.offset) + (b < r.offset + r.length)
        if added > room:
            continue
        room -= added
        cuts.setdefault(k, []).append((a, b))
    out: list[BulkRange] = []
    for k, r in enumerate(ranges):
        at = r.offset
        for a, b in sorted(cuts.get(k, [])):
            for lo, hi in ((at, a), (a, b)):
                if hi > lo:
                    out.append(BulkRange(r.vaddr + lo - r.offset, hi - lo, lo))
            at = b
        if at < r.offset + r.length:
            out.append(BulkRange(r.vaddr + at - r.offset, r.offset + r.length - at, at))
    return out


def _kept_by_kind(pagemap: img.Pagemap, vmas: list[Any], moved: set[int], min_run: int,
                  written: img.Written = _NOTHING,
                  inherited: frozenset[tuple[int, int]] = frozenset()) -> dict[str, int]:
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
        elif (vmas[i].start, vmas[i].end) in inherited:
            kind = "copy-on-write with a parent or child"
        elif written.hits(e.vaddr, e.vaddr + length):
            kind = "stacks and rseq areas"
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


def _kept_spans(pagemap: img.Pagemap, moved: set[int]) -> list[tuple[int, int]]:
    """``(offset, length)`` in the old pages file of each entry CRIU keeps (merged)."""
    spans, offset = [], 0
    for idx, e in enumerate(pagemap.entries):
        if not img.has_data(e):
            continue
        length = img.nr_pages(e) * img.PAGE
        if idx not in moved:
            spans.append((offset, length))
        offset += length
    return holes.merge(spans)


@dataclass(frozen=True)
class _Punched:
    punched: int  # bytes punched out
    hashed: Hashed | None  # what the punched file hashes to, where the head start could be kept


def _punch_kept(path: str, pagemap: img.Pagemap, moved: set[int], ahead: Hashed | None) -> _Punched:
    """Punch the bytes CRIU keeps (copied into its new pages file) out of the bulk file at
    ``path``: they would be stored twice (a forked tree's copy-on-write memory stays with CRIU
    whole). Offsets do not move, so the ranges still point at their bytes. ``ahead`` (hashed
    while CRIU wrote the file) is brought up to date by hashing again only the pieces punched."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fresh = ahead if ahead is not None and ahead.matches(os.fstat(fd)) else None
        punched = holes.punch(fd, _kept_spans(pagemap, moved))
        if fresh is not None and punched:
            fresh = tailhash.rehash(fd, fresh, punched, workers=WORKERS)
        return _Punched(sum(n for _o, n in punched), fresh)
    finally:
        os.close(fd)


def _data_offsets(entries: Sequence[Any]) -> list[tuple[int, int, int]]:
    """``(vaddr, end, offset in the pages file)`` of each entry whose pages the file holds."""
    out, offset = [], 0
    for e in entries:
        if img.has_data(e):
            length = img.nr_pages(e) * img.PAGE
            out.append((int(e.vaddr), int(e.vaddr) + length, offset))
            offset += length
    return out


def rejoin(kept: img.Pagemap, whole: img.Pagemap, kept_pages: str, whole_pages: str) -> int:
    """Write the bytes CRIU keeps (``kept_pages``, laid out by ``kept``) back into
    ``whole_pages``, a private copy of the bulk file laid out by ``whole`` (the pagemap before
    the split), whose copies of them were punched out: CRIU alone restores from the result (the
    stock path). Returns the bytes written."""
    spans = _data_offsets(whole.entries)
    starts = [s[0] for s in spans]
    written = 0
    with open(kept_pages, "rb") as fin, open(whole_pages, "r+b") as fout:
        for vaddr, end, src in _data_offsets(kept.entries):
            i = bisect.bisect_right(starts, vaddr) - 1
            if i < 0 or end > spans[i][1]:
                raise OSError(errno.EINVAL, f"{kept.path}: entry at {vaddr:#x} is not in {whole.path}")
            dst, done = spans[i][2] + vaddr - spans[i][0], 0
            while done < end - vaddr:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), end - vaddr - done, src + done, dst + done)
                if n <= 0:
                    raise OSError(errno.EIO, f"{kept_pages}: short copy at {src + done}")
                done += n
            written += done
    return written


def _punch_zero(path: str, sums: bytes, hashed: MutableMapping[str, Hashed]) -> int:
    """Punch each chunk of the bulk file at ``path`` whose digest in ``sums`` is that of zeros
    (an engine's KV cache, memory touched and never written): stored as nothing, and read and
    hashed as nothing at restore (:mod:`runtime.pages.chunks`). The file's content, so its
    digests, do not change; a digest hashed ahead of it is kept with the new mtime. Returns the
    bytes that held data before."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        ahead = hashed.get(path)
        fresh = ahead is not None and ahead.matches(st)
        zero = []
        for i, off in enumerate(range(0, st.st_size, SUM_CHUNK)):
            n = min(SUM_CHUNK, st.st_size - off)
            if chunks.is_zero(sums[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES], n) and not holes.is_hole(fd, off, off + n):
                zero.append((off, n))
        done = holes.punch(fd, zero)
        if ahead is not None and fresh and done:
            hashed[path] = dataclasses.replace(ahead, mtime_ns=os.fstat(fd).st_mtime_ns)
        return sum(n for _o, n in done)
    finally:
        os.close(fd)


def _chunk_digest(fd: int, offset: int, length: int) -> bytes:
    digest, done = new_hash(), 0
    while done < length:
        data = os.pread(fd, min(CHUNK, length - done), offset + done)
        if not data:
            raise OSError(errno.EIO, "bulk file shrank while hashed")
        digest.update(data)
        done += len(data)
    return digest.digest()


def write_sums(bulk_path: str, sums_path: str) -> None:
    """The digest of each SUM_CHUNK of ``bulk_path``, in order (the fill checks each chunk
    before it writes it; the manifest signs this file like any other)."""
    fd = os.open(bulk_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rekindle-sums") as pool:
            sums = list(pool.map(lambda off: _chunk_digest(fd, off, min(SUM_CHUNK, size - off)),
                                 range(0, size, SUM_CHUNK)))
    finally:
        os.close(fd)
    _write_sums_file(sums_path, b"".join(sums))


def _write_sums_file(sums_path: str, data: bytes) -> None:
    tmp = sums_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, sums_path)


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


def _inherited(procs: Sequence[img.PstreeEntry], vmas_of: Mapping[int, list[Any]]) -> dict[int, frozenset[tuple[int, int]]]:
    """Per process, the private anonymous VMAs it has at the very place its parent in the tree
    has one: inherited at a fork, their pages shared copy-on-write. CRIU restores such a VMA in
    the parent before the fork and keeps in the child each page equal to the parent's (shared
    again); a fill writes each process's copy privately, doubling a forked tree's memory. So
    they stay with CRIU, in both processes."""
    spans = {pid: {(v.start, v.end) for v in vmas if img.is_private_anon_writable(v)} for pid, vmas in vmas_of.items()}
    out: dict[int, set[tuple[int, int]]] = {p.pid: set() for p in procs}
    for p in procs:
        if p.ppid in spans:
            common = spans[p.pid] & spans[p.ppid]
            out[p.pid] |= common
            out[p.ppid] |= common
    return {pid: frozenset(v) for pid, v in out.items()}


@dataclass(frozen=True)
class _Moved:
    kept: int  # bytes left with CRIU (its new pages file)
    punched: int  # of them, punched out of the bulk file
    zero: int  # bytes of whole zero chunks punched out of the bulk file
    sums: bytes  # the bulk file's chunk digests


def _move_out(artifact_dir: str, pagemap: img.Pagemap, dest: str, original: str, moved: set[int],
              hashed: MutableMapping[str, Hashed]) -> _Moved:
    """The entries ``moved`` of ``pagemap`` leave CRIU's images: its pages file becomes the bulk
    file ``dest`` (renamed, no copy), its pagemap is kept as ``original`` (the stock path), CRIU
    gets a new pages file of what it keeps, which is punched out of the bulk file as are its
    zero chunks, and the chunk digests are written beside it."""
    os.makedirs(os.path.join(artifact_dir, BULK_DIR), mode=0o700, exist_ok=True)
    dest, ahead = os.path.join(artifact_dir, dest), hashed.pop(pagemap.pages_path, None)  # the file's until punched
    os.rename(pagemap.pages_path, dest)
    shutil.copyfile(pagemap.path, os.path.join(artifact_dir, original))
    kept = _copy_kept(pagemap, dest, moved)
    fresh = _punch_kept(dest, pagemap, moved, ahead)
    sums_path = layout.sums_of(dest)
    if fresh.hashed is not None:
        hashed[dest] = fresh.hashed
        _write_sums_file(sums_path, fresh.hashed.sums)
    else:
        write_sums(dest, sums_path)
    with open(sums_path, "rb") as f:
        sums = f.read()
    zero = _punch_zero(dest, sums, hashed)
    img.write_pagemap(pagemap, [e for i, e in enumerate(pagemap.entries) if i not in moved])
    return _Moved(kept, fresh.punched, zero, sums)


@dataclass(frozen=True)
class Split:
    files: tuple[BulkFile, ...]  # the processes' bulk files
    shared: tuple[SharedBulkFile, ...]  # the shared anonymous segments'
    stats: SplitStats


def _writer(shmid: int, pagemap: img.Pagemap, procs: Sequence[img.PstreeEntry],
            vmas_of: Mapping[int, list[Any]], memfds: Mapping[int, int]) -> tuple[int, Any] | None:
    """The process and VMA through which segment ``shmid`` is written at restore: a writable
    mapping of it that holds the most of its pages (the lowest pid of equals)."""
    best: tuple[int, int, int, Any] | None = None  # -bytes, pid, start, vma
    for p in procs:
        for v in vmas_of[p.pid]:
            window = _writable_window(v, shmid, memfds)
            if window is None:
                continue
            held = sum(img.nr_pages(e) * img.PAGE for e in pagemap.entries if img.has_data(e)
                       and window[0] <= e.vaddr and e.vaddr + img.nr_pages(e) * img.PAGE <= window[1])
            key = (-held, p.pid, int(v.start), v)
            if best is None or key[:3] < best[:3]:
                best = key
    return None if best is None or best[0] == 0 else (best[1], best[3])


def split(artifact_dir: str, huge: Mapping[int, Sequence[tuple[int, int]]] | None = None,
          min_run: int = MIN_RUN, hashed: MutableMapping[str, Hashed] | None = None,
          min_shared: int = SHARED_MIN) -> Split:
    """Move the bulk page runs of the dump in ``artifact_dir/criu`` to ``artifact_dir/bulk``:
    each process's private runs to its bulk file, each shared anonymous segment's to its own.

    ``huge`` maps each CUDA process (pid as the image numbers it) to the address ranges whose
    VMAs get MADV_HUGEPAGE (the driver's staging copy, seen appear at the CUDA checkpoint; when
    none was seen, the process's largest bulk run, if at least 1 GiB). ``hashed``: what
    :mod:`runtime.pages.tailhash` hashed of the pages images, by path, while CRIU wrote them
    (used for the very file only); a pages image's entry is replaced by its bulk file's, made
    after the punch (for the publish). A segment moves when its writable mapping holds at least
    ``min_shared`` bytes of it."""
    t0 = time.monotonic()
    hashed = {} if hashed is None else hashed
    images = os.path.join(artifact_dir, CRIU_DIR)
    files, moved_total, kept_total, punched_total, zero_total = [], 0, 0, 0, 0
    procs = [e for e in img.read_pstree(images)
             if os.path.exists(os.path.join(images, f"pagemap-{e.pid}.img"))]  # not zombies
    vmas_of = {p.pid: sorted(img.read_mm(images, p.pid).entry.vmas, key=lambda v: v.start) for p in procs}
    inherited = _inherited(procs, vmas_of)
    segments = _shmem_pagemaps(images)
    memfds = img.memfd_segments(images) if segments else {}
    shared_total = shared_memory_bytes(images)
    cap = MAX_RANGES // max(1, len(procs) + len(segments))  # the plan lists every range
    for proc in procs:
        pid = proc.pid
        vmas = vmas_of[pid]
        written = img.written_after_restore(images, proc, vmas)
        if inherited[pid]:  # kept whole with CRIU, which restores them shared (see _inherited)
            written = dataclasses.replace(written, vmas=(*written.vmas, *sorted(inherited[pid])))
        pagemap = img.read_pagemap(images, pid)
        pagemap = dataclasses.replace(pagemap, entries=_cut(pagemap.entries, written.pages))
        ranges, moved = _runs(pagemap, vmas, min_run, cap=cap, written=written)
        kept = _kept_by_kind(pagemap, vmas, moved, min_run, written, inherited[pid])
        if kept:
            log.info("pid %d: left with CRIU: %s", pid, ", ".join(
                f"{v / 2**20:.1f} MiB {k}" for k, v in sorted(kept.items(), key=lambda kv: -kv[1])))
        if not ranges:
            continue
        out = _move_out(artifact_dir, pagemap, bulk_file(pid), bulk_pagemap(pid), moved, hashed)
        kept_total, punched_total, zero_total = kept_total + out.kept, punched_total + out.punched, zero_total + out.zero
        listed = zeros_apart(ranges, out.sums, cap - len(ranges), ZERO_APART)
        if huge is not None and pid in huge:  # a CUDA process
            _mark_huge(images, pid, huge[pid], ranges)
        files.append(BulkFile(pid, bulk_file(pid), pagemap.pages_id, tuple(listed)))
        moved_total += sum(r.length for r in ranges)
    shared, shared_moved = [], 0
    for shmid, path in segments.items():
        pagemap = img.read_pagemap_at(path)
        writer = _writer(shmid, pagemap, procs, vmas_of, memfds)
        if writer is None:  # mapped read-only everywhere (or SysV, or huge pages): CRIU's
            continue
        pid, vma = writer
        ranges, moved = _shared_runs(pagemap, vma, min_run, cap)
        if sum(r.length for r in ranges) < max(min_shared, 1):
            continue
        out = _move_out(artifact_dir, pagemap, layout.shared_file(shmid), layout.shared_pagemap(shmid),
                        moved, hashed)
        kept_total, punched_total, zero_total = kept_total + out.kept, punched_total + out.punched, zero_total + out.zero
        shared.append(SharedBulkFile(shmid, pid, layout.shared_file(shmid), pagemap.pages_id, tuple(ranges)))
        shared_moved += shared[-1].bytes
        log.info("shared segment %d: %.1f MiB to its bulk file, written through pid %d at %#x",
                 shmid, shared[-1].bytes / 2**20, pid, vma.start)
    stats = SplitStats(len(files), moved_total + shared_moved, kept_total, time.monotonic() - t0, punched_total,
                       zero_total, shared_total, shared_moved)
    if shared_total > shared_moved:
        log.info("%.1f MiB of shared memory stays with CRIU, which restores it on one thread",
                 (shared_total - shared_moved) / 2**20)
    log.info("bulk split: %d processes and %d shared segments, %.1f MiB to bulk files (%.1f MiB of it zero "
             "chunks, not stored), %.1f MiB left with CRIU (%.1f MiB of it punched out of the bulk files), %.2fs",
             stats.processes, len(shared), stats.moved_bytes / 2**20, zero_total / 2**20, kept_total / 2**20,
             punched_total / 2**20, stats.seconds)
    return Split(tuple(files), tuple(shared), stats)


# --- fill ----------------------------------------------------------------------------------------

def write_remote(pid: int, local: int, remote: int, length: int) -> None:
    """Copy ``length`` bytes at our address ``local`` to ``remote`` in process ``pid``
    (ctypes drops the GIL for the call, so threads copy in parallel)."""
    writev = libc.function("process_vm_writev")
    while length:
        liov, riov = libc.Iovec(local, length), libc.Iovec(remote, length)
        n = writev(pid, ctypes.byref(liov), 1, ctypes.byref(riov), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            raise OSError(err, f"process_vm_writev(pid {pid}, {remote:#x}+{length}): {os.strerror(err)}")
        if n == 0:
            raise OSError(errno.EFAULT, f"process_vm_writev(pid {pid}, {remote:#x}): nothing written")
        local, remote, length = local + n, remote + n, length - n


# --- what the fill may write ---------------------------------------------------------------------

# A page the target already has was written after CRIU let the tree go (a signal frame, say):
# the fill must never overwrite it. /proc/<pid>/pagemap: bit 63 present, bit 62 swapped; in the
# entry's top byte (little-endian) those are 0xC0.
_TOUCHED = bytes(1 if b & 0xC0 else 0 for b in range(256))
_ZERO_PAGE = bytes(img.PAGE)
_SCAN = 2 << 20  # address span per pagemap read: 4 KiB of entries


def assert_untouched(pid: int, ranges: Iterable[BulkRange]) -> None:
    """FillError if any page of ``ranges`` in process ``pid`` is present (or swapped) and holds
    anything but zeros. Zeros are what a huge page faulted in around a page CRIU wrote (THP),
    or khugepaged's collapse, put there: nothing was written. Checked for every range before
    the first write: a write of the fill itself faults in a whole huge page where THP applies."""
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    mem = -1
    try:
        for r in ranges:
            for vaddr in range(r.vaddr, r.vaddr + r.length, _SCAN):
                n = min(_SCAN, r.vaddr + r.length - vaddr) // img.PAGE
                data = os.pread(fd, n * 8, vaddr // img.PAGE * 8)
                if len(data) != n * 8:
                    raise FillError(f"pid {pid}: pagemap short at {vaddr:#x}")
                touched = data[7::8].translate(_TOUCHED)
                i = touched.find(1)
                while i >= 0:
                    page = vaddr + i * img.PAGE
                    if mem < 0:
                        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
                    if os.pread(mem, img.PAGE, page) != _ZERO_PAGE:
                        raise FillError(f"pid {pid}: page {page:#x} was written after CRIU restored the "
                                        "process; the bulk pages would overwrite it")
                    i = touched.find(1, i + 1)
    finally:
        os.close(fd)
        if mem >= 0:
            os.close(mem)


def _maps(pid: int) -> list[list[str]]:
    """The fields of each line of the restored process's ``/proc/<pid>/maps`` (at most six)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return [line.split(maxsplit=5) for line in f.read().splitlines()]
    except OSError as exc:
        raise FillError(f"restored process {pid}: cannot read its maps: {exc}") from exc


def _writable_spans(pid: int) -> list[tuple[int, int]]:
    """Spans of the restored process's plain private anonymous writable mappings, as the kernel
    lists them (adjacent ones merged): no file behind them, not its stack, no special mapping."""
    spans: list[tuple[int, int]] = []
    for fields in _maps(pid):
        if len(fields) < 5:
            continue
        addrs, perms, _off, dev, inode = fields[:5]
        name = fields[5].strip() if len(fields) > 5 else ""
        if (perms[1] != "w" or perms[3] != "p" or inode != "0" or dev not in ("00:00", "0:0")
                or (name and name != "[heap]" and not name.startswith("[anon:"))):
            continue
        lo, hi = (int(x, 16) for x in addrs.split("-"))
        if spans and spans[-1][1] == lo:
            spans[-1] = (spans[-1][0], hi)
        else:
            spans.append((lo, hi))
    return spans


def _inside(spans: Sequence[tuple[int, int]], lo: int, hi: int) -> bool:
    i = bisect.bisect_right(spans, (lo, 1 << 65)) - 1
    return i >= 0 and spans[i][0] <= lo and hi <= spans[i][1]


def _shmem_dev() -> int:
    """The device of the kernel's internal shared memory mount: what a memfd's (or a shared
    anonymous mapping's) object lives on, as ``/proc/<pid>/maps`` shows it."""
    fd = os.memfd_create("rekindle-probe", os.MFD_CLOEXEC)
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def _shared_spans(pid: int) -> list[tuple[int, int, int]]:
    """``(start, end, inode)`` of the restored process's writable shared mappings of a shared
    memory object on the kernel's internal mount (CRIU restores a segment as a memfd), adjacent
    ones of one object merged."""
    spans: list[tuple[int, int, int]] = []
    dev = _shmem_dev()
    for fields in _maps(pid):
        if len(fields) < 5 or fields[1][1] != "w" or fields[1][3] != "s":
            continue
        major, minor = (int(x, 16) for x in fields[3].split(":"))
        if os.makedev(major, minor) != dev:
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        inode = int(fields[4])
        if spans and spans[-1][1] == lo and spans[-1][2] == inode:
            spans[-1] = (spans[-1][0], hi, inode)
        else:
            spans.append((lo, hi, inode))
    return spans


def _check_shared(f: SharedBulkFile, vmas: Sequence[Any], memfds: Mapping[int, int], host: int) -> None:
    """Every range of ``f`` lies in one writable mapping of its segment in the dumped process,
    and in one writable shared mapping of one shared memory object in the restored one."""
    windows = [(int(v.start), int(v.end)) for v in vmas if _writable_window(v, f.shmid, memfds) is not None]
    live = _shared_spans(host)
    objects = set()
    for r in f.ranges:
        lo, hi = r.vaddr, r.vaddr + r.length
        if not any(a <= lo and hi <= b for a, b in windows):
            raise FillError(f"{f.path}: range {lo:#x}+{r.length:#x} is not inside one writable mapping of "
                            f"shared segment {f.shmid} in the dumped process")
        found = [ino for a, b, ino in live if a <= lo and hi <= b]
        if not found:
            raise FillError(f"{f.path}: range {lo:#x}+{r.length:#x} is not inside a writable shared memory "
                            f"mapping of restored process {host}")
        objects.add(found[0])
    if len(objects) > 1:
        raise FillError(f"{f.path}: its ranges lie in {len(objects)} shared memory objects of restored process "
                        f"{host}, not one")


def check_targets(files: Sequence[AnyBulkFile], images: str, tree: Iterable[int],
                  pid_of: Callable[[int], int]) -> list[int]:
    """The host pid of each bulk file's process, once every range was found to belong there:
    the process is one of the dumped tree (``images``, CRIU's verified images) and one CRIU
    restored (``tree``, host pids), and every range lies in one private anonymous writable VMA
    that is no thread's stack, both in the dumped mm image and in the restored process's maps
    (a shared segment's: in a writable mapping of that segment, :func:`_check_shared`)."""
    dumped = {e.pid: e for e in img.read_pstree(images)
              if os.path.exists(os.path.join(images, f"mm-{e.pid}.img"))}  # not zombies
    restored = set(tree)
    memfds = img.memfd_segments(images) if any(isinstance(f, SharedBulkFile) for f in files) else {}
    hosts = []
    for f in files:
        entry = dumped.get(f.pid)
        if entry is None:
            raise FillError(f"{f.path}: pid {f.pid} is no live process of the dumped tree")
        host = pid_of(f.pid)
        if host not in restored:
            raise FillError(f"{f.path}: pid {f.pid} (host pid {host}) is not a process CRIU restored")
        vmas = sorted(img.read_mm(images, f.pid).entry.vmas, key=lambda v: v.start)
        hosts.append(host)
        if isinstance(f, SharedBulkFile):
            _check_shared(f, vmas, memfds, host)
            continue
        written = img.written_after_restore(images, entry, vmas)
        movable = [(int(v.start), int(v.end)) for v in vmas if _movable(v, written)]
        live = _writable_spans(host)
        for r in f.ranges:
            lo, hi = r.vaddr, r.vaddr + r.length
            if written.hits(lo, hi):
                raise FillError(f"{f.path}: range {lo:#x}+{r.length:#x} lies in a thread's stack or rseq area "
                                "(written after CRIU restored the process)")
            if not _inside(movable, lo, hi):
                raise FillError(f"{f.path}: range {lo:#x}+{r.length:#x} is not inside one private anonymous "
                                "writable VMA of the dumped process")
            if not _inside(live, lo, hi):
                raise FillError(f"{f.path}: range {lo:#x}+{r.length:#x} is not inside a private anonymous "
                                f"writable mapping of restored process {host}")
    return hosts


def read_sums(artifact: Artifact, f: AnyBulkFile, source: Callable[[str], int] | None = None) -> bytes:
    """The chunk digests of ``f``, checked against the manifest (read them when the bulk file
    is opened: a later open may find the version gone). ``source``: opens the node cache's
    copy instead of the store's."""
    path = layout.sums_of(f.path)
    want = -(-artifact.entry(f.path).size // SUM_CHUNK) * DIGEST_BYTES
    if artifact.entry(path).size != want:
        raise FillError(f"{artifact.label}: {path} is {artifact.entry(path).size} bytes, want {want}")
    fd = (source or artifact.open_file)(path)
    try:
        data = os.pread(fd, want + 1, 0)
    finally:
        os.close(fd)
    artifact.check(path, len(data), new_hash(data).hexdigest())
    return data


# --- fill ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    file: int
    offset: int
    length: int


class _Filler:
    def __init__(self, fds: list[int], pids: list[int], files: Sequence[AnyBulkFile], sums: list[bytes] | None,
                 progress: Callable[[int], None] | None, mapped: list[int], sizes: Sequence[int]) -> None:
        self.fds, self.pids, self.files, self.sums, self.sizes = fds, pids, files, sums, sizes
        self.mapped = mapped  # with no sums: each file's address in a read-only mapping of it
        # (file offset, vaddr, length) of each range, by file, sorted by offset
        self.segments = [sorted((r.offset, r.vaddr, r.length) for r in f.ranges) for f in files]
        # a sealed file's data, as (start, end): its holes are zeros, which the target's untouched
        # pages read already; read through the mapping, each would take a page of the entry
        self.data = [[(a, a + n) for a, n in holes.data_spans(fd)] for fd in fds] if sums is None else []
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

    def piece(self, p: _Piece) -> None:
        with _FILLING:
            if self.sums is None:
                self._sealed_piece(p)
            else:
                self._piece(p, self.sums[p.file])

    def _sealed_piece(self, p: _Piece) -> None:
        """Copy the piece's ranges straight from the sealed file's mapping, its data only (no
        chunk of it that holds no range is touched: the entry has holes there; nor a hole in a
        range: zeros, as the target's pages are)."""
        pid, segs, base, data = self.pids[p.file], self.segments[p.file], self.mapped[p.file], self.data[p.file]
        end, done, written = p.offset + p.length, 0, 0
        i = max(bisect.bisect_right(segs, (p.offset, 1 << 65, 0)) - 1, 0)
        while i < len(segs) and segs[i][0] < end:
            off, vaddr, length = segs[i]
            lo, hi = max(off, p.offset), min(off + length, end)
            if lo < hi:
                done += hi - lo
                k = max(bisect.bisect_right(data, (lo, 1 << 65)) - 1, 0)
                while k < len(data) and data[k][0] < hi:
                    a, b = max(data[k][0], lo), min(data[k][1], hi)
                    if a < b:
                        write_remote(pid, base + a, vaddr + (a - off), b - a)
                        written += b - a
                    k += 1
            i += 1
        self._count(done, written)

    def _count(self, read: int, written: int) -> None:
        with self.lock:
            self.read += read
            self.written += written
            done = self.read
        if self.progress is not None:
            self.progress(done)

    def _piece(self, p: _Piece, sums: bytes) -> None:
        _m, view, addr = self._buffer()
        fd, pid, segs = self.fds[p.file], self.pids[p.file], self.segments[p.file]
        pos, end, written, read = p.offset, p.offset + p.length, 0, 0
        chunks.advise(fd, pos, p.length)
        while pos < end:
            want = min(CHUNK, end - pos)  # one SUM_CHUNK: pieces start on one
            i = max(bisect.bisect_right(segs, (pos, 1 << 65, 0)) - 1, 0)
            if not any(off < pos + want and pos < off + length for off, _v, length in segs[i:i + 2]):
                # No range of this chunk to fill (a node cache's copy has a hole where a range
                # is mapped instead): nothing of it is read or written.
                pos += want
                continue
            read += want  # of the range done (a zero chunk's too: progress counts it)
            # Verified before a byte of it is written: what is written is exactly what was hashed.
            spent = chunks.read(fd, pos, want, view, sums, size=self.sizes[p.file], name=self.files[p.file].path)
            if spent.zero == want:
                # A zero chunk: the target's pages there read zeros already (assert_untouched).
                pos += want
                continue
            while i < len(segs) and segs[i][0] < pos + want:
                off, vaddr, length = segs[i]
                lo, hi = max(off, pos), min(off + length, pos + want)
                if lo < hi:
                    write_remote(pid, addr + (lo - pos), vaddr + (lo - off), hi - lo)
                    written += hi - lo
                i += 1
            pos += want
        self._count(read, written)


def fill(artifact: Artifact, files: Sequence[AnyBulkFile], fds: Sequence[int], pid_of: Callable[[int], int], *,
         sums: Sequence[bytes], images: str, tree: Iterable[int], threads: int = WORKERS,
         progress: Callable[[int], None] | None = None, sealed: bool = False) -> FillStats:
    """Write every bulk file (``fds[i]`` is ``files[i]``, opened by the caller through
    ``artifact``; ``sums[i]`` its :func:`read_sums`) into its stopped process; FillError unless
    every range belongs to the restored tree (:func:`check_targets`: ``images`` is CRIU's
    verified image directory, ``tree`` the host pids CRIU restored) and every chunk matched its
    signed digest before it was written; nothing is written over a page the process has.

    ``sealed``: the fds are a node cache entry's fill files, checked against their sealed
    identity (``runtime.pages.nodecache.Held.fd``); every byte of them was verified when the
    entry was written and only root can change them, the trust its mapped ranges have. They are
    then copied straight from a read-only mapping of the file, not read and hashed again: one
    copy instead of two and no hash (``bench.entry_fill`` measures both); ``sums`` is unused."""
    t0 = time.monotonic()
    try:
        if digests.PIECE % SUM_CHUNK:
            raise FillError(f"fill pieces of {digests.PIECE} bytes do not hold whole {SUM_CHUNK}-byte chunks")
        pids = check_targets(files, images, tree, pid_of)
        pieces: list[_Piece] = []
        sizes = []
        for i, (f, fd) in enumerate(zip(files, fds, strict=True)):
            size = os.fstat(fd).st_size
            if size != artifact.entry(f.path).size:
                raise FillError(f"{artifact.label}: {f.path} is {size} bytes, the manifest says "
                                f"{artifact.entry(f.path).size}")
            if any(r.offset + r.length > size for r in f.ranges):
                raise FillError(f"{artifact.label}: {f.path}: a range lies past the end of the file")
            if not sealed and len(sums[i]) != -(-size // SUM_CHUNK) * DIGEST_BYTES:
                raise FillError(f"{artifact.label}: {f.path}: {len(sums[i])} bytes of chunk digests for {size} bytes")
            pieces.extend(_Piece(i, off, length) for off, length in piece_ranges(size) if length)
            sizes.append(size)
        for pid, f in zip(pids, files):
            assert_untouched(pid, f.ranges)
        stats = write_pieces(list(fds), pids, files, pieces, threads=threads, progress=progress,
                             sums=None if sealed else list(sums), sizes=sizes)
    except OSError as exc:
        raise FillError(f"{artifact.label}: bulk fill failed: {exc}") from exc
    stats = dataclasses.replace(stats, seconds=time.monotonic() - t0)
    log.info("bulk fill: %.1f MiB read%s, %.1f MiB written, %d threads, %.2fs (%.2f GB/s)",
             stats.bytes_read / 2**20, " from a sealed cache entry" if sealed else " and verified",
             stats.bytes_written / 2**20, threads, stats.seconds, stats.bytes_read / 1e9 / max(stats.seconds, 1e-9))
    return stats


def write_pieces(fds: list[int], pids: list[int], files: Sequence[AnyBulkFile], pieces: Sequence[_Piece], *,
                 threads: int, progress: Callable[[int], None] | None, sums: list[bytes] | None,
                 sizes: Sequence[int]) -> FillStats:
    """The fill's copying, on ``threads`` threads: each piece's ranges from ``fds`` into
    ``pids``, every chunk checked against ``sums`` first; with no ``sums`` (a sealed entry),
    copied from a read-only mapping of each file. The checks on the targets are the caller's."""
    t0 = time.monotonic()
    maps: list[FileMap] = []
    try:
        if sums is None:
            maps = [FileMap(fd, size, writable=False) for fd, size in zip(fds, sizes)]
        filler = _Filler(fds, pids, files, sums, progress, [m.addr for m in maps], sizes)
        with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="rekindle-fill") as pool:
            list(pool.map(filler.piece, pieces))
    finally:
        for m in maps:
            m.close()
    return FillStats(filler.read, filler.written, time.monotonic() - t0, threads)
