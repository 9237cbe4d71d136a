"""The bulk split's choice of runs, and the restore plan's encoding of them (no CRIU needed:
the images are built from CRIU's own message types)."""

from __future__ import annotations

import json

import pytest

from runtime import bulk
from runtime import criu_image as img
from runtime.criu_proto import pagemap_pb2, vma_pb2
from runtime.layout import BulkFile, BulkRange, RestorePlan, bulk_file

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
    ([0x10000, 2 * P, 0, 0x11000, P, 2 * P], "overlapping"),
])
def test_bad_flat_ranges_are_refused(ranges: list[object], why: str) -> None:
    obj = json.loads(plan((BulkRange(0x10000, P, 0),)).to_json())
    obj["bulk"][0]["ranges"] = ranges
    with pytest.raises(ValueError, match=why):
        RestorePlan.from_json(json.dumps(obj).encode())
