"""Add mount flags (ro, nosuid, nodev, noexec) and look up paths inside another mount namespace,
running nothing from it.

A mount's flags can only be changed from inside its mount namespace (the kernel checks that the
mount belongs to the caller's), and a multi-threaded Python process cannot ``setns()`` into one.
So :func:`adjust` starts a fresh host interpreter (``sys.executable -I -S``: no site, no user
paths, no PYTHON* variables) with :data:`_CHILD` as its program. The child imports all it
needs, joins the namespace through an fd the caller opened, ``lstat``s the paths it is asked
about, calls ``mount_setattr(2)`` (Linux >= 5.12; every other flag of the mount stays as it is)
on each path to change, and leaves with ``os._exit``: after ``setns`` its ``/`` is the restored
container's root, which the tenant controls, so nothing may be imported or read by path from
then on (``lstat`` reads no content). Final path components are not followed; mount points come
from the kernel's mountinfo, and the caller re-reads mountinfo afterwards to verify what was set.

Flags only ever get added (``attr_clr`` is 0): this cannot make a mount less restricted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

from runtime.errors import NamespaceError

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
ATTRS = {"ro": MOUNT_ATTR_RDONLY, "nosuid": MOUNT_ATTR_NOSUID, "nodev": MOUNT_ATTR_NODEV,
         "noexec": MOUNT_ATTR_NOEXEC}
TIMEOUT = 10.0

_CHILD = r"""
import ctypes, json, os, sys
def fail(msg):
    os.write(2, msg.encode("utf-8", "replace") + b"\n")
    os._exit(1)
try:
    fd, job = int(sys.argv[1]), json.loads(sys.argv[2])
    libc = ctypes.CDLL(None, use_errno=True)
    setns, syscall = libc.setns, libc.syscall
    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]
    NR_MOUNT_SETATTR, AT_FDCWD, AT_SYMLINK_NOFOLLOW, CLONE_NEWNS = 442, -100, 0x100, 0x20000
    ops = [(p.encode(), int(a)) for p, a in job["set"]]
    probes, found = [p.encode() for p in job["probe"]], []
    if setns(fd, CLONE_NEWNS) != 0:
        fail("setns: " + os.strerror(ctypes.get_errno()))
    # From here on "/" is the container's: no imports, no reads by path.
    for path in probes:
        try:
            os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            pass  # cannot tell: count it as there
        found.append(path.decode("utf-8", "surrogateescape"))
    for path, attrs in ops:
        attr = MountAttr(attrs, 0, 0, 0)
        rc = syscall(ctypes.c_long(NR_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(path),
                     ctypes.c_uint(AT_SYMLINK_NOFOLLOW), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
        if rc != 0:
            fail("mount_setattr " + path.decode("utf-8", "replace") + ": " + os.strerror(ctypes.get_errno()))
    os.write(1, json.dumps(found).encode())
    os._exit(0)
except BaseException as exc:  # no traceback: formatting one reads source files by path
    fail(type(exc).__name__ + ": " + str(exc))
"""


def adjust(pid: int, attrs: Mapping[str, int], probe: Sequence[str] = (), timeout: float = TIMEOUT) -> list[str]:
    """In ``pid``'s mount namespace: add ``attrs[path]`` (MOUNT_ATTR_* bits) to the mount at each
    path, and return which of the ``probe`` paths exist there (without following a final symlink)."""
    if not attrs and not probe:
        return []
    job = {"set": sorted(attrs.items()), "probe": list(probe)}
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        argv = [sys.executable, "-I", "-S", "-c", _CHILD, str(fd), json.dumps(job)]
        try:
            res = subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True, timeout=timeout,
                                 cwd="/", check=False)
        except subprocess.TimeoutExpired as e:
            raise NamespaceError(f"mount namespace of {pid}: child timed out") from e
    finally:
        os.close(fd)
    if res.returncode != 0:
        raise NamespaceError(f"mount namespace of {pid}: {res.stderr.strip()}")
    try:
        found = json.loads(res.stdout)
    except ValueError as e:
        raise NamespaceError(f"mount namespace of {pid}: child said {res.stdout[:200]!r}") from e
    return [str(p) for p in found]
