"""Prefetch reads an artifact's files through the store, bounded and cancellable."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from nri_plugin.prefetch import Prefetcher
from runtime.prefetch import warm
from runtime.store import ArtifactStore
from tests.unit.test_store import KEY, publish
from tests.waiting import wait_for


def test_warm_reads_every_file_once(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"bulk/pages-1.bulk": b"p" * (9 << 20), "plan": b"x"})
    with store.open("team-a", "qwen-7b", KEY) as art:
        got = warm(art, threading.Event(), threads=2, budget=1 << 30)
    assert got.bytes == (9 << 20) + 1 and not got.skipped


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
        wait_for(lambda: not p._cancel, 5, "every prefetch to end")
    finally:
        p.shutdown()


def test_warm_waits_while_paused(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"bulk/pages-1.bulk": b"p" * (9 << 20)})
    go, done = threading.Event(), []
    with store.open("team-a", "qwen-7b", KEY) as art:
        t = threading.Thread(target=lambda: done.append(warm(art, threading.Event(), threads=1,
                                                             budget=1 << 30, go=go)))
        t.start()
        time.sleep(0.3)
        assert not done  # paused: the restore is in CRIU
        go.set()
        t.join(10)
    assert done and done[0].bytes == 9 << 20
