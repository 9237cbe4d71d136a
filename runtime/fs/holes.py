"""Holes in files: punched where bytes are not needed, skipped where a file is read or counted.

A bulk file keeps its offsets (the restore plan's ranges point into it) but not the bytes CRIU
keeps in its own pages image: those ranges are punched out (``FALLOC_FL_PUNCH_HOLE``), so the
artifact stores each byte once. A hole reads as zeros, so the chunk digests and every verified
read work on the punched file unchanged. Where the file system cannot punch, the bytes stay.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Iterable

from runtime import libc

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_CANNOT = (errno.EOPNOTSUPP, errno.ENOSYS)


def _fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    return int(libc.function("fallocate")(fd, mode, offset, length))



def merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` spans sorted, with overlapping or adjacent ones merged; empty ones dropped."""
    out: list[tuple[int, int]] = []
    for off, length in sorted(s for s in spans if s[1] > 0):
        if out and off <= out[-1][0] + out[-1][1]:
            last = out[-1]
            out[-1] = (last[0], max(last[0] + last[1], off + length) - last[0])
        else:
            out.append((off, length))
    return out


def punch(fd: int, spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Punch ``spans`` (merged, see :func:`merge`) out of ``fd``, keeping its size; the spans
    punched. Nothing where the file system cannot punch (logged): the bytes stay, which costs
    only room. The file's mtime changes: a digest made before it does not stand for it."""
    done: list[tuple[int, int]] = []
    for off, length in merge(spans):
        if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, length) != 0:
            err = ctypes.get_errno()
            if err in _CANNOT and not done:
                log.info("cannot punch holes here (%s): the bytes stay", os.strerror(err))
                return []
            raise OSError(err, f"punching {off}+{length}: {os.strerror(err)}")
        done.append((off, length))
    return done


def is_hole(fd: int, lo: int, hi: int) -> bool:
    """Whether [lo, hi) of ``fd`` holds no data (where the file system cannot tell: False)."""
    try:
        return os.lseek(fd, lo, os.SEEK_DATA) >= hi
    except OSError as exc:
        return exc.errno == errno.ENXIO  # no data from lo on


def data_spans(fd: int, offset: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of ``fd`` between ``offset`` and ``end`` that is not a
    hole (SEEK_DATA/SEEK_HOLE; where the file system cannot tell, all of it)."""
    end = os.fstat(fd).st_size if end is None else end
    out: list[tuple[int, int]] = []
    pos = offset
    while pos < end:
        try:
            lo = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole past pos
                break
            if exc.errno in (errno.EINVAL, *_CANNOT):
                return [*out, (pos, end - pos)]
            raise
        if lo >= end:
            break
        hi = min(os.lseek(fd, lo, os.SEEK_HOLE), end)
        out.append((lo, hi - lo))
        pos = hi
    return out


def allocated(st: os.stat_result) -> int:
    """Bytes a file takes on its file system (its blocks; holes take none)."""
    return int(st.st_blocks) * 512
