"""A file of the node cache mapped into the plugin where its pages can be 2 MiB pages.

On a ``huge=always`` tmpfs a fault maps a huge page only where the address and the file offset
agree mod 2 MiB; a mapping placed anywhere else reads the same huge folios through 4 KiB page
table entries, one fault-around at a time. So the file's offset 0 goes at a 2 MiB-aligned address
(room reserved, the mapping put in it, the rest of the room given back).
"""

from __future__ import annotations

import mmap

from runtime import libc

HUGE = 2 << 20
_MAP_FIXED = 0x10



class FileMap:
    """``fd``'s first ``size`` bytes mapped shared at a 2 MiB-aligned address: read-write (where
    the streamed serve writes a mapped range's file) or read-only (where the fill copies a sealed
    entry's bytes from). ``addr`` until :meth:`close`."""

    def __init__(self, fd: int, size: int, *, writable: bool) -> None:
        self.size = max(size, 1)
        _mmap, _munmap = libc.function("mmap"), libc.function("munmap")
        room = _mmap(None, self.size + HUGE, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if room in (None, libc.MAP_FAILED):
            raise OSError(libc.errno(), "mmap of room for a file")
        at = -(-room // HUGE) * HUGE
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        got = _mmap(at, self.size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != at:
            err = libc.errno()
            _munmap(room, self.size + HUGE)
            raise OSError(err, "mmap of a node cache file")
        if at > room:
            _munmap(room, at - room)
        tail = room + self.size + HUGE - (at + self.size)
        if tail > 0:
            _munmap(at + self.size, tail)
        self.addr = at

    def close(self) -> None:
        if self.addr:
            libc.function("munmap")(self.addr, self.size)
            self.addr = 0

    def __enter__(self) -> FileMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
