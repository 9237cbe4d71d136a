"""Capture a container's overlayfs upperdir into a tar; apply it to another container's rootfs.

Contract:

- :func:`capture` walks the upperdir through directory fds and never follows a symlink. It
  writes regular files, directories and symlinks (as symlinks) into a PAX tar with mode,
  uid/gid, mtime (nanoseconds) and xattrs (``SCHILY.xattr.*``; overlayfs' own
  ``trusted.overlay.*`` and ``user.overlay.*`` are left out). A regular file with holes is stored
  sparsely (GNU PAX 1.0 sparse member, see :mod:`runtime.overlay.tar`): a 2 GiB file holding
  4 KiB of data costs about 4 KiB. A regular file with several links is stored once, at the first
  of its names in the walk; its other names in the upperdir become hardlink members pointing to
  that name (a name whose other links are in a lower layer is a plain file). Whiteouts (char
  device 0:0, or a file carrying an ``overlay.whiteout`` xattr) become ``{"path", "type":
  "whiteout"}`` entries of the deletions JSON; opaque dirs (``overlay.opaque=y``) become
  ``"opaque"`` entries and are also captured. A fifo becomes a fifo member (a process of the
  tree may hold it open, and CRIU's restore reopens it by name); device nodes and sockets are
  skipped with a logged reason. Excluded paths (bind-mount destinations, /proc, /sys, /dev, ...) are skipped
  with everything below them. Overlay features whose data lives in the lower layers
  (``redirect``, ``metacopy``) raise :class:`OverlayError` rather than produce a wrong capture.
  Bounds: the archive never exceeds ``max_bytes`` (default :data:`DEFAULT_MAX_LAYER_BYTES`,
  8 GiB; headers, stored data and end blocks count, holes do not), the deletions JSON never
  exceeds :data:`MAX_DELETIONS_BYTES`, and the capture stops at ``deadline`` (a
  ``time.monotonic()`` instant; default none); each raises OverlayError and leaves no output.
  Outputs appear by rename only when complete; memory does not grow with the number of files.
- :func:`apply` treats the tar and the deletions JSON as untrusted and changes the rootfs all or
  nothing. The archive is streamed, never loaded: :func:`runtime.overlay.tar.members` parses only
  what capture writes, with every allocation bounded. A first pass checks every member
  (:mod:`runtime.overlay.check`: names, types, xattrs, owners, sizes against ``max_bytes``
  (default 8 GiB), sparse maps against their declared size, no parent that an earlier member
  made a symlink, hardlinks only to regular files earlier in the archive; a second pass when
  there are hardlinks) and every deletion (a normalised relative path whose parent in the
  rootfs is not a symlink); one bad entry refuses the whole layer before anything is written.
  Then it deletes (whiteouts; opaque dirs are emptied) and writes each member, streaming the
  archive again and checking each member again. Every parent is opened one component at a time
  with ``O_NOFOLLOW|O_DIRECTORY`` from an fd of the rootfs, so a symlink on the way (planted in
  the archive or in the rootfs) is refused, never followed. An existing entry at a member's name
  is moved aside and the new one is created with ``O_CREAT|O_EXCL|O_NOFOLLOW``; owner, mode,
  xattrs and mtime are set through the fd; sparse members are written sparsely. Symlink targets
  are stored verbatim: they are only ever resolved inside the container. Nothing is ever created
  or changed outside ``rootfs``. Every change is journaled before it is made, in a journal
  OUTSIDE the rootfs (:mod:`runtime.overlay.undo`; what is deleted or replaced is copied there
  first); when anything fails late (a parent missing, ENOSPC, a hardlink target gone, a member
  refused on the second read) the changes are undone in reverse order and the rootfs is as
  before (names, data, owners, modes, xattrs, times). The journal a caller names outlives the
  apply, so a later failure (or the next agent, after this one was killed) can still roll it
  back (:mod:`runtime.overlay.pending`). Memory is bounded by the symlink and hardlink-target
  names, not by the number of members.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

from runtime.errors import OverlayError
from runtime.overlay import undo as overlay_undo
from runtime.overlay.capture import CaptureStats, Walk, walk
from runtime.overlay.check import MAX_DELETIONS_BYTES, MemberCheck, load_deletions
from runtime.overlay.fs import DIR_FLAGS, copy_range, lstat_at, open_dir, write_all
from runtime.overlay.tar import Member, TarWriter, members
from runtime.overlay.undo import Undo
from runtime.overlay.verified import VerifiedArchive
from runtime.testpause import pause_for_test

log = logging.getLogger(__name__)

DEFAULT_EXCLUDES = ("rekindle", ".rekindle", "etc/hosts", "etc/resolv.conf", "etc/hostname",
                    "dev", "proc", "sys")
DEFAULT_MAX_LAYER_BYTES = 8 << 30
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
PAUSE_AT_MEMBER = 200  # the member before which the "member" test pause waits (runtime.testpause)

__all__ = ["DEFAULT_EXCLUDES", "DEFAULT_MAX_LAYER_BYTES", "MAX_DELETIONS_BYTES", "ApplyStats",
           "CaptureStats", "apply", "capture"]


@dataclass
class ApplyStats:
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    fifos: int = 0
    deleted: int = 0
    opaque: int = 0
    bytes: int = 0  # data bytes written (holes of sparse files not counted)


# --- capture -----------------------------------------------------------------------------------

def capture(upperdir: str, out_tar: str, deletions_json: str,
            exclude: Iterable[str] = DEFAULT_EXCLUDES, *,
            max_bytes: int = DEFAULT_MAX_LAYER_BYTES, deadline: float | None = None) -> CaptureStats:
    """Archive ``upperdir`` into ``out_tar`` and its deletions into ``deletions_json``.

    ``max_bytes``: the most the archive may take (default 8 GiB). ``deadline``: a
    ``time.monotonic()`` value after which the capture fails (default: none). Either raises
    OverlayError ("... exceeds the writable-layer cap of N bytes", "... deadline") with no
    output left behind.
    """
    excluded = {_normalise_exclude(p) for p in exclude}
    tmp, dtmp = out_tar + ".tmp", deletions_json + ".tmp"
    try:
        root = os.open(upperdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise OverlayError(f"capture {upperdir}: {exc}") from exc
    try:
        out = _create_new(tmp)
        try:
            cap = Walk(TarWriter(out, max_bytes, deadline), excluded, deadline)
            walk(root, "", cap)
            cap.tar.close()
        finally:
            os.close(out)
        dels = [{"path": p, "type": t} for p, t in sorted(cap.deletions)]
        dfd = _create_new(dtmp)
        try:
            write_all(dfd, json.dumps(dels, sort_keys=True, separators=(",", ":")).encode())
        finally:
            os.close(dfd)
        os.replace(dtmp, deletions_json)
        os.replace(tmp, out_tar)
    except OverlayError as exc:
        raise OverlayError(f"capture {upperdir}: {exc}") from exc
    except (OSError, RecursionError) as exc:
        raise OverlayError(f"capture {upperdir}: {exc}") from exc
    finally:
        os.close(root)
        for leftover in (tmp, dtmp):
            if os.path.lexists(leftover):
                os.unlink(leftover)
    stats = cap.stats
    stats.stored_bytes = cap.tar.offset
    log.info("captured %s: %d files (%d sparse), %d hardlinks, %d dirs, %d symlinks, "
             "%d whiteouts, %d opaque, %d bytes in %d stored, %d skipped", upperdir, stats.files,
             stats.sparse, stats.hardlinks, stats.dirs, stats.symlinks, stats.whiteouts,
             stats.opaque, stats.bytes, stats.stored_bytes, len(stats.skipped))
    return stats


def _create_new(path: str) -> int:
    """A new file at ``path``: whatever is there (a leftover, a planted link) is removed, never
    followed."""
    if os.path.lexists(path):
        os.unlink(path)
    return os.open(path, _CREATE, 0o600)


def _normalise_exclude(path: str) -> str:
    norm = posixpath.normpath("/" + path).lstrip("/")
    if not norm:
        raise OverlayError(f"exclude {path!r} would exclude the whole rootfs")
    return norm


# --- apply -------------------------------------------------------------------------------------

def apply(rootfs: str, tar: str | VerifiedArchive, deletions_json: str, *,
          max_bytes: int = DEFAULT_MAX_LAYER_BYTES, journal: str | None = None) -> ApplyStats:
    """Apply a captured layer to ``rootfs`` (the target container's merged overlay mount), all or
    nothing. ``tar``: the archive's path (a private copy), or the store's file read through its
    chunk digests (:class:`runtime.overlay.verified.VerifiedArchive`: every byte is verified
    before it is parsed or written; the caller keeps and closes it). ``max_bytes``: the largest archive accepted (default 8 GiB); every member's stored
    data must end below it, so it also bounds what is written. ``journal``: a new directory
    outside the rootfs for the undo journal (:mod:`runtime.overlay.undo`), left there when the
    apply succeeds so that the caller can still roll it back (``runtime.overlay.undo.roll_back``) or
    drop it (``runtime.overlay.undo.discard``); removed when the apply fails (after its rollback). None:
    a private temporary journal, dropped at the end."""
    stats = ApplyStats()
    tar_path = tar if isinstance(tar, str) else "the store's archive"
    deletions = load_deletions(deletions_json)
    try:
        root = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise OverlayError(f"apply to {rootfs}: {exc}") from exc
    own_journal = journal is None
    try:
        if journal is None:
            journal = os.path.join(tempfile.mkdtemp(prefix="rekindle-undo-"), "journal")
        with _opened(tar) as f:
            check = MemberCheck(max_bytes=max_bytes)
            for m in members(f):
                check.check(m)
            targets = frozenset(check.link_names)
            if targets:  # second pass: each hardlink's target is a regular file written before it
                check = MemberCheck(max_bytes=max_bytes, link_targets=targets)
                for m in members(f):
                    check.check(m)
            for parts, _ in deletions:
                parent = open_dir(root, parts[:-1], "/".join(parts), missing_ok=True)
                if parent >= 0:
                    os.close(parent)
            undo = Undo(root, rootfs, journal)
            try:
                undo.step("checked")
                for parts, kind in deletions:
                    _delete(root, parts, kind, undo, stats)
                undo.step("deleted")
                pause_for_test("deleted")
                check = MemberCheck(max_bytes=max_bytes, link_targets=targets)
                _write_members(root, f, check, undo, stats)
                undo.step("applied")
                undo.close()
            except BaseException as exc:
                problems = undo.rollback()
                overlay_undo.discard(journal)
                log.warning("apply %s to %s failed (%s); %s", tar_path, rootfs, exc,
                            f"rollback incomplete: {problems}" if problems
                            else f"rolled back {len(undo)} changes")
                if problems:
                    raise OverlayError(f"apply {tar_path} to {rootfs}: {exc}; rollback incomplete: "
                                       + "; ".join(problems[:5])) from exc
                if isinstance(exc, Exception):
                    raise OverlayError(f"apply {tar_path} to {rootfs}: {exc} (rolled back: the "
                                       "rootfs is unchanged)") from exc
                raise
    except (ArithmeticError, ValueError) as exc:  # absurd numbers in headers
        raise OverlayError(f"apply {tar_path}: bad value in archive: {exc}") from exc
    except (OSError, RecursionError) as exc:
        raise OverlayError(f"apply {tar_path} to {rootfs}: {exc}") from exc
    finally:
        os.close(root)
        if own_journal and journal is not None:
            shutil.rmtree(os.path.dirname(journal), ignore_errors=True)
    log.info("applied %s to %s: %d files, %d hardlinks, %d dirs, %d symlinks, %d deleted, "
             "%d opaque, %d bytes", tar_path, rootfs, stats.files, stats.hardlinks, stats.dirs,
             stats.symlinks, stats.deleted, stats.opaque, stats.bytes)
    return stats


@contextlib.contextmanager
def _opened(tar: str | VerifiedArchive) -> Iterator[IO[bytes] | VerifiedArchive]:
    if isinstance(tar, str):
        with open(tar, "rb", buffering=256 << 10) as f:
            yield f
    else:
        yield tar


def _delete(root: int, parts: list[str], kind: str, undo: Undo, stats: ApplyStats) -> None:
    parent = open_dir(root, parts[:-1], "/".join(parts), missing_ok=True)
    if parent < 0:
        return
    try:
        st = lstat_at(parent, parts[-1])
        if kind == "whiteout" or (st is not None and not stat.S_ISDIR(st.st_mode)):
            stats.deleted += undo.move_aside(parent, parts)  # a non-dir where the opaque dir goes
            return
        if st is None:
            return
        fd = os.open(parts[-1], DIR_FLAGS, dir_fd=parent)
        try:
            for child in sorted(os.listdir(fd)):
                stats.deleted += undo.move_aside(fd, parts + [child])
            stats.opaque += 1
        finally:
            os.close(fd)
    finally:
        os.close(parent)


def _write_members(root: int, f: IO[bytes] | VerifiedArchive, check: MemberCheck, undo: Undo,
                   stats: ApplyStats) -> None:
    # Directories of the archive whose subtree is being written, innermost last, with their
    # mtimes: set once the walk has left them (capture writes a directory, then its subtree).
    open_dirs: list[tuple[list[str], int]] = []
    for i, m in enumerate(members(f)):
        parts = check.check(m)
        _leave_dirs(root, open_dirs, m.name)
        if i == PAUSE_AT_MEMBER:
            pause_for_test("member")
        _write(root, f, m, parts, undo, stats)
        if m.isdir():
            open_dirs.append((parts, m.mtime_ns))
    _leave_dirs(root, open_dirs, None)


def _leave_dirs(root: int, open_dirs: list[tuple[list[str], int]], name: str | None) -> None:
    while open_dirs and (name is None or not name.startswith("/".join(open_dirs[-1][0]) + "/")):
        parts, ns = open_dirs.pop()
        parent = open_dir(root, parts[:-1], "/".join(parts))
        try:
            os.utime(parts[-1], ns=(ns, ns), dir_fd=parent, follow_symlinks=False)
        finally:
            os.close(parent)


def _set_meta(fd: int, m: Member) -> None:
    os.chown(fd, m.uid, m.gid)  # before chmod: chown clears setuid bits
    os.chmod(fd, m.mode & 0o7777)
    for name, value in m.xattrs.items():  # after chown: it clears security.capability
        os.setxattr(fd, name, value)


def _write(root: int, archive: IO[bytes] | VerifiedArchive, m: Member, parts: list[str], undo: Undo,
           stats: ApplyStats) -> None:
    leaf = parts[-1]
    parent = open_dir(root, parts[:-1], m.name)
    try:
        if m.isdir():
            st = lstat_at(parent, leaf)
            existing = st is not None and stat.S_ISDIR(st.st_mode)
            if not existing:
                undo.move_aside(parent, parts)
                undo.created(parent, parts)
                os.mkdir(leaf, 0o700, dir_fd=parent)
            fd = os.open(leaf, DIR_FLAGS, dir_fd=parent)
            try:
                if existing:
                    undo.changed_meta(fd, parts)
                _set_meta(fd, m)
            finally:
                os.close(fd)
            stats.dirs += 1
            return
        undo.move_aside(parent, parts)
        undo.created(parent, parts)
        if m.isreg():
            fd = os.open(leaf, _CREATE, 0o600, dir_fd=parent)
            try:
                stats.bytes += _write_data(archive, fd, m)
                _set_meta(fd, m)
                os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))
            finally:
                os.close(fd)
            stats.files += 1
        elif m.isfifo():
            os.mkfifo(leaf, 0o600, dir_fd=parent)  # fails on anything there: never follows one
            os.chown(leaf, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
            where = f"/proc/self/fd/{parent}/{leaf}"
            os.chmod(where, m.mode & 0o7777)
            for name, value in m.xattrs.items():
                os.setxattr(where, name, value, follow_symlinks=False)
            os.utime(leaf, ns=(m.mtime_ns, m.mtime_ns), dir_fd=parent, follow_symlinks=False)
            stats.fifos += 1
        elif m.issym():
            os.symlink(m.linkname, leaf, dir_fd=parent)
            os.chown(leaf, m.uid, m.gid, dir_fd=parent, follow_symlinks=False)
            for name, value in m.xattrs.items():
                os.setxattr(f"/proc/self/fd/{parent}/{leaf}", name, value, follow_symlinks=False)
            os.utime(leaf, ns=(m.mtime_ns, m.mtime_ns), dir_fd=parent, follow_symlinks=False)
            stats.symlinks += 1
        elif m.islnk():
            target = m.linkname.split("/")
            tparent = open_dir(root, target[:-1], m.name)
            try:
                tst = lstat_at(tparent, target[-1])
                if tst is None or not stat.S_ISREG(tst.st_mode):
                    raise OverlayError(f"entry {m.name!r}: hardlink target {m.linkname!r} is "
                                       "missing or not a regular file")
                os.link(target[-1], leaf, src_dir_fd=tparent, dst_dir_fd=parent,
                        follow_symlinks=False)
            finally:
                os.close(tparent)
            stats.hardlinks += 1
    finally:
        os.close(parent)


def _write_data(archive: IO[bytes] | VerifiedArchive, fd: int, m: Member) -> int:
    """Copy ``m``'s data from the archive into ``fd``, holes left as holes; the bytes written."""
    what = f"entry {m.name!r}"

    def copy(src_off: int, dst_off: int, count: int) -> None:
        if isinstance(archive, VerifiedArchive):
            archive.copy_to(src_off, fd, dst_off, count)
        else:
            copy_range(archive.fileno(), src_off, fd, dst_off, count, what)

    if m.sparse is None:
        copy(m.offset_data, 0, m.size)
        return int(m.size)
    pos = m.offset_data
    for offset, length in m.sparse:
        copy(pos, offset, length)
        pos += length
    os.ftruncate(fd, m.size)
    return pos - m.offset_data
