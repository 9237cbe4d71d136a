"""The tasks of a restored or frozen tree: which are stopped, waiting until all are, signalling them.

``criu restore --leave-stopped`` returns with the tree stopped; the fill, the stream and the
GPU restore act on it and then let it run (SIGCONT) or end it (SIGKILL) here."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

from runtime.errors import CriuError

def stopped(pids: Iterable[int]) -> set[int]:
    """The processes of ``pids`` stopped now (every thread in ``T``: SIGSTOP, job control)."""
    return {p for p in pids if (states := _task_states(p)) and all(s == "T" for s in states)}


def _task_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid``; none for a process that is gone."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            continue
    return states


# Stopped (T, t), or done running: a zombie (Z) or one exiting (X) never runs again. CRIU dumps
# and restores zombies; they have no memory to split or fill.
SETTLED = frozenset("TtZX")


def wait_stopped(pids: Iterable[int], timeout: float = 10.0) -> None:
    """Wait until every thread of every process is stopped (or a zombie, or gone): ``criu
    restore --leave-stopped`` can return before the last thread has stopped, and a thread
    running on before the fill would compute on zero pages."""
    pending = list(pids)
    deadline = time.monotonic() + timeout
    while pending:
        pending = [p for p in pending if any(s not in SETTLED for s in _task_states(p))]
        if not pending:
            return
        if time.monotonic() > deadline:
            raise CriuError("restore", f"processes {pending} did not stop within {timeout}s")
        time.sleep(0.002)


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_all(pids: Iterable[int]) -> None:
    signal_all(pids, signal.SIGKILL)
