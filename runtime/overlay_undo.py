"""An undo journal for changes to a rootfs, so that a failed apply leaves the rootfs as it was.

:class:`Undo` is created on a rootfs directory fd. On the first entry it moves aside, it makes a
private backup directory at the rootfs root (``.rekindle-undo-<random>``, mode 0700, so on the
same file system as every entry it will hold); its records go to an anonymous temporary file. Each change is recorded BEFORE
it is made, so a change that fails half way is still undone:

- :meth:`move_aside` renames an existing entry (to be deleted or replaced) into the backup
  directory. overlayfs without ``redirect_dir`` refuses to rename a directory that has lower
  layers (EXDEV): such a directory is taken apart instead (its entries moved aside one by one,
  then it is removed and its owner, mode, xattrs and times recorded). On overlayfs a rename copies
  a lower-layer file up: deleting or replacing a large image file costs a copy of it.
- :meth:`created` records a path about to be created.
- :meth:`changed_meta` records an existing directory's owner, mode, xattrs and times before
  they are changed.

Every record also keeps the times of the parent directory it changes. :meth:`rollback` undoes the
records in reverse order (removes what was created, renames back what was moved aside, recreates
taken-apart directories, puts back metadata and parent times), then removes the backup directory
and puts back the root's times; it returns the problems it met (none when the rootfs is as it
was). :meth:`commit` removes the backup directory and its content. Memory: 8 bytes per record
(the records are in the temporary file). Paths are walked with :func:`open_dir`: no symlink is
ever followed, nothing outside the rootfs is touched. The journal lives in this process: an
apply killed half way leaves its changes and the backup directory behind.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import typing
import secrets
import shutil
import stat
import tempfile
from array import array

from runtime.errors import OverlayError
from runtime.overlay_fs import DIR_FLAGS, Meta, lstat_at, open_dir, remove, times

log = logging.getLogger(__name__)

BACKUP_PREFIX = ".rekindle-undo-"


class Undo:
    """The journal of one apply on the rootfs open as ``root``."""

    def __init__(self, root: int) -> None:
        self._root = root
        self._root_times = times(os.fstat(root))
        self.backup_name = BACKUP_PREFIX + secrets.token_hex(16)
        self._backup = -1  # made on the first move aside: an apply that only adds makes none
        self._log = tempfile.TemporaryFile()
        self._offsets = array("Q")

    def _backup_fd(self) -> int:
        if self._backup < 0:
            os.mkdir(self.backup_name, 0o700, dir_fd=self._root)
            self._backup = os.open(self.backup_name, DIR_FLAGS, dir_fd=self._root)
        return self._backup

    def __len__(self) -> int:
        return len(self._offsets)

    def _record(self, *fields: object) -> None:
        self._offsets.append(self._log.tell())
        self._log.write(json.dumps(fields).encode() + b"\n")

    def created(self, parent: int, path: list[str]) -> None:
        self._record("created", "/".join(path), times(os.fstat(parent)))

    def changed_meta(self, fd: int, path: list[str]) -> None:
        self._record("meta", "/".join(path), Meta.read(fd).to_json())

    def move_aside(self, parent: int, path: list[str]) -> bool:
        """Move the entry at ``path`` (in ``parent``) into the backup dir; False if there is none."""
        st = lstat_at(parent, path[-1])
        if st is None:
            return False
        backup = str(len(self._offsets))
        self._record("moved", "/".join(path), times(os.fstat(parent)), backup)
        try:
            os.rename(path[-1], backup, src_dir_fd=parent, dst_dir_fd=self._backup_fd())
        except OSError as exc:
            if exc.errno != errno.EXDEV or not stat.S_ISDIR(st.st_mode):
                raise
            self._take_apart(parent, path)
        return True

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

    def commit(self) -> None:
        made = self._backup >= 0
        root_times = times(os.fstat(self._root))
        self._close()
        if made:
            shutil.rmtree(self.backup_name, dir_fd=self._root)
            os.utime(self._root, ns=root_times)

    def rollback(self) -> list[str]:
        problems: list[str] = []
        self._log.flush()
        for offset in reversed(self._offsets):
            self._log.seek(offset)
            record = json.loads(self._log.readline())
            try:
                self._undo(record)
            except (OSError, OverlayError, ValueError, TypeError) as exc:
                problems.append(f"undo {record[0]} {record[1]!r}: {exc}")
        made = self._backup >= 0
        self._close()
        try:
            if made:
                os.rmdir(self.backup_name, dir_fd=self._root)
            os.utime(self._root, ns=self._root_times)
        except OSError as exc:
            problems.append(f"backup dir {self.backup_name} left in place: {exc}")
        if problems:
            log.error("rollback incomplete: %s", "; ".join(problems))
        return problems

    def _close(self) -> None:
        if self._backup >= 0:
            os.close(self._backup)
            self._backup = -1
        self._log.close()

    def _undo(self, record: list[object]) -> None:
        kind, path = str(record[0]), str(record[1]).split("/")
        if kind == "meta":
            fd = open_dir(self._root, path, "/".join(path))
            try:
                Meta.from_json(_meta(record[2])).put(fd)
            finally:
                os.close(fd)
            return
        parent = open_dir(self._root, path[:-1], "/".join(path), missing_ok=True)
        if parent < 0:
            return  # never created, or removed with its parent already
        try:
            if kind == "created":
                remove(parent, path[-1])
            elif kind == "moved":
                backup = str(record[3])
                if self._backup >= 0 and lstat_at(self._backup, backup) is not None:
                    remove(parent, path[-1])
                    os.rename(backup, path[-1], src_dir_fd=self._backup, dst_dir_fd=parent)
            elif kind == "rmdir":
                if lstat_at(parent, path[-1]) is None:
                    os.mkdir(path[-1], 0o700, dir_fd=parent)
                fd = os.open(path[-1], DIR_FLAGS, dir_fd=parent)
                try:
                    Meta.from_json(_meta(record[3])).put(fd)
                finally:
                    os.close(fd)
            atime_ns, mtime_ns = typing.cast("list[int]", record[2])  # as _record wrote it
            os.utime(parent, ns=(atime_ns, mtime_ns))
        finally:
            os.close(parent)


def _meta(field: object) -> dict[str, typing.Any]:
    """A journal record's metadata object (written by ``Meta.to_json`` in this process)."""
    if not isinstance(field, dict):
        raise OverlayError(f"undo journal: metadata is {type(field).__name__}, not an object")
    return field
