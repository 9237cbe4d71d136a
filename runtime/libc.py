"""The C library, loaded once, each function used here declared once.

Python has no wrapper for a few calls the engine needs (setns, renameat2, process_vm_writev,
sync_file_range, mount, mmap at a chosen address, and raw system calls such as openat2,
cachestat, pidfd_getfd, userfaultfd, ioprio_set). :func:`function` gives the one handle's
function with its :data:`SIGNATURES` applied (on first use: nothing is loaded at import), and
:func:`call` calls it and raises ``OSError(errno, strerror)`` on -1, as
:mod:`runtime.gpu.driver` raises on a failed CUresult. A caller that tells errors apart itself
(EINTR retried, ENOSYS remembered, a failure only logged) uses :func:`function` and
:func:`errno`.

``syscall`` and ``ioctl`` are variadic: only their result type is declared, and each caller
passes its arguments as ctypes values of the kernel's types where the default (C ``int``) is
not it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any


class Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


# name -> (argtypes, restype); argtypes None: variadic, arguments converted by the caller
SIGNATURES: dict[str, tuple[list[Any] | None, Any]] = {
    "syscall": (None, ctypes.c_long),
    "ioctl": ([ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p], ctypes.c_int),
    "setns": ([ctypes.c_int, ctypes.c_int], ctypes.c_int),
    "mount": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p], ctypes.c_int),
    "renameat2": ([ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint], ctypes.c_int),
    "mmap": ([ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long],
             ctypes.c_void_p),
    "munmap": ([ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
    "statfs": ([ctypes.c_char_p, ctypes.c_void_p], ctypes.c_int),
    "fallocate": ([ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int),
    "sync_file_range": ([ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int),
    "process_vm_writev": ([ctypes.c_int, ctypes.POINTER(Iovec), ctypes.c_ulong, ctypes.POINTER(Iovec),
                           ctypes.c_ulong, ctypes.c_ulong], ctypes.c_ssize_t),
    "ptrace": ([ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_long),
    "process_vm_readv": ([ctypes.c_int, ctypes.POINTER(Iovec), ctypes.c_ulong, ctypes.POINTER(Iovec),
                          ctypes.c_ulong, ctypes.c_ulong], ctypes.c_ssize_t),
}

MAP_FAILED = ctypes.c_void_p(-1).value

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_functions: dict[str, Any] = {}


def _load() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            _lib = ctypes.CDLL(None, use_errno=True)
        return _lib


def function(name: str) -> Any:
    """The C library's ``name`` with its signature applied (a KeyError for one not declared)."""
    fn = _functions.get(name)
    if fn is None:
        argtypes, restype = SIGNATURES[name]
        lib = _load()
        with _lock:  # declared once: the handle's function objects are shared by every caller
            fn = getattr(lib, name)
            if argtypes is not None:
                fn.argtypes = argtypes
            fn.restype = restype
            _functions[name] = fn
    return fn


def errno() -> int:
    """The errno the last call of this thread left (ctypes keeps a copy per thread)."""
    return ctypes.get_errno()


def call(name: str, *args: Any, what: str = "") -> int:
    """``name(*args)``; raises ``OSError(errno, "<what or name>: <strerror>")`` when it returns -1."""
    result = int(function(name)(*args))
    if result == -1:
        raise error(what or name)
    return result


def error(what: str, filename: str | None = None) -> OSError:
    """The OSError of the errno the last call left, its message ``what: strerror``."""
    err = ctypes.get_errno()
    message = f"{what}: {os.strerror(err)}" if what else os.strerror(err)
    return OSError(err, message, filename) if filename is not None else OSError(err, message)
