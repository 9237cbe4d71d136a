"""Every thread of some processes held stopped under ptrace, but the ones let run.

The CUDA driver restores a process through one thread of its own, the restore thread, which
must run; every other thread must not run until the restore is done: a thread that touches
device-mapped memory (a UVM pointer, the driver's host mappings) before its mappings are back
crashes the process. CRIU's CUDA plugin holds a restored tree this way (its threads seized,
only the restore thread continued, its signals blocked). The plugin's restores and the source's
resume after a dump do the same here, where CRIU left the tree stopped: SIGCONT does not wake a
thread in a ptrace stop, so the rest of the tree may run meanwhile.

ptrace binds a tracee to the one thread that seized it: every call on a :class:`Hold`, from
:meth:`Hold.seize` to :meth:`Hold.release`, must come from the same thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from runtime import libc

log = logging.getLogger(__name__)

PTRACE_CONT = 7
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_GETSIGMASK = 0x420A
PTRACE_SETSIGMASK = 0x420B
WALL = 0x40000000  # __WALL: a thread, not only a child process
SIGSET_BYTES = 8  # the kernel's sigset_t on 64-bit

# Every signal blocked but SIGTRAP, as CRIU's plugin leaves its restore thread: no handler of the
# workload runs on the one thread that runs. (SIGKILL and SIGSTOP cannot be blocked.)
RUN_MASK = ((1 << 64) - 1) & ~(1 << (signal.SIGTRAP - 1))


class HoldError(OSError):
    """A thread could not be seized, stopped, let run or let go."""


@dataclass
class Hold:
    """The seized threads of ``pids``, each stopped under ptrace but those let run."""

    pids: tuple[int, ...]
    wait_s: float = 5.0  # for one thread to stop once asked
    threads: dict[int, int] = field(default_factory=dict)  # tid -> its pid
    running: dict[int, int] = field(default_factory=dict)  # tid let run -> its saved signal mask

    @classmethod
    def seize(cls, pids: Iterable[int], wait_s: float = 5.0) -> Hold:
        """Seize and stop every thread of ``pids`` (threads started meanwhile too); on any
        failure, what was seized is let go and :class:`HoldError` raised."""
        hold = cls(tuple(dict.fromkeys(pids)), wait_s)
        try:
            for pid in hold.pids:
                hold._seize_all(pid)
        except BaseException:
            hold.release()
            raise
        log.info("holding %d thread(s) of %s", len(hold.threads), list(hold.pids))
        return hold

    def _seize_all(self, pid: int) -> None:
        while True:  # a running process may start threads while it is seized: until none is new
            new = [t for t in _tids(pid) if t not in self.threads]
            if not new:
                if pid not in self.threads.values():
                    raise HoldError(3, f"pid {pid} has no thread to hold")
                return
            for tid in new:
                try:
                    libc.call("ptrace", PTRACE_SEIZE, tid, None, None, what=f"ptrace(SEIZE, {tid})")
                except OSError as exc:
                    if exc.errno == 3 and not os.path.exists(f"/proc/{pid}/task/{tid}"):
                        continue  # the thread ended meanwhile
                    raise HoldError(exc.errno, str(exc)) from exc
                self.threads[tid] = pid
                if not self._stopped_now(tid):
                    self._stop(tid)

    def let_run(self, tid: int) -> None:
        """Let the held thread ``tid`` run alone, its signals blocked but SIGTRAP."""
        if tid not in self.threads:
            raise HoldError(3, f"thread {tid} is not held")
        if tid in self.running:
            return
        saved = ctypes.c_uint64()
        libc.call("ptrace", PTRACE_GETSIGMASK, tid, ctypes.c_void_p(SIGSET_BYTES), ctypes.byref(saved),
                  what=f"ptrace(GETSIGMASK, {tid})")
        block = ctypes.c_uint64(RUN_MASK)
        libc.call("ptrace", PTRACE_SETSIGMASK, tid, ctypes.c_void_p(SIGSET_BYTES), ctypes.byref(block),
                  what=f"ptrace(SETSIGMASK, {tid})")
        libc.call("ptrace", PTRACE_CONT, tid, None, None, what=f"ptrace(CONT, {tid})")
        self.running[tid] = saved.value

    def stop(self, tid: int) -> None:
        """Stop again a thread let run, its signal mask as it was."""
        saved = self.running.pop(tid, None)
        if saved is None:
            return
        self._stop(tid)
        mask = ctypes.c_uint64(saved)
        libc.call("ptrace", PTRACE_SETSIGMASK, tid, ctypes.c_void_p(SIGSET_BYTES), ctypes.byref(mask),
                  what=f"ptrace(SETSIGMASK, {tid})")

    def release(self) -> None:
        """Let every thread go (those let run stopped first, their masks back); the threads run
        unless their process is stopped. Never raises: a thread that is gone is let go too."""
        for tid in list(self.running):
            try:
                self.stop(tid)
            except OSError as exc:
                log.warning("thread %d: %s", tid, exc)
                self.running.pop(tid, None)
        for tid in list(self.threads):
            try:
                libc.call("ptrace", PTRACE_DETACH, tid, None, None, what=f"ptrace(DETACH, {tid})")
            except OSError as exc:
                if exc.errno != 3:  # ESRCH: gone (or not stopped, which it is here)
                    log.warning("thread %d: %s", tid, exc)
            del self.threads[tid]

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- mechanics --------------------------------------------------------------------------
    def _stopped_now(self, tid: int) -> bool:
        """Whether the seized ``tid`` reports a stop already (it was in a group stop: the
        kernel traps it as it is seized)."""
        return self._reap(tid, os.WNOHANG)

    def _stop(self, tid: int) -> None:
        """Interrupt ``tid`` and wait for its stop."""
        libc.call("ptrace", PTRACE_INTERRUPT, tid, None, None, what=f"ptrace(INTERRUPT, {tid})")
        deadline = time.monotonic() + self.wait_s
        while not self._reap(tid, os.WNOHANG):
            if time.monotonic() > deadline:
                raise HoldError(62, f"thread {tid} did not stop within {self.wait_s:g}s")
            time.sleep(0.001)

    def _reap(self, tid: int, options: int) -> bool:
        """A stop (or the end) of ``tid`` reported; False while it runs."""
        try:
            got, status = os.waitpid(tid, options | WALL)
        except ChildProcessError as exc:
            raise HoldError(exc.errno or 10, f"thread {tid}: {exc}") from exc
        if got == 0:
            return False
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            self.threads.pop(tid, None)
            self.running.pop(tid, None)
            raise HoldError(3, f"thread {tid} ended while held")
        return os.WIFSTOPPED(status)


def _tids(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError as exc:
        raise HoldError(3, f"pid {pid} is gone") from exc
