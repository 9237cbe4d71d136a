"""The store's sweep over planted trees: walked and removed without recursion, within bounds,
reported, and never stopped by one entry."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.proc.owner import OWNER, Owner
from runtime.store import gc as store_gc
from runtime.store.volume import ArtifactStore
from tests.unit.test_store import KEY, publish

DEPTH = 1500  # past the interpreter's recursion limit (1000)


def deep_tree(top: Path, depth: int = DEPTH, outside: Path | None = None) -> None:
    """``top/d/d/.../d`` ``depth`` levels deep, a file every 100 levels (and a symlink to
    ``outside``), made through dir fds (the path would pass PATH_MAX further down)."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(depth):
            os.mkdir("d", dir_fd=fd)
            if level % 100 == 99:
                os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
                if outside is not None:
                    os.symlink(outside, "out", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
    finally:
        os.close(fd)


@pytest.fixture(autouse=True)
def _no_deep_trees_left(tmp_path: Path) -> Iterator[None]:
    """pytest removes old temp dirs with shutil.rmtree, which recurses: a failed test must not
    leave a deep tree for it (rm does not recurse)."""
    yield
    subprocess.run(["rm", "-rf", "--one-file-system", "--", *map(str, tmp_path.iterdir())], check=True)


def staging(ns: Path, name: str, **owner: object) -> Path:
    d = ns / name
    d.mkdir()
    (d / "pages.img").write_bytes(b"x" * 4096)
    (d / OWNER).write_text(json.dumps({**dataclasses.asdict(Owner.me()), **owner}))
    return d


def test_a_1500_deep_tree_in_a_stale_staging_dir_is_reported_and_removed(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    version = publish(store)
    ns = version.parent
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the store's")
    planted = staging(ns, ".staging-qwen-7b-00000000000000aa", boot_id="another-boot")
    deep_tree(planted, outside=outside)
    dead = staging(ns, ".staging-qwen-7b-00000000000000bb", boot_id="another-boot")

    found = {x.entry: x for x in store_gc.leftovers(store)}  # the old walk: RecursionError here
    assert "deeper than" in found[planted.name].problem and found[planted.name].bytes == 0
    assert found[dead.name].problem == "" and found[dead.name].bytes >= 4096
    bad: list[store_gc.Leftover] = []
    removed = sorted(x.entry for x in store_gc.sweep(store, on_bad=bad.append))
    assert removed == [planted.name, dead.name]
    assert [x.entry for x in bad] == [planted.name]
    assert sorted(os.listdir(ns)) == [version.name, "qwen-7b"]
    assert (outside / "keep").read_text() == "not the store's"  # the symlinks were not followed
    with store.open("team-a", "qwen-7b", KEY) as art:
        art.verify_files()


def test_a_deep_tree_in_a_version_being_read_waits_for_its_reader(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    old = publish(store, files={"f": b"old"})
    with store.open("team-a", "qwen-7b", KEY):
        new = publish(store, files={"f": b"new"})
        deep_tree(old / "planted")
        [left] = store_gc.leftovers(store)
        assert left.kind == "unreferenced-version" and "deeper than" in left.problem
        assert store_gc.sweep(store, grace=0) == []  # read: kept
    trash = tmp_path / "team-a" / ".trash-planted-0000"
    deep_tree(trash, depth=1100)
    assert sorted(x.entry for x in store_gc.sweep(store, grace=0)) == [trash.name, old.name]
    assert sorted(os.listdir(tmp_path / "team-a")) == [new.name, "qwen-7b"]


def test_an_owner_record_nested_too_deep_is_no_owner(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    d = tmp_path / "team-a" / ".staging-qwen-7b-00000000000000cc"
    d.mkdir()
    (d / OWNER).write_text("[" * 4096)  # json.loads recursed on it: RecursionError
    [left] = store_gc.leftovers(store)
    assert left.entry == d.name and left.owner is None


def test_one_entry_that_cannot_be_removed_stops_no_other(tmp_path: Path, monkeypatch) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    ns = tmp_path / "team-a"
    first = staging(ns, ".staging-qwen-7b-00000000000000a1", boot_id="another-boot")
    second = staging(ns, ".staging-qwen-7b-00000000000000a2", boot_id="another-boot")
    real = store_gc.remove_tree

    def remove_tree(parent_fd: int, name: str) -> None:
        if name == first.name:
            raise PermissionError(1, "Operation not permitted")
        real(parent_fd, name)

    monkeypatch.setattr(store_gc, "remove_tree", remove_tree)
    assert [x.entry for x in store_gc.sweep(store)] == [second.name]
    assert first.is_dir() and not second.exists()
