"""runtime.proc.hold on a real multi-threaded process: while held, only the thread let run
runs (its process stays stopped), and all run once let go and continued, as a restore does."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from runtime.proc import procfs, tasks
from runtime.proc.hold import Hold, HoldError
from tests.waiting import wait_for

CHILD = r"""
import os, sys, threading
ins = [int(x) for x in sys.argv[1].split(",")]
out = int(sys.argv[2])
def serve(i, fd):
    while os.read(fd, 1):
        os.write(out, f"{i}:{threading.get_native_id()}\n".encode())
for i, fd in enumerate(ins):
    threading.Thread(target=serve, args=(i, fd), daemon=True).start()
os.write(out, b"ready\n")
os.read(0, 1)
"""


class Lines:
    def __init__(self, fd: int) -> None:
        self.fd, self.buf = fd, b""

    def next(self, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, f"no line within {timeout}s (have {self.buf!r})"
            if select.select([self.fd], [], [], left)[0]:
                self.buf += os.read(self.fd, 4096)
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def pending(self) -> bytes:
        while select.select([self.fd], [], [], 0)[0]:
            self.buf += os.read(self.fd, 4096)
        return self.buf


@pytest.fixture
def threaded():
    pipes = [os.pipe() for _ in range(3)]
    out_r, out_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", CHILD, ",".join(str(r) for r, _ in pipes), str(out_w)],
                            stdin=subprocess.PIPE, pass_fds=[r for r, _ in pipes] + [out_w])
    for r, _ in pipes:
        os.close(r)
    os.close(out_w)
    lines = Lines(out_r)
    try:
        assert lines.next() == "ready"
        tids = {}
        for i, (_, w) in enumerate(pipes):
            os.write(w, b"x")
            n, tid = lines.next().split(":")
            tids[int(n)] = int(tid)
        yield proc, [w for _, w in pipes], tids, lines
    finally:
        proc.kill()
        proc.wait()
        for _, w in pipes:
            os.close(w)
        os.close(out_r)


def _state(pid: int, tid: int) -> str:
    st = procfs.read_stat(pid, tid=tid)
    return st.state if st is not None else "gone"


def _tracer(pid: int, tid: int | str) -> int:
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("TracerPid:"))


def test_only_the_thread_let_run_runs_until_released(threaded) -> None:
    proc, writers, tids, lines = threaded
    os.kill(proc.pid, signal.SIGSTOP)
    tasks.wait_stopped([proc.pid])
    hold = Hold.seize([proc.pid])
    try:
        assert set(hold.threads) == {int(t) for t in os.listdir(f"/proc/{proc.pid}/task")}
        hold.let_run(tids[0])  # runs though its process is stopped
        os.write(writers[1], b"x")
        os.write(writers[0], b"x")
        assert lines.next() == f"0:{tids[0]}"
        assert _state(proc.pid, tids[1]) == "t"
        assert _state(proc.pid, proc.pid) == "t"
        hold.stop(tids[0])
        assert _state(proc.pid, tids[0]) == "t"
        assert lines.pending() == b""  # thread 1 was asked first and has not answered
    finally:
        hold.release()
    wait_for(lambda: tasks.stopped([proc.pid]), 10, "every thread back in the group stop")
    os.kill(proc.pid, signal.SIGCONT)
    assert lines.next() == f"1:{tids[1]}"
    os.write(writers[2], b"x")
    assert lines.next() == f"2:{tids[2]}"
    assert not any(_tracer(proc.pid, t) for t in tids.values())


def test_a_running_process_is_held_and_let_go(threaded) -> None:
    proc, writers, tids, lines = threaded
    with Hold.seize([proc.pid]) as hold:
        assert all(_state(proc.pid, t) == "t" and _tracer(proc.pid, t) == os.getpid() for t in hold.threads)
        os.write(writers[2], b"x")
    assert lines.next() == f"2:{tids[2]}"


def test_a_thread_not_held_is_refused_and_nothing_stays_seized(threaded) -> None:
    proc, writers, tids, lines = threaded
    with Hold.seize([proc.pid]) as hold:
        with pytest.raises(HoldError):
            hold.let_run(1)
    with pytest.raises(HoldError):
        Hold.seize([proc.pid, 2 ** 22 + 7])  # no such pid: the first one's threads are let go
    assert not any(_tracer(proc.pid, t) for t in os.listdir(f"/proc/{proc.pid}/task"))
    os.write(writers[0], b"x")
    assert lines.next() == f"0:{tids[0]}"


class OneThreadCuda:
    """A driver whose restore needs its restore thread (thread 0) to answer, and records whether
    another thread (thread 1), asked first, answered meanwhile."""

    def __init__(self, writers: list[int], tids: dict[int, int], lines: Lines) -> None:
        self.writers, self.tids, self.lines = writers, tids, lines
        self.seen: list[str] = []

    def restore_tid(self, pid: int) -> int:
        return self.tids[0]

    def restore_all(self, pids: list[int], gpu_map: object = None) -> None:
        os.write(self.writers[1], b"x")
        os.write(self.writers[0], b"x")
        self.seen.append(self.lines.next())
        self.seen.append(self.lines.pending().decode())


def test_a_cuda_restore_runs_only_the_restore_thread_then_continues_the_process(threaded) -> None:
    from runtime.gpu import target  # noqa: PLC0415

    proc, writers, tids, lines = threaded
    os.kill(proc.pid, signal.SIGSTOP)
    tasks.wait_stopped([proc.pid])
    cuda = OneThreadCuda(writers, tids, lines)
    hold = target.hold_cuda([proc.pid])
    assert hold is not None
    target.cuda_restore(cuda, [proc.pid], None, proc.pid, (proc.pid,), hold=hold)  # type: ignore[arg-type]
    assert cuda.seen == [f"0:{tids[0]}", ""]
    assert lines.next() == f"1:{tids[1]}"  # let go and continued
    assert not hold.threads
