"""File-system steps of the overlay code that never follow a symlink out of a directory fd.

- :func:`open_dir` opens a directory below a root fd one component at a time with
  ``O_NOFOLLOW|O_DIRECTORY``: a symlink on the way is refused, never followed.
- :func:`remove` deletes one entry (a directory with everything below it) relative to a
  directory fd, without following symlinks.
- :func:`copy_range` copies bytes between fds (``copy_file_range``, else ``pread``/``write``),
  failing on a source that ends early and at a monotonic deadline.
- :class:`Meta` is a directory's owner, mode, xattrs and times, read from an fd and put back on one.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import OverlayError

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")
ALLOWED_XATTRS = ("user.", "security.", "trusted.", "system.posix_acl_access",
                  "system.posix_acl_default")
_CHUNK = 16 << 20
# By hand (no copy_file_range across file systems, as from a node-local file into an overlay
# mount): 1 MiB buffers. 16 MiB ones are fresh memory at every read, and made the copy of a
# 1 GiB layer into a rootfs 2-5x slower than 1 MiB ones (bench/layer_restore.py).
_HAND_CHUNK = 1 << 20
# copy_file_range cannot do this pair of files (other file systems, old kernels): copy by hand
_NO_COPY_RANGE = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF)


def open_dir(root: int, parts: list[str], entry: str, missing_ok: bool = False) -> int:
    """An fd of the directory ``parts`` below ``root``, never following a symlink (-1 when
    ``missing_ok`` and it does not exist)."""
    fd = os.dup(root)
    try:
        for i, part in enumerate(parts):
            try:
                nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                where = "/".join(parts[:i + 1])
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OverlayError(f"entry {entry!r}: parent {where!r} is a symlink or not "
                                       "a directory") from exc
                if exc.errno == errno.ENOENT and missing_ok:
                    os.close(fd)
                    return -1
                if exc.errno == errno.ENOENT:
                    raise OverlayError(f"entry {entry!r}: parent {where!r} missing") from exc
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def lstat_at(parent: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove(parent: int, name: str) -> bool:
    """Remove ``name`` in ``parent`` (recursively for a dir, never following a symlink)."""
    st = lstat_at(parent, name)
    if st is None:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)
    return True


def times(st: os.stat_result) -> tuple[int, int]:
    return st.st_atime_ns, st.st_mtime_ns


def check_deadline(deadline: float | None, what: str) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise OverlayError(f"{what}: not finished by its deadline")


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def copy_range(src: int, src_off: int, dst: int, dst_off: int | None, count: int,
               what: str, deadline: float | None = None) -> None:
    """Copy ``count`` bytes of ``src`` at ``src_off`` to ``dst`` at ``dst_off`` (None: at and
    advancing ``dst``'s file position)."""
    by_hand = False
    while count > 0:
        check_deadline(deadline, what)
        n = min(count, _HAND_CHUNK if by_hand else _CHUNK)
        done = 0
        if not by_hand:
            try:
                done = os.copy_file_range(src, dst, n, src_off, dst_off)
            except OSError as exc:
                if exc.errno not in _NO_COPY_RANGE:
                    raise
                by_hand, n = True, min(count, _HAND_CHUNK)
        if by_hand:
            data = os.pread(src, n, src_off)
            if dst_off is None:
                write_all(dst, data)
            else:
                view = memoryview(data)
                at = dst_off
                while view:
                    w = os.pwrite(dst, view, at)
                    view, at = view[w:], at + w
            done = len(data)
        if done == 0:
            raise OverlayError(f"{what}: data ends {count} bytes early (changed or truncated)")
        count -= done
        src_off += done
        if dst_off is not None:
            dst_off += done


def kept_xattr(name: str) -> bool:
    """An xattr the overlay code carries (never overlayfs' own)."""
    return name.startswith(ALLOWED_XATTRS) and not name.startswith(OVERLAY_XATTRS)


def _xattr_names(fd: int) -> list[str]:
    try:
        return [n for n in os.listxattr(fd) if kept_xattr(n)]
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return []
        raise


@dataclass(frozen=True)
class Meta:
    """What :func:`runtime.overlay.rootfs.apply` may change on an existing directory."""

    mode: int
    uid: int
    gid: int
    xattrs: dict[str, str]  # name -> value as hex: it goes through JSON
    atime_ns: int
    mtime_ns: int

    @classmethod
    def read(cls, fd: int) -> Meta:
        st = os.fstat(fd)
        return cls(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                   {n: os.getxattr(fd, n).hex() for n in _xattr_names(fd)},
                   st.st_atime_ns, st.st_mtime_ns)

    def put(self, fd: int) -> None:
        os.chown(fd, self.uid, self.gid)  # before chmod: chown clears setuid bits
        os.chmod(fd, self.mode)
        for name in _xattr_names(fd):
            if name not in self.xattrs:
                os.removexattr(fd, name)
        for name, value in self.xattrs.items():
            os.setxattr(fd, name, bytes.fromhex(value))
        os.utime(fd, ns=(self.atime_ns, self.mtime_ns))

    def to_json(self) -> dict[str, object]:
        return {"mode": self.mode, "uid": self.uid, "gid": self.gid, "xattrs": self.xattrs,
                "atime_ns": self.atime_ns, "mtime_ns": self.mtime_ns}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Meta:
        return cls(**obj)  # written by Meta.to_json in this process
