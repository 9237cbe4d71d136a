"""runtime.pages.mapping: which ranges a restore from the node cache maps, and the image rewrite CRIU
restores them from (the restore itself: tests/e2e/test_node_cache.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.criu import image_files as img
from runtime.criu.proto import mm_pb2, pagemap_pb2
from runtime.layout import BulkFile, BulkRange, bulk_file
from runtime.pages import mapping as bulk_map
from runtime.pages.mapping import MapError, MapMode, Span
from tests.unit.test_bulk_plan import ANON, _image, vma

M = 1 << 20
HUGE_ADVICE = 1 << img.MADV_HUGEPAGE


def _images(tmp: Path, vmas: list, pages: list[tuple[int, int]] = ()) -> str:  # type: ignore[assignment]
    mm = mm_pb2.mm_entry(mm_start_code=0, mm_end_code=0, mm_start_data=0, mm_end_data=0, mm_start_stack=0,
                         mm_start_brk=0, mm_brk=0, mm_arg_start=0, mm_arg_end=0, mm_env_start=0, mm_env_end=0,
                         exe_file_id=1)
    mm.vmas.extend(vmas)
    _image(tmp / "mm-1.img", mm)
    head = pagemap_pb2.pagemap_head(pages_id=1)
    entries = [pagemap_pb2.pagemap_entry(vaddr=v, nr_pages=n, flags=img.PE_PRESENT) for v, n in pages]
    _image(tmp / "pagemap-1.img", head, *entries)
    _image(tmp / "files.img")
    return str(tmp)


def _heap(start: int, end: int):  # type: ignore[no-untyped-def]
    return vma(start, end, status=ANON | img.VMA_AREA_HEAP)


def test_driver_mode_maps_only_the_cuda_processes_huge_page_ranges_and_all_mode_every_large_plain_one(
        tmp_path: Path) -> None:
    driver = vma(0x40000000, 0x40000000 + 64 * M)
    driver.madv = HUGE_ADVICE
    images = _images(tmp_path, [driver, vma(0x80000000, 0x80000000 + 8 * M), _heap(0x1000000, 0x1000000 + 8 * M)])
    f = BulkFile(1, bulk_file(1), 1, (BulkRange(0x40000000, 64 * M, 0), BulkRange(0x80000000, 6 * M, 64 * M),
                                      BulkRange(0x80000000 + 8 * M - 2 * img.PAGE, img.PAGE, 72 * M),
                                      BulkRange(0x1000000, 8 * M, 73 * M)))
    assert bulk_map.choose([f], images, MapMode.DRIVER, cuda_pids=[1]) == [Span(1, 0x40000000, 64 * M, 0)]
    assert bulk_map.choose([f], images, MapMode.DRIVER, cuda_pids=[]) == []
    # all: not the heap (brk), not a range under 2 MiB
    assert bulk_map.choose([f], images, MapMode.ALL) == [Span(1, 0x40000000, 64 * M, 0),
                                                         Span(1, 0x80000000, 6 * M, 64 * M)]
    assert bulk_map.choose([f], images, MapMode.NONE, cuda_pids=[1]) == []
    left = bulk_map.remainder([f], bulk_map.choose([f], images, MapMode.ALL))
    assert [r.vaddr for r in left[0].ranges] == [0x80000000 + 8 * M - 2 * img.PAGE, 0x1000000]


def test_a_span_is_laid_out_for_huge_pages() -> None:
    s = Span(1, 0x40000000 + 3 * img.PAGE, 4 * M, 0)
    assert s.file_offset == 3 * img.PAGE and s.file_size == 3 * img.PAGE + 4 * M
    assert (s.vaddr - s.file_offset) % (2 * M) == 0


def test_the_rewrite_splits_the_vma_and_adds_a_file_crius_restore_maps(tmp_path: Path) -> None:
    big = vma(0x40000000, 0x40000000 + 16 * M)
    big.madv = HUGE_ADVICE
    images = _images(tmp_path, [big], pages=[(0x40000000, 1)])
    span = Span(1, 0x40000000 + 4 * M, 8 * M, 0)
    bulk_map.rewrite_images(images, [span], "k" * 32, {span.name: span.file_size})
    vmas = list(img.read_mm(images, 1).entry.vmas)
    assert [(v.start, v.end) for v in vmas] == [(0x40000000, 0x40000000 + 4 * M), (0x40000000 + 4 * M, 0x40000000 + 12 * M),
                                                (0x40000000 + 12 * M, 0x40000000 + 16 * M)]
    before, mapped, after = vmas
    assert before.status == after.status == ANON and after.pgoff == big.pgoff + 12 * M
    assert mapped.status == img.VMA_AREA_REGULAR | img.VMA_FILE_PRIVATE
    assert mapped.flags & bulk_map.MAP_ANONYMOUS == 0 and mapped.flags & bulk_map.MAP_PRIVATE
    assert mapped.pgoff == span.file_offset and mapped.madv == HUGE_ADVICE
    (reg,) = img.read_reg_files(images)
    assert (reg.id, reg.size) == (mapped.shmid, span.file_size)
    assert reg.path == "/" + bulk_map.inherit_key(span, "k" * 32)


@pytest.mark.parametrize("where", ["pages", "heap", "straddles"])
def test_the_rewrite_refuses_a_range_it_cannot_map(tmp_path: Path, where: str) -> None:
    first = _heap(0x40000000, 0x40000000 + 16 * M) if where == "heap" else vma(0x40000000, 0x40000000 + 16 * M)
    images = _images(tmp_path, [first, vma(0x40000000 + 16 * M, 0x40000000 + 32 * M)],
                     pages=[(0x40000000 + 5 * M, 1)] if where == "pages" else [])
    span = Span(1, 0x40000000 + (12 * M if where == "straddles" else 4 * M), 8 * M, 0)
    with pytest.raises(MapError):
        bulk_map.rewrite_images(images, [span], "k" * 32, {span.name: span.file_size})


def test_an_all_zero_range_is_never_mapped_by_its_digests(tmp_path: Path) -> None:
    """Anonymous, a zero range reads as the zero page; a mapped tmpfs file allocates each page read."""
    import blake3

    from runtime.layout import SUM_CHUNK
    driver = vma(0x40000000, 0x40000000 + 64 * M)
    driver.madv = HUGE_ADVICE
    images = _images(tmp_path, [driver])
    f = BulkFile(1, bulk_file(1), 1, (BulkRange(0x40000000, 16 * M, 0), BulkRange(0x40000000 + 16 * M, 32 * M, 16 * M),
                                      BulkRange(0x40000000 + 48 * M, 16 * M, 48 * M)))
    zero, other = blake3.blake3(bytes(SUM_CHUNK)).digest(), b"\x01" * 32
    sums = {f.path: other * 16 + zero * 32 + other * 16}
    spans = bulk_map.choose([f], images, MapMode.DRIVER, cuda_pids=[1], sums=sums)
    assert spans == [Span(1, 0x40000000, 16 * M, 0), Span(1, 0x40000000 + 48 * M, 16 * M, 48 * M)]
    assert bulk_map.remainder([f], spans)[0].ranges == (BulkRange(0x40000000 + 16 * M, 32 * M, 16 * M),)
    # without the digests (or digests of data) every range is mapped, as before
    assert len(bulk_map.choose([f], images, MapMode.DRIVER, cuda_pids=[1])) == 3


@pytest.mark.parametrize("recorded, node, want", [
    ("", MapMode.DRIVER, MapMode.DRIVER), ("", MapMode.ALL, MapMode.ALL),
    ("all", MapMode.DRIVER, MapMode.ALL), ("none", MapMode.ALL, MapMode.NONE), ("driver", MapMode.NONE, MapMode.DRIVER)])
def test_an_artifacts_recorded_mode_wins_over_the_nodes(recorded: str, node: MapMode, want: MapMode) -> None:
    assert bulk_map.for_artifact(recorded, node) is want
