"""Node-local rotation of work/log dirs and status records; private copies of interrupted restores."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from runtime.housekeeping import expire_status, rotate_logs, sweep_restore_copies
from runtime.proc.owner import OWNER, Owner, write_owner
from runtime.status import ContainerStatus, Phase, StatusBook
from tests.unit.test_store_gc import _no_deep_trees_left  # noqa: F401 - the fixture


def _dir(root: Path, name: str, age: float) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "restore.log").write_text("x")
    t = time.time() - age
    os.utime(d, (t, t))
    return d


def test_rotate_logs_keeps_the_newest_and_never_a_busy_dir(tmp_path: Path) -> None:
    for i in range(6):
        _dir(tmp_path, f"restore-{i}", age=7200 + i * 60)  # restore-0 is the newest
    _dir(tmp_path, "checkpoint-busy", age=10)
    _dir(tmp_path, "restore-ancient", age=30 * 86400)
    removed = rotate_logs(tmp_path, keep=3, max_age=7 * 86400, busy=3600)
    assert sorted(removed) == ["restore-3", "restore-4", "restore-5", "restore-ancient"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-busy", "restore-0", "restore-1", "restore-2"]


def test_expire_status_removes_old_final_records_only(tmp_path: Path) -> None:
    book = StatusBook(tmp_path)
    for pod, phase in (("old-done", Phase.RESTORED), ("old-running", Phase.RESTORING), ("new-done", Phase.PUBLISHED)):
        book.write(ContainerStatus(namespace="ns", pod=pod, container="c", phase=phase))
    for pod in ("old-done", "old-running"):
        path = book.root / "ns" / pod / "c.json"
        st = ContainerStatus.from_json(path.read_text())
        st.updated_at = time.time() - 8 * 86400
        path.write_text(st.to_json())
    assert expire_status(tmp_path) == 1
    assert sorted(s.pod for s in book.list()) == ["new-done", "old-running"]
    assert not (book.root / "ns" / "old-done").exists()


def _restore_dir(root: Path, name: str, owner: Owner | None) -> Path:
    d = root / name
    (d / "private" / "criu").mkdir(parents=True)
    (d / "private" / "criu" / "pages-1.img").write_bytes(b"p" * 4096)
    (d / "restore.log").write_text("log")
    if owner is not None:
        (d / OWNER).write_text(json.dumps(dataclasses.asdict(owner)))
    return d


def test_private_copies_of_a_dead_restore_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    me = Owner.me()
    dead = _restore_dir(tmp_path, "restore-default-a-dead", dataclasses.replace(me, start_time=me.start_time + 1))
    rebooted = _restore_dir(tmp_path, "restore-default-a-rebooted", dataclasses.replace(me, boot_id="old-boot"))
    live = tmp_path / "restore-default-a-live"
    (live / "private").mkdir(parents=True)
    write_owner(str(live))
    other_node = _restore_dir(tmp_path, "restore-default-a-other", dataclasses.replace(me, node="elsewhere", pid=1))
    unowned = _restore_dir(tmp_path, "restore-default-a-unowned", None)
    assert sweep_restore_copies(tmp_path) == [dead.name, rebooted.name]
    assert not (dead / "private").exists() and (dead / "restore.log").exists()  # the log stays
    assert not (rebooted / "private").exists()
    for kept in (live, other_node, unowned):
        assert (kept / "private").is_dir(), kept.name


def test_private_staging_of_a_dead_checkpoint_is_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    me = Owner.me()
    dead = tmp_path / "checkpoint-default-a-1"
    (dead / "staging-default-a-x1" / "criu").mkdir(parents=True)
    (dead / "staging-default-a-x1" / "criu" / "pages-1.img").write_bytes(b"p" * 4096)
    (dead / "dump.log").write_text("log")
    (dead / OWNER).write_text(json.dumps(dataclasses.asdict(dataclasses.replace(me, start_time=me.start_time + 1))))
    live = tmp_path / "checkpoint-default-a-2"
    (live / "staging-default-a-x2").mkdir(parents=True)
    write_owner(str(live))
    assert sweep_restore_copies(tmp_path) == [dead.name]
    assert not (dead / "staging-default-a-x1").exists() and (dead / "dump.log").exists()
    assert (live / "staging-default-a-x2").is_dir()


def test_a_deep_tree_in_an_old_work_dir_is_rotated_away(tmp_path: Path) -> None:
    from tests.unit.test_store_gc import deep_tree
    old = _dir(tmp_path, "restore-old", age=30 * 86400)
    deep_tree(old / "private", depth=1500)  # shutil.rmtree recursed: RecursionError
    os.utime(old, (time.time() - 30 * 86400,) * 2)
    assert rotate_logs(tmp_path, keep=10) == ["restore-old"]
    assert os.listdir(tmp_path) == []


def _old_final_status(state: Path) -> Path:
    book = StatusBook(state)
    book.write(ContainerStatus(namespace="ns", pod="gone", container="c", phase=Phase.RESTORED))
    path = book.root / "ns" / "gone" / "c.json"
    st = ContainerStatus.from_json(path.read_text())
    st.updated_at = time.time() - 8 * 86400
    path.write_text(st.to_json())
    return path


def test_one_failing_housekeeping_step_skips_no_other(tmp_path: Path, monkeypatch) -> None:
    from nri_plugin import agent
    from nri_plugin.config import Settings
    from nri_plugin.metrics import Metrics
    from runtime.store import gc as store_gc
    from runtime.store.volume import ArtifactStore

    def prepare() -> tuple[Path, Path, Path]:
        logs = tmp_path / "state" / "logs"
        me = Owner.me()
        dead = _restore_dir(logs, "restore-default-a-dead", dataclasses.replace(me, boot_id="old-boot"))
        old_log = _dir(logs, "checkpoint-ancient", age=30 * 86400)
        return dead, old_log, _old_final_status(tmp_path / "state")

    def sweep(*_: object, **__: object) -> list[store_gc.Leftover]:
        raise RecursionError("maximum recursion depth exceeded")  # what a planted tree did

    monkeypatch.setattr(store_gc, "sweep", sweep)
    settings = Settings(state_dir=str(tmp_path / "state"), store=str(tmp_path / "store"))
    store = ArtifactStore(settings.store)
    dead, old_log, status = prepare()
    failed = agent._housekeep_once(settings, store)
    assert not (dead / "private").exists()  # the others ran all the same
    assert not old_log.exists() and not status.exists()
    assert failed == ["store_sweep"]

    metrics = Metrics(store_path=str(tmp_path))
    dead, old_log, status = prepare()
    assert agent._housekeep_once(settings, store, metrics) == ["store_sweep"]
    assert not (dead / "private").exists() and not old_log.exists() and not status.exists()
    failures = metrics.registry.get_sample_value
    assert failures("rekindle_housekeeping_failures_total", {"step": "store_sweep"}) == 1
    assert failures("rekindle_housekeeping_failures_total", {"step": "logs"}) == 0


def test_a_planted_tree_in_the_store_is_counted_and_housekeeping_goes_on(tmp_path: Path) -> None:
    from nri_plugin import agent
    from nri_plugin.config import Settings
    from nri_plugin.metrics import Metrics
    from runtime.fs import fdfs
    from runtime.store.volume import ArtifactStore
    from tests.unit.test_store_gc import deep_tree

    settings = Settings(state_dir=str(tmp_path / "state"), store=str(tmp_path / "store"))
    store = ArtifactStore(settings.store)
    planted = tmp_path / "store" / "team-a" / ".staging-x-00000000000000aa"
    deep_tree(planted, depth=1500)
    (planted / OWNER).write_text(json.dumps({**dataclasses.asdict(Owner.me()), "node": "elsewhere"}))
    status = _old_final_status(tmp_path / "state")
    metrics = Metrics(store_path=str(tmp_path))
    try:
        assert agent._housekeep_once(settings, store, metrics) == []
        assert planted.is_dir()  # another node's, and young: kept, but reported
        assert metrics.registry.get_sample_value("rekindle_store_bad_leftovers") == 1
        assert not status.exists()
    finally:
        fdfs.remove_tree_path(planted)


def test_run_steps_runs_every_step_and_names_the_failed_ones() -> None:
    from runtime.housekeeping import Step, run_steps
    ran, failed = [], []

    def boom() -> None:
        raise OSError("disk gone")

    steps = [Step("a", lambda: ran.append("a")), Step("b", boom), Step("c", lambda: ran.append("c"))]
    assert run_steps(steps, failed.append) == ["b"]
    assert ran == ["a", "c"] and failed == ["b"]
