"""Pre-warming's looks, states and pacing (nri_plugin.prewarm); the entry written through the plugin
on a second node: tests/e2e/test_prewarm.py."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

import pytest

from nri_plugin import prewarm
from nri_plugin.disk_gate import DiskGate
from nri_plugin.prewarm import Pacer, Prewarmer
from nri_plugin.prewarm_state import State, Status, parse_names
from runtime.manifest import Manifest
from runtime.pages import nodecache
from runtime.pages.mapping import MapMode
from runtime.store.volume import ArtifactStore
from tests.unit.test_store import KEY, publish


class _Cache:
    def __init__(self) -> None:
        self.have: set[str] = set()
        self.max_bytes = 1 << 30
        self.room = True

    def has(self, manifest_id: str, mode: MapMode) -> bool:
        return manifest_id in self.have

    def entries(self) -> list[nodecache.EntryInfo]:
        return []

    def has_room(self, need: int) -> bool:
        return self.room


class _Writer:
    def __init__(self) -> None:
        self.jobs: list[tuple[str, Callable[[], object]]] = []

    def __call__(self, manifest_id: str, job: Callable[[], object]) -> bool:
        if any(m == manifest_id for m, _ in self.jobs):
            return False
        self.jobs.append((manifest_id, job))
        return True


def _prewarmer(tmp_path: Path, **kw: Any) -> tuple[Prewarmer, ArtifactStore, _Cache, _Writer]:
    store, cache, writer = ArtifactStore(str(tmp_path / "store")), _Cache(), _Writer()
    p = Prewarmer(store, KEY, cache, writer, MapMode.DRIVER, DiskGate(), str(tmp_path / "work"),  # type: ignore[arg-type]
                  state_path=str(tmp_path / "prewarm.json"), **kw)
    return p, store, cache, writer


def _state(p: Prewarmer, artifact: str) -> Status | None:
    return next((s for s in p.states() if s.artifact == artifact), None)


def test_names_parse_as_namespace_slash_name() -> None:
    assert parse_names(["team-a/llm", " team-b/asr.v2 ", "team-a/llm"]) == (("team-a", "llm"),
                                                                                     ("team-b", "asr.v2"))
    for bad in ("llm", "Team/llm", "a/../b", "a/", "/b", "a/b/c"):
        with pytest.raises(ValueError, match="not namespace/name"):
            parse_names([bad])


def test_a_listed_name_is_absent_until_published_then_queued_once_per_version(tmp_path: Path) -> None:
    p, store, _cache, writer = _prewarmer(tmp_path, named=(("team-a", "llm"),))
    (tmp_path / "store" / "team-a").mkdir(parents=True)
    p.look()
    st = _state(p, "team-a/llm")
    assert st is not None and st.state is State.ABSENT and st.reason == "not published"
    publish(store, "team-a", "llm")  # not marked in its manifest: listed is enough
    p.look()
    st = _state(p, "team-a/llm")
    assert st is not None and st.state is State.WARMING and len(writer.jobs) == 1
    p.look()  # the same version: not opened, not queued again
    assert len(writer.jobs) == 1
    publish(store, "team-a", "llm", generation=0, timings={"dump": 1.0})  # a new version
    p.look()
    assert len(writer.jobs) == 2 and writer.jobs[0][0] != writer.jobs[1][0]
    assert prewarm.read_states(str(tmp_path))[0]["state"] == "warming"


def test_the_store_is_looked_through_for_versions_marked_in_their_manifest(tmp_path: Path, monkeypatch) -> None:
    p, store, _cache, writer = _prewarmer(tmp_path)
    publish(store, "team-a", "plain")
    publish(store, "team-a", "marked", prewarm=True)
    opened: list[str] = []
    real = store.open

    def counting(ns: str, name: str, key: bytes, version: str | None = None) -> Any:
        opened.append(name)
        return real(ns, name, key, version=version)
    monkeypatch.setattr(store, "open", counting)
    p.look()
    assert [s.artifact for s in p.states()] == ["team-a/marked"] and len(writer.jobs) == 1
    assert sorted(opened) == ["marked", "plain"]
    p.look()  # versions seen: only links read
    assert sorted(opened) == ["marked", "plain"]


def test_a_look_reads_at_most_max_names_links_the_listed_first(tmp_path: Path) -> None:
    p, store, _cache, _writer = _prewarmer(tmp_path, named=(("team-z", "last"),), max_names=3)
    for i in range(6):
        publish(store, "team-a", f"n{i}")
    got = p.candidates()
    assert len(got) == 3 and got[0] == ("team-z", "last")  # the listed one, then two the directory gave first
    assert {ns for ns, _ in got[1:]} == {"team-a"} and len(set(got)) == 3


def test_a_version_already_cached_is_warm_and_an_evicted_one_absent(tmp_path: Path) -> None:
    p, store, cache, writer = _prewarmer(tmp_path, named=(("team-a", "llm"),))
    publish(store, "team-a", "llm")
    with store.open("team-a", "llm", KEY) as art:
        cache.have.add(art.manifest_id)
    p.look()
    st = _state(p, "team-a/llm")
    assert st is not None and st.state is State.WARM and writer.jobs == []
    cache.have.clear()
    cache.room = False  # the cache let it go for another: not written again while that would evict
    p.look()
    st = _state(p, "team-a/llm")
    assert st is not None and st.state is State.ABSENT and st.reason.startswith("evicted from the cache")
    p.look()
    assert writer.jobs == []
    cache.room = True  # room again (the other went): queued on the next look
    p.look()
    assert writer.jobs == []
    p.look()
    st = _state(p, "team-a/llm")
    assert st is not None and st.state is State.WARMING and len(writer.jobs) == 1


def test_evicted_versions_are_warmed_again_one_at_a_time(tmp_path: Path) -> None:
    """Two evicted, room for either: one is queued; the other waits while it warms, and once it
    is warm (the room taken) stays absent."""
    p, store, cache, writer = _prewarmer(tmp_path)
    for name in ("a", "b"):
        publish(store, "team-a", name, prewarm=True)
        with store.open("team-a", name, KEY) as art:
            cache.have.add(art.manifest_id)
    p.look()
    assert {s.state for s in p.states()} == {State.WARM} and writer.jobs == []
    cache.have.clear()
    p.look()  # both found evicted; room for one: one re-queued
    assert all(s.state is State.ABSENT for s in p.states())
    p.look()
    assert len(writer.jobs) == 1
    first = next(s for s in p.states() if s.state is State.WARMING)
    p.look()  # the other waits while that one is queued
    assert len(writer.jobs) == 1
    with store.open(*first.artifact.split("/"), KEY) as art:
        cache.have.add(art.manifest_id)
    cache.room = False  # written: the room is taken
    p._set(*first.artifact.split("/"), State.WARM)  # as its job's end records it
    p.look()
    p.look()
    assert len(writer.jobs) == 1
    other = next(s for s in p.states() if s.artifact != first.artifact)
    assert other.state is State.ABSENT and other.reason.startswith("evicted")


def test_a_discovered_name_deleted_from_the_store_is_forgotten(tmp_path: Path) -> None:
    p, store, _cache, writer = _prewarmer(tmp_path)
    publish(store, "team-a", "marked", prewarm=True)
    p.look()
    assert [s.artifact for s in p.states()] == ["team-a/marked"]
    store.delete("team-a", "marked")
    assert ("team-a", "marked") in p.candidates()  # no longer listed, still looked at once more
    p.look()
    assert p.states() == [] and prewarm.read_states(str(tmp_path))[0:] == []
    assert ("team-a", "marked") not in p.candidates()


def test_a_marked_version_whose_manifest_a_store_writer_changed_is_refused(tmp_path: Path) -> None:
    p, store, _cache, writer = _prewarmer(tmp_path, named=(("team-a", "llm"),))
    version = publish(store, "team-a", "llm", prewarm=True)
    data = (version / "manifest.json").read_bytes()
    (version / "manifest.json").write_bytes(data.replace(b'"serve"', b'"evil"'))
    p.look()
    st = _state(p, "team-a/llm")
    assert st is not None and st.state is State.REFUSED and "bad signature" in st.reason
    assert writer.jobs == []


def test_a_version_with_no_restore_plan_is_refused_by_its_job(tmp_path: Path) -> None:
    p, store, _cache, writer = _prewarmer(tmp_path, named=(("team-a", "llm"),))
    publish(store, "team-a", "llm")
    p.look()
    (_mid, job), = writer.jobs
    job()
    st = _state(p, "team-a/llm")
    assert st is not None and st.state is State.REFUSED and "restore-plan.json" in st.reason
    assert not list((tmp_path / "work").iterdir())  # its staged copies went


def test_a_warm_up_waits_while_a_restore_runs_and_its_rate_leaves_the_pause_out() -> None:
    now = [0.0]
    gate, stop = DiskGate(), threading.Event()
    status = Status("team-a/llm")
    pacer = Pacer(status, gate, stop, clock=lambda: now[0])
    now[0] = 1.0
    pacer(1 << 20)
    assert status.bytes == 1 << 20 and status.rate == pytest.approx(1 << 20)
    entered, leave, paced = threading.Event(), threading.Event(), threading.Event()

    def restore() -> None:
        with gate.restore():
            entered.set()
            leave.wait(10)
            now[0] = 11.0  # ten seconds of restore
    t = threading.Thread(target=restore)
    t.start()
    entered.wait(10)
    w = threading.Thread(target=lambda: (pacer(1 << 20), paced.set()))
    w.start()
    # the warm-up's next chunk waits for the restore (paused shows), then goes on
    from tests.waiting import wait_for
    wait_for(lambda: status.paused, 10, "the warm-up to pause")
    assert not paced.is_set() and status.bytes == 1 << 20
    leave.set()
    assert paced.wait(10)
    t.join(10)
    w.join(10)
    assert status.bytes == 2 << 20 and not status.paused and pacer.pauses == 1
    now[0] = 12.0
    assert status.rate == pytest.approx((2 << 20) / 1.0)  # 11 s elapsed, 10 of them paused
    stop.set()
    with pytest.raises(Exception, match="stopping"):
        pacer(1)


def test_describe_says_each_state_in_a_line() -> None:
    assert prewarm.describe(Status("a/b", State.WARMING, bytes=48 << 20, total=96 << 20,
                                   rate=float(300 << 20)).to_obj()) == "warming 48.0 of 96.0 MiB at 300.0 MiB/s"
    assert prewarm.describe(Status("a/b", State.REFUSED, reason="past\x1b[2J the bound").to_obj()) \
        == "refused: past?[2J the bound"
    assert prewarm.describe(Status("a/b", State.WARM).to_obj()) == "warm"


def test_another_version_of_the_artifact_written_is_evicted_before_older_entries(monkeypatch, tmp_path) -> None:
    cache = nodecache.NodeCache(str(tmp_path / "cache"), 300)
    entries = [nodecache.EntryInfo("k-old", "team-b/asr", "v1", "driver", 100, 1.0, False),
               nodecache.EntryInfo("k-llm1", "team-a/llm", "v1", "driver", 100, 5.0, False),
               nodecache.EntryInfo("k-mid", "team-c/tts", "v1", "driver", 100, 3.0, False)]
    dropped: list[str] = []
    monkeypatch.setattr(cache, "entries", lambda: [e for e in entries if e.key not in dropped])
    monkeypatch.setattr(cache, "_drop", lambda root, key, wait=True: dropped.append(key) or True)
    assert cache._make_room(-1, 100, "team-a/llm")
    assert dropped == ["k-llm1"]  # the superseded version, though the least recently used is k-old
    assert cache._make_room(-1, 250, "team-z/new")
    assert dropped == ["k-llm1", "k-old", "k-mid"]


def test_manifest_prewarm_defaults_off() -> None:
    assert Manifest.__dataclass_fields__["prewarm"].default is False


def test_the_metrics_show_each_marked_artifacts_state_and_drop_one_no_longer_marked() -> None:
    from prometheus_client import CollectorRegistry

    from nri_plugin.metrics import Metrics
    m = Metrics(registry=CollectorRegistry())
    m.prewarm([Status("a/llm", State.WARMING, bytes=5 << 20, total=10 << 20, rate=2e8), Status("a/asr", State.WARM)])
    got = m.registry.get_sample_value
    assert got("rekindle_prewarm_state", {"artifact": "a/llm", "state": "warming"}) == 1
    assert got("rekindle_prewarm_state", {"artifact": "a/llm", "state": "warm"}) == 0
    assert got("rekindle_prewarm_bytes", {"artifact": "a/llm"}) == 5 << 20
    assert got("rekindle_prewarm_rate_bytes", {"artifact": "a/llm"}) == 2e8
    m.prewarm([Status("a/llm", State.REFUSED, reason="past the bound")])
    assert got("rekindle_prewarm_state", {"artifact": "a/llm", "state": "refused"}) == 1
    assert got("rekindle_prewarm_state", {"artifact": "a/asr", "state": "warm"}) is None
