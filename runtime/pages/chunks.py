"""The one verified read of a bulk file: no byte is used before its chunk's digest matched.

A bulk file's ``bulk/pages-<pid>.sums`` holds the BLAKE3 digest of each ``layout.SUM_CHUNK``
(1 MiB) of it, in order (written at checkpoint, signed through the manifest). Every reader of
a bulk file's bytes (the fill, the serve's pieces, the mapped ranges' files) reads through
:func:`read`: it reads every chunk that covers the bytes asked for whole, those bytes into the
caller's buffer and the rest of their chunk into scratch, and hashes each chunk before it
returns. A chunk off its digest, a file shorter than it says, or a digest list too short for
the file raises :class:`IntegrityError`; the caller uses the buffer only once :func:`read`
returned, so what it uses is exactly what was hashed.

A chunk whose signed digest is that of zeros (:func:`is_zero`) and which is a hole in the file
(the checkpoint punches such chunks out: :mod:`runtime.pages.bulk`) is neither read nor hashed:
its bytes are zeros by its digest (a file cut short is read, and found short). Where the file holds data there (a file system that cannot
punch, or a store writer who filled the hole in), the chunk is read and checked like any other.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from runtime.digests import new_hash
from runtime.errors import Reason, RekindleError
from runtime.fs import holes
from runtime.fs.pagecache import is_cached
from runtime.layout import DIGEST_BYTES, SUM_CHUNK

_ZEROS = memoryview(bytes(SUM_CHUNK))
SCRATCH = SUM_CHUNK  # what :func:`read` needs beside the caller's buffer: the rest of one chunk


class IntegrityError(RekindleError):
    """A bulk file's bytes do not match their chunk digests (or the file or its digests are
    short): nothing of the chunk was used."""

    reason_class = Reason.INTEGRITY


@dataclass
class Spent:
    """What a read did: bytes of the range read and verified, and the thread-seconds spent
    reading them and hashing them."""

    verified: int = 0
    read_s: float = 0.0
    hash_s: float = 0.0
    zero: int = 0  # of ``verified``: bytes of zero chunks that are holes (neither read nor hashed)


@functools.lru_cache(maxsize=64)
def zero_digest(length: int) -> bytes:
    """The digest of ``length`` zero bytes (a whole chunk's, or a file's short last one)."""
    return new_hash(bytes(length)).digest()


def is_zero(want: bytes, length: int) -> bool:
    """Whether a chunk of ``length`` bytes whose digest is ``want`` holds only zeros."""
    return want == zero_digest(length)


def zero_runs(sums: bytes, lo: int, hi: int, min_len: int) -> list[tuple[int, int]]:
    """The runs of at least ``min_len`` bytes of whole zero chunks (by their digests ``sums``)
    within [lo, hi) of a file, as (start, end) offsets, chunk-aligned."""
    zero = zero_digest(SUM_CHUNK)
    first, last = -(-lo // SUM_CHUNK), min(hi // SUM_CHUNK, len(sums) // DIGEST_BYTES - 1)
    out: list[tuple[int, int]] = []
    start = -1
    for i in range(first, last + 1):  # the file's last chunk (maybe short) is never counted
        z = i < last and sums[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] == zero
        if z and start < 0:
            start = i
        elif not z and start >= 0:
            if (i - start) * SUM_CHUNK >= min_len:
                out.append((start * SUM_CHUNK, i * SUM_CHUNK))
            start = -1
    return out


def all_zero(sums: bytes, lo: int, hi: int) -> bool:
    """Whether every chunk covering [lo, hi) of a file is zeros by its digest (the file's last
    chunk, whose length the digests do not tell, never is)."""
    n = len(sums) // DIGEST_BYTES
    first, end = lo // SUM_CHUNK, -(-hi // SUM_CHUNK)
    zero = zero_digest(SUM_CHUNK)
    return lo < hi and end < n and all(sums[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES] == zero
                                       for i in range(first, end))


def advise(fd: int, offset: int, length: int) -> None:
    """Ask the disk for [offset, offset + length) of ``fd`` at once unless it is cached: reads
    of it chunk by chunk (threads interleaving on one file) keep the requests queued."""
    if not is_cached(fd, offset, length):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:  # a hint: the reads still read it
            pass


def read(fd: int, offset: int, length: int, into: memoryview, sums: bytes, *, size: int, name: str,
         scratch: memoryview | None = None, needed: Callable[[int, int], bool] | None = None) -> Spent:
    """Read [offset, offset + length) of ``fd`` (a file of ``size`` bytes whose chunk digests
    are ``sums``) into ``into[:length]``, every chunk covering it checked against its digest.
    ``scratch`` (at least :data:`SCRATCH` bytes) takes the covering chunks' other bytes; one is
    made when the range does not start and end on chunk edges and none is given. ``needed``:
    a chunk whose part [lo, hi) of the range it says False of is neither read nor checked (its
    bytes in ``into`` are left as they were). :class:`IntegrityError` on the first chunk that
    does not verify, with nothing after it read."""
    end = offset + length
    if offset < 0 or length < 0 or end > size or len(into) < length:
        raise IntegrityError(f"{name}: {offset}+{length} is not within its {size} bytes")
    spent = Spent()
    if not length:
        return spent
    for c in range(offset - offset % SUM_CHUNK, end, SUM_CHUNK):
        ce = min(c + SUM_CHUNK, size)
        a, b = max(c, offset), min(ce, end)  # the range's part of this chunk
        if needed is not None and not needed(a, b):
            continue
        k = c // SUM_CHUNK * DIGEST_BYTES
        want = sums[k:k + DIGEST_BYTES]
        if len(want) != DIGEST_BYTES:
            raise IntegrityError(f"{name}: no digest for the chunk at {c}")
        if is_zero(want, ce - c) and holes.is_hole(fd, c, ce) and os.fstat(fd).st_size >= ce:
            into[a - offset:b - offset] = _ZEROS[:b - a]
            spent.verified += b - a
            spent.zero += b - a
            continue
        head, tail = a - c, ce - b
        if (head or tail) and scratch is None:
            scratch = memoryview(bytearray(SCRATCH))
        parts = [into[a - offset:b - offset]]
        if head or tail:
            assert scratch is not None and len(scratch) >= head + tail
            parts = [scratch[:head], *parts, scratch[head:head + tail]]
        t0 = time.perf_counter()
        pos = c
        for view in parts:
            _read_exact(fd, view, pos, name)
            pos += len(view)
        t1 = time.perf_counter()
        digest = new_hash()
        for view in parts:
            digest.update(view)
        if digest.digest() != want:
            raise IntegrityError(f"{name}: chunk at {c} does not match its digest")
        spent.verified += b - a
        spent.read_s += t1 - t0
        spent.hash_s += time.perf_counter() - t1
    return spent


def _read_exact(fd: int, view: memoryview, offset: int, name: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise IntegrityError(f"{name}: shrank while read (at {offset + got})")
        got += n
