"""A file of the node cache mapped into the plugin where its pages can be 2 MiB pages.

On a ``huge=always`` tmpfs a fault maps a huge page only where the address and the file offset
agree mod 2 MiB; a mapping placed anywhere else reads the same huge folios through 4 KiB page
table entries, one fault-around at a time. So the file's offset 0 goes at a 2 MiB-aligned address
(room reserved, the mapping put in it, the rest of the room given back).
"""

from __future__ import annotations

import ctypes
import mmap

HUGE = 2 << 20
_MAP_FIXED = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


class FileMap:
    """``fd``'s first ``size`` bytes mapped shared at a 2 MiB-aligned address: read-write (where
    the streamed serve writes a mapped range's file) or read-only (where the fill copies a sealed
    entry's bytes from). ``addr`` until :meth:`close`."""

    def __init__(self, fd: int, size: int, *, writable: bool) -> None:
        self.size = max(size, 1)
        room = _libc.mmap(None, self.size + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if room in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap of room for a file")
        at = -(-room // HUGE) * HUGE
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        got = _libc.mmap(at, self.size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != at:
            err = ctypes.get_errno()
            _libc.munmap(room, self.size + HUGE)
            raise OSError(err, "mmap of a node cache file")
        if at > room:
            _libc.munmap(room, at - room)
        tail = room + self.size + HUGE - (at + self.size)
        if tail > 0:
            _libc.munmap(at + self.size, tail)
        self.addr = at

    def close(self) -> None:
        if self.addr:
            _libc.munmap(self.addr, self.size)
            self.addr = 0

    def __enter__(self) -> FileMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
