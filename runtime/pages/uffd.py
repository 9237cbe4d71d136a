"""userfaultfd through ctypes: the ioctls and event messages the streamed restore uses.

Only what ``runtime.pages.stream`` needs: the uffds come from ``criu restore --lazy-pages`` (opened
with O_NONBLOCK and the non-cooperative events FORK, REMAP, REMOVE and UNMAP), so this module
installs pages (``UFFDIO_COPY``, ``UFFDIO_ZEROPAGE``), wakes waiters (``UFFDIO_WAKE``) and
decodes events. For a range the restored process maps privately from a node-local tmpfs file
(``runtime.pages.mapping``) it registers the range in missing and minor mode on the process's
uffd (:func:`register`: any holder of a uffd may, the ranges are its process's) and later lets
it go (:func:`release`: unregistered, then woken, so the process's next touch maps the file's
page-cache pages, 2 MiB at a time on a ``huge=always`` tmpfs). :func:`probe` and
:func:`probe_minor` say whether the kernel offers what streaming needs; :func:`open_uffd` is
for probing and tests (a region of our own).
Every ioctl runs through ctypes, which drops the GIL: threads install in parallel.
The layout is the kernel's UAPI (linux/userfaultfd.h); the numbers are x86_64 and aarch64's.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime import libc

PAGE = os.sysconf("SC_PAGE_SIZE")

_UFFD_API = 0xAA
# Events
EVENT_PAGEFAULT = 0x12
EVENT_FORK = 0x13
EVENT_REMAP = 0x14
EVENT_REMOVE = 0x15
EVENT_UNMAP = 0x16
# Features (what CRIU asks for; the streamed restore needs all four)
FEATURE_EVENT_FORK = 1 << 1
FEATURE_EVENT_REMAP = 1 << 2
FEATURE_EVENT_REMOVE = 1 << 3
FEATURE_EVENT_UNMAP = 1 << 6
NEEDED_FEATURES = FEATURE_EVENT_FORK | FEATURE_EVENT_REMAP | FEATURE_EVENT_REMOVE | FEATURE_EVENT_UNMAP
FEATURE_NAMES = {FEATURE_EVENT_FORK: "EVENT_FORK", FEATURE_EVENT_REMAP: "EVENT_REMAP",
                 FEATURE_EVENT_REMOVE: "EVENT_REMOVE", FEATURE_EVENT_UNMAP: "EVENT_UNMAP"}
REGISTER_MODE_MISSING = 1
REGISTER_MODE_MINOR = 4  # a fault on a page already in the page cache (shmem, hugetlbfs) is ours too
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (_UFFD_API << 8) | nr


class _Range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Register(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class _Copy(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class _Zeropage(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("zeropage", ctypes.c_int64)]


class _Continue(ctypes.Structure):
    _fields_ = [("range", _Range), ("mode", ctypes.c_uint64), ("mapped", ctypes.c_int64)]


_READ, _WRITE = 2, 1
UFFDIO_REGISTER = _ioc(_READ | _WRITE, 0x00, ctypes.sizeof(_Register))
UFFDIO_UNREGISTER = _ioc(_READ, 0x01, ctypes.sizeof(_Range))
UFFDIO_WAKE = _ioc(_READ, 0x02, ctypes.sizeof(_Range))
UFFDIO_COPY = _ioc(_READ | _WRITE, 0x03, ctypes.sizeof(_Copy))
UFFDIO_ZEROPAGE = _ioc(_READ | _WRITE, 0x04, ctypes.sizeof(_Zeropage))
UFFDIO_CONTINUE = _ioc(_READ | _WRITE, 0x07, ctypes.sizeof(_Continue))
UFFDIO_API = _ioc(_READ | _WRITE, 0x3F, ctypes.sizeof(_Api))
_API_VERSION = 0xAA
MSG_SIZE = 32


def _call(fd: int, request: int, arg: ctypes.Structure) -> int:
    """0, or the errno of a failed ioctl."""
    if libc.function("ioctl")(fd, request, ctypes.addressof(arg)) == 0:
        return 0
    return libc.errno()


class Gone(Exception):
    """The range or the process behind the uffd is gone (unmapped, exited): nothing to install."""


class Exited(Gone):
    """The process behind the uffd exited (ESRCH: its address space is gone): nothing will
    ever be installed there again."""


class Changing(Exception):
    """The address space is changing (an event not read yet): retry after reading events."""


def _fill(fd: int, name: str, request: int, arg_of: Callable[[int, int], ctypes.Structure],
          done_of: Callable[[Any], int], start: int, length: int,
          on_hole: Callable[[int], object] | None = None) -> int:
    """The loop the filling ioctls share over ``start``+``length``: each call goes as far as the
    kernel lets it (``done_of(arg)`` bytes); a page already present is left as it is and skipped
    (EEXIST: served before, or written by the process or the kernel since: never overwritten);
    with ``on_hole``, a page the kernel has nothing for (EFAULT) is handed to it and skipped.
    Returns the bytes done; Gone (Exited: the process is gone), Changing or OSError otherwise
    (what was done before stays)."""
    installed = 0
    while length > 0:
        arg = arg_of(start, length)
        err = _call(fd, request, arg)
        done = max(0, done_of(arg))
        installed += done
        start, length = start + done, length - done
        if err in (0, errno.EINTR):
            continue
        if err == errno.EEXIST or (err == errno.EFAULT and on_hole is not None):
            if err == errno.EFAULT and on_hole is not None:
                on_hole(start)
            start, length = start + PAGE, length - PAGE
        elif err == errno.EAGAIN:
            if done:
                continue
            raise Changing()
        elif err == errno.ESRCH:
            raise Exited()
        elif err in (errno.ENOENT, errno.EFAULT):
            raise Gone()
        else:
            raise OSError(err, f"{name} {start:#x}+{length}: {os.strerror(err)}")
    return installed


def copy(fd: int, dst: int, src: int, length: int) -> int:
    """Install ``length`` bytes at our address ``src`` into ``dst`` (page-aligned), waking the
    waiters; a present page is left as it is (:func:`_fill`). Returns the bytes installed."""
    return _fill(fd, "UFFDIO_COPY", UFFDIO_COPY, lambda at, n: _Copy(at, src + (at - dst), n, 0, 0),
                 lambda arg: int(arg.copy), dst, length)


def zeropage(fd: int, start: int, length: int) -> int:
    """Map zero pages over what is missing in ``start``+``length`` (a hole: never written); the
    bytes mapped (a present page is left as it is, as :func:`copy` leaves it)."""
    return _fill(fd, "UFFDIO_ZEROPAGE", UFFDIO_ZEROPAGE, lambda at, n: _Zeropage(_Range(at, n), 0, 0),
                 lambda arg: int(arg.zeropage), start, length)


def map_cached(fd: int, start: int, length: int) -> int:
    """Map the page cache's pages of a range registered in minor mode (``UFFDIO_CONTINUE``: a
    private mapping gets them read-only, copied on write), waking the waiters; the range stays
    registered and its VMA whole, where an unregister splits it, under the mm's lock taken for
    writing. A page already present is left as it is; a hole in the file (no page in the cache)
    gets the zero page, as the kernel's own fault would read it. Returns the bytes mapped (holes
    not counted)."""
    return _fill(fd, "UFFDIO_CONTINUE", UFFDIO_CONTINUE, lambda at, n: _Continue(_Range(at, n), 0, 0),
                 lambda arg: int(arg.mapped), start, length, on_hole=lambda at: zeropage(fd, at, PAGE))


def wake(fd: int, start: int, length: int) -> None:
    err = _call(fd, UFFDIO_WAKE, _Range(start, length))
    if err not in (0, errno.ENOENT, errno.ESRCH):
        raise OSError(err, f"UFFDIO_WAKE {start:#x}+{length}: {os.strerror(err)}")


@dataclass(frozen=True)
class Event:
    kind: int
    address: int = 0  # PAGEFAULT: the faulting address
    flags: int = 0
    fd: int = -1      # FORK: the child's uffd (already in our fd table)
    start: int = 0    # REMOVE/UNMAP: [start, end); REMAP: from
    end: int = 0
    to: int = 0       # REMAP: the new address (len in end - start)


def decode(msg: bytes) -> Event:
    kind = msg[0]
    a, b, c = (int.from_bytes(msg[8 + 8 * i:16 + 8 * i], "little") for i in range(3))
    if kind == EVENT_PAGEFAULT:
        return Event(kind, address=b, flags=a)
    if kind == EVENT_FORK:
        return Event(kind, fd=a & 0xFFFFFFFF)
    if kind == EVENT_REMAP:
        return Event(kind, start=a, to=b, end=a + c)
    if kind in (EVENT_REMOVE, EVENT_UNMAP):
        return Event(kind, start=a, end=b)
    return Event(kind)


def read_events(fd: int, max_events: int = 64) -> list[Event]:
    """The events queued on ``fd`` (non-blocking: [] when none)."""
    try:
        raw = os.read(fd, MSG_SIZE * max_events)
    except BlockingIOError:
        return []
    return [decode(raw[i:i + MSG_SIZE]) for i in range(0, len(raw) - MSG_SIZE + 1, MSG_SIZE)]


def open_uffd(features: int = 0) -> int:
    """A new userfaultfd (O_CLOEXEC|O_NONBLOCK) with the API handshake done for ``features``;
    OSError when the kernel refuses (no userfaultfd, or a feature missing)."""
    if _SYS_USERFAULTFD is None:
        raise OSError(errno.ENOSYS, f"userfaultfd: unknown syscall number on {platform.machine()}")
    fd = libc.call("syscall", _SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK, what="userfaultfd")
    api = _Api(_API_VERSION, features, 0)
    err = _call(fd, UFFDIO_API, api)
    if err:
        os.close(fd)
        raise OSError(err, f"UFFDIO_API (features {features:#x}): {os.strerror(err)}")
    if api.features & features != features:
        os.close(fd)
        missing = [n for f, n in FEATURE_NAMES.items() if features & f and not api.features & f]
        raise OSError(errno.EOPNOTSUPP, f"userfaultfd lacks {', '.join(missing) or hex(features)}")
    return int(fd)


def register(fd: int, start: int, length: int, mode: int = REGISTER_MODE_MISSING) -> None:
    """Register ``start``+``length`` of the uffd's address space (ours, for tests and probing;
    or a restored process's, whose uffd CRIU handed over) in ``mode``; Gone when the process or
    the range is gone."""
    err = _call(fd, UFFDIO_REGISTER, _Register(_Range(start, length), mode, 0))
    if err in (errno.ESRCH, errno.ENOMEM):
        raise Gone()
    if err:
        raise OSError(err, f"UFFDIO_REGISTER {start:#x}+{length}: {os.strerror(err)}")


def release(fd: int, start: int, length: int) -> None:
    """Unregister ``start``+``length`` and wake whoever waits there: the process's faults in it
    are the kernel's own from now on. The kernel wakes waiters as it unregisters, but a fault
    that queues itself while the VMA is being changed can miss that wake (seen on 6.18: a
    thread left asleep in handle_userfault on a range no longer registered); the explicit wake
    after the unregister, which returns only once such a fault has queued, reaches it. Gone when
    the process or the range is gone (unmapped since)."""
    err = _call(fd, UFFDIO_UNREGISTER, _Range(start, length))
    if err in (errno.ESRCH, errno.ENOMEM):
        raise Gone()
    if err:
        raise OSError(err, f"UFFDIO_UNREGISTER {start:#x}+{length}: {os.strerror(err)}")
    wake(fd, start, length)


def probe_minor(directory: str) -> str | None:
    """None when a private mapping of a file in ``directory`` (the node cache's tmpfs) can be
    registered in missing and minor mode on a uffd opened as CRIU opens it, else why not."""
    if _SYS_USERFAULTFD is None:
        return f"userfaultfd: unknown syscall number on {platform.machine()}"
    try:
        fd = os.open(directory, os.O_RDWR | os.O_TMPFILE | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return f"no file in {directory}: {exc}"
    try:
        os.ftruncate(fd, PAGE)
        with mmap.mmap(fd, PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
            anchor = ctypes.c_char.from_buffer(m)
            start = ctypes.addressof(anchor)
            try:
                u = open_uffd(NEEDED_FEATURES)
            except OSError as exc:
                return str(exc)
            try:
                register(u, start, PAGE, REGISTER_MODE_MISSING | REGISTER_MODE_MINOR)
                release(u, start, PAGE)
            except (OSError, Gone) as exc:
                return f"a private file mapping in {directory} cannot be registered in minor mode: {exc}"
            finally:
                os.close(u)
                del anchor  # the mapping can close only once nothing holds its buffer
    except (OSError, ValueError, BufferError) as exc:
        return f"probing minor faults in {directory}: {exc}"
    finally:
        os.close(fd)
    return None


def probe() -> str | None:
    """None when this kernel serves what the streamed restore needs, else why not."""
    try:
        fd = open_uffd(NEEDED_FEATURES)
    except OSError as exc:
        return str(exc)
    os.close(fd)
    return None
