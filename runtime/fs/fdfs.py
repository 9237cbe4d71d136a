"""fd-relative file operations for a directory other writers share, and its locks.

Everything here works below a directory fd and never follows a symlink (``O_NOFOLLOW`` on every
component); reads are size-capped. The locks are open-file-description locks: per open file (two
readers in one process hold two locks) and honoured over NFS.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import struct
import time
from collections.abc import Iterator

from runtime import libc
from runtime.errors import ArtifactRejected, TreeTooLarge
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



# Bounds of a walk below a shared directory: trees Rekindle writes are 3 directories deep and
# hold at most what a 16 MiB manifest lists (about 100k files); anything past these was planted.
MAX_DEPTH = 64
MAX_ENTRIES = 1_000_000


def _listing(dir_fd: int, budget: list[int], max_entries: int) -> list[tuple[str, bool]]:
    """(name, is a directory) of each entry of ``dir_fd``, counted against ``budget[0]``."""
    out = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            budget[0] -= 1
            if budget[0] < 0:
                raise TreeTooLarge("entries", max_entries)
            out.append((entry.name, entry.is_dir(follow_symlinks=False)))
    return out


def walk_files(dir_fd: int, prefix: str = "", *, max_depth: int = MAX_DEPTH,
               max_entries: int = MAX_ENTRIES) -> Iterator[str]:
    """Relative paths of all non-directories below ``dir_fd``, in name order (a directory's
    files where its name sorts); never follows symlinks.

    Iterative, with one open fd per level: past ``max_depth`` directories, or ``max_entries``
    entries in all, it raises TreeTooLarge where it got to (a planted tree costs the walk no
    more than the bounds)."""
    budget = [max_entries]
    top = sorted(_listing(dir_fd, budget, max_entries), reverse=True)  # popped from the end
    stack: list[tuple[int, str, list[tuple[str, bool]]]] = [(dir_fd, prefix, top)]
    try:
        while stack:
            fd, rel, pending = stack[-1]
            if not pending:
                stack.pop()
                if stack:  # the caller's fd stays open
                    os.close(fd)
                continue
            name, is_dir = pending.pop()
            if not is_dir:
                yield rel + name
                continue
            if len(stack) > max_depth:
                raise TreeTooLarge("depth", max_depth)
            sub = os.open(name, DIR_FLAGS, dir_fd=fd)
            try:
                entries = sorted(_listing(sub, budget, max_entries), reverse=True)
            except BaseException:
                os.close(sub)
                raise
            stack.append((sub, rel + name + "/", entries))
    finally:
        for fd, _, _ in stack[1:]:
            os.close(fd)


def tree_bytes(dir_fd: int) -> int:
    total = 0
    for rel in walk_files(dir_fd):
        with contextlib.suppress(OSError):
            total += os.stat(rel, dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
    return total


_DEEP_PREFIX = ".rekindle-deep-"  # a subtree moved up by remove_tree


def remove_tree(parent_fd: int, name: str, *, max_depth: int = MAX_DEPTH,
                max_entries: int = MAX_ENTRIES) -> None:
    """Remove ``name`` below ``parent_fd`` and everything below it (shutil.rmtree recurses, and
    a planted tree deeper than the interpreter's stack made it raise RecursionError).

    Iterative, never follows a symlink (one is unlinked itself), and holds at most
    ``max_depth`` + 1 fds: a directory deeper than that is first moved up to the top of the tree
    being removed (a rename inside it) and removed from there. After ``max_entries`` entries it
    raises TreeTooLarge, the rest left for a later call; an entry that cannot be removed is
    skipped and the first such OSError raised once all else is gone."""
    try:
        top = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent_fd)  # a symlink or a file: itself, nothing behind it
        return
    budget = [max_entries]
    errors: list[OSError] = []
    # Per level: its fd, its name in the level above, its directories still to remove (empty:
    # list it again) and the names in it that could not be removed.
    stack: list[tuple[int, str, list[str], set[str]]] = [(top, name, [], set())]
    try:
        while stack:
            fd, own, pending, failed = stack[-1]
            if not pending:
                pending += _unlink_files(fd, failed, budget, max_entries, errors)
                if not pending:  # nothing left but what failed: this level is done
                    stack.pop()
                    os.close(fd)
                    above = stack[-1][0] if stack else parent_fd
                    if failed:  # cannot be empty: the level above leaves it too
                        if stack:
                            stack[-1][3].add(own)
                        continue
                    try:
                        os.rmdir(own, dir_fd=above)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        if exc.errno != errno.ENOTEMPTY or not stack:  # else: filled meanwhile, listed again
                            errors.append(exc)
                            if stack:
                                stack[-1][3].add(own)
                    continue
            child = pending.pop()
            if len(stack) > max_depth:
                moved = _DEEP_PREFIX + secrets.token_hex(8)
                try:
                    os.rename(child, moved, src_dir_fd=fd, dst_dir_fd=top)
                    stack[0][2].append(moved)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    errors.append(exc)
                    failed.add(child)
                continue
            try:
                sub = os.open(child, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # now a link or a file: itself
                    try:
                        os.unlink(child, dir_fd=fd)
                    except FileNotFoundError:
                        pass
                    except OSError as exc2:
                        errors.append(exc2)
                        failed.add(child)
                else:
                    errors.append(exc)
                    failed.add(child)
                continue
            stack.append((sub, child, [], set()))
    finally:
        for fd, _, _, _ in stack:
            os.close(fd)
    if errors:
        raise errors[0]


def _unlink_files(dir_fd: int, failed: set[str], budget: list[int], max_entries: int,
                  errors: list[OSError]) -> list[str]:
    """Unlink every non-directory of ``dir_fd`` (but ``failed``); its directories' names."""
    dirs = []
    for entry, is_dir in _listing(dir_fd, budget, max_entries):
        if entry in failed:
            continue
        if is_dir:
            dirs.append(entry)
            continue
        try:
            os.unlink(entry, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            dirs.append(entry)  # it became a directory meanwhile
        except OSError as exc:
            errors.append(exc)
            failed.add(entry)
    return dirs


def remove_tree_path(path: str | os.PathLike[str]) -> None:
    """:func:`remove_tree` of a path whose parent is trusted (a node-local directory)."""
    parent, name = os.path.split(os.path.normpath(os.fspath(path)))
    try:
        parent_fd = os.open(parent or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        remove_tree(parent_fd, name)
    finally:
        os.close(parent_fd)


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


def rename_noreplace(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> None:
    """Rename ``src`` below ``src_dir_fd`` to ``dst`` below ``dst_dir_fd``, failing (``EEXIST``)
    rather than replacing whatever sits at ``dst``. Neither name is followed if it is a symlink."""
    renameat2 = libc.function("renameat2")
    if renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), RENAME_NOREPLACE) != 0:
        raise libc.error("", dst)


def same_inode(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
