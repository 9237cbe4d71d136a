"""Jobs (nri_plugin/jobs.py): each outcome reaches the container's control dir exactly once and
the status record says what happened; a restarted plugin resumes or fails what was cut short."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from nri_plugin.jobs import Jobs, Skipped, Work
from nri_plugin.policy import Intent, ReadyProbe, Role
from runtime import control
from runtime.errors import RekindleError
from runtime.status import ContainerStatus, Phase, StatusBook
from tests.waiting import wait_for_async


class Engine:
    """Answers each call with ``outcome`` (timings, or an exception to raise); counts calls."""

    def __init__(self, outcome: dict[str, float] | Exception, before: Callable[[Work], None] | None = None) -> None:
        self.outcome = outcome
        self.before = before
        self.calls: list[tuple[str, str]] = []

    def _answer(self, kind: str, work: Work) -> dict[str, float]:
        self.calls.append((kind, work.container_id))
        if self.before is not None:
            self.before(work)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return dict(self.outcome)

    def checkpoint(self, work: Work) -> dict[str, float]:
        return self._answer("checkpoint", work)

    def restore(self, work: Work) -> dict[str, float]:
        return self._answer("restore", work)

    def recover(self, work: Work) -> list[str] | None:
        self.calls.append(("recover", work.container_id))
        return None

    async def probe(self, netns: str, probe: ReadyProbe) -> bool:
        return True


def make_work(tmp_path: Path, role: Role, cid: str = "c1", pod: str = "qwen-1") -> Work:
    ctl = control.ControlDir(tmp_path / "ctl" / cid)
    ctl.prepare()
    return Work(intent=Intent(role, "qwen-7b"), control=ctl, container_id=cid, pid=1, namespace="team-a",
                pod=pod, pod_uid="u1", container="server", image="", netns="")


def run_jobs(status: StatusBook, engine: Engine, body: Callable[[Jobs], object]) -> object:
    async def main() -> object:
        jobs = Jobs(engine, status)
        jobs.bind_loop(asyncio.get_running_loop())
        try:
            result = body(jobs)
            return await result if asyncio.iscoroutine(result) else result
        finally:
            await jobs.shutdown()
    return asyncio.run(main())


async def outcome(status: StatusBook) -> ContainerStatus:
    def final() -> ContainerStatus | None:
        st = status.read("team-a", "qwen-1", "server")
        return st if st is not None and st.phase.final else None
    return await wait_for_async(final, 5, "an outcome in the status record")


def test_checkpoint_waits_for_ready_then_publishes(tmp_path):
    status = StatusBook(tmp_path / "state")
    engine = Engine({"criu_dump": 1.5})
    work = make_work(tmp_path, Role.CHECKPOINT)

    async def body(jobs: Jobs) -> ContainerStatus:
        jobs.start(work)
        await wait_for_async(lambda: (st := status.read("team-a", "qwen-1", "server")) and
                             st.phase is Phase.WAITING_READY, 5, "waiting-ready")
        assert engine.calls == []
        work.control.write("ready-for-checkpoint", "")
        return await outcome(status)
    st = run_jobs(status, engine, body)
    assert st.phase is Phase.PUBLISHED and st.reason == ""
    assert set(st.timings) == {"wait_ready", "cold_start", "criu_dump", "total"}
    assert engine.calls == [("checkpoint", "c1")]
    assert not work.control.exists(control.CHECKPOINT_FAILED)


@pytest.mark.parametrize("role, error, phase, file, content", [
    (Role.CHECKPOINT, RekindleError("criu dump failed"), Phase.CHECKPOINT_FAILED, control.CHECKPOINT_FAILED,
     "criu dump failed\n"),
    (Role.CHECKPOINT, Skipped("artifact exists"), Phase.SKIPPED, control.CHECKPOINT_FAILED,
     "skipped: artifact exists\n"),
    (Role.RESTORE, RekindleError("digest mismatch"), Phase.COLD_START, control.RESTORE_FAILED, "digest mismatch\n"),
    (Role.RESTORE, ValueError(), Phase.COLD_START, control.RESTORE_FAILED, "ValueError\n"),
], ids=["checkpoint-fails", "checkpoint-skipped", "restore-fails", "restore-fails-without-message"])
def test_a_failure_tells_the_container_once_and_records_why(tmp_path, role, error, phase, file, content):
    status = StatusBook(tmp_path / "state")
    work = make_work(tmp_path, role)
    if role is Role.CHECKPOINT:
        work.control.write("ready-for-checkpoint", "")

    async def body(jobs: Jobs) -> ContainerStatus:
        jobs.start(work)
        return await outcome(status)
    st = run_jobs(status, Engine(error), body)
    assert st.phase is phase and st.reason == content.removeprefix("skipped: ").strip()
    assert work.control.read(file) == content


def test_no_restore_failed_after_the_init_was_told_restore_complete(tmp_path):
    status = StatusBook(tmp_path / "state")
    work = make_work(tmp_path, Role.RESTORE)
    engine = Engine(RekindleError("late failure"), before=lambda w: w.control.write(control.RESTORE_COMPLETE, "x"))

    async def body(jobs: Jobs) -> ContainerStatus:
        jobs.start(work)
        return await outcome(status)
    st = run_jobs(status, engine, body)
    assert st.phase is Phase.COLD_START
    assert not work.control.exists(control.RESTORE_FAILED), "the init already adopted the restored process"


def test_one_job_per_container_and_cancel_before_the_engine_runs(tmp_path):
    status = StatusBook(tmp_path / "state")
    engine = Engine({"criu_dump": 1.0})
    work = make_work(tmp_path, Role.CHECKPOINT)

    async def body(jobs: Jobs) -> None:
        jobs.start(work)
        jobs.start(work)  # a replayed PostStart
        await asyncio.sleep(0.3)  # several ready polls, the file never comes
        jobs.cancel(work.container_id, "container stopping")
        work.control.write("ready-for-checkpoint", "")
        await asyncio.sleep(0.5)
    run_jobs(status, engine, body)
    assert engine.calls == []
    assert status.read("team-a", "qwen-1", "server").phase is Phase.WAITING_READY


def test_resume_fails_a_restore_the_restart_cut_short(tmp_path):
    status = StatusBook(tmp_path / "state")
    engine = Engine({"criu_restore": 1.0})
    work = make_work(tmp_path, Role.RESTORE)
    status.write(ContainerStatus(namespace="team-a", pod="qwen-1", container="server", role="restore",
                                 artifact="qwen-7b", phase=Phase.RESTORING, reason="", container_id="c1",
                                 pod_uid="u1"))
    async def body(jobs: Jobs) -> None:
        jobs.resume(work)
        while status.read("team-a", "qwen-1", "server").phase is Phase.RESTORING:
            await asyncio.sleep(0.01)
    run_jobs(status, engine, body)
    st = status.read("team-a", "qwen-1", "server")
    assert st.phase is Phase.COLD_START and "restarted during the restore" in st.reason
    assert "restarted" in (work.control.read(control.RESTORE_FAILED) or "")
    assert engine.calls == [("recover", "c1")]  # its rootfs changes undone first; no new restore


@pytest.mark.parametrize("done", [control.RESTORE_COMPLETE, control.RESTORE_FAILED, control.COLD_START])
def test_resume_leaves_a_decided_restore_alone(tmp_path, done):
    status = StatusBook(tmp_path / "state")
    engine = Engine({"criu_restore": 1.0})
    work = make_work(tmp_path, Role.RESTORE)
    work.control.write(done, "")
    run_jobs(status, engine, lambda jobs: jobs.resume(work))
    assert engine.calls == [] and status.read("team-a", "qwen-1", "server") is None


def test_resume_starts_a_restore_and_rewatches_a_source(tmp_path):
    status = StatusBook(tmp_path / "state")
    engine = Engine({"criu_restore": 1.0})
    restore = make_work(tmp_path, Role.RESTORE, "r1", pod="qwen-2")
    source = make_work(tmp_path, Role.CHECKPOINT, "s1", pod="qwen-src")
    source.control.write("ready-for-checkpoint", "")

    async def body(jobs: Jobs) -> None:
        jobs.resume(restore)
        await wait_for_async(lambda: len(engine.calls) == 1, 5, "the restore to start")
        jobs.resume(source)
        await wait_for_async(lambda: len(engine.calls) == 2, 5, "the checkpoint to start")
    run_jobs(status, engine, body)
    assert sorted(engine.calls) == [("checkpoint", "s1"), ("restore", "r1")]
