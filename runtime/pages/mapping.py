"""Bulk ranges restored as private mappings of a node-local verified file instead of copied.

A restore from the node cache (``runtime.pages.nodecache``) leaves the chosen bulk ranges to the kernel:
CRIU maps each one ``MAP_PRIVATE`` from its own cache file, so nothing is copied at the restore,
the pages are read (by the CUDA driver's restore, say) straight from the page cache, and pods
restored from one artifact on a node share those pages until one writes (copy on write).

- :func:`choose` picks the ranges: in ``driver`` mode the CUDA driver's host copy (the VMAs the
  checkpoint marked for huge pages in the CUDA processes), which the driver reads once and
  unmaps after its restore; in ``all`` mode every range of at least :data:`MAP_MIN` in a plain
  (not heap) private anonymous VMA; never one that is all zeros (the split makes a long zero run
  a range of its own: ``runtime.pages.bulk.zeros_apart``). A mapped range is no longer anonymous memory: after
  ``MADV_DONTNEED`` it reads the file's bytes back, not zeros, and ``MADV_FREE`` fails on it;
  hence ``driver`` by default.
- Each range has its own file, its bytes at file offset ``vaddr % 2 MiB``: a ``huge=always``
  tmpfs can then map it with 2 MiB pages (4 KiB page-cache pages slowed the driver's copy from
  2.86 to 3.98 s for 16 GiB, measured by hand).
- :func:`rewrite_images` turns each range into a ``VMA_FILE_PRIVATE`` entry (its VMA split where
  the range does not cover it) of a new regular file in ``files.img``, which CRIU is handed as
  an inherited fd (:func:`inherit_key`); the range has no pagemap entry (the bulk split removed
  it), so CRIU restores no page there.
- :func:`check_mapped`: after CRIU, each range of the restored process is a mapping of exactly
  its file (device, inode, offset), or the restore fails.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.criu import image_files as img
from runtime.criu.proto import fown_pb2, regfile_pb2
from runtime.errors import Reason, RekindleError
from runtime.layout import BulkFile, BulkRange
from runtime.pages import chunks

MAP_MIN = 2 << 20  # smaller ranges are filled: a VMA each would cost more than the copy
HUGE = 2 << 20
MAX_MAPPED = 512  # ranges mapped per restore at most (each splits a VMA); the rest are filled
MAP_PRIVATE = 0x02
MAP_ANONYMOUS = 0x20
KEY_PREFIX = "rekindle-map/"  # the files' names in the images: no path of the target's


class MapError(RekindleError):
    reason_class = Reason.INTEGRITY  # the images and the cache entry do not fit each other


class MapMode(enum.Enum):
    NONE = "none"      # the cache feeds the fill; nothing is mapped
    DRIVER = "driver"  # the CUDA driver's host copy only (default)
    ALL = "all"        # every large range of plain private anonymous memory


def for_artifact(recorded: str, node: MapMode) -> MapMode:
    """What a restore of an artifact maps: what its source pod asked for (``recorded`` in its
    signed manifest, from ``rekindle.dev/map-ranges``: the owner of the process says its memory
    may read cached bytes back after ``MADV_DONTNEED``), else the node's setting."""
    return MapMode(recorded) if recorded else node


@dataclass(frozen=True, slots=True)
class Span:
    """One bulk range restored as a private mapping of its own cache file."""

    pid: int
    vaddr: int
    length: int
    offset: int  # of its bytes in the bulk file

    @property
    def file_offset(self) -> int:  # where its bytes start in its cache file
        return self.vaddr % HUGE

    @property
    def name(self) -> str:  # its cache file's name
        return f"map-{self.pid}-{self.vaddr:x}.bin"

    @property
    def file_size(self) -> int:
        return self.file_offset + self.length


def _mappable(vma: Any) -> bool:
    return img.is_private_anon_writable(vma) and not vma.status & (img.VMA_AREA_HEAP | img.VMA_AREA_STACK)


def choose(files: Sequence[BulkFile], images: str, mode: MapMode, cuda_pids: Iterable[int] = (),
           sums: Mapping[str, bytes] | None = None) -> list[Span]:
    """The ranges of ``files`` to map, by ``mode`` (see the module's text); with ``sums`` (each
    bulk file's verified chunk digests, by path), none that is all zeros: anonymous, it reads as
    the zero page, where a mapped file would allocate every page read."""
    if mode is MapMode.NONE:
        return []
    cuda = set(cuda_pids)
    out: list[Span] = []
    for f in files:
        if mode is MapMode.DRIVER and f.pid not in cuda:
            continue
        vmas = [v for v in img.read_mm(images, f.pid).entry.vmas if _mappable(v)]
        if mode is MapMode.DRIVER:
            vmas = [v for v in vmas if v.madv & (1 << img.MADV_HUGEPAGE)]
        starts = sorted((v.start, v.end) for v in vmas)
        digests = (sums or {}).get(f.path)
        for r in f.ranges:
            if r.length < MAP_MIN or (digests is not None and chunks.all_zero(digests, r.offset, r.offset + r.length)):
                continue
            if any(lo <= r.vaddr and r.vaddr + r.length <= hi for lo, hi in starts):
                out.append(Span(f.pid, r.vaddr, r.length, r.offset))
    out.sort(key=lambda s: -s.length)
    return sorted(out[:MAX_MAPPED], key=lambda s: (s.pid, s.vaddr))


def remainder(files: Sequence[BulkFile], spans: Iterable[Span]) -> tuple[BulkFile, ...]:
    """``files`` without the mapped ranges (those left to the fill); a file left with none
    is dropped."""
    mapped = {(s.pid, s.vaddr) for s in spans}
    out = []
    for f in files:
        left = tuple(r for r in f.ranges if (f.pid, r.vaddr) not in mapped)
        if left:
            out.append(BulkFile(f.pid, f.path, f.pages_id, left))
    return tuple(out)


def inherit_key(span: Span, entry: str) -> str:
    """The name CRIU knows the span's file by (``--inherit-fd fd[N]:<key>``: its path in the
    images without the leading slash)."""
    return f"{KEY_PREFIX}{entry}/{span.name}"


def _file_entry(file_id: int, name: str, size: int, mode: int) -> bytes:
    """A files.img entry (images/fdinfo.proto ``file_entry``: type, id, reg) for a regular file."""
    reg = regfile_pb2.reg_file_entry(id=file_id, flags=os.O_RDONLY | os.O_LARGEFILE, pos=0,
                                     fown=fown_pb2.fown_entry(uid=0, euid=0, signum=0, pid_type=0, pid=0),
                                     name=name, size=size, mode=mode).SerializeToString()
    return _varint_field(1, img.FD_TYPE_REG) + _varint_field(2, file_id) + _bytes_field(3, reg)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _split(vma: Any, lo: int, hi: int, file_id: int, span: Span) -> list[Any]:
    """``vma`` as up to three entries: anonymous before ``lo``, the file mapping, anonymous
    after ``hi``."""
    out = []
    for a, b in ((vma.start, lo), (lo, hi), (hi, vma.end)):
        if a >= b:
            continue
        piece = type(vma)()
        piece.CopyFrom(vma)
        piece.start, piece.end = a, b
        if (a, b) == (lo, hi):
            piece.status = (vma.status & ~img.VMA_ANON_PRIVATE) | img.VMA_FILE_PRIVATE
            piece.flags = (vma.flags & ~MAP_ANONYMOUS) | MAP_PRIVATE
            piece.shmid = file_id
            piece.pgoff = span.file_offset
            piece.fdflags = os.O_RDONLY | os.O_LARGEFILE
        else:
            piece.pgoff = vma.pgoff + (a - vma.start)
        out.append(piece)
    return out


def rewrite_images(images: str, spans: Sequence[Span], entry: str, sizes: Mapping[str, int]) -> None:
    """Make CRIU map each span from its file (``sizes``: each file's size by name, as CRIU
    checks it); the spans' pages are absent from CRIU's pagemap already (the bulk split)."""
    if not spans:
        return
    files_img = os.path.join(images, "files.img")
    raw = img.read_raw(files_img)
    next_id = max((i for i in img.file_ids(images)), default=0) + 1
    by_pid: dict[int, list[Span]] = {}
    for s in spans:
        by_pid.setdefault(s.pid, []).append(s)
    for pid, mine in by_pid.items():
        mm = img.read_mm(images, pid)
        pagemap = img.read_pagemap(images, pid)
        for e in pagemap.entries:
            lo, hi = e.vaddr, e.vaddr + img.nr_pages(e) * img.PAGE
            if any(lo < s.vaddr + s.length and s.vaddr < hi for s in mine):
                raise MapError(f"pid {pid}: CRIU's images hold pages at {lo:#x}-{hi:#x}, in a mapped range")
        vmas = list(mm.entry.vmas)
        for s in sorted(mine, key=lambda s: s.vaddr):
            lo, hi = s.vaddr, s.vaddr + s.length
            at = [i for i, v in enumerate(vmas) if v.start <= lo and hi <= v.end]
            if len(at) != 1 or not _mappable(vmas[at[0]]):
                raise MapError(f"pid {pid}: no plain private anonymous VMA holds {lo:#x}-{hi:#x}")
            file_id, next_id = next_id, next_id + 1
            vmas[at[0]:at[0] + 1] = _split(vmas[at[0]], lo, hi, file_id, s)
            raw.entries.append(_file_entry(file_id, "/" + inherit_key(s, entry), sizes[s.name], 0o100444))
        del mm.entry.vmas[:]
        mm.entry.vmas.extend(vmas)
        img.write_mm(mm)
    img.write_raw(files_img, raw)


def _maps(pid: int) -> list[tuple[int, int, int, int, int]]:
    """(start, end, offset, device, inode) of each of ``pid``'s mappings."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            span, offset, dev, inode = parts[0], parts[2], parts[3], parts[4]
            lo, hi = (int(x, 16) for x in span.split("-"))
            major, minor = (int(x, 16) for x in dev.split(":"))
            out.append((lo, hi, int(offset, 16), os.makedev(major, minor), int(inode)))
    return out


def check_mapped(host_pid_of: Mapping[int, int], spans: Sequence[Span], files: Mapping[str, os.stat_result]) -> None:
    """Each span is, in the restored process, a mapping of exactly its cache file."""
    by_pid: dict[int, list[Span]] = {}
    for s in spans:
        by_pid.setdefault(s.pid, []).append(s)
    for pid, mine in by_pid.items():
        maps = _maps(host_pid_of[pid])
        for s in mine:
            st = files[s.name]
            ok = [m for m in maps if m[0] <= s.vaddr and s.vaddr + s.length <= m[1]
                  and m[2] + (s.vaddr - m[0]) == s.file_offset and (m[3], m[4]) == (st.st_dev, st.st_ino)]
            if not ok:
                raise MapError(f"pid {pid}: {s.vaddr:#x}+{s.length:#x} is not a mapping of its cache file")


_SCAN = 64 << 20  # address span per pagemap read: 128 KiB of entries


def check_untouched(host_pid_of: Mapping[int, int], spans: Sequence[Span]) -> None:
    """No page of any span is mapped in its restored process: checked once each span is
    registered with userfaultfd while its file is still being written (a page mapped before
    that would show the file's bytes as they were then). /proc/<pid>/pagemap: bit 63 present,
    bit 62 swapped; in each entry's top byte, 0xC0."""
    for s in spans:
        fd = os.open(f"/proc/{host_pid_of[s.pid]}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        try:
            for vaddr in range(s.vaddr, s.vaddr + s.length, _SCAN):
                n = min(_SCAN, s.vaddr + s.length - vaddr) // img.PAGE
                data = os.pread(fd, n * 8, vaddr // img.PAGE * 8)
                if len(data) != n * 8:
                    raise MapError(f"pid {s.pid}: pagemap short at {vaddr:#x}")
                i = next((i for i, b in enumerate(data[7::8]) if b & 0xC0), -1) if any(data[7::8]) else -1
                if i >= 0:
                    raise MapError(f"pid {s.pid}: page {vaddr + i * img.PAGE:#x} of a mapped range was touched "
                                   "before it was registered")
        finally:
            os.close(fd)


def ranges_of(spans: Iterable[Span]) -> list[BulkRange]:
    return [BulkRange(s.vaddr, s.length, s.offset) for s in spans]
