"""The project's CRIU build (hack/criu-patches/0002-compel-restart-timed-waits-instead-of-eintr.patch): a thread in a timed
wait that the dump interrupts goes back into the same call after ``criu dump --leave-running``,
instead of coming back with EINTR (the kernel's restart block does not survive CRIU's parasite).

Why it matters: the CUDA driver's own thread in a CUDA-checkpointed JAX process waits in a timed
poll(2); handed EINTR by the dump, the process died of SIGSEGV, before the plugin could resume
its CUDA state (bench/cuda_dump_lab.py on the H200). The test needs no GPU: a thread of a plain
process waits in poll(2) with a timeout on a pipe, the process is dumped with --leave-running,
then the pipe is written; its first return after the dump must be the readable pipe, not EINTR.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runtime.criu import command as criu_mod
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

POLLER = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)

class PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]

r = int(sys.argv[1])
out = open(sys.argv[2], "a", buffering=1)

def wait():
    pfd = PollFd(r, 1, 0)  # POLLIN
    while True:
        # a timed poll(2) straight from libc (Python's own select.poll retries EINTR itself)
        n = libc.poll(ctypes.byref(pfd), 1, 600_000)
        out.write(f"{n} {ctypes.get_errno() if n < 0 else 0} {pfd.revents}\n")
        if n > 0:
            return

t = threading.Thread(target=wait, name="poller")
t.start()
t.join()
"""


POLL, RESTART_SYSCALL = "7", "219"  # x86_64


def _poller_waits(pid: int, nr: str = POLL) -> bool:
    """A thread of ``pid`` other than the main one sleeps in system call ``nr``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) == pid:
            continue
        try:
            syscall = Path(f"/proc/{pid}/task/{tid}/syscall").read_text().split()
        except OSError:
            continue
        if syscall and syscall[0] == nr:
            return True
    return False


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the patch and these syscall numbers are x86_64's")
@pytest.mark.parametrize("resumed_before", [False, True], ids=["in-poll", "in-restart-syscall"])
def test_a_timed_wait_is_resumed_not_failed_after_a_dump_that_leaves_it_running(resumed_before: bool) -> None:
    """``in-restart-syscall``: the process was stopped and continued before the dump (SIGSTOP and
    SIGCONT: the poll goes on as restart_syscall, whose arguments no register holds): its first
    return may be 0 (no event yet), never EINTR."""
    if os.geteuid() != 0:
        pytest.skip("needs root (criu dump)")
    r, w = os.pipe()
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "returns"
        record.touch()
        proc = subprocess.Popen([sys.executable, "-c", POLLER, str(r), str(record)], pass_fds=(r,),
                                start_new_session=True)
        try:
            wait_for(lambda: _poller_waits(proc.pid), 30, "the thread to wait in poll(2)", interval=0.02)
            if resumed_before:
                os.kill(proc.pid, signal.SIGSTOP)
                wait_for(lambda: _stopped(proc.pid), 30, "the process to stop", interval=0.02)
                os.kill(proc.pid, signal.SIGCONT)
                wait_for(lambda: _poller_waits(proc.pid, RESTART_SYSCALL), 30, "the poll to go on as restart_syscall",
                         interval=0.02)
            images = Path(tmp) / "images"
            images.mkdir()
            dump = subprocess.run([criu_mod.CRIU, "dump", "-t", str(proc.pid), "--shell-job", "--leave-running",
                                   "--ext-unix-sk", "-D", str(images), "-o", "dump.log", "-v4"],
                                  capture_output=True, text=True, timeout=120)
            log = (images / "dump.log").read_text(errors="replace")
            assert dump.returncode == 0, log[-3000:]
            # CRIU logs either way that it found the thread in a call the kernel restarts through
            # its restart block (stock: "Will restore ... with interrupted system call")
            found = ("restarted system call", "with interrupted system call") if resumed_before else \
                ("Will restart", "with interrupted system call")
            assert any(f in log for f in found), "no timed wait was interrupted: the test proves nothing"
            os.write(w, b"x")
            wait_for(lambda: record.read_text().strip() != "", 30, "the poll to return")
            first = record.read_text().splitlines()[0].split()
            allowed = ("0", "1") if resumed_before else ("1",)  # 0: returned as a wait with no event yet
            assert first[0] in allowed, f"the poll came back with {first} (-1 4 is EINTR), not {allowed}"
            wait_for(lambda: proc.poll() is not None, 30, "the poller to see the pipe and end")
            assert proc.returncode == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            os.close(r)
            os.close(w)
