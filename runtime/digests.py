"""Content digests of artifact files: BLAKE3, piecewise for large files, hashed in parallel.

A file's digest is the BLAKE3 (256-bit) digest of its content up to 64 MiB; above that it is the
BLAKE3 digest of a tag and the digests of its 64 MiB pieces, which threads hash in parallel
(BLAKE3 releases the GIL; a restore hashes every byte it uses, and GPU artifacts are tens of GiB
in a few files). :func:`hash_fd` can copy what it hashes to a second fd on the way.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import blake3

from runtime.fs import holes

_CHUNK = 1 << 20

# Files larger than one piece get a two-level digest: the BLAKE3 of the BLAKE3s of their 64 MiB
# pieces, hashed in parallel. GPU checkpoints are tens of GiB in a few files.
PIECE = 64 << 20
_PIECE_TAG = b"rekindle-pieces-v2\n"
WORKERS = min(16, os.cpu_count() or 1)


@dataclass(frozen=True)
class Hashed:
    """A file hashed while it was written (runtime.pages.tailhash): stands for a hash of the very
    inode at the very size and modification time only (its maker holds the inode open until it
    is used, so the number is not reused meanwhile)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    sums: bytes   # the digest of each layout.SUM_CHUNK, in order (a bulk file's .sums)
    digest: str   # the file's digest, as hash_fd gives it
    pieces: tuple[bytes, ...] = ()  # the digest of each PIECE, in order (what ``digest`` combines)

    def matches(self, st: os.stat_result) -> bool:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) == (self.dev, self.ino, self.size, self.mtime_ns)


def combine_pieces(size: int, pieces: list[bytes]) -> str:
    """The file digest from its pieces' digests (in order)."""
    if size <= PIECE:
        return pieces[0].hex() if pieces else new_hash().hexdigest()
    return new_hash(_PIECE_TAG + b"".join(pieces)).hexdigest()


def new_hash(data: bytes = b"") -> blake3.blake3:
    """The content hash (BLAKE3; its update drops the GIL, so threads hash in parallel)."""
    return blake3.blake3(data)


def piece_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece; one (empty) piece for an empty file."""
    return [(off, min(PIECE, size - off)) for off in range(0, size, PIECE)] or [(0, 0)]


def _copy_range(src: int, dst: int | None, offset: int, length: int,
                data_spans: Sequence[tuple[int, int]] = ()) -> bytes:
    """Digest of ``length`` bytes at ``offset`` of ``src``, written to ``dst`` at the same offset
    (only where they overlap ``data_spans``: the source's holes stay holes)."""
    digest, done = new_hash(), 0
    while done < length:
        data = os.pread(src, min(_CHUNK, length - done), offset + done)
        if not data:
            raise OSError(errno.EIO, "file shrank while being read")
        digest.update(data)  # releases the GIL for large buffers: threads hash in parallel
        if dst is not None:
            lo = offset + done
            hi = lo + len(data)
            for a, n in data_spans:
                a, b = max(a, lo), min(a + n, hi)
                view = memoryview(data)[a - lo:b - lo] if a < b else memoryview(b"")
                pos = a
                while view:
                    w = os.pwrite(dst, view, pos)
                    view, pos = view[w:], pos + w
        done += len(data)
    return digest.digest()


def hash_fd(fd: int, dst: int | None = None) -> tuple[int, str]:
    """(size, digest) of ``fd`` (copied to ``dst`` on the way when given, holes kept: a bulk
    file holds only the runs moved out of CRIU's images, at their offsets)."""
    size = os.fstat(fd).st_size
    ranges = piece_ranges(size)
    spans: list[tuple[int, int]] = []
    if dst is not None:
        spans = holes.data_spans(fd, 0, size)
        os.ftruncate(dst, size)  # a hole at the end stays one too

    def one(r: tuple[int, int]) -> bytes:
        return _copy_range(fd, dst, *r, [s for s in spans if s[0] < r[0] + r[1] and r[0] < s[0] + s[1]])

    if len(ranges) == 1:
        pieces = [one(ranges[0])]
    else:
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="rekindle-hash") as pool:
            pieces = list(pool.map(one, ranges))
    return size, combine_pieces(size, pieces)


