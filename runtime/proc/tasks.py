"""The tasks of a restored or frozen tree: which are stopped, waiting until all are, signalling them.

``criu restore --leave-stopped`` returns with the tree stopped; the fill, the stream and the
GPU restore act on it and then let it run (SIGCONT) or end it (SIGKILL) here."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

from runtime.errors import CriuError
from runtime.proc import procfs


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
        st = procfs.read_stat(pid, tid=tid)
        if st is not None:
            states.append(st.state)
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


def descendants(root: int, proc: str = "/proc") -> list[int]:
    """Host pids of every process descended from ``root`` (not ``root`` itself), by parentage
    (``PPid``) as /proc shows it now. A restore's clean-up kills only these: a task of the
    restored tree's pid namespace that no restored task forked (an exec'd shell, a debug
    container's) is never the tree's."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        st = procfs.read_stat(name, proc)
        if st is None:
            continue  # gone meanwhile
        kids.setdefault(st.ppid, []).append(int(name))
    found: list[int] = []
    seen = {root}  # a pid reused while /proc was read must not make a cycle
    todo = list(kids.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        found.append(pid)
        todo.extend(kids.get(pid, ()))
    return found


def kill_descendants(root: int, pidns: int, wait: float = 5.0, started_before: int | None = None) -> list[int]:
    """SIGKILL every descendant of ``root`` living in pid namespace ``pidns`` (and started
    before ``started_before``, clock ticks since boot, when given) until none is left or
    ``wait`` seconds passed: a killed task's children are reparented to the namespace's init
    (``root``), so they are found on the next round. Nothing when ``root`` is not in ``pidns``
    (any more: a reused pid is not the init). The pids signalled."""
    killed: dict[int, None] = {}  # in the order signalled
    deadline = time.monotonic() + wait
    while True:
        if _pidns(root) != pidns:
            return list(killed)
        left = [p for p in descendants(root) if _pidns(p) == pidns
                and (started_before is None or _started(p) <= started_before)]
        left = [p for p in left if _task_states(p) and any(s not in "ZX" for s in _task_states(p))]
        if not left or time.monotonic() > deadline:
            return list(killed)
        kill_all(left)
        killed.update(dict.fromkeys(left))
        time.sleep(0.01)


def _pidns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def _started(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (a huge number for one that is gone)."""
    start = procfs.start_time(pid)
    return start if start is not None else 1 << 62
