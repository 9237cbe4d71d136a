"""Device nodes created inside a container's mount namespace, from the host, by syscalls only.

A restore onto a GPU with another UUID needs the target's ``/dev/nvidiaN`` in the restored
process's /dev (CRIU rebuilds the *source's* /dev tmpfs). Nothing from the container runs for
that: no shell, no ``mknod`` binary of the tenant's image. The host opens the process's root
(``/proc/<pid>/root``, which procfs resolves into that mount namespace), resolves the node's
parent directory with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
relative to it, so no symlink the tenant planted is followed and nothing outside the container's
root can be reached, and calls mknodat there. An existing entry of another kind at the node's
name is refused, never replaced.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass

from runtime.errors import NamespaceError
from runtime.fs.openat2 import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2


@dataclass(frozen=True)
class CharDevice:
    path: str  # absolute, inside the container
    major: int
    minor: int
    mode: int = 0o666


def ensure_char_devices(host_pid: int, devices: list[CharDevice]) -> list[str]:
    """Create each missing device node in the mount namespace of ``host_pid``; returns the paths
    created. NamespaceError when one cannot be created safely."""
    created = []
    try:
        root = os.open(f"/proc/{host_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise NamespaceError(f"root of process {host_pid}: {exc}") from exc
    try:
        for dev in devices:
            parent, leaf = os.path.split(os.path.normpath(dev.path))
            if not os.path.isabs(dev.path) or leaf in ("", ".", ".."):
                raise NamespaceError(f"device path {dev.path!r} is not an absolute file path")
            try:
                pfd = openat2(root, parent.lstrip("/") or ".", os.O_PATH | os.O_DIRECTORY,
                              RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
            except OSError as exc:
                raise NamespaceError(f"pid {host_pid}: {parent}: {exc.strerror}") from exc
            try:
                if _ensure_one(pfd, leaf, dev):
                    created.append(dev.path)
            finally:
                os.close(pfd)
    finally:
        os.close(root)
    return created


def _ensure_one(pfd: int, leaf: str, dev: CharDevice) -> bool:
    rdev = os.makedev(dev.major, dev.minor)
    try:
        st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    if st is not None:
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == rdev:
            return False
        raise NamespaceError(f"{dev.path} exists and is not the char device {dev.major}:{dev.minor}")
    try:
        os.mknod(leaf, stat.S_IFCHR | (dev.mode & 0o777), rdev, dir_fd=pfd)
    except FileExistsError:
        return _ensure_one(pfd, leaf, dev)  # raced with another creator: check what is there now
    except OSError as exc:
        raise NamespaceError(f"mknod {dev.path}: {exc.strerror}") from exc
    # mknod applied our umask; set the mode through an O_PATH fd of the node just made (a
    # path-based chmod could follow a symlink swapped in meanwhile).
    fd = os.open(leaf, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev != rdev:
            raise NamespaceError(f"{dev.path} was replaced while being created")
        os.chmod(f"/proc/self/fd/{fd}", dev.mode & 0o777)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise NamespaceError(f"{dev.path} vanished while being created") from exc
        raise
    finally:
        os.close(fd)
    return True
