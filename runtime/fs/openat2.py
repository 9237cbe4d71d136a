"""Open a path beneath a directory fd without ever leaving that directory.

Contract:

- :func:`open_beneath` ``(dir_fd, path, flags) -> fd`` opens ``path`` relative to ``dir_fd``,
  following symlinks only while they stay beneath the directory. It uses Linux's openat2
  (syscall 437, ``RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS``); on kernels without it (< 5.6,
  ``ENOSYS``) it walks the path one component at a time with the same rules. Either way the
  errors are the kernel's: ``EXDEV`` for an absolute path, an absolute symlink or a ``..`` that
  would leave the directory; ``ELOOP`` for more than 40 symlinks; ``ENOENT``/``ENOTDIR`` as
  usual. A /proc magic link is refused too (openat2: ``ELOOP``; the walk reads its target as
  text, which is absolute or names nothing: ``EXDEV`` or ``ENOENT``). ``O_CLOEXEC`` is always added. ``EAGAIN`` (the kernel saw a
  concurrent rename, as kubelet's atomic Secret updates do) is retried a few times.
- :func:`openat2` is the raw call (ctypes, errno as ``OSError``).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections import deque

from runtime import libc

SYS_OPENAT2 = 437  # the same number on every Linux architecture (added after the syscall table merge)

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

MAX_SYMLINKS = 40  # the kernel's limit (MAXSYMLINKS)
_EAGAIN_RETRIES = 8


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_have_openat2 = True  # cleared the first time the kernel answers ENOSYS


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """The openat2 system call; raises OSError(errno) on failure."""
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    syscall = libc.function("syscall")
    fd = syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(path)),
                 ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        raise libc.error("", path)
    return int(fd)


def open_beneath(dir_fd: int, path: str, flags: int) -> int:
    """Open ``path`` relative to ``dir_fd``, never resolving outside that directory."""
    global _have_openat2
    if _have_openat2:
        for _ in range(_EAGAIN_RETRIES):
            try:
                return openat2(dir_fd, path, flags, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
            except OSError as exc:
                if exc.errno == errno.ENOSYS:
                    _have_openat2 = False
                    break
                if exc.errno != errno.EAGAIN:
                    raise
        else:
            raise OSError(errno.EAGAIN, "path kept changing while being resolved", path)
    return _walk_beneath(dir_fd, path, flags)


def _split(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


def _walk_beneath(dir_fd: int, path: str, flags: int) -> int:
    """What openat2 RESOLVE_BENEATH does, one component at a time (kernels before 5.6).

    Each directory on the way is held open (O_PATH|O_NOFOLLOW), so a rename cannot move the
    walk elsewhere; a symlink is read with readlinkat and its target walked in its place; the
    last component is opened with O_NOFOLLOW, so a symlink swapped in after the check is not
    followed.
    """
    if path.startswith("/"):
        raise OSError(errno.EXDEV, "absolute path refused", path)
    todo = deque(_split(path))
    held: list[int] = []  # fds of the directories descended into, innermost last
    links = 0
    try:
        while todo:
            name = todo.popleft()
            here = held[-1] if held else dir_fd
            if name == "..":
                if not held:
                    raise OSError(errno.EXDEV, "'..' leads outside the directory", path)
                os.close(held.pop())
                continue
            try:
                target: str | None = os.readlink(name, dir_fd=here)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: not a symlink
                    raise OSError(exc.errno, exc.strerror, path) from None
                target = None
            if target is not None:
                links += 1
                if links > MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, "too many levels of symbolic links", path)
                if target.startswith("/"):
                    raise OSError(errno.EXDEV, f"symlink {name} -> {target} leads outside the directory", path)
                todo.extendleft(reversed(_split(target)))
                continue
            if not todo:
                return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            held.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here))
        # the path named the directory itself (empty, ".", or "x/..")
        return os.open(".", flags | os.O_CLOEXEC, dir_fd=held[-1] if held else dir_fd)
    finally:
        for fd in held:
            os.close(fd)
