"""The artifact layout: file names inside an artifact, and the typed restore plan.

An artifact (one published version, see ``runtime.store.volume``) holds::

    manifest.json, manifest.json.sig   the signed manifest (every other file's size and digest)
    restore-plan.json                  RestorePlan below (what CRIU restore needs beyond the manifest)
    criu/                              CRIU's images; with the bulk path its pages files hold only
                                       what CRIU restores itself
    bulk/pages-<pid>.bulk              a process's large private anonymous page runs, restored
                                       beside CRIU (the pages file CRIU wrote, renamed); where each
                                       run goes is in RestorePlan.bulk
    bulk/pages-<pid>.sums              the BLAKE3 digest (32 bytes) of each SUM_CHUNK of that bulk
                                       file, in order: the fill checks each chunk before it
                                       writes it (this file itself is checked against the manifest)
    bulk/pagemap-<pid>.img             CRIU's pagemap before the split (the stock restore path)
    bulk/shmem-<shmid>.bulk            the same three for a shared anonymous segment (an engine's
    bulk/shmem-<shmid>.sums            pinned host buffers), written through one process's mapping
    bulk/pagemap-shmem-<shmid>.img     of it (RestorePlan.shared)
    rootfs-diff.tar, rootfs-deletions.json   the container's writable layer
    shm.tar, shm-deletions.json        the container's /dev/shm when it is an external mount

Everything but ``bulk/`` is small and is copied, hashed while copied, into a private node-local
directory before use; the bulk files are hashed as they are written into the stopped process.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from typing import Any

from runtime import strict_json

MANIFEST = "manifest.json"
SIGNATURE = "manifest.json.sig"
RESTORE_PLAN = "restore-plan.json"
CRIU_DIR = "criu"
BULK_DIR = "bulk"
ROOTFS_TAR = "rootfs-diff.tar"
ROOTFS_DELETIONS = "rootfs-deletions.json"
SHM_TAR = "shm.tar"
SHM_DELETIONS = "shm-deletions.json"
MAX_PLAN_BYTES = 16 << 20
MAX_BULK_RANGES = 200_000  # per artifact, all processes together: the split never lists more
SUM_CHUNK = 1 << 20  # bytes of a bulk file per digest in its .sums file
DIGEST_BYTES = 32
_PAGE = 4096
_ADDR_END = 1 << 63  # no user address or file offset (off_t) reaches this


def bulk_file(pid: int) -> str:
    return f"{BULK_DIR}/pages-{pid}.bulk"


def bulk_sums(pid: int) -> str:
    return f"{BULK_DIR}/pages-{pid}.sums"


def bulk_pagemap(pid: int) -> str:
    """CRIU's pagemap of ``pid`` as the dump wrote it (before the split): with the bulk file as
    its pages file it restores the process the stock way, for comparison."""
    return f"{BULK_DIR}/pagemap-{pid}.img"


def shared_file(shmid: int) -> str:
    """The bulk pages of shared anonymous segment ``shmid`` (CRIU's id for it)."""
    return f"{BULK_DIR}/shmem-{shmid}.bulk"


def shared_pagemap(shmid: int) -> str:
    """CRIU's ``pagemap-shmem-<shmid>.img`` as the dump wrote it (the stock restore path)."""
    return f"{BULK_DIR}/pagemap-shmem-{shmid}.img"


def sums_of(bulk_path: str) -> str:
    """The chunk digests' file of a bulk file (``x.bulk`` -> ``x.sums``)."""
    return bulk_path.removesuffix(".bulk") + ".sums"


def is_bulk(path: str) -> bool:
    return path.startswith(BULK_DIR + "/")


def layer_sums(tar: str) -> str:
    """The chunk digests (one per SUM_CHUNK) of a writable-layer archive: with them listed, a
    restore reads the archive from the store while applying it instead of staging a copy
    (runtime.overlay.verified)."""
    return tar + ".sums"


def staged_skip(listed: typing.Collection[str]) -> typing.Callable[[str], bool]:
    """What staging leaves in the store, of an artifact listing ``listed``: the bulk files, and
    each layer archive whose chunk digests are listed (artifacts of before them stage it)."""
    streamed = {t for t in (ROOTFS_TAR, SHM_TAR) if layer_sums(t) in listed}
    return lambda path: is_bulk(path) or path in streamed


def is_bulk_pages(path: str) -> bool:
    """A bulk file itself (not its chunk digests or pagemap)."""
    return is_bulk(path) and path.endswith(".bulk")


@dataclass(frozen=True, slots=True)
class MountPlanEntry:
    """One external mount of the dumped tree: CRIU key, where it is mounted, and its kind."""

    key: str
    destination: str
    type: str  # "bind", "cgroup" or "cgroup2"
    mount_point: str = ""  # where the source saw it, when a symlink made it differ from destination


@dataclass(frozen=True, slots=True)
class BulkRange:
    """``length`` bytes at ``offset`` of the bulk file belong at ``vaddr`` of the process."""

    vaddr: int
    length: int
    offset: int

    def __post_init__(self) -> None:
        if (self.vaddr < 0 or self.length <= 0 or self.offset < 0
                or (self.vaddr | self.length | self.offset) % _PAGE):
            raise ValueError(f"bulk range {self}: want page-aligned, positive values")
        if self.vaddr + self.length > _ADDR_END or self.offset + self.length > _ADDR_END:
            raise ValueError(f"bulk range {self}: overflows")


@dataclass(frozen=True, slots=True)
class BulkFile:
    """The bulk pages of one process (``pid`` as its own pid namespace numbers it)."""

    pid: int
    path: str
    pages_id: int  # the pages-<id>.img this file was, in CRIU's images
    ranges: tuple[BulkRange, ...]

    def __post_init__(self) -> None:
        if self.path != bulk_file(self.pid):
            raise ValueError(f"bulk file of pid {self.pid} must be {bulk_file(self.pid)}, not {self.path!r}")
        _disjoint(self.path, self.ranges)

    @property
    def bytes(self) -> int:
        return sum(r.length for r in self.ranges)


def _disjoint(path: str, ranges: tuple[BulkRange, ...]) -> None:
    """Each byte of the file goes to one place, each place gets one byte of the file."""
    if len(ranges) < 2:
        return
    for what, spans in (("addresses", sorted((r.vaddr, r.vaddr + r.length) for r in ranges)),
                        ("file offsets", sorted((r.offset, r.offset + r.length) for r in ranges))):
        if any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
            raise ValueError(f"{path}: ranges overlap in {what}")


@dataclass(frozen=True, slots=True)
class SharedBulkFile:
    """The bulk pages of one shared anonymous segment (``shmid``, CRIU's id for it), written
    through process ``pid``'s writable mapping of it: ``vaddr`` of each range is that process's
    address. Every process that shares the segment sees them (CRIU restores it as one memfd)."""

    shmid: int
    pid: int
    path: str
    pages_id: int  # the pages-<id>.img this file was, in CRIU's images
    ranges: tuple[BulkRange, ...]

    def __post_init__(self) -> None:
        if self.path != shared_file(self.shmid):
            raise ValueError(f"bulk file of segment {self.shmid} must be {shared_file(self.shmid)}, "
                             f"not {self.path!r}")
        _disjoint(self.path, self.ranges)

    @property
    def bytes(self) -> int:
        return sum(r.length for r in self.ranges)


AnyBulkFile = BulkFile | SharedBulkFile  # what the fill writes: a process's pages or a segment's

_BULK_KEYS = frozenset(("pid", "path", "pages_id", "ranges"))


def _flat_bulk_file(entry: dict[str, Any], flat: list[int], i: int) -> BulkFile:
    """One bulk file of the plan in the flat form, its types checked as strict_json would."""
    where = f"restore plan.bulk[{i}]"
    if entry.keys() != _BULK_KEYS:
        raise ValueError(f"{where}: unknown keys {sorted(set(entry) - _BULK_KEYS)}, "
                         f"missing keys {sorted(_BULK_KEYS - set(entry))}")
    pid, path, pages_id = entry["pid"], entry["path"], entry["pages_id"]
    if type(pid) is not int or type(pages_id) is not int or type(path) is not str:
        raise TypeError(f"{where}: pid and pages_id want integers, path a string")
    return BulkFile(pid, path, pages_id, tuple(BulkRange(flat[j], flat[j + 1], flat[j + 2])
                                               for j in range(0, len(flat), 3)))


@dataclass(frozen=True, slots=True)
class RestorePlan:
    stdio: tuple[str, ...]
    shell_job: bool
    mounts: tuple[MountPlanEntry, ...]
    shm: bool
    bulk: tuple[BulkFile, ...] = ()
    tcp_established: bool = False
    # Shared anonymous segments' bulk pages; listed only when there are some, so that a plan
    # without them reads as before (and one from before it reads as having none).
    shared: tuple[SharedBulkFile, ...] = ()

    # A process's bulk ranges are one flat list [vaddr, length, offset, vaddr, ...] on disk: an LLM
    # worker has thousands (every heap run), and as objects they took 0.2 s to parse per restore.

    def to_json(self) -> bytes:
        obj = strict_json.to_obj(self)
        for entry, b in zip(obj["bulk"], self.bulk):
            entry["ranges"] = [n for r in b.ranges for n in (r.vaddr, r.length, r.offset)]
        if not self.shared:
            del obj["shared"]
        return strict_json.canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes) -> RestorePlan:
        """Parse (ValueError/TypeError on anything off; the caller names the artifact)."""
        obj = strict_json.loads(data, max_bytes=MAX_PLAN_BYTES)
        if isinstance(obj, dict) and "shared" not in obj:
            obj["shared"] = []
        flat: list[list[int] | None] = []
        entries: list[Any] = []
        if isinstance(obj, dict) and isinstance(obj.get("bulk"), list):
            entries = obj["bulk"]
            for i, entry in enumerate(entries):
                ranges = entry.get("ranges") if isinstance(entry, dict) else None
                if isinstance(ranges, list) and ranges and not isinstance(ranges[0], dict):
                    if len(ranges) % 3 or not all(type(n) is int for n in ranges):
                        raise ValueError(f"restore plan.bulk[{i}].ranges: want [vaddr, length, offset, ...] integers")
                    flat.append(ranges)
                else:
                    flat.append(None)  # the object form (older artifacts) goes the generic way
            counted = sum(len(f) // 3 for f in flat if f is not None)
            if counted > MAX_BULK_RANGES:  # refused before a BulkRange is built for each
                raise ValueError(f"restore plan: {counted} bulk ranges, at most {MAX_BULK_RANGES}")
            # The flat form is built here, each BulkFile once: through the generic converter
            # (and again with its ranges) 100k processes took seconds.
            obj["bulk"] = [e for e, f in zip(entries, flat) if f is None]
        plan = typing.cast(RestorePlan, strict_json.from_obj(cls, obj, "restore plan"))
        if any(f is not None for f in flat):
            generic = iter(plan.bulk)
            plan = dataclasses.replace(plan, bulk=tuple(
                next(generic) if f is None else _flat_bulk_file(e, f, i)
                for i, (e, f) in enumerate(zip(entries, flat))))
        total = sum(len(b.ranges) for b in plan.bulk) + sum(len(sh.ranges) for sh in plan.shared)
        if total > MAX_BULK_RANGES:
            raise ValueError(f"restore plan: {total} bulk ranges, at most {MAX_BULK_RANGES}")
        if len({b.pid for b in plan.bulk}) != len(plan.bulk):
            raise ValueError("restore plan: two bulk files for one process")
        if len({s.shmid for s in plan.shared}) != len(plan.shared):
            raise ValueError("restore plan: two bulk files for one shared segment")
        for m in plan.mounts:
            if not os.path.isabs(m.destination) or m.type not in ("bind", "cgroup", "cgroup2"):
                raise ValueError(f"restore plan: bad mount {m}")
        return plan
