"""CRIU's lazy-pages hand-off: the images made lazy, and the socket CRIU hands each task's uffd on.

- :func:`prepare_images` (restore side, on the private copy of CRIU's images): each bulk range
  goes back into its process's pagemap as an entry flagged ``PE_LAZY`` and not ``PE_PRESENT``
  (CRIU 4.2.1's ``--lazy-pages`` restore skips lazy entries without moving its pages-file
  offset, so the pages file CRIU keeps stays as the split wrote it), and every other entry loses
  ``PE_LAZY`` (a dump tags all private anonymous pages lazy: CRIU then restores them itself).
  Refused (the caller falls back to the bulk path) when a bulk range lies in a VMA CRIU would
  not register with userfaultfd (``vma_entry_can_be_lazy``: locked, hugetlb, not anonymous).
- :class:`Listener`: ``criu restore --lazy-pages`` connects to ``lazy-pages.socket`` in its
  work dir and sends, per task, an int32 pid (in the restored pid namespace; negative for a
  zombie, which has no uffd) and that task's uffd by SCM_RIGHTS, then ``RSTF`` (0x52535446);
  it expects no reply. The socket listens before CRIU starts (CRIU fails without it).

What is done with the uffds is the page server's (``runtime.pages.serve``).
"""

from __future__ import annotations

import bisect
import os
import socket
import sys
from collections.abc import Callable, Sequence

from runtime.criu import image_files as img
from runtime.criu.proto import pagemap_pb2
from runtime.errors import Reason, RekindleError
from runtime.layout import BulkFile

SOCKET_NAME = "lazy-pages.socket"
RESTORE_FINISHED = 0x52535446  # "RSTF"
# flags of a VMA CRIU registers with userfaultfd (criu/include/vma.h vma_entry_can_be_lazy)
MAP_PRIVATE, MAP_ANONYMOUS, MAP_LOCKED, MAP_HUGETLB = 0x02, 0x20, 0x2000, 0x40000
_NOT_LAZY_STATUS = img.VMA_AREA_VDSO | img.VMA_AREA_VVAR | img.VMA_AREA_VSYSCALL


class LazyPagesError(RekindleError):
    """CRIU's images cannot be made lazy, or its lazy-pages hand-off failed."""

    reason_class = Reason.CRIU


def _can_be_lazy(vma: object) -> bool:
    flags, status = getattr(vma, "flags"), getattr(vma, "status")
    return (bool(flags & MAP_ANONYMOUS) and bool(flags & MAP_PRIVATE) and not flags & (MAP_LOCKED | MAP_HUGETLB)
            and not status & _NOT_LAZY_STATUS)


def prepare_images(images: str, files: Sequence[BulkFile]) -> None:
    """Rewrite the pagemaps of CRIU's images in ``images`` for ``criu restore --lazy-pages``:
    the bulk ranges lazy (no data), everything else eager. LazyPagesError when a bulk range lies
    where CRIU registers no userfaultfd (then nothing was written)."""
    rewritten = []
    by_pid = {f.pid: f for f in files}
    # Every process CRIU restores, not only those with bulk files: a dump tags each private
    # anonymous page lazy, and a lazy page nobody serves would read zero (a tree's pages kept
    # with CRIU: a forked child's inherited VMAs, short runs).
    for proc in img.read_pstree(images):
        if proc.pid in by_pid or not os.path.exists(os.path.join(images, f"pagemap-{proc.pid}.img")):
            continue
        pagemap = img.read_pagemap(images, proc.pid)
        entries = list(pagemap.entries)
        if any(e.HasField("flags") and e.flags & img.PE_LAZY for e in entries):
            for e in entries:
                if e.HasField("flags"):
                    e.flags &= ~img.PE_LAZY
            rewritten.append((pagemap, entries))
    for f in files:
        pagemap = img.read_pagemap(images, f.pid)
        vmas = sorted(img.read_mm(images, f.pid).entry.vmas, key=lambda v: v.start)
        starts = [v.start for v in vmas]
        entries = []
        for e in pagemap.entries:
            if e.HasField("flags"):
                e.flags &= ~img.PE_LAZY
            entries.append(e)
        for r in f.ranges:
            i = bisect.bisect_right(starts, r.vaddr) - 1
            if i < 0 or r.vaddr + r.length > vmas[i].end or not _can_be_lazy(vmas[i]):
                raise LazyPagesError(f"pid {f.pid}: bulk range {r.vaddr:#x}+{r.length} is not in a VMA "
                                  "CRIU registers with userfaultfd")
            e = pagemap_pb2.pagemap_entry()
            # compat_nr_pages is required (proto2); CRIU reads nr_pages when it is there
            e.vaddr, e.nr_pages, e.flags = r.vaddr, r.length // img.PAGE, img.PE_LAZY
            e.compat_nr_pages = min(e.nr_pages, 0xFFFFFFFF)
            entries.append(e)
        entries.sort(key=lambda e: e.vaddr)
        rewritten.append((pagemap, entries))
    for pagemap, entries in rewritten:
        img.write_pagemap(pagemap, entries)


class Listener:
    """The lazy-pages socket in ``work_dir``, listening before CRIU starts; :meth:`receive`
    takes CRIU's hand-off (pid in the restored namespace -> uffd)."""

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, SOCKET_NAME)
        self._dir = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # through the directory fd: the work dir's path may exceed sun_path's 108 bytes
        short = f"/proc/self/fd/{self._dir}/{SOCKET_NAME}"
        try:
            os.unlink(SOCKET_NAME, dir_fd=self._dir)  # a stale socket would take CRIU elsewhere
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.conn: socket.socket | None = None
        try:
            self.sock.bind(short)
            os.chmod(SOCKET_NAME, 0o600, dir_fd=self._dir)
            self.sock.listen(1)
        except OSError:
            self.close()
            raise

    def receive(self, take: Callable[[int, int], None], timeout: float = 1800.0) -> None:
        """Hand each (pid, uffd) CRIU sends to ``take`` (which owns the fd from then on);
        return at RSTF. LazyPagesError otherwise."""
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except OSError as exc:
            raise LazyPagesError(f"CRIU did not connect to {SOCKET_NAME}: {exc}") from exc
        self.conn = conn
        try:
            conn.settimeout(timeout)
            while True:
                raw = _recv_exact(conn, 4)
                value = int.from_bytes(raw, sys.byteorder, signed=True)
                if value == RESTORE_FINISHED:
                    return
                if value <= 0:  # a zombie: no memory, no uffd
                    continue
                _msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 1)
                if len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise LazyPagesError(f"CRIU sent pid {value} without its uffd")
                take(value, fds[0])
        except (OSError, ValueError) as exc:
            raise LazyPagesError(f"lazy-pages hand-off from CRIU failed: {exc}") from exc
        finally:
            conn.close()

    def interrupt(self) -> None:
        """Make a :meth:`receive` in progress return (with LazyPagesError)."""
        for sk in (self.sock, self.conn):
            if sk is not None:
                try:
                    sk.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(SOCKET_NAME, dir_fd=self._dir)
        except FileNotFoundError:
            pass
        os.close(self._dir)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            raise LazyPagesError(f"CRIU closed the lazy-pages socket before RSTF ({len(buf)} of {n} bytes)")
        buf += got
    return buf
