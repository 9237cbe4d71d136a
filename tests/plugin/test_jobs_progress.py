"""Jobs give the engine a progress callback: while a restore runs its status record shows the
phase and bytes (the engine's threads write it); afterwards the record has the outcome, the
total time and the artifact's size, and no progress. The engine's log lines carry the pod and
artifact the job bound, although they come from the jobs' thread pool."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable

from nri_plugin import logs
from nri_plugin.jobs import Jobs, Work
from nri_plugin.policy import Intent, Role
from runtime import control
from runtime.status import ContainerStatus, Phase, StatusBook
from tests.waiting import wait_for_async


class SlowRestore:
    def __init__(self) -> None:
        self.go_on = threading.Event()
        self.log = logging.getLogger("test.engine")

    def restore(self, work: Work) -> dict[str, float]:
        work.progress("stage", 0, 0)
        work.progress("fill", 0, 1000)
        self.log.info("filling")
        assert self.go_on.wait(10)
        work.progress("fill", 1000, 1000)
        work.progress("complete", 4096, 4096)
        return {"stage": 0.1, "fill": 0.2}

    checkpoint = restore

    async def probe(self, netns, probe):
        return True


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.addFilter(logs.ContextFields())
        self.setFormatter(logs.JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record):
        self.lines.append(json.loads(self.format(record)))


def test_progress_while_running_then_outcome_total_and_size(tmp_path):
    capture = Capture()
    logging.getLogger("test.engine").addHandler(capture)
    logging.getLogger("test.engine").setLevel(logging.INFO)
    status = StatusBook(tmp_path / "state")
    engine = SlowRestore()
    ctl = control.ControlDir(tmp_path / "ctl")
    ctl.prepare()
    work = Work(intent=Intent(Role.RESTORE, "qwen-7b"), control=ctl, container_id="c1", pid=1,
                namespace="team-a", pod="qwen-1", pod_uid="u1", container="server", image="", netns="")

    async def body():
        jobs = Jobs(engine, status)
        jobs.bind_loop(asyncio.get_running_loop())
        jobs.start(work)
        st = await wait_for_async(lambda: _with(status.read("team-a", "qwen-1", "server"),
                                                lambda s: s.progress is not None and s.progress.phase == "fill"),
                                  4, "fill progress in the status record")
        assert st.phase is Phase.RESTORING and st.progress.phase == "fill" and st.progress.bytes_total == 1000
        engine.go_on.set()
        return await wait_for_async(lambda: _with(status.read("team-a", "qwen-1", "server"), lambda s: s.phase.final),
                                    4, "an outcome in the status record")
    try:
        st = asyncio.run(asyncio.wait_for(body(), 20))
    finally:
        logging.getLogger("test.engine").removeHandler(capture)
    assert st.phase is Phase.RESTORED and st.progress is None
    assert st.bytes == 4096
    assert st.timings["stage"] == 0.1 and st.timings["total"] >= 0
    (line,) = [entry for entry in capture.lines if entry["msg"] == "filling"]
    assert (line["namespace"], line["pod"], line["container"], line["artifact"]) == \
        ("team-a", "qwen-1", "server", "qwen-7b")


def _with(st: ContainerStatus | None, holds: Callable[[ContainerStatus], bool]) -> ContainerStatus | None:
    return st if st is not None and holds(st) else None
