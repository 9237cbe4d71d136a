"""Where a served piece's verified bytes go: copied into a restored task through its uffd, or
written into a node cache entry's file that the task maps, and then let go there.

- :class:`Copy`: the piece's bytes, in private memory, installed with ``UFFDIO_COPY`` (a page
  already present is left alone: nothing the kernel or the process wrote after CRIU is
  overwritten).
- :class:`Zero`: a piece of zero chunks that are holes (``runtime.pages.chunks``), installed as
  zero pages.
- :class:`EntryFiles` and :class:`LetGo`: a mapped range (the first restore of a version on a
  node whose cache is a tmpfs: ``runtime.pages.entry.EntryBuild``) is a file of the cache
  entry being made, which CRIU maps ``MAP_PRIVATE``; the serve registered it in missing and
  minor mode, so every touch is the serve's. A piece of it (2 MiB of the file, which are 2 MiB
  of address space: the file holds the range at ``vaddr % 2 MiB``) is read from the bulk file
  straight into the file, each chunk checked there, and then let go (``uffd.release``:
  unregistered, its waiters woken): the process's next touch maps the file's pages, nothing
  copied. Restores of one version at once share the files and one
  :class:`~runtime.pages.book.MappedBook`: a piece is written once, by whichever serve needs it
  first, and each serve lets it go in its own tree.

Which piece goes where, when, and what happens when the address space changes meanwhile is
the server's (``runtime.pages.serve``).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from runtime.pages import chunks, uffd
from runtime.pages.book import MappedBook
from runtime.pages.filemap import FileMap
from runtime.pages.mapping import Span
from runtime.pages.source import PIECE, Piece, PieceSource

log = logging.getLogger(__name__)


class Sink(Protocol):
    def put(self, fd: int, dst: int, rel: int, length: int) -> int:
        """Put the piece's ``length`` bytes at ``rel`` in it at ``dst`` of the space behind uffd
        ``fd``; the bytes put. ``uffd.Gone`` (``uffd.Exited``) or ``uffd.Changing`` as the
        kernel says."""
        ...


@dataclass(frozen=True)
class Copy:
    """A piece's verified bytes at our address ``addr``, copied in."""

    addr: int

    def put(self, fd: int, dst: int, rel: int, length: int) -> int:
        return uffd.copy(fd, dst, self.addr + rel, length)


class Zero:
    """A piece whose every chunk is zeros and a hole in its file (nothing read or hashed):
    zero pages mapped in with ``UFFDIO_ZEROPAGE``, no byte copied and no memory taken until
    the task writes there (a page already present is left alone, as :class:`Copy` leaves it)."""

    def put(self, fd: int, dst: int, rel: int, length: int) -> int:
        return uffd.zeropage(fd, dst, length)


class LetGo:
    """A mapped piece already in its file: unregistered there, its waiters woken (the process's
    next touch maps the file's pages: on the cache's huge=always tmpfs, 2 MiB at a time)."""

    def put(self, fd: int, dst: int, rel: int, length: int) -> int:
        uffd.release(fd, dst, length)
        return length


class MapCached:
    """A mapped piece already in its file: its pages mapped in, the range left registered
    (``uffd.map_cached``: no VMA split, the mm's lock taken for reading only; 4 KiB pages)."""

    def put(self, fd: int, dst: int, rel: int, length: int) -> int:
        uffd.map_cached(fd, dst, length)
        return length


class LetGoMode(enum.Enum):
    """How a serve lets a mapped piece go (``$REKINDLE_LET_GO``, a measurement setting)."""

    UNREGISTER = "unregister"  # LetGo (the default)
    CONTINUE = "continue"      # MapCached


LET_GO_ENV = "REKINDLE_LET_GO"


def let_go_sink(environ: Mapping[str, str]) -> Sink:
    """The let-go ``environ`` asks for; an unknown one is logged and the default used."""
    raw = environ.get(LET_GO_ENV, "") or LetGoMode.UNREGISTER.value
    try:
        mode = LetGoMode(raw)
    except ValueError:
        log.warning("$%s=%r is none of %s: unregister", LET_GO_ENV, raw, [m.value for m in LetGoMode])
        mode = LetGoMode.UNREGISTER
    return MapCached() if mode is LetGoMode.CONTINUE else LetGo()


@dataclass(frozen=True)
class Mapped:
    """A bulk range the tree maps privately from ``out``, a node-local tmpfs file the serve
    writes (its bytes at ``span.file_offset``): registered, written piece by piece, let go."""

    span: Span
    out: int


class EntryFiles:
    """The mapped ranges' files, each mapped shared here: where their pieces are written.
    ``mapped``: (range, the index of its bulk file in the source); ``book``: the state of their
    pieces, shared with other restores writing them too (else this serve's own)."""

    def __init__(self, mapped: Sequence[tuple[Mapped, int]], book: MappedBook | None = None) -> None:
        self.mapped: list[tuple[Mapped, int]] = []  # out: our dup
        self._shared: list[FileMap] = []  # each mapped range's file, mapped shared: where it is written
        try:
            for m, src in mapped:
                self.mapped.append((Mapped(m.span, os.dup(m.out)), src))
                self._shared.append(FileMap(m.out, m.span.file_size, writable=True))
        except BaseException:
            self.close()
            raise
        self.book = book if book is not None else MappedBook([m.span for m, _src in mapped])

    def write(self, k: int, p: Piece, source: PieceSource) -> chunks.Spent | None:
        """Piece ``p`` of mapped range ``k`` into its file, verified there, unless it is in
        already (this serve's or another's): what the read did, or None. Its bytes are read
        from the bulk file straight into the file (through the shared mapping: a tmpfs write()
        holds the file's inode lock, and every thread writes the one file; measured on the
        H200, 16.8 GB went in at 4.8 GB/s however many threads), each chunk holding them hashed
        from the file with the chunk's other bytes, read into private memory at the same time.
        The file is ours alone: what is hashed there is what the process will map. A chunk off
        its digest raises before the piece is marked written (it is never let go, and the entry
        is never finished)."""
        m, src = self.mapped[k]
        name, index = m.span.name, p.offset // PIECE
        with self.book.lock(name, index):
            if self.book.written(name, index):
                return None
            at = m.span.offset + (p.offset - m.span.file_offset)  # its bytes in the bulk file
            here = memoryview((ctypes.c_char * p.length).from_address(self._shared[k].addr + p.offset)).cast("B")
            try:
                spent = source.read_into(src, at, p.length, here)
            finally:
                here.release()
            self.book.mark(name, index)
        return spent

    def close(self) -> None:
        for m, _src in self.mapped:
            if m.out >= 0:
                os.close(m.out)
        for sh in self._shared:
            sh.close()
        self.mapped = [(Mapped(m.span, -1), src) for m, src in self.mapped]
