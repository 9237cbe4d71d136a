"""The bulk split's choice of runs, and the restore plan's encoding of them (no CRIU needed:
the images are built from CRIU's own message types)."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import blake3
import pytest

from runtime.criu import image_files as img
from runtime.criu.proto import core_pb2, mm_pb2, pagemap_pb2, pstree_pb2, vma_pb2
from runtime.digests import hash_fd
from runtime.fs import holes
from runtime.layout import (
    CRIU_DIR,
    SUM_CHUNK,
    BulkFile,
    BulkRange,
    RestorePlan,
    SharedBulkFile,
    bulk_file,
    bulk_sums,
    shared_file,
    shared_pagemap,
    sums_of,
)
from runtime.pages import bulk
from runtime.pages.tailhash import TailHasher

P = img.PAGE
ANON = img.VMA_AREA_REGULAR | img.VMA_ANON_PRIVATE
FILE = img.VMA_AREA_REGULAR | img.VMA_FILE_PRIVATE


def vma(start: int, end: int, status: int = ANON, prot: int = 0x3) -> vma_pb2.vma_entry:
    return vma_pb2.vma_entry(start=start, end=end, pgoff=0, shmid=0, prot=prot, flags=0x22,
                             status=status, fd=-1)


def pagemap(*runs: tuple[int, int]) -> img.Pagemap:
    entries = [pagemap_pb2.pagemap_entry(vaddr=v, nr_pages=n, flags=img.PE_PRESENT) for v, n in runs]
    return img.Pagemap("pagemap-1.img", b"", 1, entries)


def test_adjacent_entries_in_one_vma_merge_and_every_run_moves_by_default() -> None:
    vmas = [vma(0x10000, 0x20000), vma(0x20000, 0x30000)]
    pm = pagemap((0x10000, 2), (0x12000, 1), (0x14000, 1), (0x1f000, 1), (0x20000, 1))
    ranges, moved = bulk._runs(pm, vmas, bulk.MIN_RUN)
    # one run per gap; an entry in the next VMA starts its own run even when adjacent
    assert ranges == [BulkRange(0x10000, 3 * P, 0), BulkRange(0x14000, P, 3 * P),
                      BulkRange(0x1f000, P, 4 * P), BulkRange(0x20000, P, 5 * P)]
    assert moved == {0, 1, 2, 3, 4}


def test_file_and_read_only_mappings_stay_with_criu_and_min_run_keeps_short_runs() -> None:
    vmas = [vma(0x10000, 0x20000, FILE), vma(0x20000, 0x30000, prot=0x1), vma(0x30000, 0x40000)]
    pm = pagemap((0x10000, 4), (0x20000, 4), (0x30000, 1), (0x32000, 8))
    ranges, moved = bulk._runs(pm, vmas, 4 * P)
    assert ranges == [BulkRange(0x32000, 8 * P, 9 * P)] and moved == {3}


def test_the_number_of_ranges_is_capped_keeping_the_longest() -> None:
    vmas = [vma(0x100000, 0x200000)]
    pm = pagemap(*[(0x100000 + i * 0x10000, 1 + (i % 4)) for i in range(12)])
    ranges, moved = bulk._runs(pm, vmas, P, cap=3)
    assert [r.length for r in ranges] == [4 * P] * 3  # the three 4-page runs, in file order
    assert [r.offset for r in ranges] == sorted(r.offset for r in ranges)
    assert moved == {3, 7, 11}


def plan(ranges: tuple[BulkRange, ...]) -> RestorePlan:
    return RestorePlan(stdio=("pipe:[1]", "pipe:[2]", "pipe:[3]"), shell_job=False, mounts=(), shm=False,
                       bulk=(BulkFile(6, bulk_file(6), 3, ranges),))


def test_plan_ranges_are_one_flat_list_and_round_trip() -> None:
    ranges = tuple(BulkRange(0x10000 + i * 2 * P, P, i * P) for i in range(1000))
    data = plan(ranges).to_json()
    assert json.loads(data)["bulk"][0]["ranges"][:6] == [0x10000, P, 0, 0x10000 + 2 * P, P, P]
    assert RestorePlan.from_json(data) == plan(ranges)


def test_plan_in_the_object_form_still_parses() -> None:
    obj = json.loads(plan((BulkRange(0x10000, P, 0),)).to_json())
    obj["bulk"][0]["ranges"] = [{"vaddr": 0x10000, "length": P, "offset": 0}]
    assert RestorePlan.from_json(json.dumps(obj).encode()) == plan((BulkRange(0x10000, P, 0),))


@pytest.mark.parametrize("ranges, why", [
    ([0x10000, P], "integers"),                       # not triples
    ([0x10000, P, True], "integers"),                 # a bool is not an int
    ([0x10000, "4096", 0], "integers"),
    ([0x10001, P, 0], "page-aligned"),
    ([0x10000, P + 1, 0], "page-aligned"),
    ([0x10000, P, 1], "page-aligned"),
    ([(1 << 63) - P, 2 * P, 0], "overflows"),
    ([0x10000, P, 1 << 63, 0x20000, P, 0], "overflows"),
    ([0x10000, 2 * P, 0, 0x11000, P, 2 * P], "overlap in addresses"),
    # two places for the same bytes: the fill used to write one and skip the other
    ([0x10000, P, 0, 0x20000, 3 * P, 0], "overlap in file offsets"),
], ids=["pairs", "bool", "string", "vaddr-unaligned", "length-unaligned", "offset-unaligned",
        "vaddr-overflow", "offset-overflow", "address-overlap", "offset-overlap"])
def test_bad_flat_ranges_are_refused(ranges: list[object], why: str) -> None:
    obj = json.loads(plan((BulkRange(0x10000, P, 0),)).to_json())
    obj["bulk"][0]["ranges"] = ranges
    with pytest.raises(ValueError, match=why):
        RestorePlan.from_json(json.dumps(obj).encode())


def test_a_plan_of_more_ranges_than_the_checkpoint_ever_lists_is_refused() -> None:
    assert bulk.MAX_RANGES == 200_000
    ok = tuple(BulkRange(i * P, P, i * P) for i in range(bulk.MAX_RANGES))
    assert len(RestorePlan.from_json(plan(ok).to_json()).bulk[0].ranges) == bulk.MAX_RANGES
    obj = json.loads(plan(ok).to_json())
    n = bulk.MAX_RANGES + 1
    obj["bulk"][0]["ranges"] = [x for i in range(n) for x in (i * P, P, i * P)]
    with pytest.raises(ValueError, match="200001 bulk ranges, at most 200000"):
        RestorePlan.from_json(json.dumps(obj).encode())
    # spread over two processes: the cap is per artifact, as the split keeps it
    half = [x for i in range(n // 2 + 1) for x in (i * P, P, i * P)]
    obj["bulk"] = [dict(obj["bulk"][0], ranges=half),
                   dict(obj["bulk"][0], pid=7, path=bulk_file(7), ranges=half)]
    with pytest.raises(ValueError, match="bulk ranges, at most 200000"):
        RestorePlan.from_json(json.dumps(obj).encode())


def _split(artifact_dir: str, **kw: Any) -> tuple[tuple[BulkFile, ...], bulk.SplitStats]:
    moved = bulk.split(artifact_dir, **kw)
    return moved.files, moved.stats


def _image(path: Path, *messages: Any) -> None:
    img.write_raw(str(path), img.RawImage(b"\0" * 8, [m.SerializePartialToString() for m in messages]))


def _core(sp: int, sas: tuple[int, int] | None = None, rseq: int = 0) -> Any:
    core = core_pb2.core_entry(mtype=core_pb2.core_entry.X86_64)
    core.thread_info.gpregs.sp = sp
    if sas is not None:
        core.thread_core.sas.ss_sp, core.thread_core.sas.ss_size = sas
    if rseq:
        core.thread_core.rseq_entry.rseq_abi_pointer, core.thread_core.rseq_entry.rseq_abi_size = rseq, 32
    return core


def test_split_keeps_stacks_and_rseq_areas_with_criu_and_writes_chunk_digests(tmp_path: Path) -> None:
    """A signal pending at restore gets its frame written on a stack (or sigaltstack) as soon as
    CRIU lets the tree go, before the fill; CRIU and the kernel write each thread's rseq area
    (in its TLS, here in the heap): none of that may be filled over afterwards."""
    images = tmp_path / CRIU_DIR
    images.mkdir()
    heap, main_stack, thread_stack, altstack, lowstack = (
        (0x100000, 0x200000), (0x7ff000000, 0x7ff100000), (0x500000, 0x600000), (0x700000, 0x710000),
        (0x800000, 0x810000))
    vmas = [vma(*heap), vma(*thread_stack), vma(*altstack), vma(*lowstack), vma(*(0x810000, 0x820000)),
            vma(*main_stack, status=ANON | img.VMA_AREA_STACK)]
    vmas[-1].flags |= img.MAP_GROWSDOWN
    _image(images / "pstree.img", pstree_pb2.pstree_entry(pid=1, ppid=0, pgid=1, sid=1, threads=[1, 2, 3]))
    mm = mm_pb2.mm_entry()
    mm.vmas.extend(vmas)
    _image(images / "mm-1.img", mm)
    _image(images / "core-1.img", _core(main_stack[1] - 0x100, rseq=heap[0] + P + 0x20))
    # thread 2 on its own stack, with a sigaltstack
    _image(images / "core-2.img", _core(thread_stack[0] + 0x8000, sas=(altstack[0], altstack[1] - altstack[0])))
    # thread 3's sp at the very start of the VMA above: its frame lands in the one below
    _image(images / "core-3.img", _core(0x810000))
    entries = [pagemap_pb2.pagemap_entry(vaddr=lo, compat_nr_pages=4, nr_pages=4, flags=img.PE_PRESENT)
               for lo, _ in (heap, thread_stack, altstack, lowstack, (0x810000, 0), main_stack)]
    _image(images / "pagemap-1.img", pagemap_pb2.pagemap_head(pages_id=9), *entries)
    data = os.urandom(len(entries) * 4 * P)
    (images / "pages-9.img").write_bytes(data)

    files, _stats = _split(str(tmp_path))
    # the heap's entry is cut around the rseq page; every stack stays with CRIU
    assert files == (BulkFile(1, bulk_file(1), 9,
                              (BulkRange(heap[0], P, 0), BulkRange(heap[0] + 2 * P, 2 * P, 2 * P))),)
    kept = img.read_pagemap(str(images), 1)
    assert [(e.vaddr, img.nr_pages(e)) for e in kept.entries] == [
        (heap[0] + P, 1), (thread_stack[0], 4), (altstack[0], 4), (lowstack[0], 4), (0x810000, 4), (main_stack[0], 4)]
    assert (images / "pages-9.img").read_bytes() == data[P:2 * P] + data[4 * P:]
    # what CRIU keeps is punched out of the bulk file (stored once); the offsets stay
    bulk_data = (tmp_path / bulk_file(1)).read_bytes()
    assert bulk_data == data[:P] + bytes(P) + data[2 * P:4 * P] + bytes(len(data) - 4 * P)
    sums = (tmp_path / bulk_sums(1)).read_bytes()
    assert sums == blake3.blake3(bulk_data).digest()  # one chunk, of the punched file
    # the stock path: the bulk file with CRIU's bytes written back is the dump's pages file again
    whole = img.Pagemap(str(tmp_path / "bulk" / "pagemap-1.img"), kept.magic, 9, entries)
    assert bulk.rejoin(kept, whole, str(images / "pages-9.img"), str(tmp_path / bulk_file(1))) == len(data) - 3 * P
    assert (tmp_path / bulk_file(1)).read_bytes() == data


def test_rejoin_refuses_an_entry_the_whole_pagemap_does_not_hold(tmp_path: Path) -> None:
    (tmp_path / "kept").write_bytes(os.urandom(2 * P))
    (tmp_path / "whole").write_bytes(bytes(4 * P))
    with pytest.raises(OSError, match="entry at 0x3000 is not in"):
        bulk.rejoin(pagemap((0x3000, 2)), pagemap((0x1000, 3)), str(tmp_path / "kept"), str(tmp_path / "whole"))


def test_a_signal_frame_reaches_down_only_through_adjacent_writable_vmas(tmp_path: Path) -> None:
    """A thread's stack pointer near the bottom of its stack: the frame may spill into the VMA
    right below, but not past a guard page (it would fault there) or a gap."""
    big, guard, stack = (0x100000, 0x4ff000), (0x4ff000, 0x500000), (0x500000, 0x600000)
    vmas = [vma(*big), vma(*guard, prot=0), vma(*stack)]
    _image(tmp_path / "core-1.img", _core(stack[0] + 0x100))
    entry = img.PstreeEntry(1, 0, 1, 1, (1,))
    assert img.written_after_restore(str(tmp_path), entry, vmas) == img.Written((stack,), ())
    # no guard: the frame can land in the VMA below, and only as far as SIGFRAME_MAX reaches
    vmas = [vma(0x100000, 0x4f0000), vma(0x4f0000, 0x500000), vma(*stack)]
    assert img.written_after_restore(str(tmp_path), entry, vmas).vmas == ((0x4f0000, 0x500000), stack)


def test_a_zombies_thread_list_is_not_taken_for_pids_the_restore_needs(tmp_path: Path) -> None:
    """CRIU writes an uninitialised thread id for a zombie (it never collects a dead task's
    threads): taken for a pid, it was "too close to pid_max" and the restore started cold."""
    _image(tmp_path / "pstree.img", pstree_pb2.pstree_entry(pid=1, ppid=0, pgid=1, sid=1, threads=[1, 2]),
           pstree_pb2.pstree_entry(pid=5, ppid=1, pgid=1, sid=1, threads=[3783754912]))
    zombie = core_pb2.core_entry(mtype=core_pb2.core_entry.X86_64)
    zombie.tc.task_state = img.TASK_DEAD
    _image(tmp_path / "core-5.img", zombie)
    _image(tmp_path / "core-1.img", _core(0x7ff000))
    assert img.image_pids(str(tmp_path)) == {1, 2, 5}
    assert img.is_zombie(str(tmp_path), 5) and not img.is_zombie(str(tmp_path), 1)


def test_what_is_written_after_restore_is_found_for_any_range() -> None:
    w = img.Written(((0x1000, 0x3000), (0x10000, 0x20000)), ((0x2000, 0x3000), (0x5000, 0x6000)))
    hit = {(0, 0x1001), (0x3000, 0x5001), (0x5fff, 0x7000), (0x1fff0, 0x30000), (0, 0x40000)}
    miss = {(0, 0x1000), (0x3000, 0x5000), (0x6000, 0x10000), (0x20000, 0x30000)}
    assert {r for r in hit | miss if w.hits(*r)} == hit


def _forked_dump(tmp_path: Path, shared: int, own: int) -> tuple[Path, bytes, bytes]:
    """A parent and its child with a private anonymous VMA at the same place (inherited at the
    fork: it stays with CRIU in both) and one of their own each (moved to the bulk files)."""
    images = tmp_path / CRIU_DIR
    images.mkdir()
    cow = (0x10000000, 0x10000000 + shared)
    _image(images / "pstree.img", pstree_pb2.pstree_entry(pid=1, ppid=0, pgid=1, sid=1, threads=[1]),
           pstree_pb2.pstree_entry(pid=2, ppid=1, pgid=1, sid=1, threads=[2]))
    datas = []
    for pid in (1, 2):
        mine = (pid << 30, (pid << 30) + own)
        mm = mm_pb2.mm_entry()
        mm.vmas.extend([vma(*cow), vma(*mine)])
        _image(images / f"mm-{pid}.img", mm)
        _image(images / f"core-{pid}.img", _core(0x7ff000))
        entries = [pagemap_pb2.pagemap_entry(vaddr=lo, compat_nr_pages=(hi - lo) // P, nr_pages=(hi - lo) // P,
                                             flags=img.PE_PRESENT) for lo, hi in (cow, mine)]
        _image(images / f"pagemap-{pid}.img", pagemap_pb2.pagemap_head(pages_id=pid), *entries)
        data = os.urandom(shared + own)
        (images / f"pages-{pid}.img").write_bytes(data)
        datas.append(data)
    return images, datas[0], datas[1]


@pytest.mark.parametrize("ahead", [False, True], ids=["hashed-after", "hashed-while-written"])
def test_the_bytes_criu_keeps_are_punched_out_of_the_bulk_file_and_its_sums_are_of_the_punched_file(
        tmp_path: Path, ahead: bool) -> None:
    """A forked tree's copy-on-write memory stays with CRIU: the bulk file keeps only the moved
    runs (its offsets unchanged), each byte is stored once, and the chunk digests (made after
    the punch, or brought up to date from those made while CRIU wrote) match the punched file."""
    shared, own = 3 * SUM_CHUNK + 5 * P, 2 * SUM_CHUNK  # the punch ends inside a chunk
    images, parent, _child = _forked_dump(tmp_path, shared, own)
    hashed: dict[str, Any] = {}
    if ahead:
        with TailHasher(str(images)) as th:
            hashed = th.finish()
    files, stats = _split(str(tmp_path), hashed=hashed)
    assert [f.ranges for f in files] == [(BulkRange(pid << 30, own, shared),) for pid in (1, 2)]
    assert stats.kept_bytes == stats.punched_bytes == 2 * shared
    path = tmp_path / bulk_file(1)
    st = os.stat(path)
    assert st.st_size == shared + own  # offsets unchanged
    assert st.st_blocks * 512 <= own + (64 << 10)  # only the moved run takes room
    punched = bytes(shared) + parent[shared:]
    assert path.read_bytes() == punched
    want = b"".join(blake3.blake3(punched[o:o + SUM_CHUNK]).digest() for o in range(0, len(punched), SUM_CHUNK))
    assert (tmp_path / bulk_sums(1)).read_bytes() == want
    assert (images / "pages-1.img").read_bytes() == parent[:shared]
    if ahead:  # what the publish takes for the file: its digest after the punch
        known = hashed[str(path)]
        assert known.matches(st) and known.sums == want
        assert known.digest == hash_fd(os.open(path, os.O_RDONLY))[1]
        assert str(images / "pages-1.img") not in hashed


def test_where_the_file_system_cannot_punch_the_bytes_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images, parent, _child = _forked_dump(tmp_path, 2 * P, 2 * P)
    monkeypatch.setattr(holes, "_fallocate", lambda *_a: (ctypes.set_errno(errno.EOPNOTSUPP), -1)[1])
    _files, stats = _split(str(tmp_path))
    assert stats.punched_bytes == 0
    assert (tmp_path / bulk_file(1)).read_bytes() == parent
    assert (tmp_path / bulk_sums(1)).read_bytes() == blake3.blake3(parent).digest()


def _one_run(tmp_path: Path, run: tuple[int, int], data: bytes, vma_start: int | None = None) -> Path:
    """CRIU's images of one process whose memory is one present run ``run`` of ``data`` (in a
    VMA from ``vma_start``, by default the run's start, to its end); the images' folder."""
    images = tmp_path / CRIU_DIR
    images.mkdir()
    _image(images / "pstree.img", pstree_pb2.pstree_entry(pid=1, ppid=0, pgid=1, sid=1, threads=[1]))
    mm = mm_pb2.mm_entry(mm_start_code=0, mm_end_code=0, mm_start_data=0, mm_end_data=0, mm_start_stack=0,
                         mm_start_brk=0, mm_brk=0, mm_arg_start=0, mm_arg_end=0, mm_env_start=0, mm_env_end=0,
                         exe_file_id=1)  # complete: the split may write it back
    mm.vmas.extend([vma(run[0] if vma_start is None else vma_start, run[1])])
    _image(images / "mm-1.img", mm)
    _image(images / "core-1.img", _core(0x7ff000))
    n = (run[1] - run[0]) // P
    _image(images / "pagemap-1.img", pagemap_pb2.pagemap_head(pages_id=1),
           pagemap_pb2.pagemap_entry(vaddr=run[0], compat_nr_pages=n, nr_pages=n, flags=img.PE_PRESENT))
    (images / "pages-1.img").write_bytes(data)
    return images


@pytest.mark.parametrize("ahead", [False, True], ids=["hashed-after", "hashed-while-written"])
def test_zero_chunks_of_the_moved_runs_are_punched_out_and_the_digests_stay(tmp_path: Path, ahead: bool) -> None:
    """Memory an engine touched and never wrote (a KV cache of zeros) is stored as nothing: each
    whole zero chunk of a bulk file is a hole; its content, so its digests, do not change."""
    run = (0x10000000, 0x10000000 + 5 * SUM_CHUNK)
    # chunks 1 and 2 zero; chunk 3 zero but for one byte; the rest random
    data = bytearray(os.urandom(5 * SUM_CHUNK))
    data[SUM_CHUNK:4 * SUM_CHUNK] = bytes(3 * SUM_CHUNK)
    data[4 * SUM_CHUNK - 1] = 1
    images = _one_run(tmp_path, run, data)
    hashed: dict[str, Any] = {}
    if ahead:
        with TailHasher(str(images)) as th:
            hashed = th.finish()
    _files, stats = _split(str(tmp_path), hashed=hashed)
    assert stats.zero_bytes == 2 * SUM_CHUNK and stats.moved_bytes == len(data)
    path = tmp_path / bulk_file(1)
    st = os.stat(path)
    assert path.read_bytes() == bytes(data) and st.st_size == len(data)
    assert st.st_blocks * 512 <= 3 * SUM_CHUNK + (64 << 10)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert holes.data_spans(fd) == [(0, SUM_CHUNK), (3 * SUM_CHUNK, 2 * SUM_CHUNK)]
        if ahead:  # what the publish takes for the file still stands for it
            assert hashed[str(path)].matches(st)
            assert hashed[str(path)].digest == hash_fd(fd)[1]
    finally:
        os.close(fd)
    want = b"".join(blake3.blake3(data[o:o + SUM_CHUNK]).digest() for o in range(0, len(data), SUM_CHUNK))
    assert (tmp_path / bulk_sums(1)).read_bytes() == want


def test_a_long_zero_run_inside_a_range_becomes_a_range_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's KV pool inside the driver's host copy: the split lists it apart (same bytes, same
    places), so that the node cache can leave it anonymous instead of mapping zeros."""
    monkeypatch.setattr(bulk, "ZERO_APART", 3 * SUM_CHUNK)
    run = (0x10000000 + 3 * P, 0x10000000 + 3 * P + 9 * SUM_CHUNK)  # not chunk-aligned in memory
    # chunks 2-5 zero (a run of 4), chunk 7 zero alone (too short to stand apart)
    data = bytearray(os.urandom(9 * SUM_CHUNK))
    data[2 * SUM_CHUNK:6 * SUM_CHUNK] = bytes(4 * SUM_CHUNK)
    data[7 * SUM_CHUNK:8 * SUM_CHUNK] = bytes(SUM_CHUNK)
    _one_run(tmp_path, run, data, vma_start=run[0] - 3 * P)
    files, stats = _split(str(tmp_path))
    assert stats.zero_bytes == 5 * SUM_CHUNK
    assert files[0].ranges == (BulkRange(run[0], 2 * SUM_CHUNK, 0),
                               BulkRange(run[0] + 2 * SUM_CHUNK, 4 * SUM_CHUNK, 2 * SUM_CHUNK),
                               BulkRange(run[0] + 6 * SUM_CHUNK, 3 * SUM_CHUNK, 6 * SUM_CHUNK))
    assert (tmp_path / bulk_file(1)).read_bytes() == bytes(data)


def test_zero_runs_stand_apart_only_while_there_is_room_for_more_ranges() -> None:
    zero, other = blake3.blake3(bytes(SUM_CHUNK)).digest(), b"\x01" * 32
    sums = other + zero * 4 + other + zero * 2 + other  # chunks 1-4 and 6-7 zero
    r = BulkRange(0x40000000, 9 * SUM_CHUNK, 0)
    both = bulk.zeros_apart([r], sums, room=4, min_len=2 * SUM_CHUNK)
    assert [(x.offset // SUM_CHUNK, x.length // SUM_CHUNK) for x in both] == [(0, 1), (1, 4), (5, 1), (6, 2), (8, 1)]
    longest = bulk.zeros_apart([r], sums, room=3, min_len=2 * SUM_CHUNK)
    assert [(x.offset // SUM_CHUNK, x.length // SUM_CHUNK) for x in longest] == [(0, 1), (1, 4), (5, 4)]
    assert bulk.zeros_apart([r], sums, room=0, min_len=2 * SUM_CHUNK) == [r]
    assert sum(x.length for x in both) == r.length


SHARED = img.VMA_AREA_REGULAR | img.VMA_ANON_SHARED


def _with_segment(images: Path, shmid: int, vmas: list[Any], data: bytes, pages: list[tuple[int, int]]) -> None:
    """Add to process 1's images shared segment ``shmid``: mapped by ``vmas``, its pages at
    ``pages`` (segment offset, number of pages) holding ``data`` in order, and a hole."""
    mm = img.read_mm(str(images), 1)
    mm.entry.vmas.extend(vmas)
    img.write_mm(mm)
    _image(images / f"pagemap-shmem-{shmid}.img", pagemap_pb2.pagemap_head(pages_id=2),
           *(pagemap_pb2.pagemap_entry(vaddr=off, compat_nr_pages=n, nr_pages=n, flags=img.PE_PRESENT)
             for off, n in pages),
           pagemap_pb2.pagemap_entry(vaddr=4096 * P, compat_nr_pages=10, nr_pages=10, flags=0))  # a hole
    (images / "pages-2.img").write_bytes(data)


def test_a_shared_anonymous_segment_moves_to_its_own_bulk_file(tmp_path: Path) -> None:
    """An engine's pinned host buffer is MAP_SHARED anonymous memory, which CRIU dumps as a
    segment of its own (offsets in the segment, not addresses) and restores on one thread: its
    pages move to ``bulk/shmem-<shmid>.bulk``, at the addresses of the writable mapping that holds
    them; what that mapping does not hold stays with CRIU, and the stock path's pagemap is kept."""
    images = _one_run(tmp_path, (0x10000000, 0x10000000 + 4 * SUM_CHUNK), os.urandom(4 * SUM_CHUNK))
    seg = vma(0x40000000 + 10 * P, 0x40000000 + 410 * P, status=SHARED)
    seg.shmid, seg.pgoff, seg.flags = 77, 10 * P, 0x01
    data = os.urandom(305 * P)
    _with_segment(images, 77, [seg], data, [(20 * P, 300), (500 * P, 5)])  # the 5 pages lie past the mapping
    small = tmp_path.parent / (tmp_path.name + "-small")
    shutil.copytree(tmp_path, small)
    assert bulk.split(str(small), min_shared=300 * P + 1).shared == ()  # too small: CRIU's
    moved = bulk.split(str(tmp_path), min_shared=300 * P)
    assert moved.stats.shared_bytes == 305 * P and moved.stats.shared_moved_bytes == 300 * P
    assert moved.stats.moved_bytes == 4 * SUM_CHUNK + 300 * P
    assert moved.shared == (SharedBulkFile(77, 1, shared_file(77), 2, (BulkRange(0x40000000 + 20 * P, 300 * P, 0),)),)
    assert moved.stats.as_record()["shared_moved_bytes"] == 300 * P
    kept = img.read_pagemap_at(str(images / "pagemap-shmem-77.img"))
    assert [(e.vaddr, img.nr_pages(e)) for e in kept.entries if img.has_data(e)] == [(500 * P, 5)]
    assert (images / "pages-2.img").read_bytes() == data[300 * P:]
    assert (tmp_path / shared_file(77)).read_bytes()[:300 * P] == data[:300 * P]
    assert (tmp_path / sums_of(shared_file(77))).stat().st_size == -(-305 * P // SUM_CHUNK) * 32
    assert len(img.read_pagemap_at(str(tmp_path / shared_pagemap(77))).entries) == 3  # as dumped
    # in the plan, and back
    p = RestorePlan(stdio=(), shell_job=False, mounts=(), shm=False, bulk=moved.files, shared=moved.shared)
    assert RestorePlan.from_json(p.to_json()) == p


def _field(number: int, value: int | bytes) -> bytes:
    """One protobuf field on the wire (varint or length-delimited): for the images this test
    has no message classes for (files.img's memfd entries, memfd.img)."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    return varint(number << 3 | 2) + varint(len(value)) + value


def test_a_segment_crius_dump_maps_through_a_memfd_moves_too(tmp_path: Path) -> None:
    """CRIU 4.x dumps a MAP_SHARED anonymous mapping as a memfd's: the VMA names a file of
    files.img (its shmid is the file's id), whose memfd inode in memfd.img names the segment."""
    images = _one_run(tmp_path, (0x10000000, 0x10000000 + SUM_CHUNK), os.urandom(SUM_CHUNK))
    seg = vma(0x40000000, 0x40000000 + 400 * P, status=img.VMA_AREA_REGULAR | img.VMA_FILE_SHARED | img.VMA_AREA_MEMFD)
    seg.shmid, seg.flags = 2, 0x01  # file id 2
    img.write_raw(str(images / "files.img"), img.RawImage(b"\0" * 8, [
        _field(1, 1) + _field(2, 1),  # a regular file
        _field(1, img.FD_TYPE_MEMFD) + _field(2, 2) + _field(20, _field(1, 2) + _field(5, 1))]))
    img.write_raw(str(images / "memfd.img"), img.RawImage(b"\0" * 8, [
        _field(1, b"/dev/zero") + _field(4, 400 * P) + _field(5, 8204) + _field(7, 1)]))
    assert img.memfd_segments(str(images)) == {2: 8204}
    data = os.urandom(300 * P)
    _with_segment(images, 8204, [seg], data, [(0, 300)])
    moved = bulk.split(str(tmp_path), min_shared=0)
    assert moved.shared == (SharedBulkFile(8204, 1, shared_file(8204), 2, (BulkRange(0x40000000, 300 * P, 0),)),)
    assert (tmp_path / shared_file(8204)).read_bytes()[:300 * P] == data


def test_a_segment_mapped_read_only_everywhere_stays_with_criu(tmp_path: Path) -> None:
    images = _one_run(tmp_path, (0x10000000, 0x10000000 + SUM_CHUNK), os.urandom(SUM_CHUNK))
    seg = vma(0x40000000, 0x40000000 + 400 * P, status=SHARED, prot=0x1)
    seg.shmid, seg.flags = 78, 0x01
    huge = vma(0x50000000, 0x50000000 + 400 * P, status=SHARED)
    huge.shmid, huge.flags = 78, 0x01 | img.MAP_HUGETLB
    _with_segment(images, 78, [seg, huge], os.urandom(300 * P), [(0, 300)])
    moved = bulk.split(str(tmp_path), min_shared=0)
    assert moved.shared == () and moved.stats.shared_bytes == 300 * P and moved.stats.shared_moved_bytes == 0
    assert not (tmp_path / shared_file(78)).exists()


def test_a_plan_without_shared_segments_reads_as_before() -> None:
    """Listed only when there are some: a plan of before them parses, and one without them is
    what a plugin of before them reads."""
    p = plan((BulkRange(0x10000, P, 0),))
    assert "shared" not in json.loads(p.to_json())
    assert RestorePlan.from_json(p.to_json()).shared == ()
    obj = json.loads(p.to_json())
    obj["shared"] = [{"shmid": 5, "pid": 6, "path": shared_file(5), "pages_id": 2,
                      "ranges": [{"vaddr": 0x20000, "length": P, "offset": 0}]},
                     {"shmid": 5, "pid": 6, "path": shared_file(5), "pages_id": 3,
                      "ranges": [{"vaddr": 0x30000, "length": P, "offset": 0}]}]
    with pytest.raises(ValueError, match="two bulk files for one shared segment"):
        RestorePlan.from_json(json.dumps(obj).encode())
    obj["shared"][1]["path"] = "bulk/../pages-6.bulk"
    with pytest.raises(ValueError, match="must be bulk/shmem-5.bulk"):
        RestorePlan.from_json(json.dumps(obj).encode())


def test_the_huge_page_fallback_looks_at_the_whole_run_not_its_zero_pieces(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's staging copy not seen appear: its VMA is the process's largest run, even when
    a zero pool inside it stands apart as a range of its own."""
    monkeypatch.setattr(bulk, "ZERO_APART", 2 * SUM_CHUNK)
    monkeypatch.setattr(bulk, "HUGE_FALLBACK_MIN", 6 * SUM_CHUNK)
    data = bytearray(os.urandom(8 * SUM_CHUNK))
    data[2 * SUM_CHUNK:6 * SUM_CHUNK] = bytes(4 * SUM_CHUNK)
    images = _one_run(tmp_path, (0x40000000, 0x40000000 + 8 * SUM_CHUNK), data)
    files, _stats = _split(str(tmp_path), huge={1: []})
    assert len(files[0].ranges) == 3  # the pool apart: no piece reaches the fallback's minimum
    (v,) = img.read_mm(str(images), 1).entry.vmas
    assert v.madv & (1 << img.MADV_HUGEPAGE)
