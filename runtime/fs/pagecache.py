"""How much of a file range is in the page cache (``cachestat(2)``, Linux 6.5+).

The prefetch reads only what is not cached yet: re-reading a cached artifact costs 16 threads
of memory copies while the restore's own staging and fill need those cores.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import platform

from runtime import libc

_NR_CACHESTAT = {"x86_64": 451, "aarch64": 451}.get(platform.machine())
PAGE = mmap.PAGESIZE


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64),
                ("nr_writeback", ctypes.c_uint64), ("nr_evicted", ctypes.c_uint64),
                ("nr_recently_evicted", ctypes.c_uint64)]


_available = _NR_CACHESTAT is not None


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """Pages of ``fd`` in [offset, offset+length) that are in the page cache; None when the
    kernel cannot tell (no cachestat)."""
    global _available
    if not _available or length <= 0:
        return None if not _available else 0
    rng, st = _Range(offset, length), _Stat()
    cachestat = libc.function("syscall")
    if cachestat(_NR_CACHESTAT, ctypes.c_uint(fd), ctypes.byref(rng), ctypes.byref(st), ctypes.c_uint(0)) != 0:
        if libc.errno() in (errno.ENOSYS, errno.EPERM):
            _available = False  # an old kernel, or seccomp: stop asking
        return None
    return int(st.nr_cache)


def is_cached(fd: int, offset: int, length: int) -> bool:
    """True only when every page of the range is known to be cached."""
    pages = cached_pages(fd, offset, length)
    if pages is None:
        return False
    first, last = offset // PAGE, (offset + length + PAGE - 1) // PAGE
    return pages >= last - first


__all__ = ["cached_pages", "is_cached"]
