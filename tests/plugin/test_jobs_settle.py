"""A restore counts as ``restored`` only once the restored process runs: one that dies right
after the restore is reported as ``restore-exited`` with its exit status (status record, the
outcome for metrics and Events), never as restored. Real processes stand in for the container's
init: its pid is watched, and the engine says what containerd reported."""

from __future__ import annotations

import asyncio
import subprocess
import threading
from pathlib import Path

from nri_plugin.jobs import Jobs, Work
from nri_plugin.outcomes import Outcome, OutcomeKind, ReasonClass, Reporter
from nri_plugin.policy import Intent, ReadyProbe, Role
from runtime import control
from runtime.status import ContainerStatus, Phase, StatusBook
from tests.waiting import wait_for_async


class Engine:
    def __init__(self, init: subprocess.Popen[bytes], exit_code: int | None) -> None:
        self.init = init
        self.exit_code = exit_code
        self.asked: list[str] = []
        self.release = threading.Event()  # exit_status answers once set
        self.release.set()

    def checkpoint(self, work: Work) -> dict[str, float]:
        raise AssertionError("no checkpoint here")

    def restore(self, work: Work) -> dict[str, float]:
        work.control.write(control.RESTORE_PID, "6\n")
        work.control.write(control.RESTORE_COMPLETE, "base\n")
        return {"criu_restore": 0.1}

    async def probe(self, netns: str, probe: ReadyProbe) -> bool:
        return True

    def exit_status(self, work: Work) -> int | None:
        self.asked.append(work.container_id)
        self.init.wait(5)
        self.release.wait(5)
        return self.exit_code


def _run(tmp_path: Path, command: list[str], exit_code: int | None, settle: float = 1.0):
    status = StatusBook(tmp_path / "state")
    heard: list[Outcome] = []
    reporter = Reporter([type("Sink", (), {"publish": lambda self, o: heard.append(o)})()])
    status.observe(reporter)
    init = subprocess.Popen(command)
    ctl = control.ControlDir(tmp_path / "ctl")
    ctl.prepare()
    work = Work(intent=Intent(Role.RESTORE, "base"), control=ctl, container_id="c" * 64, pid=init.pid,
                namespace="team-a", pod="p", pod_uid="u1", container="server", image="", netns="")
    engine = Engine(init, exit_code)
    seen: list[Phase] = []
    status.observe(lambda s: seen.append(s.phase))

    async def main() -> ContainerStatus:
        jobs = Jobs(engine, status, settle=settle)
        jobs.bind_loop(asyncio.get_running_loop())
        try:
            jobs.start(work)
            return await wait_for_async(lambda: (st := status.read("team-a", "p", "server")) and st.phase.final and st,
                                        10, "an outcome")
        finally:
            await jobs.shutdown()
    try:
        st = asyncio.run(main())
    finally:
        init.kill()
        init.wait()
    return st, heard, seen, engine


def test_a_process_that_dies_right_after_the_restore_is_not_restored(tmp_path):
    # The "init" dies 0.2 s after the restore, by SIGSEGV, as a workload that trips on its new pod.
    st, heard, seen, engine = _run(tmp_path, ["/bin/sh", "-c", "sleep 0.2; kill -SEGV $$"], 139)
    assert st.phase is Phase.RESTORE_EXITED, st
    assert st.reason == "the restored process exited right after the restore (exit status 139: SIGSEGV)"
    assert Phase.RESTORED not in seen  # never said, not even for a moment
    assert [(o.kind, o.reason_class) for o in heard] == [(OutcomeKind.RESTORE_EXITED, ReasonClass.EXITED)]
    assert "criu_restore" in st.timings and engine.asked == ["c" * 64]


def test_a_process_that_runs_on_is_restored_after_the_settle(tmp_path):
    st, heard, seen, engine = _run(tmp_path, ["/bin/sleep", "30"], None, settle=0.5)
    assert st.phase is Phase.RESTORED and st.reason == ""
    assert [o.kind for o in heard] == [OutcomeKind.RESTORED]
    assert engine.asked == []


def test_an_exit_status_containerd_does_not_give_is_said_to_be_unknown(tmp_path):
    st, _, _, _ = _run(tmp_path, ["/bin/sh", "-c", "exit 3"], None)
    assert st.phase is Phase.RESTORE_EXITED
    assert st.reason.endswith("(exit status unknown)")


def test_the_containers_stop_during_the_settle_does_not_lose_the_outcome(tmp_path):
    """containerd tells the plugin (StopContainer) as soon as the dead container's init exits:
    that must not cancel the watch that reports it."""
    status = StatusBook(tmp_path / "state")
    init = subprocess.Popen(["/bin/sh", "-c", "sleep 0.2; exit 7"])
    ctl = control.ControlDir(tmp_path / "ctl")
    ctl.prepare()
    work = Work(intent=Intent(Role.RESTORE, "base"), control=ctl, container_id="d" * 64, pid=init.pid,
                namespace="team-a", pod="p", pod_uid="u1", container="server", image="", netns="")

    engine = Engine(init, 7)
    engine.release.clear()

    async def main() -> ContainerStatus:
        jobs = Jobs(engine, status, settle=5.0)
        jobs.bind_loop(asyncio.get_running_loop())
        try:
            jobs.start(work)
            await wait_for_async(lambda: engine.asked, 5, "the exit status to be asked for")
            jobs.cancel(work.container_id, "container stopping")  # what StopContainer does
            engine.release.set()
            return await wait_for_async(lambda: (st := status.read("team-a", "p", "server")) and st.phase.final and st,
                                        10, "an outcome")
        finally:
            await jobs.shutdown()
    try:
        st = asyncio.run(main())
    finally:
        init.wait()
    assert st.phase is Phase.RESTORE_EXITED and st.reason.endswith("(exit status 7)"), st
