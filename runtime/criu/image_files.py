"""CRIU image files: read and rewrite the few images Rekindle needs (pstree, pagemap, mm, core,
files).

Format (CRIU's ``images/`` and its pycriu): an image starts with 8 bytes of magic (the common
magic, then the image's own), followed by entries, each a 4-byte little-endian length and a
protobuf message. A pagemap image holds one ``pagemap_head`` (which ``pages-<id>.img`` holds its
data) and then ``pagemap_entry`` records; the data of the present entries lies back to back in
the pages file in entry order (offsets are implicit). ``mm-<pid>.img`` holds one ``mm_entry``
with the process's VMAs; ``core-<tid>.img`` one ``core_entry`` per thread (its registers,
sigaltstack and rseq area are what :func:`written_after_restore` needs). ``files.img`` holds a
``file_entry`` for every file the tree uses (open fds, file-backed VMAs, executables, cwd and
root); only its regular-file part is read, with a small walk over the wire format (its other
members would pull in two dozen schemas). The message classes are generated from CRIU's own
.proto files (``runtime.criu.proto``, see hack/gen-protos.sh).

Images are written by CRIU on this node or come out of a verified artifact; a malformed one
still raises :class:`CriuError` naming the file, never an IndexError.
"""

from __future__ import annotations

import bisect
import os
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError

from runtime.criu.proto import core_pb2, mm_pb2, pagemap_pb2, pstree_pb2, regfile_pb2
from runtime.errors import CriuError

MAGIC_LEN = 8
MAX_ENTRY = 64 << 20  # no entry of these images comes near this; a bigger length is corruption

# pagemap_entry.flags (criu/include/pagemap.h)
PE_PARENT = 1 << 0
PE_LAZY = 1 << 1
PE_PRESENT = 1 << 2

# vma_entry.status (criu/include/image.h)
VMA_AREA_REGULAR = 1 << 0
VMA_AREA_STACK = 1 << 1
VMA_ANON_SHARED = 1 << 8
VMA_ANON_PRIVATE = 1 << 9
VMA_AREA_SYSVIPC = 1 << 10
VMA_AREA_SOCKET = 1 << 11
VMA_AREA_VVAR = 1 << 12
VMA_AREA_AIORING = 1 << 13
VMA_AREA_MEMFD = 1 << 14
VMA_AREA_VDSO = 1 << 3
VMA_AREA_VSYSCALL = 1 << 2
VMA_AREA_HEAP = 1 << 5
VMA_FILE_PRIVATE = 1 << 6
VMA_FILE_SHARED = 1 << 7
VMA_AREA_SHSTK = 1 << 15
VMA_AREA_GUARD = 1 << 16
VMA_AREA_UPROBES = 1 << 17
VMA_EXT_PLUGIN = 1 << 27
VMA_UNSUPP = 1 << 31
PROT_WRITE = 0x2
MAP_GROWSDOWN = 0x100  # vma_entry.flags
MAP_SHARED = 0x01
MAP_HUGETLB = 0x40000
SS_DISABLE = 2  # thread_sas_entry.ss_flags
MADV_HUGEPAGE = 14
PAGE = 4096


@dataclass(frozen=True)
class RawImage:
    magic: bytes
    entries: list[bytes]


def read_raw(path: str) -> RawImage:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CriuError("image", f"cannot read {path}: {exc}") from exc
    if len(data) < MAGIC_LEN:
        raise CriuError("image", f"{path}: shorter than its magic")
    entries, i = [], MAGIC_LEN
    while i < len(data):
        if i + 4 > len(data):
            raise CriuError("image", f"{path}: truncated entry header at {i}")
        (size,) = struct.unpack_from("<I", data, i)
        if size > MAX_ENTRY or i + 4 + size > len(data):
            raise CriuError("image", f"{path}: entry of {size} bytes at {i} runs past the end")
        entries.append(data[i + 4:i + 4 + size])
        i += 4 + size
    return RawImage(data[:MAGIC_LEN], entries)


def write_raw(path: str, image: RawImage) -> None:
    """Write to a temp name and rename: a crash never leaves a half-written image."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(image.magic)
        for entry in image.entries:
            f.write(struct.pack("<I", len(entry)))
            f.write(entry)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _parse(msg_type: Any, raw: bytes, path: str) -> Any:  # a protoc message class and one of its messages
    msg = msg_type()
    try:
        msg.ParseFromString(raw)
    except DecodeError as exc:
        raise CriuError("image", f"{path}: bad {msg_type.__name__}: {exc}") from exc
    return msg


# --- pstree -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PstreeEntry:
    pid: int
    ppid: int
    pgid: int
    sid: int
    threads: tuple[int, ...]


def read_pstree(images_dir: str) -> list[PstreeEntry]:
    path = os.path.join(images_dir, "pstree.img")
    out = []
    for raw in read_raw(path).entries:
        e = _parse(pstree_pb2.pstree_entry, raw, path)
        out.append(PstreeEntry(e.pid, e.ppid, e.pgid, e.sid, tuple(e.threads)))
    return out


TASK_DEAD = 2  # task_core_entry.task_state of a zombie (COMPEL_TASK_DEAD)


def is_zombie(images_dir: str, pid: int) -> bool:
    """Whether ``pid``'s core image says it is a zombie (no core image: not known to be one).
    A zombie has no memory either: no mm or pagemap image."""
    if not os.path.exists(os.path.join(images_dir, f"core-{pid}.img")):
        return False
    core = read_core(images_dir, pid)
    return bool(core.HasField("tc") and core.tc.task_state == TASK_DEAD)


TASK_STOPPED = 3  # task_core_entry.task_state of a task stopped at dump (COMPEL_TASK_STOPPED)


def stopped_pids(images_dir: str) -> set[int]:
    """Image pids of the tasks that were stopped (SIGSTOP, job control) when they were dumped:
    a restore leaves them stopped, as they were."""
    out = set()
    for e in read_pstree(images_dir):
        if os.path.exists(os.path.join(images_dir, f"core-{e.pid}.img")):
            core = read_core(images_dir, e.pid)
            if core.HasField("tc") and core.tc.task_state == TASK_STOPPED:
                out.add(e.pid)
    return out


def image_pids(images_dir: str) -> set[int]:
    """Every pid and thread id the image will need in the target pid namespace."""
    out: set[int] = set()
    for e in read_pstree(images_dir):
        out.add(e.pid)
        if not is_zombie(images_dir, e.pid):  # CRIU writes garbage for a zombie's thread list
            out.update(e.threads)
    return out


def image_is_shell_job(images_dir: str) -> bool:
    """True when the tree's session or process group leader is outside the image."""
    entries = read_pstree(images_dir)
    pids = {e.pid for e in entries}
    return any(e.sid not in pids or e.pgid not in pids for e in entries)


# --- pagemap ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pagemap:
    """A process's pagemap: which pages file, and its entries."""

    path: str
    magic: bytes
    pages_id: int
    entries: list[pagemap_pb2.pagemap_entry]

    @property
    def pages_path(self) -> str:
        return os.path.join(os.path.dirname(self.path), f"pages-{self.pages_id}.img")


def nr_pages(entry: pagemap_pb2.pagemap_entry) -> int:
    return int(entry.nr_pages if entry.HasField("nr_pages") else entry.compat_nr_pages)


def has_data(entry: pagemap_pb2.pagemap_entry) -> bool:
    """Whether the entry's pages lie in this image's pages file (not in a parent, not lazy)."""
    if entry.HasField("flags"):
        return bool(entry.flags & PE_PRESENT) and not entry.flags & PE_PARENT
    return not entry.in_parent


def read_pagemap(images_dir: str, pid: int) -> Pagemap:
    return read_pagemap_at(os.path.join(images_dir, f"pagemap-{pid}.img"))


def read_pagemap_at(path: str) -> Pagemap:
    """A pagemap image by its path (a process's, or shared memory's ``pagemap-shmem-<id>.img``)."""
    raw = read_raw(path)
    if not raw.entries:
        raise CriuError("image", f"{path}: no pagemap head")
    head = _parse(pagemap_pb2.pagemap_head, raw.entries[0], path)
    entries = [_parse(pagemap_pb2.pagemap_entry, e, path) for e in raw.entries[1:]]
    return Pagemap(path, raw.magic, head.pages_id, entries)


def write_pagemap(pagemap: Pagemap, entries: list[pagemap_pb2.pagemap_entry]) -> None:
    head = pagemap_pb2.pagemap_head(pages_id=pagemap.pages_id)
    write_raw(pagemap.path, RawImage(pagemap.magic, [head.SerializeToString(),
                                                     *(e.SerializeToString() for e in entries)]))


@dataclass(frozen=True)
class Mm:
    path: str
    magic: bytes
    entry: mm_pb2.mm_entry


def read_mm(images_dir: str, pid: int) -> Mm:
    path = os.path.join(images_dir, f"mm-{pid}.img")
    raw = read_raw(path)
    if len(raw.entries) != 1:
        raise CriuError("image", f"{path}: {len(raw.entries)} entries, want 1")
    return Mm(path, raw.magic, _parse(mm_pb2.mm_entry, raw.entries[0], path))


def write_mm(mm: Mm) -> None:
    write_raw(mm.path, RawImage(mm.magic, [mm.entry.SerializeToString()]))


def is_private_anon_writable(vma: Any) -> bool:  # a vma_entry message
    """A plain private anonymous writable mapping: the only kind whose pages may move out of
    CRIU (process_vm_writev cannot write read-only mappings; shared ones are CRIU's)."""
    special = (VMA_ANON_SHARED | VMA_AREA_SYSVIPC | VMA_AREA_SOCKET | VMA_AREA_VVAR | VMA_AREA_AIORING
               | VMA_AREA_MEMFD | VMA_AREA_VDSO | VMA_AREA_VSYSCALL | VMA_FILE_PRIVATE | VMA_FILE_SHARED
               | VMA_AREA_SHSTK | VMA_AREA_GUARD | VMA_AREA_UPROBES | VMA_EXT_PLUGIN | VMA_UNSUPP)
    return (bool(vma.status & VMA_AREA_REGULAR) and bool(vma.status & VMA_ANON_PRIVATE)
            and not vma.status & special and bool(vma.prot & PROT_WRITE))


# --- threads' stacks ----------------------------------------------------------------------------

# The kernel writes a signal frame below a thread's stack pointer (the x86-64 red zone, then up
# to a few KiB of xsave state: AMX makes it ~11 KiB) or on its sigaltstack.
SIGFRAME_MAX = 64 << 10


def read_core(images_dir: str, tid: int) -> Any:  # a core_entry message
    path = os.path.join(images_dir, f"core-{tid}.img")
    raw = read_raw(path)
    if len(raw.entries) != 1:
        raise CriuError("image", f"{path}: {len(raw.entries)} entries, want 1")
    return _parse(core_pb2.core_entry, raw.entries[0], path)


def _stack_pointer(core: Any, path: str) -> int:
    for arch in ("thread_info", "ti_aarch64", "ti_riscv64"):  # x86-64, arm64, riscv64
        if core.HasField(arch):
            return int(getattr(core, arch).gpregs.sp)
    raise CriuError("image", f"{path}: no stack pointer of an architecture this build reads")


@dataclass(frozen=True)
class Written:
    """What gets written into a process after CRIU restored its memory and before the tree was
    resumed, so that no later writer of that memory may touch it: ``vmas`` (start, end) whole
    VMAs, ``pages`` (start, end) page-aligned spans inside others."""

    vmas: tuple[tuple[int, int], ...]
    pages: tuple[tuple[int, int], ...]
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _ends: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        merged: list[list[int]] = []  # both kinds as disjoint sorted spans: a split or a plan asks per range
        for a, b in sorted((*self.vmas, *self.pages)):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        object.__setattr__(self, "_starts", tuple(a for a, _ in merged))
        object.__setattr__(self, "_ends", tuple(b for _, b in merged))

    def hits(self, lo: int, hi: int) -> bool:
        """Whether [lo, hi) overlaps any of it."""
        i = bisect.bisect_left(self._starts, hi) - 1  # the last span starting below hi
        return i >= 0 and self._ends[i] > lo


def written_after_restore(images_dir: str, entry: PstreeEntry, vmas: list[Any]) -> Written:
    """For process ``entry`` (its ``vmas`` from mm-<pid>.img): the kernel may deliver a pending
    signal as soon as CRIU lets the tree go, writing its frame below the thread's stack pointer
    (up to SIGFRAME_MAX) or on its sigaltstack, so the VMAs holding those, and the main stack
    (VMA_AREA_STACK or MAP_GROWSDOWN), count whole; and each thread's rseq area (in its TLS,
    often inside a heap VMA) is written by CRIU (rseq_cs) and by the kernel (cpu_id) on the
    way back to user space: its pages count."""
    windows: list[tuple[int, int]] = []
    pages: list[tuple[int, int]] = []
    for tid in entry.threads or (entry.pid,):
        path = os.path.join(images_dir, f"core-{tid}.img")
        core = read_core(images_dir, tid)
        sp = _stack_pointer(core, path)
        windows.append((max(0, sp - SIGFRAME_MAX), sp + 1))
        tc = core.thread_core if core.HasField("thread_core") else None
        if tc is not None and tc.HasField("sas"):
            if tc.sas.ss_size and not tc.sas.ss_flags & SS_DISABLE:
                windows.append((tc.sas.ss_sp, tc.sas.ss_sp + tc.sas.ss_size))
        if tc is not None and tc.HasField("rseq_entry") and tc.rseq_entry.rseq_abi_pointer:
            lo = tc.rseq_entry.rseq_abi_pointer
            hi = lo + max(tc.rseq_entry.rseq_abi_size, 32)
            pages.append((lo // PAGE * PAGE, -(-hi // PAGE) * PAGE))
    whole = {(int(v.start), int(v.end)) for v in vmas if v.status & VMA_AREA_STACK or v.flags & MAP_GROWSDOWN}
    ordered = sorted(vmas, key=lambda v: v.start)
    for lo, hi in windows:
        # The VMA holding the window's top, then down through adjacent writable ones while the
        # window reaches them (a gap or a guard page below would fault the frame's write).
        top = hi
        for v in reversed(ordered):
            if v.start >= top:
                continue
            if v.end < top or not v.prot & PROT_WRITE:
                break
            whole.add((int(v.start), int(v.end)))
            top = v.start
            if top <= lo:
                break
    return Written(tuple(sorted(whole)), tuple(sorted(pages)))


# --- files --------------------------------------------------------------------------------------

FD_TYPE_REG = 1  # fd_types.REG (images/fdinfo.proto)
_FILE_TYPE, _FILE_ID, _FILE_REG = 1, 2, 3  # file_entry's fields
_REMAP_ORIG_ID = 1  # remap_file_path_entry.orig_id (images/remap-file-path.proto)


@dataclass(frozen=True)
class RegFile:
    """A regular file the tree maps or holds open: its path in the tree's mount namespace and
    its size when dumped (what CRIU checks at restore)."""

    id: int
    path: str
    size: int


def _varint(raw: bytes, i: int, path: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(raw) or shift > 63:
            raise CriuError("image", f"{path}: bad varint at {i}")
        b = raw[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def _wire_fields(raw: bytes, path: str) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of one protobuf message: varints as ints, length-delimited fields
    as bytes; fixed-width fields are skipped."""
    i = 0
    while i < len(raw):
        key, i = _varint(raw, i, path)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(raw, i, path)
            yield number, value
        elif wire == 2:
            size, i = _varint(raw, i, path)
            if i + size > len(raw):
                raise CriuError("image", f"{path}: field {number} runs past its entry")
            yield number, raw[i:i + size]
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise CriuError("image", f"{path}: wire type {wire} of field {number}")


def read_reg_files(images_dir: str) -> list[RegFile]:
    """Every regular file of ``files.img`` (fds, file-backed VMAs, executables) that CRIU will
    reopen by path: not directories or device nodes, and not the deleted files it remapped
    (``remap-fpath.img``: their content is in the images, or CRIU linked it beside them)."""
    path = os.path.join(images_dir, "files.img")
    remap = os.path.join(images_dir, "remap-fpath.img")
    remapped: set[int] = set()
    if os.path.exists(remap):
        for raw in read_raw(remap).entries:
            remapped.update(v for n, v in _wire_fields(raw, remap) if n == _REMAP_ORIG_ID and isinstance(v, int))
    out = []
    for raw in read_raw(path).entries:
        fields = dict(_wire_fields(raw, path))
        reg = fields.get(_FILE_REG)
        if fields.get(_FILE_TYPE) != FD_TYPE_REG or not isinstance(reg, bytes):
            continue
        e = _parse(regfile_pb2.reg_file_entry, reg, path)
        if e.id in remapped or (e.HasField("mode") and not stat.S_ISREG(e.mode)):
            continue  # (without a mode, the reader of the file checks what it is)
        out.append(RegFile(e.id, e.name, e.size))
    return out


FD_TYPE_MEMFD = 18  # fd_types.MEMFD
_FILE_MEMFD = 20  # file_entry.memfd: a memfd_file_entry
_MEMFD_FILE_INODE = 5  # memfd_file_entry.inode_id
_MEMFD_SHMID, _MEMFD_INODE, _MEMFD_HUGETLB = 5, 7, 8  # memfd_inode_entry's fields (images/memfd.proto)


def memfd_segments(images_dir: str) -> dict[int, int]:
    """The shared memory segment (the id of its ``pagemap-shmem-<id>.img``) of each memfd file
    of ``files.img``, by file id: the ``shmid`` of a VMA that maps a memfd. CRIU (4.x) dumps
    shared anonymous memory this way too: a ``/dev/zero (deleted)`` mapping becomes a memfd's.
    Huge-page memfds are left out (4 KiB pages only)."""
    inodes_path = os.path.join(images_dir, "memfd.img")
    if not os.path.exists(inodes_path):
        return {}
    segment_of_inode = {}
    for raw in read_raw(inodes_path).entries:
        fields = dict(_wire_fields(raw, inodes_path))
        shmid, inode = fields.get(_MEMFD_SHMID), fields.get(_MEMFD_INODE)
        if isinstance(shmid, int) and isinstance(inode, int) and not fields.get(_MEMFD_HUGETLB):
            segment_of_inode[inode] = shmid
    path = os.path.join(images_dir, "files.img")
    out = {}
    for raw in read_raw(path).entries:
        fields = dict(_wire_fields(raw, path))
        entry, fid = fields.get(_FILE_MEMFD), fields.get(_FILE_ID)
        if fields.get(_FILE_TYPE) != FD_TYPE_MEMFD or not isinstance(entry, bytes) or not isinstance(fid, int):
            continue
        inode = dict(_wire_fields(entry, path)).get(_MEMFD_FILE_INODE)
        if isinstance(inode, int) and inode in segment_of_inode:
            out[fid] = segment_of_inode[inode]
    return out


def file_ids(images_dir: str) -> list[int]:
    """The id of every entry of ``files.img``, whatever its type (one id space)."""
    path = os.path.join(images_dir, "files.img")
    return [v for raw in read_raw(path).entries for n, v in _wire_fields(raw, path)
            if n == _FILE_ID and isinstance(v, int)]
