"""runtime.proc.frozen: what a checkpoint stopped is continued by the next one if the agent died."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from runtime.proc import frozen, tasks
from tests.waiting import wait_for


def _stopped_child() -> subprocess.Popen[bytes]:
    child = subprocess.Popen(["sleep", "60"])
    os.kill(child.pid, signal.SIGSTOP)
    wait_for(lambda: tasks.stopped([child.pid]) == {child.pid}, 5, "the child to stop")
    return child


def test_what_a_dead_agent_left_stopped_is_continued_and_what_the_workload_stopped_is_not(tmp_path: Path) -> None:
    ours, theirs = _stopped_child(), _stopped_child()
    try:
        frozen.record(str(tmp_path), "cid", [ours.pid])  # the agent stopped `ours`, then died
        assert frozen.thaw_left_over(str(tmp_path), "cid") == [ours.pid]
        wait_for(lambda: not tasks.stopped([ours.pid]), 5, "the checkpoint's process to run again")
        assert tasks.stopped([theirs.pid]) == {theirs.pid}  # stopped by the workload: stays stopped
        assert not list(tmp_path.iterdir())
        assert frozen.thaw_left_over(str(tmp_path), "cid") == []
    finally:
        for c in (ours, theirs):
            c.kill()
            c.wait()


def test_a_record_naming_a_reused_pid_continues_nothing(tmp_path: Path) -> None:
    child = _stopped_child()
    try:
        (tmp_path / "frozen-cid.json").write_text(json.dumps({"stopped": [[child.pid, 1]]}))
        assert frozen.thaw_left_over(str(tmp_path), "cid") == []
        assert tasks.stopped([child.pid]) == {child.pid}
    finally:
        child.kill()
        child.wait()


def test_a_cleared_record_is_gone(tmp_path: Path) -> None:
    frozen.record(str(tmp_path), "cid", [os.getpid()])
    frozen.clear(str(tmp_path), "cid")
    assert not list(tmp_path.iterdir())
