"""bulk.fill against a real stopped process: bytes land where the plan says, each chunk
verified before it is written; a cold page cache gets each piece asked of the disk whole before
it is read; and every range that does not belong to a private anonymous writable mapping of a
process CRIU restored (a stack, a shared file mapping, a process outside the tree, a page the
process already has) is refused before anything is written."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import digests
from runtime.criu import image_files as img
from runtime.criu.proto import core_pb2, mm_pb2, pstree_pb2, vma_pb2
from runtime.errors import ArtifactRejected
from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file, bulk_sums
from runtime.pages import bulk, chunks
from runtime.proc import tasks
from runtime.store.volume import ArtifactStore
from tests.unit.test_store import KEY, publish
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="process_vm_writev into another process needs root")

SIZE = 3 << 20
P = img.PAGE
NS_PID = 1  # the pid the images give the process

# An anonymous private region, a shared mapping of a file, and (optionally) one page of the
# anonymous region touched before the stop.
_CHILD = """
import mmap, ctypes, sys
m = mmap.mmap(-1, %d, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
f = open(sys.argv[1], "r+b")
s = mmap.mmap(f.fileno(), %d, flags=mmap.MAP_SHARED)
touch, value = int(sys.argv[2]), int(sys.argv[3])
if touch >= 0:
    m[touch] = value
print(ctypes.addressof(ctypes.c_char.from_buffer(m)), ctypes.addressof(ctypes.c_char.from_buffer(s)), flush=True)
sys.stdin.read()
""" % (SIZE, 1 << 20)


@dataclasses.dataclass
class Target:
    proc: subprocess.Popen[str]
    anon: int  # vaddr of the anonymous region
    shared: int  # vaddr of the shared file mapping
    shared_file: Path
    stack: tuple[int, int]
    images: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


def _required(msg: Any) -> Any:
    """``msg`` with every required field set (zero), recursively: CRIU's core image has many."""
    for f in msg.DESCRIPTOR.fields:
        if f.is_required:
            if f.message_type is not None:
                _required(getattr(msg, f.name))
                getattr(msg, f.name).SetInParent()
            elif not msg.HasField(f.name):
                setattr(msg, f.name, getattr(msg, f.name))
    return msg


def _write_image(path: Path, *messages: Any) -> None:
    img.write_raw(str(path), img.RawImage(b"\0" * 8, [m.SerializeToString() for m in messages]))


def _dump_images(pid: int, images: Path) -> tuple[int, int]:
    """pstree, mm and core images of ``pid`` as CRIU would write them (its VMAs from its maps,
    its stack pointer inside its [stack]); returns the [stack] span."""
    images.mkdir()
    _write_image(images / "pstree.img", pstree_pb2.pstree_entry(pid=NS_PID, ppid=0, pgid=NS_PID, sid=NS_PID,
                                                                threads=[NS_PID]))
    vmas, stack = [], (0, 0)
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        perms, inode, name = fields[1], fields[4], fields[5].strip() if len(fields) > 5 else ""
        prot = (1 if perms[0] == "r" else 0) | (2 if perms[1] == "w" else 0) | (4 if perms[2] == "x" else 0)
        status, flags = img.VMA_AREA_REGULAR, 0x2 if perms[3] == "p" else 0x1
        if inode != "0":
            status |= img.VMA_FILE_PRIVATE if perms[3] == "p" else img.VMA_FILE_SHARED
        elif name in ("[vdso]", "[vvar]", "[vsyscall]", "[vvar_vclock]"):
            status = img.VMA_AREA_VDSO
        else:
            status |= img.VMA_ANON_PRIVATE
            flags |= 0x20
        if name == "[stack]":
            status |= img.VMA_AREA_STACK
            flags |= img.MAP_GROWSDOWN
            stack = (lo, hi)
        vmas.append(vma_pb2.vma_entry(start=lo, end=hi, pgoff=0, shmid=0, prot=prot, flags=flags,
                                      status=status, fd=-1))
    mm = _required(mm_pb2.mm_entry())
    mm.vmas.extend(vmas)
    _write_image(images / f"mm-{NS_PID}.img", mm)
    core = core_pb2.core_entry(mtype=core_pb2.core_entry.X86_64)
    _required(core.thread_info)
    core.thread_info.gpregs.sp = stack[1] - 0x800
    _write_image(images / f"core-{NS_PID}.img", core)
    return stack


@pytest.fixture
def start_target(tmp_path: Path) -> Iterator[Callable[..., Target]]:
    made: list[subprocess.Popen[str]] = []

    def start(touch: int = -1, name: str = "t", value: int = 7) -> Target:
        shared_file = tmp_path / f"{name}-shared.bin"
        shared_file.write_bytes(b"s" * (1 << 20))
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(shared_file), str(touch), str(value)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        made.append(proc)
        assert proc.stdout is not None
        anon, shared = (int(x) for x in proc.stdout.readline().split())
        os.kill(proc.pid, signal.SIGSTOP)
        tasks.wait_stopped([proc.pid])
        stack = _dump_images(proc.pid, tmp_path / f"{name}-images")
        return Target(proc, anon, shared, shared_file, stack, tmp_path / f"{name}-images")

    yield start
    for proc in made:
        proc.kill()
        proc.wait()


def _memory(pid: int, vaddr: int, length: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(vaddr)
        return f.read(length)


def _publish(store: ArtifactStore, data: bytes, tmp_path: Path) -> None:
    src = tmp_path / "pages.bulk"
    src.write_bytes(data)
    bulk.write_sums(str(src), str(tmp_path / "pages.sums"))
    publish(store, files={bulk_file(NS_PID): data, bulk_sums(NS_PID): (tmp_path / "pages.sums").read_bytes()})


def _fill(store: ArtifactStore, plan: BulkFile, t: Target, *, pid_of: Callable[[int], int] | None = None,
          tree: list[int] | None = None, threads: int = 2) -> bulk.FillStats:
    with store.open("team-a", "qwen-7b", KEY) as art:
        fd = art.open_file(plan.path)
        try:
            return bulk.fill(art, [plan], [fd], pid_of or (lambda _pid: t.pid), sums=[bulk.read_sums(art, plan)],
                             images=str(t.images), tree=[t.pid] if tree is None else tree, threads=threads)
        finally:
            os.close(fd)


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
def test_fill_writes_verified_pages_and_asks_the_disk_ahead_when_cold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_target: Callable[..., Target], cold: bool) -> None:
    monkeypatch.setattr(digests, "PIECE", 1 << 20)  # for publish and fill alike: three pieces
    data = os.urandom(SIZE)
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, data, tmp_path)
    advised: list[tuple[int, int]] = []
    if cold:
        monkeypatch.setattr(chunks, "is_cached", lambda *_: False)
    real = os.posix_fadvise
    monkeypatch.setattr(bulk.os, "posix_fadvise",
                        lambda fd, off, n, advice: (advised.append((off, n)), real(fd, off, n, advice))[1])
    t = start_target()
    stats = _fill(store, BulkFile(NS_PID, bulk_file(NS_PID), 1, (BulkRange(t.anon, SIZE, 0),)), t)
    assert stats.bytes_written == SIZE
    assert _memory(t.pid, t.anon, SIZE) == data
    assert sorted(advised) == ([(o, 1 << 20) for o in range(0, SIZE, 1 << 20)] if cold else [])


def _refused(store: ArtifactStore, t: Target, ranges: tuple[BulkRange, ...], match: str, **kw: Any) -> None:
    before = _memory(t.pid, t.anon, SIZE)
    with pytest.raises(bulk.FillError, match=match):
        _fill(store, BulkFile(NS_PID, bulk_file(NS_PID), 1, ranges), t, **kw)
    assert _memory(t.pid, t.anon, SIZE) == before  # not even the good range was written


def test_a_range_in_the_stack_is_refused(tmp_path: Path, start_target: Callable[..., Target]) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, os.urandom(SIZE), tmp_path)
    t = start_target()
    top = t.stack[1] - P
    stack_before = _memory(t.pid, top, P)
    _refused(store, t, (BulkRange(t.anon, P, 0), BulkRange(top, P, P)), "thread's stack")
    assert _memory(t.pid, top, P) == stack_before


def test_a_range_in_a_shared_file_mapping_is_refused_and_the_file_is_unchanged(
        tmp_path: Path, start_target: Callable[..., Target]) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, os.urandom(SIZE), tmp_path)
    t = start_target()
    _refused(store, t, (BulkRange(t.anon, P, 0), BulkRange(t.shared, 1 << 20, P)),
             "not inside one private anonymous writable VMA")
    assert t.shared_file.read_bytes() == b"s" * (1 << 20)


def test_a_process_outside_the_restored_tree_is_refused(tmp_path: Path, start_target: Callable[..., Target]) -> None:
    """A plan naming a process of the target's pid namespace that CRIU did not restore (its
    init, say), or a pid the dump does not have."""
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, os.urandom(SIZE), tmp_path)
    t = start_target()
    other = start_target(name="other")  # stands for the target's init: same layout, not restored
    _refused(store, t, (BulkRange(other.anon, SIZE, 0),), "is not a process CRIU restored",
             pid_of=lambda _pid: other.pid, tree=[t.pid])
    assert _memory(other.pid, other.anon, SIZE) == bytes(SIZE)
    plan = BulkFile(2, bulk_file(2), 1, (BulkRange(t.anon, SIZE, 0),))  # no such pid in the dump
    with store.open("team-a", "qwen-7b", KEY) as art, pytest.raises(bulk.FillError, match="pid 2 is no live process"):
        bulk.fill(art, [plan], [-1], lambda _pid: t.pid, sums=[b""], images=str(t.images), tree=[t.pid])


def test_a_page_the_restored_process_already_has_is_never_overwritten(
        tmp_path: Path, start_target: Callable[..., Target]) -> None:
    """The second line behind the split keeping stacks with CRIU: a page written after CRIU
    let the tree go (a signal frame) is present; the fill refuses rather than overwrite it."""
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, os.urandom(SIZE), tmp_path)
    t = start_target(touch=SIZE - P)  # the last page of the region
    _refused(store, t, (BulkRange(t.anon, SIZE, 0),), f"page {t.anon + SIZE - P:#x} was written after CRIU")
    assert _memory(t.pid, t.anon + SIZE - P, 1) == b"\x07"


def test_a_present_page_of_zeros_is_filled(tmp_path: Path, start_target: Callable[..., Target]) -> None:
    """What a huge page faulted in around a page CRIU wrote holds: nothing written, so filled."""
    data = os.urandom(SIZE)
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, data, tmp_path)
    t = start_target(touch=P, value=0)
    with open(f"/proc/{t.pid}/pagemap", "rb") as pm:
        pm.seek((t.anon + P) // P * 8)
        assert int.from_bytes(pm.read(8), "little") >> 63  # present
    assert _memory(t.pid, t.anon + P, P) == bytes(P)
    _fill(store, BulkFile(NS_PID, bulk_file(NS_PID), 1, (BulkRange(t.anon, SIZE, 0),)), t)
    assert _memory(t.pid, t.anon, SIZE) == data


def test_a_sealed_entry_is_copied_from_its_mapping_ranges_only(
        tmp_path: Path, start_target: Callable[..., Target]) -> None:
    """A node cache entry's fill file (sealed: no sums, no hash) may have holes where ranges are
    mapped; the fill copies its two ranges, at their file offsets, and nothing in between."""
    data = os.urandom(SIZE)  # what lies between the ranges is no range's: never written
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, data, tmp_path)
    t = start_target()
    ranges = (BulkRange(t.anon, P, 0), BulkRange(t.anon + SIZE - P, P, SIZE - P))
    with store.open("team-a", "qwen-7b", KEY) as art:
        fd = art.open_file(bulk_file(NS_PID))
        try:
            stats = bulk.fill(art, [BulkFile(NS_PID, bulk_file(NS_PID), 1, ranges)], [fd], lambda _pid: t.pid,
                              sums=[], images=str(t.images), tree=[t.pid], threads=2, sealed=True)
        finally:
            os.close(fd)
    assert (stats.bytes_read, stats.bytes_written) == (2 * P, 2 * P)
    assert _memory(t.pid, t.anon, P) == data[:P]
    assert _memory(t.pid, t.anon + SIZE - P, P) == data[SIZE - P:]
    assert _memory(t.pid, t.anon + P, SIZE - 2 * P) == bytes(SIZE - 2 * P)


def test_ranges_that_share_file_bytes_cannot_be_planned() -> None:
    """The fill used to write one of them and skip the rest, and said ok."""
    with pytest.raises(ValueError, match="overlap in file offsets"):
        BulkFile(NS_PID, bulk_file(NS_PID), 1, (BulkRange(0x10000, P, 0), BulkRange(0x20000, 3 * P, 0)))
    with pytest.raises(ValueError, match="overlap in addresses"):
        BulkFile(NS_PID, bulk_file(NS_PID), 1, (BulkRange(0x10000, 2 * P, 0), BulkRange(0x11000, P, 2 * P)))


def test_a_chunk_that_does_not_match_its_digest_is_never_written(
        tmp_path: Path, start_target: Callable[..., Target]) -> None:
    data = os.urandom(SIZE)
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, data, tmp_path)
    version = Path(store.root, "team-a", os.readlink(Path(store.root, "team-a", "qwen-7b")))
    with open(version / bulk_file(NS_PID), "r+b") as f:  # a store writer flips a byte of chunk 1
        f.seek(SUM_CHUNK + 5)
        f.write(bytes([data[SUM_CHUNK + 5] ^ 1]))
    t = start_target()
    with pytest.raises(chunks.IntegrityError, match=f"chunk at {SUM_CHUNK} does not match its digest"):
        _fill(store, BulkFile(NS_PID, bulk_file(NS_PID), 1, (BulkRange(t.anon, SIZE, 0),)), t, threads=1)
    # Chunk 0 verified and went in; the bad chunk and what follows never did.
    assert _memory(t.pid, t.anon + SUM_CHUNK, SIZE - SUM_CHUNK) == bytes(SIZE - SUM_CHUNK)


def test_a_sums_file_that_does_not_match_the_manifest_writes_nothing(
        tmp_path: Path, start_target: Callable[..., Target]) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, os.urandom(SIZE), tmp_path)
    version = Path(store.root, "team-a", os.readlink(Path(store.root, "team-a", "qwen-7b")))
    sums = version / bulk_sums(NS_PID)
    sums.write_bytes(bytes(len(sums.read_bytes())))  # digests of anything the writer likes
    t = start_target()
    with pytest.raises(ArtifactRejected, match="content changed"):
        _fill(store, BulkFile(NS_PID, bulk_file(NS_PID), 1, (BulkRange(t.anon, SIZE, 0),)), t)
    assert _memory(t.pid, t.anon, SIZE) == bytes(SIZE)


def test_zombies_and_gone_processes_count_as_settled() -> None:
    child = subprocess.Popen(["/bin/true"])
    wait_for(lambda: tasks._task_states(child.pid) == ["Z"], 5, "the child to be a zombie")
    tasks.wait_stopped([child.pid], timeout=0.5)  # a zombie: it never runs again
    child.wait()
    tasks.wait_stopped([child.pid], timeout=0.5)  # gone


def test_a_zero_chunk_that_is_a_hole_is_not_written(tmp_path: Path, start_target: Callable[..., Target]) -> None:
    """The checkpoint punches zero chunks out; the target's pages there read zeros already (the
    fill checks that none is written before it starts), so nothing is written there."""
    from runtime.fs import holes
    data = bytearray(os.urandom(SIZE))
    data[SUM_CHUNK:2 * SUM_CHUNK] = bytes(SUM_CHUNK)
    store = ArtifactStore(str(tmp_path / "store"))
    _publish(store, bytes(data), tmp_path)
    [stored] = Path(store.root).rglob(bulk_file(NS_PID).rsplit("/", 1)[-1])
    fd = os.open(stored, os.O_RDWR)
    try:
        assert holes.punch(fd, [(SUM_CHUNK, SUM_CHUNK)])
    finally:
        os.close(fd)
    t = start_target()
    stats = _fill(store, BulkFile(NS_PID, bulk_file(NS_PID), 1, (BulkRange(t.anon, SIZE, 0),)), t)
    assert _memory(t.pid, t.anon, SIZE) == data
    assert stats.bytes_written == SIZE - SUM_CHUNK  # (whether a page is present says little: THP)
