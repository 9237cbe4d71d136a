"""The one C library table (runtime.libc): signatures applied once, -1 raised as OSError."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

import pytest

from runtime import libc


def test_each_function_is_declared_once_and_shared() -> None:
    fn = libc.function("renameat2")
    assert fn is libc.function("renameat2")
    assert fn.argtypes == libc.SIGNATURES["renameat2"][0]
    assert fn.restype is ctypes.c_int
    assert libc.function("syscall").restype is ctypes.c_long


def test_an_undeclared_function_is_refused() -> None:
    with pytest.raises(KeyError):
        libc.function("system")


def test_a_checked_call_returns_the_result(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        assert libc.call("sync_file_range", fd, 0, 0, 2) == 0
    finally:
        os.close(fd)


def test_a_checked_call_raises_the_errno() -> None:
    with pytest.raises(OSError) as caught:
        libc.call("setns", -1, 0, what="setns -1")
    assert caught.value.errno == errno.EBADF
    assert str(caught.value) == f"[Errno {errno.EBADF}] setns -1: {os.strerror(errno.EBADF)}"


def test_the_error_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("")
    (tmp_path / "b").write_text("")
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert libc.function("renameat2")(dir_fd, b"a", dir_fd, b"b", 1) == -1
        exc = libc.error("", "b")
    finally:
        os.close(dir_fd)
    assert (exc.errno, exc.strerror, exc.filename) == (errno.EEXIST, os.strerror(errno.EEXIST), "b")
