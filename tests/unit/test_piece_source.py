"""runtime.pages.source.PieceSource without a uffd: a piece comes out of its bulk file verified
into this thread's buffer (chunks holding no range neither read nor checked), or into a given
buffer with its first and last chunks checked whole; a file off its digests or ranges says so."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import blake3
import pytest

from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file
from runtime.pages import chunks
from runtime.pages.source import PIECE, Piece, PieceSource

C = SUM_CHUNK


def _source(tmp_path: Path, size: int, ranges: tuple[BulkRange, ...] | None = None,
            sums_cut: int = 0) -> tuple[PieceSource, bytes, Path]:
    data = os.urandom(size)
    path = tmp_path / "pages.bulk"
    path.write_bytes(data)
    sums = b"".join(blake3.blake3(data[off:off + C]).digest() for off in range(0, size, C))
    f = BulkFile(7, bulk_file(7), 1, ranges if ranges is not None else (BulkRange(0x10000000, size, 0),))
    fd = os.open(path, os.O_RDONLY)
    try:
        source = PieceSource([f], [fd], [sums[:len(sums) - sums_cut]])
    finally:
        os.close(fd)  # the source holds its own copy
    return source, data, path


def _at(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


def test_a_piece_is_read_verified_into_a_private_buffer(tmp_path: Path) -> None:
    source, data, _ = _source(tmp_path, PIECE + C + 4096)  # a last piece not a whole chunk
    try:
        assert source.matches(0) and source.sizes == [len(data)]
        for p in (Piece(0, 0, 0, PIECE), Piece(1, 0, PIECE, C + 4096)):
            addr, spent = source.read(p)
            assert _at(addr, p.length) == data[p.offset:p.offset + p.length]
            assert spent.verified == p.length
    finally:
        source.close()


def test_each_thread_reads_into_its_own_buffer(tmp_path: Path) -> None:
    source, _data, _ = _source(tmp_path, 2 * PIECE)
    addrs: list[int] = []
    done = threading.Event()

    def other() -> None:
        addrs.append(source.read(Piece(1, 0, PIECE, PIECE))[0])
        done.wait(10)  # its buffer lives as long as the thread

    th = threading.Thread(target=other)
    try:
        th.start()
        while not addrs and th.is_alive():
            th.join(0.01)
        assert source.read(Piece(0, 0, 0, PIECE))[0] != addrs[0]
    finally:
        done.set()
        th.join()
        source.close()


def test_a_chunk_holding_no_range_is_neither_read_nor_checked(tmp_path: Path) -> None:
    source, data, path = _source(tmp_path, PIECE, (BulkRange(0x10000000, C, 0),))
    with open(path, "r+b") as f:  # the second chunk holds no range: a flip there is not seen
        f.seek(C + 5)
        f.write(b"\x00" if data[C + 5] else b"\x01")
    try:
        addr, spent = source.read(Piece(0, 0, 0, PIECE))
        assert spent.verified == C and _at(addr, C) == data[:C]
        assert source.holds_range(0, C - 1, C) and not source.holds_range(0, C, PIECE)
    finally:
        source.close()


def test_a_flipped_byte_fails_the_piece(tmp_path: Path) -> None:
    source, data, path = _source(tmp_path, PIECE)
    with open(path, "r+b") as f:
        f.seek(PIECE - 1)
        f.write(b"\x00" if data[PIECE - 1] else b"\x01")
    try:
        with pytest.raises(chunks.IntegrityError, match=f"pages-7.bulk: chunk at {C} does not match its digest"):
            source.read(Piece(0, 0, 0, PIECE))
    finally:
        source.close()


def test_read_into_checks_the_neighbours_of_an_unaligned_window(tmp_path: Path) -> None:
    source, data, path = _source(tmp_path, 3 * C)
    into = memoryview(bytearray(C))
    try:
        spent = source.read_into(0, C // 2, C, into)
        assert bytes(into) == data[C // 2:C // 2 + C] and spent.verified == C
        with open(path, "r+b") as f:  # a byte of chunk 0 outside the window: still checked
            f.seek(3)
            f.write(b"\x00" if data[3] else b"\x01")
        with pytest.raises(chunks.IntegrityError, match="chunk at 0 does not match"):
            source.read_into(0, C // 2, C, into)
    finally:
        source.close()


def test_a_file_off_its_digests_or_ranges_does_not_match(tmp_path: Path) -> None:
    short, _, _ = _source(tmp_path, 2 * C, sums_cut=32)
    past, _, _ = _source(tmp_path, 2 * C, (BulkRange(0x10000000, 3 * C, 0),))
    try:
        assert not short.matches(0) and not past.matches(0)
    finally:
        short.close()
        past.close()


def test_the_source_keeps_its_own_fds(tmp_path: Path) -> None:
    source, data, _ = _source(tmp_path, C)  # the caller's fd was closed already
    try:
        assert _at(source.read(Piece(0, 0, 0, C))[0], C) == data
    finally:
        source.close()
    assert source.fds == []


def test_counts_must_agree(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="1 bulk files, 0 fds"):
        PieceSource([BulkFile(7, bulk_file(7), 1, ())], [], [b""])
