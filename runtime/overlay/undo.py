"""An undo journal for changes to a rootfs, kept OUTSIDE the rootfs, so that an apply that fails,
is killed half way, or is followed by a restore step that fails, can be rolled back.

A journal is a directory the caller names (node-local, private to the agent, never inside the
rootfs: nothing of it can be seen, changed or captured from the container):

- ``journal``: one JSON line per record, appended (one ``write(2)``, ``O_APPEND``) BEFORE the
  change it describes is made, so a change cut short at any instant is still undone. The first
  record names the rootfs (path, device, inode, times); a rollback in another process refuses a
  rootfs that is not that one. A last line cut short by a kill is ignored: its change was never
  begun.
- ``saved/<n>``: the data of the regular file record ``n`` removed from the rootfs, copied there
  (holes kept) and renamed into place before the original is removed. Owner, mode, xattrs and
  times, symlink targets and device numbers are in the record.

Records:

- :meth:`Undo.move_aside` saves an existing entry (to be deleted or replaced) and removes it; a
  directory is taken apart (its entries saved one by one, then it is removed and its owner, mode,
  xattrs and times recorded). On overlayfs, reading a lower-layer file costs a copy of it, as the
  copy-up of a rename did.
- :meth:`Undo.created` records a path about to be created.
- :meth:`Undo.changed_meta` records an existing directory's owner, mode, xattrs and times.
- :meth:`Undo.step` records how far the caller got (for the log of a rollback).

Every record also keeps the times of the parent directory it changes. :func:`roll_back` undoes
the records in reverse order (removes what was created, writes back what was saved, recreates
taken-apart directories, puts back metadata and parent times) and the root's times, and returns
the problems it met (none when the rootfs is as it was). Each undo step is idempotent, so a
rollback killed half way is simply run again. Durability: records are written, not fsync'd. The
journal guards against the agent dying (SIGKILL, OOM): what it wrote is read back by the next
agent. A node crash takes the container with it (kubelet makes new containers on new snapshots),
and a journal whose rootfs is gone is dropped unread. A file with several links in the rootfs
comes back as a copy of its own. Paths are walked with :func:`open_dir`: no symlink is ever
followed, nothing outside the rootfs is touched. Memory: 8 bytes per record.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import typing
from array import array

from runtime.errors import OverlayError
from runtime.overlay.fs import DIR_FLAGS, Meta, copy_range, kept_xattr, lstat_at, open_dir, remove, times
from runtime.overlay.tar import data_extents

log = logging.getLogger(__name__)

JOURNAL = "journal"
SAVED = "saved"
_APPEND = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Undo:
    """The journal of one apply to the rootfs open as ``root`` (at ``root_path``), in the new
    directory ``journal_dir`` (its parent must exist)."""

    def __init__(self, root: int, root_path: str, journal_dir: str) -> None:
        self._root = root
        self.path = journal_dir
        os.mkdir(journal_dir, 0o700)
        self._dir = os.open(journal_dir, DIR_FLAGS)
        os.mkdir(SAVED, 0o700, dir_fd=self._dir)
        self._saved = os.open(SAVED, DIR_FLAGS, dir_fd=self._dir)
        self._log = os.open(JOURNAL, _APPEND, 0o600, dir_fd=self._dir)
        self._offsets = array("Q")
        self._size = 0
        st = os.fstat(root)
        self._root_times = times(st)
        self._write(["root", os.path.abspath(root_path), st.st_dev, st.st_ino, *self._root_times])

    def __len__(self) -> int:
        return len(self._offsets)

    def _write(self, fields: list[object]) -> None:
        line = json.dumps(fields).encode() + b"\n"
        if os.write(self._log, line) != len(line):
            raise OverlayError(f"undo journal {self.path}: short write")
        self._size += len(line)

    def _record(self, *fields: object) -> None:
        self._offsets.append(self._size)
        self._write(list(fields))

    def step(self, name: str) -> None:
        self._write(["step", name])

    def created(self, parent: int, path: list[str]) -> None:
        self._record("created", "/".join(path), times(os.fstat(parent)))

    def changed_meta(self, fd: int, path: list[str]) -> None:
        self._record("meta", "/".join(path), Meta.read(fd).to_json())

    def move_aside(self, parent: int, path: list[str]) -> bool:
        """Save the entry at ``path`` (in ``parent``) and remove it; False if there is none."""
        st = lstat_at(parent, path[-1])
        if st is None:
            return False
        if stat.S_ISDIR(st.st_mode):
            self._take_apart(parent, path)
            return True
        n = str(len(self._offsets))
        leaf = path[-1]
        meta = _meta_at(parent, leaf, st)
        extra: object = None
        if stat.S_ISLNK(st.st_mode):
            extra = os.readlink(leaf, dir_fd=parent)
        elif not stat.S_ISREG(st.st_mode):
            extra = st.st_rdev
        self._record("saved", "/".join(path), times(os.fstat(parent)), n, stat.S_IFMT(st.st_mode),
                     meta.to_json(), extra)
        if stat.S_ISREG(st.st_mode):
            self._save_data(parent, leaf, n)
        os.unlink(leaf, dir_fd=parent)
        return True

    def _save_data(self, parent: int, leaf: str, n: str) -> None:
        src = os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=parent)
        try:
            part = n + ".part"
            dst = os.open(part, _CREATE, 0o600, dir_fd=self._saved)
            try:
                copy_sparse(src, dst, os.fstat(src).st_size, f"save {leaf!r}")
            finally:
                os.close(dst)
            os.rename(part, n, src_dir_fd=self._saved, dst_dir_fd=self._saved)
        finally:
            os.close(src)

    def _take_apart(self, parent: int, path: list[str]) -> None:
        fd = os.open(path[-1], DIR_FLAGS, dir_fd=parent)
        try:
            for child in sorted(os.listdir(fd)):
                self.move_aside(fd, path + [child])
            meta = Meta.read(fd)
        finally:
            os.close(fd)
        self._record("rmdir", "/".join(path), times(os.fstat(parent)), meta.to_json())
        os.rmdir(path[-1], dir_fd=parent)

    def rollback(self) -> list[str]:
        """Undo every change of this journal; the problems met (none: the rootfs is as it was)."""
        try:
            with _open_journal(self._dir) as f:
                problems = _undo_all(self._root, self._saved, f, self._offsets)
            try:
                os.utime(self._root, ns=self._root_times)
            except OSError as exc:
                problems.append(f"root times: {exc}")
            return problems
        finally:
            self.close()

    def close(self) -> None:
        for fd in (self._log, self._saved, self._dir):
            if fd >= 0:
                os.close(fd)
        self._log = self._saved = self._dir = -1


def copy_sparse(src: int, dst: int, size: int, what: str) -> None:
    """Copy the first ``size`` bytes of ``src`` to ``dst``, holes left as holes."""
    extents = data_extents(src, size, size)
    for offset, length in [(0, size)] if extents is None else extents:
        copy_range(src, offset, dst, offset, length, what)
    os.ftruncate(dst, size)


def _meta_at(parent: int, leaf: str, st: os.stat_result) -> Meta:
    """Owner, mode, xattrs and times of a non-directory, read without opening (or following) it."""
    where = f"/proc/self/fd/{parent}/{leaf}"
    try:
        names = os.listxattr(where, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.ENOTSUP, errno.EPERM):
            raise
        names = []
    xattrs = {n: os.getxattr(where, n, follow_symlinks=False).hex() for n in names if kept_xattr(n)}
    return Meta(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, xattrs, st.st_atime_ns, st.st_mtime_ns)


def _change_offsets(f: typing.BinaryIO) -> array[int]:
    """Where each change record of a journal starts (the header and step records left out)."""
    offsets = array("Q")
    pos = 0
    f.seek(0)
    for line in f:
        if not line.endswith(b"\n"):
            break  # cut short by a kill: its change was never begun
        if not line.startswith((b'["root"', b'["step"')):
            offsets.append(pos)
        pos += len(line)
    return offsets


def header(journal_dir: str) -> tuple[str, int, int, tuple[int, int], list[str]] | None:
    """A journal's rootfs (path, device, inode, times) and its step records; None when it has
    none (killed before its first record: nothing was changed)."""
    try:
        f = open(os.path.join(journal_dir, JOURNAL), "rb")
    except FileNotFoundError:
        return None
    with f:
        line = f.readline()
        if not line.endswith(b"\n"):
            return None
        first = json.loads(line)
        steps = [str(r[1]) for r in (json.loads(line) for line in f if line.endswith(b"\n"))
                 if isinstance(r, list) and r and r[0] == "step"]
    if not isinstance(first, list) or len(first) != 6 or first[0] != "root":
        raise OverlayError(f"undo journal {journal_dir}: no rootfs record")
    return str(first[1]), int(first[2]), int(first[3]), (int(first[4]), int(first[5])), steps


def roll_back(journal_dir: str) -> list[str]:
    """Roll back the journal at ``journal_dir`` (written by an earlier, dead, process) onto its
    rootfs, if that rootfs is still the same one; the problems met. The journal is left for the
    caller to remove."""
    head = header(journal_dir)
    if head is None:
        return []
    path, dev, ino, root_times, steps = head
    try:
        root = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return [f"rootfs {path} is gone ({exc}): nothing to roll back"] if exc.errno != errno.ENOENT else []
    try:
        st = os.fstat(root)
        if (st.st_dev, st.st_ino) != (dev, ino):
            log.info("undo journal %s: %s is another file system now (the container is gone)",
                     journal_dir, path)
            return []
        jdir = os.open(journal_dir, DIR_FLAGS)
        try:
            saved = os.open(SAVED, DIR_FLAGS, dir_fd=jdir)
            try:
                with _open_journal(jdir) as f:
                    offsets = _change_offsets(f)
                    log.info("rolling back %d changes to %s (steps done: %s)", len(offsets), path,
                             ", ".join(steps) or "none")
                    problems = _undo_all(root, saved, f, offsets)
            finally:
                os.close(saved)
        finally:
            os.close(jdir)
        try:
            os.utime(root, ns=root_times)
        except OSError as exc:
            problems.append(f"root times: {exc}")
        return problems
    finally:
        os.close(root)


def rootfs_present(journal_dir: str) -> bool:
    """Whether the rootfs a journal changed is still there (same device and inode)."""
    try:
        head = header(journal_dir)
        if head is None:
            return False
        st = os.stat(head[0])
    except (OSError, ValueError, TypeError, OverlayError):
        return False
    return (st.st_dev, st.st_ino) == (head[1], head[2])


def discard(journal_dir: str) -> None:
    shutil.rmtree(journal_dir, ignore_errors=True)


def _open_journal(jdir: int) -> typing.BinaryIO:
    fd = os.open(JOURNAL, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=jdir)
    return open(fd, "rb", buffering=64 << 10)


def _undo_all(root: int, saved: int, f: typing.BinaryIO, offsets: array[int]) -> list[str]:
    problems: list[str] = []
    for offset in reversed(offsets):
        f.seek(offset)
        record: list[object] = ["?", "?"]
        try:
            record = json.loads(f.readline())
            _undo(root, saved, record)
        except (OSError, OverlayError, ValueError, TypeError, IndexError) as exc:
            problems.append(f"undo {record[0]} {record[1]!r}: {exc}")
    if problems:
        log.error("rollback incomplete: %s", "; ".join(problems[:20]))
    return problems


def _undo(root: int, saved: int, record: list[object]) -> None:
    kind, path = str(record[0]), str(record[1]).split("/")
    if kind == "meta":
        fd = open_dir(root, path, "/".join(path), missing_ok=True)
        if fd < 0:
            return
        try:
            Meta.from_json(_meta(record[2])).put(fd)
        finally:
            os.close(fd)
        return
    parent = open_dir(root, path[:-1], "/".join(path), missing_ok=True)
    if parent < 0:
        return  # never created, or removed with its parent already
    leaf = path[-1]
    try:
        if kind == "created":
            remove(parent, leaf)
        elif kind == "saved":
            _put_back(parent, leaf, saved, record)
        elif kind == "rmdir":
            st = lstat_at(parent, leaf)
            if st is not None and not stat.S_ISDIR(st.st_mode):
                remove(parent, leaf)
                st = None
            if st is None:
                os.mkdir(leaf, 0o700, dir_fd=parent)
            fd = os.open(leaf, DIR_FLAGS, dir_fd=parent)
            try:
                Meta.from_json(_meta(record[3])).put(fd)
            finally:
                os.close(fd)
        else:
            raise OverlayError(f"unknown record kind {kind!r}")
        atime_ns, mtime_ns = typing.cast("list[int]", record[2])  # as _record wrote it
        os.utime(parent, ns=(atime_ns, mtime_ns))
    finally:
        os.close(parent)


def _put_back(parent: int, leaf: str, saved: int, record: list[object]) -> None:
    n, fmt, meta, extra = str(record[3]), int(typing.cast(int, record[4])), \
        Meta.from_json(_meta(record[5])), record[6]
    if fmt == stat.S_IFREG:
        try:
            src = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=saved)
        except FileNotFoundError:
            return  # killed before the copy was complete: the original was never removed
        try:
            remove(parent, leaf)
            dst = os.open(leaf, _CREATE, 0o600, dir_fd=parent)
            try:
                copy_sparse(src, dst, os.fstat(src).st_size, f"put back {leaf!r}")
                meta.put(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return
    remove(parent, leaf)
    if fmt == stat.S_IFLNK:
        os.symlink(str(extra), leaf, dir_fd=parent)
    else:
        os.mknod(leaf, fmt | 0o600, int(typing.cast(int, extra)), dir_fd=parent)
    where = f"/proc/self/fd/{parent}/{leaf}"
    os.chown(leaf, meta.uid, meta.gid, dir_fd=parent, follow_symlinks=False)
    if fmt != stat.S_IFLNK:
        os.chmod(where, meta.mode)  # not a symlink: we just made it
    for name, value in meta.xattrs.items():
        os.setxattr(where, name, bytes.fromhex(value), follow_symlinks=False)
    os.utime(leaf, ns=(meta.atime_ns, meta.mtime_ns), dir_fd=parent, follow_symlinks=False)


def _meta(field: object) -> dict[str, typing.Any]:
    """A journal record's metadata object (written by ``Meta.to_json``)."""
    if not isinstance(field, dict):
        raise OverlayError(f"undo journal: metadata is {type(field).__name__}, not an object")
    return field
