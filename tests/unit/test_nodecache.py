"""runtime.pages.nodecache pieces that need no restore (the cache through the plugin:
tests/e2e/test_node_cache.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from runtime.pages import nodecache
from runtime.pages.mapping import MapMode

CG = "/sys/fs/cgroup/memory"


@pytest.mark.skipif(not os.access(CG, os.W_OK), reason="needs a writable cgroup v1 memory controller (root)")
def test_the_memory_limit_read_is_the_callers_cgroups() -> None:
    path = os.path.join(CG, f"rekindle-test-{os.getpid()}")
    os.mkdir(path)
    try:
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(512 << 20))
        code = "from runtime.pages.nodecache import cgroup_memory; print(cgroup_memory()[0])"
        out = subprocess.run(["sh", "-c", f'echo $$ > {path}/cgroup.procs && exec {sys.executable} -c "{code}"'],
                             capture_output=True, text=True, check=True, cwd=os.getcwd()).stdout
        assert int(out) == 512 << 20
    finally:
        os.rmdir(path)
    assert nodecache.cgroup_memory() is None or nodecache.cgroup_memory()[0] != 512 << 20  # type: ignore[index]


def test_an_entry_key_names_the_version_and_the_map_mode() -> None:
    a, b = "a" * 64, "b" * 64
    keys = {nodecache.entry_key(m, mode) for m in (a, b) for mode in MapMode}
    assert len(keys) == 6 and all(len(k) == 32 for k in keys)


def test_a_missing_cache_holds_nothing_and_lists_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cache = nodecache.NodeCache(str(tmp_path / "cache"), 1 << 30)
    assert cache.entries() == [] and cache.sweep() == 0
    assert not cache.has("a" * 64, MapMode.DRIVER)
    assert not nodecache.NodeCache(str(tmp_path / "off"), 0).enabled


class _Statvfs:
    f_frsize = 4096

    def __init__(self, blocks: int, free: int, avail: int) -> None:
        self.f_blocks, self.f_bfree, self.f_bavail = blocks, free, avail


@pytest.mark.parametrize("avail_gib, need_gib, fits", [(79, 1, True), (20, 1, True), (4, 1, True), (3, 1, False), (5, 6, False)])
def test_on_disk_an_entry_must_leave_a_tenth_of_what_df_counts_free(monkeypatch, tmp_path, avail_gib, need_gib,
                                                                    fits) -> None:  # type: ignore[no-untyped-def]
    # a host that reserves most of a 252 GiB disk away from us: df shows 24 GiB used plus what is
    # available; a tenth of the 252 GiB the filesystem counts would refuse every entry at 20 GiB free
    gib = (1 << 30) // 4096
    st = _Statvfs(blocks=252 * gib, free=228 * gib, avail=avail_gib * gib)
    monkeypatch.setattr(nodecache, "fs_magic", lambda path: 0xEF53)
    monkeypatch.setattr(nodecache.os, "statvfs", lambda path: st)
    cache = nodecache.NodeCache(str(tmp_path / "cache"), 1 << 40)
    assert (cache._fits(need_gib << 30) is None) is fits
