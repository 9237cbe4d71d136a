"""The walk of an upperdir for :func:`runtime.overlay.rootfs.capture`, written into a :class:`TarWriter`.

The walk goes through directory fds and never follows a symlink; entries are visited in sorted
order, a directory before its subtree. Per entry: a whiteout (char device 0:0, or a file with an
``overlay.whiteout`` xattr) or an opaque directory (``overlay.opaque=y``) becomes a deletion
(their JSON is bounded by MAX_DELETIONS_BYTES as it grows); a directory, symlink or regular file
becomes a member with mode, owner, mtime (nanoseconds, in a PAX record) and xattrs (overlayfs'
own left out); a regular file with more than one link is stored at its first name and later
names with the same (st_dev, st_ino) become hardlink members; fifos become fifo members; device
nodes and sockets are skipped with a logged reason; excluded paths are skipped with everything
below them, and so is a top-level ``.rekindle-undo-*`` (an older agent's undo backup).
``redirect`` and ``metacopy`` (data in a lower layer) raise OverlayError. The deadline is checked
at every entry.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import tarfile
from dataclasses import dataclass, field

from runtime.errors import OverlayError
from runtime.overlay.check import MAX_DELETIONS_BYTES
from runtime.overlay.fs import DIR_FLAGS, OVERLAY_XATTRS, check_deadline
from runtime.overlay.tar import PAX_XATTR, TarWriter

log = logging.getLogger(__name__)
# Where agents before the undo journal moved to outside the rootfs kept the originals of a restore
# (``/.rekindle-undo-<hex>``); one killed mid-apply left it behind, never to be captured.
OLD_UNDO_PREFIX = ".rekindle-undo-"


@dataclass
class CaptureStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0  # hardlink members: further names of a file stored once
    fifos: int = 0
    sparse: int = 0  # files stored as sparse members
    whiteouts: int = 0
    opaque: int = 0
    bytes: int = 0  # apparent size of the regular files
    stored_bytes: int = 0  # size of the archive
    skipped: list[str] = field(default_factory=list)


@dataclass
class Walk:
    """One capture's writer, rules and what it found."""

    tar: TarWriter
    excluded: set[str]
    deadline: float | None
    stats: CaptureStats = field(default_factory=CaptureStats)
    deletions: list[tuple[str, str]] = field(default_factory=list)
    deletions_bytes: int = 2
    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (dev, ino) -> first name

    def delete(self, rel: str, kind: str) -> None:
        self.deletions_bytes += len(json.dumps({"path": rel, "type": kind})) + 1
        if self.deletions_bytes > MAX_DELETIONS_BYTES:
            raise OverlayError(f"the deletions exceed {MAX_DELETIONS_BYTES} bytes")
        self.deletions.append((rel, kind))
        if kind == "whiteout":
            self.stats.whiteouts += 1
        else:
            self.stats.opaque += 1


def _is_excluded(rel: str, excluded: set[str]) -> bool:
    return any(rel == e or rel.startswith(e + "/") for e in excluded)


def _read_xattrs(target: int | str) -> dict[str, bytes]:
    try:
        follow = isinstance(target, int)  # an fd is never a symlink; a path must not be followed
        names = os.listxattr(target, follow_symlinks=follow)
        return {n: os.getxattr(target, n, follow_symlinks=follow) for n in names}
    except OSError as exc:
        if exc.errno in (errno.ENOTSUP, errno.EPERM):
            return {}
        raise


def _has(xattrs_: dict[str, bytes], suffix: str, value: bytes | None = None) -> bool:
    return any(p + suffix in xattrs_ and (value is None or xattrs_[p + suffix] == value)
               for p in OVERLAY_XATTRS)


def _tarinfo(rel: str, kind: bytes, st: os.stat_result, xattrs_: dict[str, bytes]) -> tarfile.TarInfo:
    info = tarfile.TarInfo(rel)
    info.type = kind
    info.mode = stat.S_IMODE(st.st_mode)
    info.uid, info.gid = st.st_uid, st.st_gid
    info.uname = info.gname = ""
    info.mtime = st.st_mtime_ns // 10**9
    info.pax_headers = {PAX_XATTR + k: v.decode("utf-8", "surrogateescape")
                        for k, v in xattrs_.items() if not k.startswith(OVERLAY_XATTRS)}
    if st.st_mtime_ns >= 0:  # exact nanoseconds; tarfile itself would go through a float
        info.pax_headers["mtime"] = f"{info.mtime}.{st.st_mtime_ns % 10**9:09d}"
    return info


def walk(dfd: int, prefix: str, cap: Walk) -> None:
    with os.scandir(dfd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        rel = prefix + name
        check_deadline(cap.deadline, rel)
        if _is_excluded(rel, cap.excluded):
            log.debug("capture: %s excluded", rel)
            continue
        if not prefix and name.startswith(OLD_UNDO_PREFIX):
            log.info("capture: skipping %s (an undo backup an older agent left in the rootfs)", rel)
            continue
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            cap.delete(rel, "whiteout")
        elif stat.S_ISDIR(st.st_mode):
            fd = os.open(name, DIR_FLAGS, dir_fd=dfd)
            try:
                xa = _read_xattrs(fd)
                if _has(xa, "redirect"):
                    raise OverlayError(f"{rel} is a renamed directory (overlay redirect_dir); "
                                       "its content lives in a lower layer")
                if _has(xa, "opaque", b"y"):
                    cap.delete(rel, "opaque")
                cap.tar.add(_tarinfo(rel, tarfile.DIRTYPE, os.fstat(fd), xa))
                cap.stats.dirs += 1
                walk(fd, rel + "/", cap)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            _capture_file(dfd, name, rel, cap)
        elif stat.S_ISLNK(st.st_mode):
            info = _tarinfo(rel, tarfile.SYMTYPE, st, _read_xattrs(f"/proc/self/fd/{dfd}/{name}"))
            info.linkname = os.readlink(name, dir_fd=dfd)
            cap.tar.add(info)
            cap.stats.symlinks += 1
        elif stat.S_ISFIFO(st.st_mode):  # a process may hold it open: CRIU's restore needs it there
            cap.tar.add(_tarinfo(rel, tarfile.FIFOTYPE, st, _read_xattrs(f"/proc/self/fd/{dfd}/{name}")))
            cap.stats.fifos += 1
        else:
            kind = "device node" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "socket"
            log.info("capture: skipping %s (%s)", rel, kind)
            cap.stats.skipped.append(f"{rel} ({kind})")


def _capture_file(dfd: int, name: str, rel: str, cap: Walk) -> None:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OverlayError(f"{rel} changed type while being read")
        xa = _read_xattrs(fd)
        if _has(xa, "whiteout"):
            cap.delete(rel, "whiteout")
            return
        if _has(xa, "metacopy"):
            raise OverlayError(f"{rel} is a metadata-only copy-up (overlay metacopy); "
                               "its data lives in a lower layer")
        info = _tarinfo(rel, tarfile.REGTYPE, st, xa)
        if st.st_nlink > 1:
            first = cap.links.setdefault((st.st_dev, st.st_ino), rel)
            if first != rel:
                info.type, info.linkname = tarfile.LNKTYPE, first
                cap.tar.add(info)
                cap.stats.hardlinks += 1
                return
        stored = cap.tar.add_file(info, fd, st.st_size)
        cap.stats.files += 1
        cap.stats.sparse += stored < st.st_size
        cap.stats.bytes += st.st_size
    finally:
        os.close(fd)
