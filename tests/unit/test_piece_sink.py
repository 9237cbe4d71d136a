"""runtime.pages.sink.EntryFiles without a uffd: a mapped range's piece is written into its file
verified, once for every serve sharing the book; a piece whose chunk does not match is never
marked written; the files' copies are closed with the sink."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import blake3
import pytest

from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file
from runtime.pages import chunks
from runtime.pages.book import MappedBook
from runtime.pages.mapping import Span
from runtime.pages.sink import EntryFiles, LetGo, LetGoMode, MapCached, Mapped, let_go_sink
from runtime.pages.source import PIECE, Piece, PieceSource

LEAD = 20 << 10  # the range's bytes start this far into the bulk file: no chunk edge
VADDR = 0x7E0000003000  # its place: 12 KiB into a 2 MiB page, so its file holds it from 12 KiB on
LENGTH = 2 * PIECE


@pytest.fixture
def entry(tmp_path: Path):
    data = os.urandom(LEAD + LENGTH)
    path = tmp_path / "pages.bulk"
    path.write_bytes(data)
    sums = b"".join(blake3.blake3(data[o:o + SUM_CHUNK]).digest() for o in range(0, len(data), SUM_CHUNK))
    span = Span(7, VADDR, LENGTH, LEAD)
    f = BulkFile(7, bulk_file(7), 1, (BulkRange(VADDR, LENGTH, LEAD),))
    out = os.open(tmp_path / span.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(out, span.file_size)
    fd = os.open(path, os.O_RDONLY)
    source = PieceSource([f], [fd], [sums])
    os.close(fd)
    made: list[EntryFiles] = []

    def make(book: MappedBook | None = None) -> EntryFiles:
        sink = EntryFiles([(Mapped(span, out), 0)], book)
        made.append(sink)
        return sink

    yield make, source, span, data, tmp_path / span.name, path
    for sink in made:
        sink.close()
    source.close()
    os.close(out)


def _pieces(span: Span) -> list[Piece]:
    return [Piece(i, 1, max(off, span.file_offset), min(off + PIECE, span.file_size) - max(off, span.file_offset))
            for i, off in enumerate(range(0, span.file_size, PIECE))]


def test_every_piece_lands_in_its_file_verified(entry) -> None:
    make, source, span, data, out_path, _ = entry
    sink = make()
    pieces = _pieces(span)
    assert len(pieces) == 3  # the range starts 12 KiB into its first 2 MiB and ends 12 KiB into its third
    spent = [sink.write(0, p, source) for p in pieces]
    assert all(s is not None for s in spent) and sum(s.verified for s in spent if s) == LENGTH
    assert out_path.read_bytes()[span.file_offset:] == data[LEAD:]
    assert out_path.read_bytes()[:span.file_offset] == bytes(span.file_offset)  # before the range: nothing
    assert sink.book.whole()


def test_a_piece_is_written_once_for_every_serve_sharing_the_book(entry) -> None:
    make, source, span, _data, _, _ = entry
    book = MappedBook([span])
    first, second = make(book), make(book)
    p = _pieces(span)[1]
    results: list[object] = []
    threads = [threading.Thread(target=lambda s=s: results.append(s.write(0, p, source))) for s in (first, second)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(r is None for r in results) == [False, True]  # one wrote it, the other found it in
    assert book.written(span.name, p.offset // PIECE) and not book.whole()


def test_a_piece_whose_chunk_does_not_match_is_never_marked(entry) -> None:
    make, source, span, data, _, path = entry
    sink = make()
    last = _pieces(span)[-1]
    bad = LEAD + LENGTH - 1  # the bulk file's last byte: the last piece's last chunk
    with open(path, "r+b") as f:
        f.seek(bad)
        f.write(b"\x00" if data[bad] else b"\x01")
    with pytest.raises(chunks.IntegrityError, match="does not match its digest"):
        sink.write(0, last, source)
    assert not sink.book.written(span.name, last.offset // PIECE)
    assert sink.write(0, _pieces(span)[0], source) is not None  # the others still go in


def test_closing_lets_go_of_the_files(entry) -> None:
    make, _source, _span, _data, _, _ = entry
    sink = make()
    dup = sink.mapped[0][0].out
    os.fstat(dup)
    sink.close()
    assert sink.mapped[0][0].out == -1
    with pytest.raises(OSError):
        os.fstat(dup)


def test_letting_go_where_nothing_is_registered_says_gone() -> None:
    from runtime.pages import uffd
    if uffd.probe() is not None:
        pytest.skip(f"no userfaultfd: {uffd.probe()}")
    fd = uffd.open_uffd(0)
    try:
        with pytest.raises((uffd.Gone, OSError)):
            LetGo().put(fd, 0x7E0000000000, 0, uffd.PAGE)
    finally:
        os.close(fd)


def test_mapping_the_cached_pages_maps_the_files_bytes_zero_for_holes_and_keeps_writes_private() -> None:
    """MapCached (UFFDIO_CONTINUE) over a private mapping of a tmpfs file registered in missing
    and minor mode, in this process: every page is present after it (nothing here faults on
    the uffd), holes read zero, a second pass maps nothing, and a write stays the process's."""
    import ctypes
    import mmap

    from runtime.pages import uffd
    if uffd.probe() is not None:
        pytest.skip(f"no userfaultfd: {uffd.probe()}")
    page = uffd.PAGE
    fd = os.open("/dev/shm", os.O_RDWR | os.O_TMPFILE, 0o600)
    os.ftruncate(fd, 4 * page)
    os.pwrite(fd, b"a" * page, 0)
    os.pwrite(fd, b"c" * page, 2 * page)  # pages 1 and 3 are holes
    m = mmap.mmap(fd, 4 * page, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(anchor)
    u = uffd.open_uffd(uffd.NEEDED_FEATURES)
    try:
        uffd.register(u, addr, 4 * page, uffd.REGISTER_MODE_MISSING | uffd.REGISTER_MODE_MINOR)
        assert MapCached().put(u, addr, 0, 4 * page) == 4 * page
        assert uffd.map_cached(u, addr, 4 * page) == 0  # every page present: nothing mapped again
        assert (m[0], m[page], m[2 * page], m[3 * page]) == (ord("a"), 0, ord("c"), 0)
        m[1] = ord("z")
        assert m[1] == ord("z") and os.pread(fd, 2, 0) == b"aa"  # copied on write: the file keeps its bytes
        uffd.release(u, addr, 4 * page)
    finally:
        os.close(u)
        del anchor
        m.close()
        os.close(fd)


def test_the_let_go_is_unregister_unless_continue_is_asked_for(caplog) -> None:
    assert isinstance(let_go_sink({}), LetGo)
    assert isinstance(let_go_sink({"REKINDLE_LET_GO": LetGoMode.CONTINUE.value}), MapCached)
    assert isinstance(let_go_sink({"REKINDLE_LET_GO": "unregister"}), LetGo)
    assert isinstance(let_go_sink({"REKINDLE_LET_GO": "faster"}), LetGo)
    assert "none of" in caplog.text
