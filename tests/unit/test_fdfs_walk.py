"""Walks and removal of trees other writers share: iterative, bounded, no symlink followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.errors import TreeTooLarge
from runtime.fs import fdfs
from tests.unit.test_store_gc import _no_deep_trees_left, deep_tree  # noqa: F401 - the fixture


def _dir_fd(path: Path) -> int:
    return os.open(path, fdfs.DIR_FLAGS)


def test_walk_files_lists_in_name_order_and_never_follows_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("s")
    t = tmp_path / "t"
    (t / "b" / "c").mkdir(parents=True)
    for rel in ("a", "b/x", "b/c/y", "z"):
        (t / rel).write_text(rel)
    (t / "b" / "link").symlink_to(tmp_path / "outside")
    fd = _dir_fd(t)
    try:
        assert list(fdfs.walk_files(fd)) == ["a", "b/c/y", "b/link", "b/x", "z"]
        assert list(fdfs.walk_files(fd, "p/")) == ["p/a", "p/b/c/y", "p/b/link", "p/b/x", "p/z"]
    finally:
        os.close(fd)


def test_walk_files_stops_at_its_bounds(tmp_path: Path) -> None:
    deep_tree(tmp_path / "deep", depth=1500)
    (tmp_path / "wide").mkdir()
    for i in range(50):
        (tmp_path / "wide" / f"f{i}").write_text("")
    fds_before = len(os.listdir("/proc/self/fd"))
    fd = _dir_fd(tmp_path / "deep")
    try:
        with pytest.raises(TreeTooLarge, match="deeper than 64 directories"):
            list(fdfs.walk_files(fd))  # the recursive walk: RecursionError
        with pytest.raises(TreeTooLarge, match="deeper than 3"):
            list(fdfs.walk_files(fd, max_depth=3))
        assert len(list(fdfs.walk_files(fd, max_depth=1500))) == 15  # a file every 100 levels
    finally:
        os.close(fd)
    fd = _dir_fd(tmp_path / "wide")
    try:
        with pytest.raises(TreeTooLarge, match="more than 10 entries"):
            list(fdfs.walk_files(fd, max_entries=10))
        assert len(list(fdfs.walk_files(fd, max_entries=50))) == 50
    finally:
        os.close(fd)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # every fd of the walks closed


def test_remove_tree_removes_any_depth_with_few_fds_and_no_symlink_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    deep_tree(tmp_path / "t", depth=1500, outside=outside)
    (tmp_path / "t" / "link-to-dir").symlink_to(outside, target_is_directory=True)
    parent = _dir_fd(tmp_path)
    try:
        fdfs.remove_tree(parent, "t", max_depth=4)  # deeper subtrees moved up, then removed
        assert sorted(os.listdir(tmp_path)) == ["outside"]
        assert (outside / "keep").read_text() == "k"
        (tmp_path / "file").write_text("f")
        (tmp_path / "sym").symlink_to(outside)
        fdfs.remove_tree(parent, "file")
        fdfs.remove_tree(parent, "sym")  # the link, not what it points to
        fdfs.remove_tree(parent, "absent")
        assert sorted(os.listdir(tmp_path)) == ["outside"] and (outside / "keep").exists()
    finally:
        os.close(parent)


def test_remove_tree_stops_after_its_entry_budget_and_a_later_call_goes_on(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / "t" / f"d{i}").mkdir(parents=True)
        (tmp_path / "t" / f"d{i}" / "f").write_text("")
    parent = _dir_fd(tmp_path)
    try:
        with pytest.raises(TreeTooLarge, match="more than 20 entries"):
            fdfs.remove_tree(parent, "t", max_entries=20)
        assert (tmp_path / "t").is_dir()
        fdfs.remove_tree(parent, "t")
        assert not (tmp_path / "t").exists()
    finally:
        os.close(parent)


def test_remove_tree_path(tmp_path: Path) -> None:
    deep_tree(tmp_path / "logs" / "restore-1" / "private", depth=300)
    fdfs.remove_tree_path(tmp_path / "logs" / "restore-1" / "private")
    assert os.listdir(tmp_path / "logs" / "restore-1") == []
    fdfs.remove_tree_path(tmp_path / "missing" / "x")
