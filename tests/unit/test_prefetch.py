"""Prefetch reads an artifact's files through the store, bounded and cancellable."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from nri_plugin.prefetch import Prefetcher
from runtime.fs import holes
from runtime.fs.pagecache import is_cached
from runtime.housekeeping import rotate_logs
from runtime.store import readahead
from runtime.store.readahead import warm
from runtime.store.volume import ArtifactStore
from tests.unit.test_store import KEY, publish
from tests.waiting import wait_for


def test_warm_reads_every_file_once(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"bulk/pages-1.bulk": b"p" * (9 << 20), "plan": b"x"})
    with store.open("team-a", "qwen-7b", KEY) as art:
        got = warm(art, threading.Event(), threads=2, budget=1 << 30)
    assert got.bytes == (9 << 20) + 1 and not got.skipped


def test_warm_reads_and_counts_no_hole(tmp_path: Path) -> None:
    """What CRIU keeps is punched out of a bulk file: a prefetch neither reads it into the page
    cache nor counts it against its budget."""
    store = ArtifactStore(str(tmp_path))
    version = publish(store, files={"bulk/pages-1.bulk": b"p" * (9 << 20), "plan": b"x"})
    bulk = version / "bulk/pages-1.bulk"
    bulk.chmod(0o600)
    fd = os.open(bulk, os.O_RDWR)
    try:
        assert holes.punch(fd, [(2 << 20, 6 << 20)]) == [(2 << 20, 6 << 20)]
    finally:
        os.close(fd)
    with store.open("team-a", "qwen-7b", KEY) as art:
        assert "budget" not in warm(art, threading.Event(), budget=(3 << 20) + 1).skipped
        got = warm(art, threading.Event(), threads=2, budget=1 << 30)
    assert got.bytes == (3 << 20) + 1 and not got.skipped


def test_warm_skips_what_does_not_fit_and_stops_when_cancelled(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"bulk/pages-1.bulk": b"p" * (9 << 20)})
    with store.open("team-a", "qwen-7b", KEY) as art:
        assert "budget" in warm(art, threading.Event(), budget=1 << 20).skipped
        cancel = threading.Event()
        cancel.set()
        assert warm(art, cancel, budget=1 << 30).bytes == 0


def test_prefetcher_starts_only_for_valid_restore_annotations(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"f": b"1" * 4096})
    p = Prefetcher(store, KEY, threads=1)
    try:
        assert not p.start("uid-1", "team-a", {})
        assert not p.start("uid-2", "team-a", {"rekindle.dev/restore": "../x"})
        assert not p.start("uid-3", "Team_A", {"rekindle.dev/restore": "qwen-7b"})
        assert p.start("uid-4", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        assert p.start("uid-5", "team-a", {"rekindle.dev/restore": "missing"})  # logged, harmless
        wait_for(lambda: p.running() == 0, 5, "every prefetch to end")
    finally:
        p.shutdown()


def test_warm_keeps_the_disk_queue_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never more than ``threads`` reads of at most CHUNK at once: a pod starting beside the
    prefetch reads from the same disk, behind whatever is queued."""
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"bulk/pages-1.bulk": b"p" * (9 * readahead.CHUNK), "plan": b"x"})
    lock, now, most, sizes, offsets = threading.Lock(), [0], [0], [], []
    real = os.preadv

    def preadv(fd: int, bufs: list[memoryview], off: int) -> int:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            sizes.append(sum(len(b) for b in bufs))
            offsets.append(off)
        time.sleep(0.01)  # long enough for the other threads to pile up, if they could
        try:
            return real(fd, bufs, off)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(readahead, "is_cached", lambda *_: False)  # as if the page cache were cold
    monkeypatch.setattr(readahead.os, "preadv", preadv)
    with store.open("team-a", "qwen-7b", KEY) as art:
        got = warm(art, threading.Event(), threads=3, budget=1 << 30)
    assert got.bytes == 9 * readahead.CHUNK + 1
    assert most[0] <= 3 and max(sizes) <= readahead.CHUNK
    bulk = sorted(o for o, n in zip(offsets, sizes) if n == readahead.CHUNK)
    assert bulk == [i * readahead.CHUNK for i in range(9)]  # each chunk once


FILES = {"bulk/pages-1.bulk": b"p" * (3 << 20), "criu/core-1.img": b"core", "restore-plan.json": b"{}"}


def _staged_prefetcher(tmp_path: Path) -> tuple[ArtifactStore, Prefetcher, Path]:
    store = ArtifactStore(str(tmp_path / "store"))
    publish(store, files=FILES)
    logs = tmp_path / "logs"
    return store, Prefetcher(store, KEY, threads=1, staging_dir=str(logs)), logs


def test_staged_copy_is_taken_by_the_restore_of_the_same_version(tmp_path: Path) -> None:
    store, p, logs = _staged_prefetcher(tmp_path)
    try:
        assert p.start("uid-1", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        with store.open("team-a", "qwen-7b", KEY) as art:
            work = p.take("uid-1", art)
        assert work is not None
        private = Path(work) / "private"
        assert (private / "criu" / "core-1.img").read_bytes() == b"core"
        assert (private / "restore-plan.json").read_bytes() == b"{}"
        assert not (private / "bulk").exists()  # the fill reads the bulk pages itself, verified
        assert os.stat(private).st_mode & 0o077 == 0
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert p.take("uid-1", art) is None  # taken once
    finally:
        p.shutdown()


def test_staged_copy_of_a_replaced_version_is_not_taken(tmp_path: Path) -> None:
    store, p, logs = _staged_prefetcher(tmp_path)
    try:
        assert p.start("uid-1", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        publish(store, files={**FILES, "criu/core-1.img": b"other"}, generation=2)  # republished
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert p.take("uid-1", art) is None
        assert not list(logs.glob("restore-staged-*/private"))  # the stale copy is gone
    finally:
        p.shutdown()


def test_staging_waits_its_turn_and_a_pod_gone_leaves_nothing(tmp_path: Path) -> None:
    store, p, logs = _staged_prefetcher(tmp_path)
    try:
        assert p.start("uid-1", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        assert list(logs.glob("restore-staged-*/private"))
        assert rotate_logs(logs, keep=0, max_age=0, busy=0) == []  # its restore may still come
        p.cancel("uid-1")  # StopPodSandbox
        wait_for(lambda: not list(logs.glob("restore-staged-*")), 10, "the staged copy to be removed")
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert p.take("uid-1", art) is None
    finally:
        p.shutdown()


def test_a_restore_that_comes_first_stages_itself(tmp_path: Path) -> None:
    store, p, logs = _staged_prefetcher(tmp_path)
    gate = threading.Event()
    for _ in range(p.max_running):  # the prefetcher's pool is busy with other pods' prefetches
        p._pool.submit(gate.wait, 10)
    p._active = p.max_running
    try:
        assert p.start("uid-1", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        with store.open("team-a", "qwen-7b", KEY) as art:
            t0 = time.monotonic()
            assert p.take("uid-1", art) is None  # queued behind other pods: not waited for
            assert time.monotonic() - t0 < 1.0
        p._active = 0
        gate.set()
        wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        assert not list(logs.glob("restore-staged-*"))  # claimed before it began: never staged
    finally:
        p.shutdown()


def test_warm_does_not_read_what_is_cached(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"bulk/pages-1.bulk": os.urandom(4 << 20)})
    with store.open("team-a", "qwen-7b", KEY) as art:
        fd = art.open_file("bulk/pages-1.bulk")
        try:
            os.pread(fd, 4 << 20, 0)
            cached = is_cached(fd, 0, 4 << 20)
        finally:
            os.close(fd)
        got = warm(art, threading.Event(), threads=1, budget=1 << 30)
    assert got.bytes == 4 << 20
    if tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 5):  # cachestat
        assert cached and got.cached == 4 << 20


def test_a_restore_right_after_the_sandbox_waits_for_the_staging_to_begin(tmp_path: Path) -> None:
    store, p, logs = _staged_prefetcher(tmp_path)
    try:
        assert p.start("uid-1", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        with store.open("team-a", "qwen-7b", KEY) as art:
            work = p.take("uid-1", art)  # at once: the prefetch had no time to begin
        assert work is not None and (Path(work) / "private" / "criu" / "core-1.img").read_bytes() == b"core"
    finally:
        p.shutdown()


def test_staged_copies_waiting_on_the_node_are_bounded(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    publish(store, files=FILES)
    logs = tmp_path / "logs"
    p = Prefetcher(store, KEY, threads=1, staging_dir=str(logs), max_staged=2)
    try:
        for uid in ("uid-1", "uid-2", "uid-3"):  # pods whose containers never start
            assert p.start(uid, "team-a", {"rekindle.dev/restore": "qwen-7b"})
            wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        assert len(list(logs.glob("restore-staged-*/private"))) == 2
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert p.take("uid-3", art) is None  # over the bound: its restore stages itself
            assert p.take("uid-1", art) is not None
        assert p.start("uid-4", "team-a", {"rekindle.dev/restore": "qwen-7b"})  # room again
        wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert p.take("uid-4", art) is not None
    finally:
        p.shutdown()
    small = Prefetcher(store, KEY, threads=1, staging_dir=str(tmp_path / "logs2"), max_staged_bytes=5)
    try:
        assert small.start("uid-1", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        wait_for(lambda: small.running() == 0, 10, "the prefetch to end")
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert small.take("uid-1", art) is None  # larger than the byte bound: not staged
    finally:
        small.shutdown()


def test_one_namespace_takes_no_more_than_its_share_of_the_staged_copies(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    publish(store, files=FILES)
    publish(store, namespace="team-b", files=FILES)
    logs = tmp_path / "logs"
    p = Prefetcher(store, KEY, threads=1, staging_dir=str(logs), max_staged=3)  # 2 per namespace: the default
    try:
        for uid in ("a-1", "a-2", "a-3"):  # one tenant's pods whose containers never start
            assert p.start(uid, "team-a", {"rekindle.dev/restore": "qwen-7b"})
            wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        assert p.start("b-1", "team-b", {"rekindle.dev/restore": "qwen-7b"})
        wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
        assert len(list(logs.glob("restore-staged-team-a-*/private"))) == 2
        with store.open("team-b", "qwen-7b", KEY) as art:
            assert p.take("b-1", art) is not None  # another tenant still gets its copy
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert p.take("a-3", art) is None  # past its namespace's bound: stages itself
    finally:
        p.shutdown()
    size = len(FILES["criu/core-1.img"]) + len(FILES["restore-plan.json"])  # what is staged
    by_bytes = Prefetcher(store, KEY, threads=1, staging_dir=str(tmp_path / "logs2"),
                          max_staged_bytes_per_namespace=size)
    try:
        for uid in ("a-1", "a-2"):
            assert by_bytes.start(uid, "team-a", {"rekindle.dev/restore": "qwen-7b"})
            wait_for(lambda: by_bytes.running() == 0, 10, "the prefetch to end")
        with store.open("team-a", "qwen-7b", KEY) as art:
            assert by_bytes.take("a-2", art) is None  # the namespace's bytes are spent
            assert by_bytes.take("a-1", art) is not None
    finally:
        by_bytes.shutdown()


def test_a_prefetch_holds_the_disk_gate_while_it_reads(tmp_path: Path) -> None:
    """A pre-warm yields to a prefetch as to a restore: the gate is busy while it stages and reads."""
    from nri_plugin.disk_gate import DiskGate

    store = ArtifactStore(str(tmp_path / "store"))
    publish(store, files=FILES)
    gate = DiskGate()
    seen: list[bool] = []
    real = readahead.warm

    def reading_warm(*args: object, **kwargs: object) -> object:
        seen.append(gate.busy())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    p = Prefetcher(store, KEY, threads=1, staging_dir=str(tmp_path / "logs"), reading=gate.restore)
    mp = pytest.MonkeyPatch()
    mp.setattr(readahead, "warm", reading_warm)
    try:
        assert p.start("uid-1", "team-a", {"rekindle.dev/restore": "qwen-7b"})
        wait_for(lambda: p.running() == 0, 10, "the prefetch to end")
    finally:
        mp.undo()
        p.shutdown()
    assert seen == [True]
    assert not gate.busy()  # and let go after
