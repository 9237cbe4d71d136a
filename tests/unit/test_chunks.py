"""runtime.pages.chunks.read, the one check every reader of a bulk file's bytes goes through:
a flipped byte anywhere in a covering chunk (its first or last byte, a neighbour's part of a
chunk the range shares) fails the read; a short file or a short digest list fails it; a range
that does not start or end on a chunk edge still checks whole chunks."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest

from runtime.fs import holes
from runtime.layout import SUM_CHUNK
from runtime.pages import chunks

C = SUM_CHUNK


def _file(tmp_path: Path, data: bytes) -> tuple[int, bytes]:
    path = tmp_path / "pages.bulk"
    path.write_bytes(data)
    sums = b"".join(blake3.blake3(data[off:off + C]).digest() for off in range(0, len(data), C))
    return os.open(path, os.O_RDONLY), sums


def _flip(fd_path: Path, at: int) -> None:
    with open(fd_path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture
def bulk(tmp_path: Path):
    fds: list[int] = []

    def make(size: int) -> tuple[int, bytes, bytes]:
        data = os.urandom(size)
        fd, sums = _file(tmp_path, data)
        fds.append(fd)
        return fd, sums, data

    yield make
    for fd in fds:
        os.close(fd)


# (offset, length) within a file of 3 chunks and a half: aligned, unaligned both ends, within
# one chunk, spanning two chunks, the short last chunk, the whole file
RANGES = [(0, C), (C, 2 * C), (5, C), (C - 7, 14), (100, 200), (C + 1, C - 2), (3 * C, C // 2),
          (3 * C - 3, C // 2 + 3), (0, 3 * C + C // 2)]


@pytest.mark.parametrize(("offset", "length"), RANGES)
def test_reads_exactly_the_bytes_asked_for(bulk, offset: int, length: int) -> None:
    fd, sums, data = bulk(3 * C + C // 2)  # a size not a multiple of the chunk
    into = memoryview(bytearray(length))
    spent = chunks.read(fd, offset, length, into, sums, size=len(data), name="f")
    assert bytes(into) == data[offset:offset + length]
    assert spent.verified == length and spent.read_s >= 0 and spent.hash_s >= 0


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize(("offset", "length", "chunk"), [
    (C, C, 1),            # one whole chunk
    (C - 10, 20, 0),      # a piece spanning chunks 0 and 1: a flip in either fails it
    (C - 10, 20, 1),
    (C + 5, 10, 1),       # a range inside one chunk: its neighbours' bytes are checked too
])
def test_a_flipped_byte_at_a_chunk_edge_fails_the_read(tmp_path: Path, bulk, where: str, offset: int,
                                                       length: int, chunk: int) -> None:
    fd, sums, data = bulk(3 * C)
    at = chunk * C + (0 if where == "first" else C - 1)
    _flip(tmp_path / "pages.bulk", at)
    with pytest.raises(chunks.IntegrityError, match=f"f: chunk at {chunk * C} does not match its digest"):
        chunks.read(fd, offset, length, memoryview(bytearray(length)), sums, size=len(data), name="f")


def test_a_flip_in_the_short_last_chunk_fails_the_read(tmp_path: Path, bulk) -> None:
    fd, sums, data = bulk(2 * C + 4096)
    _flip(tmp_path / "pages.bulk", 2 * C + 4095)
    with pytest.raises(chunks.IntegrityError, match=f"chunk at {2 * C} does not match"):
        chunks.read(fd, 2 * C, 10, memoryview(bytearray(10)), sums, size=len(data), name="f")
    assert chunks.read(fd, 0, 2 * C, memoryview(bytearray(2 * C)), sums, size=len(data), name="f").verified == 2 * C


def test_nothing_after_the_bad_chunk_is_read(tmp_path: Path, bulk) -> None:
    fd, sums, data = bulk(3 * C)
    _flip(tmp_path / "pages.bulk", C + 1)
    into = memoryview(bytearray(3 * C))
    with pytest.raises(chunks.IntegrityError):
        chunks.read(fd, 0, 3 * C, into, sums, size=len(data), name="f")
    assert bytes(into[:C]) == data[:C] and bytes(into[2 * C:]) == bytes(C)


def test_a_file_shorter_than_it_says_fails_the_read(tmp_path: Path, bulk) -> None:
    fd, sums, data = bulk(2 * C)
    os.truncate(tmp_path / "pages.bulk", C + 100)
    with pytest.raises(chunks.IntegrityError, match=f"f: shrank while read \\(at {C + 100}\\)"):
        chunks.read(fd, C, C, memoryview(bytearray(C)), sums, size=len(data), name="f")
    with pytest.raises(chunks.IntegrityError, match="shrank while read"):  # a range within the short part too:
        chunks.read(fd, C, 10, memoryview(bytearray(10)), sums, size=len(data), name="f")  # its chunk is whole


def test_a_range_past_the_size_or_the_buffer_is_refused(bulk) -> None:
    fd, sums, data = bulk(C)
    with pytest.raises(chunks.IntegrityError, match="is not within its"):
        chunks.read(fd, C - 10, 20, memoryview(bytearray(20)), sums, size=len(data), name="f")
    with pytest.raises(chunks.IntegrityError, match="is not within its"):
        chunks.read(fd, 0, 20, memoryview(bytearray(10)), sums, size=len(data), name="f")


@pytest.mark.parametrize("keep", [64, 64 + 31])  # two digests; two and most of the third
def test_a_digest_list_too_short_fails_the_read(bulk, keep: int) -> None:
    fd, sums, data = bulk(2 * C + 10)
    with pytest.raises(chunks.IntegrityError, match=f"f: no digest for the chunk at {2 * C}"):
        chunks.read(fd, 0, len(data), memoryview(bytearray(len(data))), sums[:keep], size=len(data), name="f")


def test_a_digest_list_too_short_before_the_last_chunk(bulk) -> None:
    fd, sums, data = bulk(3 * C)
    with pytest.raises(chunks.IntegrityError, match=f"no digest for the chunk at {C}"):
        chunks.read(fd, C, 10, memoryview(bytearray(10)), sums[:32], size=len(data), name="f")


def test_chunks_not_needed_are_neither_read_nor_checked(tmp_path: Path, bulk) -> None:
    fd, sums, data = bulk(3 * C)
    _flip(tmp_path / "pages.bulk", C + 3)  # in the skipped chunk: no failure
    into = memoryview(bytearray(3 * C))
    asked: list[tuple[int, int]] = []
    spent = chunks.read(fd, 0, 3 * C, into, sums, size=len(data), name="f",
                          needed=lambda lo, hi: asked.append((lo, hi)) or lo != C)
    assert asked == [(0, C), (C, 2 * C), (2 * C, 3 * C)]
    assert spent.verified == 2 * C
    assert bytes(into[:C]) == data[:C] and bytes(into[C:2 * C]) == bytes(C) and bytes(into[2 * C:]) == data[2 * C:]


def test_a_given_scratch_holds_the_neighbours_bytes(bulk) -> None:
    fd, sums, data = bulk(2 * C)
    scratch = memoryview(bytearray(chunks.SCRATCH))
    into = memoryview(bytearray(C))
    chunks.read(fd, C // 2, C, into, sums, size=len(data), name="f", scratch=scratch)
    assert bytes(into) == data[C // 2:C // 2 + C]


def test_an_empty_range_reads_nothing(bulk) -> None:
    fd, sums, data = bulk(C)
    assert chunks.read(fd, 10, 0, memoryview(bytearray(0)), b"", size=len(data), name="f").verified == 0


def _punched(tmp_path: Path, zero: tuple[int, ...], size: int = 3 * C + C // 2) -> tuple[Path, bytes, bytes]:
    """A file whose chunks ``zero`` are zeros punched out (as the checkpoint leaves them)."""
    data = bytearray(os.urandom(size))
    for i in zero:
        data[i * C:(i + 1) * C] = bytes(len(data[i * C:(i + 1) * C]))
    path = tmp_path / "pages.bulk"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    try:
        for i in zero:
            assert holes.punch(fd, [(i * C, min(C, size - i * C))])
    finally:
        os.close(fd)
    sums = b"".join(blake3.blake3(data[off:off + C]).digest() for off in range(0, size, C))
    return path, sums, bytes(data)


def test_a_zero_chunk_that_is_a_hole_is_neither_read_nor_hashed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, sums, data = _punched(tmp_path, (1, 3))  # a whole chunk and the short last one
    reads: list[int] = []
    real = chunks._read_exact
    monkeypatch.setattr(chunks, "_read_exact", lambda fd, view, pos, name: (reads.append(pos), real(fd, view, pos, name)))
    fd = os.open(path, os.O_RDONLY)
    try:
        into = memoryview(bytearray(b"\xff" * len(data)))
        spent = chunks.read(fd, 0, len(data), into, sums, size=len(data), name="f")
    finally:
        os.close(fd)
    assert bytes(into) == data
    assert spent.verified == len(data) and spent.zero == C + C // 2
    assert sorted({p - p % C for p in reads}) == [0, 2 * C]  # chunks 1 and 3 never read


def test_a_zero_chunk_stored_as_data_is_read_and_checked(tmp_path: Path) -> None:
    """Where the file system kept the zeros (no punch), the chunk is read like any other."""
    data = os.urandom(C) + bytes(C)
    fd, sums = _file(tmp_path, data)
    try:
        into = memoryview(bytearray(2 * C))
        spent = chunks.read(fd, 0, 2 * C, into, sums, size=2 * C, name="f")
        assert bytes(into) == data and spent.zero == 0
    finally:
        os.close(fd)


def test_a_zero_chunks_hole_filled_in_by_a_store_writer_is_refused(tmp_path: Path) -> None:
    path, sums, data = _punched(tmp_path, (1,))
    with open(path, "r+b") as f:  # written into the hole afterwards
        f.seek(C + 4096)
        f.write(b"\xa5" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(chunks.IntegrityError, match=f"chunk at {C} does not match its digest"):
            chunks.read(fd, C, C, memoryview(bytearray(C)), sums, size=len(data), name="f")
    finally:
        os.close(fd)


def test_a_file_cut_short_over_its_zero_chunks_is_found_short(tmp_path: Path) -> None:
    path, sums, data = _punched(tmp_path, (2, 3))
    os.truncate(path, 2 * C)  # the zero chunks' holes gone with the rest
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(chunks.IntegrityError, match="shrank"):
            chunks.read(fd, 0, len(data), memoryview(bytearray(len(data))), sums, size=len(data), name="f")
    finally:
        os.close(fd)


def test_zero_runs_and_all_zero_go_by_the_digests_and_never_count_the_short_last_chunk() -> None:
    zero, other = blake3.blake3(bytes(SUM_CHUNK)).digest(), b"\x01" * 32
    sums = zero * 3 + other + zero * 2  # the last chunk (maybe short) is never counted as zero
    assert chunks.zero_runs(sums, 0, 6 * SUM_CHUNK, SUM_CHUNK) == [(0, 3 * SUM_CHUNK), (4 * SUM_CHUNK, 5 * SUM_CHUNK)]
    assert chunks.zero_runs(sums, 1, 6 * SUM_CHUNK, 2 * SUM_CHUNK) == [(SUM_CHUNK, 3 * SUM_CHUNK)]  # whole chunks only
    assert chunks.zero_runs(sums, 0, 6 * SUM_CHUNK, 4 * SUM_CHUNK) == []
    assert chunks.all_zero(sums, 4096, 3 * SUM_CHUNK)
    assert not chunks.all_zero(sums, 0, 3 * SUM_CHUNK + 1)
    assert not chunks.all_zero(sums, 4 * SUM_CHUNK, 6 * SUM_CHUNK)
    assert not chunks.all_zero(sums, 0, 0)
