"""Jobs.resume on Synchronize: after a plugin restart it fails a cut-short restore once; after a
containerd restart (the plugin ran on) it leaves a running job alone."""

from __future__ import annotations

import asyncio
import threading

from nri_plugin.jobs import Jobs, Work
from nri_plugin.policy import Intent, ProbeKind, ReadyProbe, Role
from runtime import control
from runtime.status import ContainerStatus, Phase, StatusBook


class GatedEngine:
    """A restore that runs until the test opens the gate."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.recovered: list[bool] = []  # per recover call: whether restore-failed was there yet
        self.problems: list[str] | None = None

    def restore(self, work: Work) -> dict[str, float]:
        self.entered.set()
        assert self.gate.wait(10)
        work.control.write(control.RESTORE_COMPLETE, work.artifact + "\n")
        return {"fill": 0.0}

    checkpoint = restore

    def recover(self, work: Work) -> list[str] | None:
        # What the next agent must do before failing the restore: undo its rootfs changes.
        self.recovered.append(work.control.exists(control.RESTORE_FAILED))
        if self.problems is None:  # as the real one: a rollback done owes nothing more
            (work.control.path / control.ROOTFS_PENDING).unlink(missing_ok=True)
        return self.problems

    async def probe(self, netns: str, probe: ReadyProbe) -> bool:
        return True


def _work(tmp_path) -> Work:
    ctl = control.ControlDir(tmp_path / "control" / "pod" / "server")
    ctl.prepare()
    return Work(intent=Intent(Role.RESTORE, "base", ReadyProbe(ProbeKind.FILE)), control=ctl, container_id="cid-1", pid=1,
                namespace="default", pod="pod", pod_uid="uid-1", container="server", image="", netns="")


def test_a_reconnect_while_a_restore_runs_leaves_it_to_its_job(tmp_path):
    engine = GatedEngine()
    status = StatusBook(tmp_path / "state")
    work = _work(tmp_path)

    async def body() -> None:
        jobs = Jobs(engine, status)
        jobs.bind_loop(asyncio.get_running_loop())
        jobs.start(work)
        assert await asyncio.to_thread(engine.entered.wait, 10)
        # containerd restarted: Synchronize lists the container again, from a handler thread.
        await asyncio.to_thread(jobs.resume, _work(tmp_path))
        assert not work.control.exists(control.RESTORE_FAILED)
        assert status.read("default", "pod", "server").phase is Phase.RESTORING
        engine.gate.set()
        while status.read("default", "pod", "server").phase is Phase.RESTORING:
            await asyncio.sleep(0.01)
        await jobs.shutdown()

    asyncio.run(body())
    assert status.read("default", "pod", "server").phase is Phase.RESTORED
    assert not work.control.exists(control.RESTORE_FAILED)


def _resume_cut_short(tmp_path, engine: GatedEngine, work: Work, status: StatusBook) -> None:
    status.write(ContainerStatus(namespace="default", pod="pod", container="server", role="restore",
                                 artifact="base", phase=Phase.RESTORING, container_id="cid-1", pod_uid="uid-1"))

    async def body() -> None:
        jobs = Jobs(engine, status)  # a fresh process: no job of its own for the container
        jobs.bind_loop(asyncio.get_running_loop())
        await asyncio.to_thread(jobs.resume, work)
        await asyncio.to_thread(jobs.resume, work)
        while status.read("default", "pod", "server").phase is Phase.RESTORING:
            await asyncio.sleep(0.01)
        await jobs.shutdown()

    asyncio.run(body())


def test_a_restore_cut_short_by_a_plugin_restart_is_rolled_back_then_failed_once(tmp_path):
    engine = GatedEngine()
    status = StatusBook(tmp_path / "state")
    work = _work(tmp_path)
    _resume_cut_short(tmp_path, engine, work, status)
    assert not engine.entered.is_set()
    # The rootfs is rolled back BEFORE restore-failed lets the init start the original command.
    assert engine.recovered == [False]
    assert work.control.read(control.RESTORE_FAILED).startswith("the agent restarted during the restore")
    assert status.read("default", "pod", "server").phase is Phase.COLD_START


def test_a_cut_short_restore_whose_rollback_is_incomplete_says_so(tmp_path):
    engine = GatedEngine()
    engine.problems = ["undo saved 'etc/passwd': EIO"]
    status = StatusBook(tmp_path / "state")
    work = _work(tmp_path)
    _resume_cut_short(tmp_path, engine, work, status)
    assert "could not all be rolled back" in work.control.read(control.RESTORE_FAILED)


def test_a_restore_that_completed_before_the_kill_keeps_its_rootfs(tmp_path):
    """Killed between restore-complete and dropping the journal: the restored rootfs stays."""
    engine = GatedEngine()
    status = StatusBook(tmp_path / "state")
    work = _work(tmp_path)
    work.control.write(control.RESTORE_COMPLETE, "base\n")
    work.control.write(control.ROOTFS_PENDING, "x\n")
    _resume_cut_short(tmp_path, engine, work, status)
    assert engine.recovered == [False] and not work.control.exists(control.RESTORE_FAILED)
