"""Where a served piece's bytes come from: a bulk file (in the store, or a node cache entry's
fill file), every chunk of it checked against its digest before a byte is handed on.

The serve (``runtime.pages.serve``) moves bulk files into the restored tree 2 MiB at a time: a
:data:`PIECE` is what one install takes and what a fault brings in at once, whole chunks
(``layout.SUM_CHUNK``) of the file. :class:`PieceSource` reads a piece through
``runtime.pages.chunks``, into this thread's private buffer (then copied into the tree) or
into a mapped range's file (then let go there): what is handed on is exactly what was hashed.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.layout import DIGEST_BYTES, SUM_CHUNK, BulkFile
from runtime.pages import chunks

PIECE = 2 << 20  # what one install takes, and what a fault brings in at once: whole chunks


@dataclass(frozen=True)
class Piece:
    id: int
    file: int  # a bulk file's index; past them, a mapped range's (its offset: in its map file)
    offset: int
    length: int


class PieceSource:
    """The bulk files ``files``, read through (copies of) ``fds``, each checked against its chunk
    digests ``sums``. Reads run on many threads at once; each has its own buffers."""

    def __init__(self, files: Sequence[BulkFile], fds: Sequence[int], sums: Sequence[bytes]) -> None:
        if not len(files) == len(fds) == len(sums):
            raise ValueError(f"{len(files)} bulk files, {len(fds)} fds, {len(sums)} digest lists")
        self.files = list(files)
        self.fds = [os.dup(fd) for fd in fds]  # the caller's may close before the serve ends
        self.sums = list(sums)
        self.sizes = [os.fstat(fd).st_size for fd in self.fds]
        # each file's ranges as (offset, end), by offset: a chunk that holds none is neither read
        # nor checked (a node cache entry's fill file has a hole there: that range is mapped)
        self._extents = [sorted((r.offset, r.offset + r.length) for r in f.ranges) for f in self.files]
        self._local = threading.local()

    def matches(self, file: int) -> bool:
        """Whether ``file``'s digests cover it exactly and its ranges lie within it."""
        size, ds = self.sizes[file], self.sums[file]
        return (len(ds) == -(-size // SUM_CHUNK) * DIGEST_BYTES
                and all(r.offset + r.length <= size for r in self.files[file].ranges))

    def read(self, p: Piece) -> tuple[int, chunks.Spent]:
        """Our address of piece ``p``'s bytes, read into this thread's private memory and
        verified (a chunk that holds no byte of a range is neither read nor checked: none of it
        is installed), and what the read did."""
        view, addr = self._buffer(PIECE)
        fd = self.fds[p.file]
        chunks.advise(fd, p.offset, p.length)
        spent = chunks.read(fd, p.offset, p.length, view, self.sums[p.file], size=self.sizes[p.file],
                              name=self.files[p.file].path, needed=lambda lo, hi: self.holds_range(p.file, lo, hi))
        return addr, spent

    def read_into(self, file: int, offset: int, length: int, into: memoryview) -> chunks.Spent:
        """[offset, offset + length) of ``file`` into ``into``, every chunk covering it verified
        (the neighbours' parts of its first and last chunks read into private memory)."""
        lo = offset // SUM_CHUNK * SUM_CHUNK
        hi = min(-(-(offset + length) // SUM_CHUNK) * SUM_CHUNK, self.sizes[file])
        scratch, _addr = self._buffer(chunks.SCRATCH)
        fd = self.fds[file]
        chunks.advise(fd, lo, hi - lo)
        return chunks.read(fd, offset, length, into, self.sums[file], size=self.sizes[file],
                             name=self.files[file].path, scratch=scratch)

    def holds_range(self, file: int, lo: int, hi: int) -> bool:
        """Whether [lo, hi) of bulk file ``file`` holds any byte of one of its ranges."""
        ext = self._extents[file]
        i = bisect.bisect_right(ext, (lo, 1 << 64)) - 1
        return any(a < hi and lo < b for a, b in ext[max(i, 0):i + 2])

    def _buffer(self, size: int) -> tuple[memoryview, int]:
        """This thread's buffer of ``size`` bytes (one per size)."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        buf = bufs.get(size)
        if buf is None:
            m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buf = bufs[size] = (memoryview(m), ctypes.addressof(ctypes.c_char.from_buffer(m)), m)
        return buf[0], buf[1]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
