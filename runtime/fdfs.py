"""fd-relative file operations for a directory other writers share, and its locks.

Everything here works below a directory fd and never follows a symlink (``O_NOFOLLOW`` on every
component); reads are size-capped. The locks are open-file-description locks: per open file (two
readers in one process hold two locks) and honoured over NFS.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import struct
import time
from collections.abc import Iterator

from runtime.errors import ArtifactRejected
from runtime.layout import MANIFEST, SIGNATURE

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

def fsync_dir(path: str | int) -> None:
    fd = os.open(path, DIR_FLAGS) if isinstance(path, str) else os.dup(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, data: bytes, dir_fd: int | None = None, *, exclusive: bool = False) -> None:
    """Write ``data`` and fsync. ``exclusive``: the file must not exist yet (``O_EXCL``), so a
    name someone else planted (a hard link to another file included) is never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)



def walk_files(dir_fd: int, prefix: str = "") -> Iterator[str]:
    """Relative paths of all non-directories below ``dir_fd``; never follows symlinks."""
    with os.scandir(dir_fd) as it:
        entries = sorted(it, key=lambda e: e.name)
    for entry in entries:
        rel = prefix + entry.name
        if entry.is_dir(follow_symlinks=False):
            sub = os.open(entry.name, DIR_FLAGS, dir_fd=dir_fd)
            try:
                yield from walk_files(sub, rel + "/")
            finally:
                os.close(sub)
        else:
            yield rel


def tree_bytes(dir_fd: int) -> int:
    total = 0
    for rel in walk_files(dir_fd):
        with contextlib.suppress(OSError):
            total += os.stat(rel, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
    return total


def open_regular(dir_fd: int, name: str, label: str) -> int:
    """An fd of the regular file ``name`` below ``dir_fd``, no symlink followed; anything else
    (absent, a link, a fifo, a directory) is ArtifactRejected."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ArtifactRejected(label, f"incomplete: no {name}") from None
    except OSError as exc:
        raise ArtifactRejected(label, f"{name}: {why(exc)}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArtifactRejected(label, f"{name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(dir_fd: int, name: str, cap: int, label: str) -> bytes:
    fd = open_regular(dir_fd, name, label)
    try:
        data = os.read(fd, cap + 1)
        while len(data) <= cap and (more := os.read(fd, cap + 1 - len(data))):
            data += more
    finally:
        os.close(fd)
    if len(data) > cap:
        raise ArtifactRejected(label, f"{name} larger than {cap} bytes")
    return data


def why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "is a symlink or not a directory"
    return exc.strerror or str(exc)


def safe_parts(path: str) -> list[str] | None:
    parts = path.split("/")
    if (path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts)
            or path in (MANIFEST, SIGNATURE)):
        return None
    return parts


# Open-file-description locks: per open file (not per process, so two restores in one plugin do
# not share a lock), and honoured over NFS. Readers hold F_RDLCK on a version's manifest; anything
# that removes a version must first get F_WRLCK.
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)


def ofd_lock(fd: int, kind: int, wait: bool) -> bool:
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0)
    try:
        fcntl.fcntl(fd, _F_OFD_SETLKW if wait else _F_OFD_SETLK, arg)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def exclusive(dir_fd: int, wait: float = 0.0) -> int | None:
    """An fd holding the exclusive lock of the version dir ``dir_fd``, or None while a reader
    holds it. A version without a manifest (broken) is lockable trivially (-1)."""
    try:
        fd = os.open(MANIFEST, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return -1
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return -1
        raise
    deadline = time.monotonic() + wait
    while True:
        if ofd_lock(fd, fcntl.F_WRLCK, wait=False):
            return fd
        if time.monotonic() >= deadline:
            os.close(fd)
            return None
        time.sleep(0.1)


def walk_files_path(path: str) -> Iterator[str]:
    fd = os.open(path, DIR_FLAGS)
    try:
        yield from walk_files(fd)
    finally:
        os.close(fd)


# renameat2(2) flags; glibc has the call since 2.28, Python has no wrapper for it.
RENAME_NOREPLACE = 1
_renameat2 = None


def rename_noreplace(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> None:
    """Rename ``src`` below ``src_dir_fd`` to ``dst`` below ``dst_dir_fd``, failing (``EEXIST``)
    rather than replacing whatever sits at ``dst``. Neither name is followed if it is a symlink."""
    global _renameat2
    if _renameat2 is None:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        fn.restype = ctypes.c_int
        _renameat2 = fn
    if _renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), RENAME_NOREPLACE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), dst)


def same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
