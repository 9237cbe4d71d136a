"""bulk.fill of a shared anonymous segment against real stopped processes: a parent that maps the
segment as CRIU restores one (a memfd, shared and writable) and a child it forked that shares it.
The bytes written through the parent's mapping are the child's too; a range anywhere else (private
memory, another segment's mapping, a read-only mapping of it) is refused before anything is
written."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.criu import image_files as img
from runtime.layout import BulkRange, SharedBulkFile, shared_file, sums_of
from runtime.pages import bulk
from runtime.proc import tasks
from runtime.store.volume import ArtifactStore
from tests.unit.test_bulk_fill import NS_PID, _dump_images, _memory
from tests.unit.test_store import KEY, publish

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="process_vm_writev into another process needs root")

SIZE = 3 << 20
P = img.PAGE
SHMID = 77

# The segment as CRIU's restore leaves it (an empty memfd, mapped shared), a read-only mapping
# of it, private memory, and a child sharing the segment.
_PAIR = """
import ctypes, mmap, os, sys
fd = os.memfd_create("")
os.ftruncate(fd, %d)
seg = mmap.mmap(fd, %d, flags=mmap.MAP_SHARED)
ro = mmap.mmap(fd, %d, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
priv = mmap.mmap(-1, %d, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
addr = lambda m: ctypes.addressof(ctypes.c_char.from_buffer(m))
child = os.fork()
if child == 0:
    sys.stdin.read()
    os._exit(0)
ro_addr = int(open("/proc/self/maps").read().split(" r--s ")[0].rsplit("\\n", 1)[-1].split("-")[0], 16)
print(addr(seg), ro_addr, addr(priv), child, flush=True)
sys.stdin.read()
""" % ((SIZE,) * 4)


@dataclasses.dataclass
class Pair:
    proc: subprocess.Popen[str]
    seg: int
    ro: int
    priv: int
    child: int
    images: Path


def _as_segment(images: Path, spans: dict[int, int]) -> None:
    """The parent's mm image with the VMAs starting at ``spans`` keys as CRIU dumps a shared
    anonymous mapping of segment ``spans[start]``."""
    mm = img.read_mm(str(images), NS_PID)
    for v in mm.entry.vmas:
        if v.start in spans:
            v.status = img.VMA_AREA_REGULAR | img.VMA_ANON_SHARED
            v.shmid, v.flags = spans[v.start], 0x21
    img.write_mm(mm)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    proc = subprocess.Popen([sys.executable, "-c", _PAIR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        seg, ro, priv, child = (int(x) for x in proc.stdout.readline().split())
        for pid in (proc.pid, child):
            os.kill(pid, signal.SIGSTOP)
        tasks.wait_stopped([proc.pid, child])
        _dump_images(proc.pid, tmp_path / "images")
        _as_segment(tmp_path / "images", {seg: SHMID, ro: SHMID})
        yield Pair(proc, seg, ro, priv, child, tmp_path / "images")
    finally:
        proc.kill()
        proc.wait()


def _fill(tmp_path: Path, p: Pair, data: bytes, ranges: tuple[BulkRange, ...], shmid: int = SHMID) -> bulk.FillStats:
    store = ArtifactStore(str(tmp_path / "store"))
    src = tmp_path / "seg.bulk"
    src.write_bytes(data)
    bulk.write_sums(str(src), str(tmp_path / "seg.sums"))
    publish(store, files={shared_file(shmid): data, sums_of(shared_file(shmid)): (tmp_path / "seg.sums").read_bytes()})
    f = SharedBulkFile(shmid, NS_PID, shared_file(shmid), 2, ranges)
    with store.open("team-a", "qwen-7b", KEY) as art:
        fd = art.open_file(f.path)
        try:
            return bulk.fill(art, [f], [fd], lambda _pid: p.proc.pid, sums=[bulk.read_sums(art, f)],
                             images=str(p.images), tree=[p.proc.pid, p.child], threads=2)
        finally:
            os.close(fd)


def test_a_segment_written_through_one_mapping_is_every_sharer_s(tmp_path: Path, pair: Pair) -> None:
    data = os.urandom(SIZE)
    stats = _fill(tmp_path, pair, data, (BulkRange(pair.seg + P, SIZE - 2 * P, P), BulkRange(pair.seg, P, 0)))
    assert stats.bytes_written == SIZE - P
    assert _memory(pair.proc.pid, pair.seg, SIZE) == data[:SIZE - P] + bytes(P)
    assert _memory(pair.child, pair.seg, SIZE) == data[:SIZE - P] + bytes(P)  # the forked sharer's view
    assert _memory(pair.proc.pid, pair.ro, SIZE) == data[:SIZE - P] + bytes(P)  # and its read-only one


@pytest.mark.parametrize("where, match", [
    ("priv", "not inside one writable mapping of shared segment"),
    ("ro", "not inside one writable mapping of shared segment"),
    ("other", "not inside one writable mapping of shared segment 78"),
], ids=["private-memory", "read-only-mapping", "another-segment"])
def test_a_range_off_a_writable_mapping_of_its_segment_is_refused(
        tmp_path: Path, pair: Pair, where: str, match: str) -> None:
    at = {"priv": pair.priv, "ro": pair.ro, "other": pair.seg}[where]
    before = [_memory(pair.proc.pid, a, SIZE) for a in (pair.seg, pair.priv)]
    with pytest.raises(bulk.FillError, match=match):
        _fill(tmp_path, pair, os.urandom(SIZE), (BulkRange(pair.seg, P, 0), BulkRange(at + P, P, P)),
              shmid=78 if where == "other" else SHMID)
    assert [_memory(pair.proc.pid, a, SIZE) for a in (pair.seg, pair.priv)] == before  # nothing written


def test_a_segment_range_over_memory_the_restored_process_does_not_share_is_refused(
        tmp_path: Path, pair: Pair) -> None:
    """The dump says shared anonymous memory is there, the restored process has private memory
    there: the images and the process disagree, so nothing is written."""
    _as_segment(pair.images, {pair.priv: SHMID})
    with pytest.raises(bulk.FillError, match="not inside a writable shared memory mapping of restored process"):
        _fill(tmp_path, pair, os.urandom(SIZE), (BulkRange(pair.priv, P, 0),))
    assert _memory(pair.proc.pid, pair.priv, SIZE) == bytes(SIZE)
