"""runtime.fs.openat2.open_beneath: the kernel's openat2 and the component walk used on kernels
without it must agree, case by case, on what they follow and what they refuse."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.fs import openat2


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    if request.param == "walk":
        monkeypatch.setattr(openat2, "_have_openat2", False)
    else:
        root = os.open("/", os.O_PATH)
        try:
            os.close(openat2.openat2(root, ".", os.O_PATH, openat2.RESOLVE_BENEATH))
        except OSError as exc:
            if exc.errno == errno.ENOSYS:
                pytest.skip("this kernel has no openat2")
            raise
        finally:
            os.close(root)
    return request.param


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """base/ is the directory we resolve beneath; outside/ is next to it."""
    base, outside = tmp_path / "base", tmp_path / "outside"
    (base / "sub" / "deeper").mkdir(parents=True)
    outside.mkdir()
    (base / "file").write_bytes(b"in")
    (base / "sub" / "deeper" / "file").write_bytes(b"deep")
    (outside / "secret").write_bytes(b"out")
    links = {
        "rel": "file",
        "via-dir": "sub/deeper/file",
        "up-and-back": "sub/../file",
        "dir-link": "sub",
        "chain": "rel",
        "dangling": "nothing-here",
        "abs-outside": str(outside / "secret"),
        "abs-inside": str(base / "file"),  # absolute, so refused even though it lands inside
        "dotdot-outside": "../outside/secret",
        "dotdot-deep": "sub/../../outside/secret",
        "loop-a": "loop-b",
        "loop-b": "loop-a",
    }
    for name, target in links.items():
        (base / name).symlink_to(target)
    (base / "sub" / "up").symlink_to("../file")
    (base / "sub" / "escape").symlink_to("../../outside/secret")
    return base


OK = [
    ("file", b"in"),
    ("rel", b"in"),
    ("via-dir", b"deep"),
    ("up-and-back", b"in"),
    ("dir-link/deeper/file", b"deep"),
    ("chain", b"in"),
    ("sub/up", b"in"),
    ("sub/../file", b"in"),
    ("./sub/./deeper//file", b"deep"),
]

REFUSED = [
    ("abs-outside", errno.EXDEV),
    ("abs-inside", errno.EXDEV),
    ("dotdot-outside", errno.EXDEV),
    ("dotdot-deep", errno.EXDEV),
    ("sub/escape", errno.EXDEV),
    ("../outside/secret", errno.EXDEV),
    ("loop-a", errno.ELOOP),
    ("dangling", errno.ENOENT),
    ("missing", errno.ENOENT),
    ("file/x", errno.ENOTDIR),
]


def _read(dfd: int, path: str) -> bytes:
    fd = openat2.open_beneath(dfd, path, os.O_RDONLY)
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


@pytest.fixture
def dfd(tree: Path) -> Iterator[int]:
    """An fd of the directory resolved beneath."""
    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("path,content", OK, ids=[p for p, _ in OK])
def test_follows_links_that_stay_beneath(dfd, resolver, path, content):
    assert _read(dfd, path) == content


@pytest.mark.parametrize("path,err", REFUSED, ids=[p for p, _ in REFUSED])
def test_refuses_what_leaves_the_directory(dfd, resolver, path, err):
    with pytest.raises(OSError) as exc:
        _read(dfd, path)
    assert exc.value.errno == err, exc.value


def test_fds_are_close_on_exec(dfd, resolver):
    fd = openat2.open_beneath(dfd, "via-dir", os.O_RDONLY)
    try:
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)


def test_walk_leaks_no_fds(dfd, monkeypatch):
    monkeypatch.setattr(openat2, "_have_openat2", False)
    before = len(os.listdir("/proc/self/fd"))
    for path, _ in OK:
        os.close(openat2.open_beneath(dfd, path, os.O_RDONLY))
    for path, _ in REFUSED:
        with pytest.raises(OSError):
            openat2.open_beneath(dfd, path, os.O_RDONLY)
    assert len(os.listdir("/proc/self/fd")) == before


def test_enosys_switches_to_the_walk(dfd, monkeypatch):
    def no_openat2(*args, **kwargs):
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(openat2, "openat2", no_openat2)
    monkeypatch.setattr(openat2, "_have_openat2", True)
    assert _read(dfd, "via-dir") == b"deep"
    assert openat2._have_openat2 is False
    with pytest.raises(OSError) as exc:
        _read(dfd, "abs-outside")
    assert exc.value.errno == errno.EXDEV
