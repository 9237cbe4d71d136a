"""The second holder of a streamed restore's uffds: the tree never runs on a zero page.

When the last holder of a userfaultfd closes it, the kernel unregisters its ranges and every
page not yet served reads as zero from then on: silent corruption. So while the agent serves
a restore (``runtime.pages.stream``), this process, in a session of its own (it outlives a SIGKILL
of the agent and of the agent's process group), holds a copy of every uffd, received over a
unix socket from the agent:

    agent -> holder   HOLD + uffds (SCM_RIGHTS)   hold these too (numbered 0, 1, ... in the
                                                  order received); no answer
    agent -> holder   SYNC                        answers ACK once every earlier uffd is held
    agent -> holder   DROP + number (4 bytes)     close that copy (its task exited)
    agent -> holder   DONE                        all is installed: close every copy, exit 0
    agent -> holder   GIVE_UP                     the agent gave up (and tells the init itself)
    EOF before DONE                               the agent is gone mid-serve

Only SYNC is answered, and the agent reads that answer at once: answers never pile up in the
socket, so neither side ever waits on the other's reading (a tenant that forks in a storm
makes the agent HOLD a uffd per fork, never a byte come back).

On EOF before "D", the tasks whose pages are not all there block on their next fault (their
uffds stay open here); the holder SIGKILLs the restored tree (the init's descendants in its
pid namespace, by parentage) that started before the agent went away, writes ``restore-failed``
into the control dir unless an outcome is there already or the rootfs still holds the restore's changes
(``rootfs-pending``: then the next agent rolls them back and fails the restore, once), then
closes its copies and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from runtime import control as control_mod
from runtime.proc import procfs, tasks

log = logging.getLogger("rekindle.stream_holder")
REASON = "the agent went away while it served the restored memory"
# The one-byte messages of the agent's socket (runtime.pages.stream.Holder speaks them)
HOLD, SYNC, ACK, DROP, DONE, GIVE_UP = b"F", b"S", b"A", b"C", b"D", b"X"
NUMBER_BYTES = 4  # of DROP's copy number (little-endian)
MAX_FDS = 64  # per HOLD
_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, int] | None:
    """(pid namespace inode, start time in clock ticks since boot) of ``pid``."""
    try:
        ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None
    start = procfs.start_time(pid)
    return (ns, start) if start is not None else None


def kill_namespace(pidns: int, init_pid: int, started_before: int) -> list[int]:
    """SIGKILL the restored tree: every descendant of ``init_pid`` in pid namespace ``pidns``
    that started before ``started_before`` (clock ticks since boot), never a task of the
    namespace that the init's tree did not fork; the pids signalled."""
    return tasks.kill_descendants(init_pid, pidns, wait=5.0, started_before=started_before)


def shield_from_oom(knob: str = "/proc/self/oom_score_adj") -> bool:
    """Make this process the last an OOM kill picks (-1000). It runs in the target's memory
    cgroup with the plugin's score, where a Guaranteed pod's tasks have -997: the memcg's first
    victim otherwise, and with it gone an agent that dies next leaves the tree on zero pages.
    Its own memory is an interpreter's few MiB. False where the kernel refuses (no
    CAP_SYS_RESOURCE): said in the log, the serve goes on."""
    try:
        with open(knob, "w") as f:
            f.write("-1000")
        return True
    except OSError as exc:
        log.warning("uffd holder: cannot lower its oom_score_adj (%s); a memory cgroup OOM may pick it first", exc)
        return False


def now_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TICKS) + 1


def serve(sock: socket.socket, pidns: int, init_pid: int, control: str | None) -> int:
    held: dict[int, int] = {}  # copy number -> our fd
    received = 0
    why = REASON
    try:
        while True:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1, MAX_FDS)
            for fd in fds:  # whatever the message: never leak one
                held[received] = fd
                received += 1
            if msg == HOLD:
                pass
            elif msg == SYNC:
                sock.sendall(ACK)
            elif msg == DROP:
                number = int.from_bytes(_recv_exact(sock, NUMBER_BYTES), "little")
                fd = held.pop(number, -1)
                if fd >= 0:
                    os.close(fd)
            elif msg == DONE:
                return 0
            elif msg == GIVE_UP:
                control = None  # the agent writes restore-failed with its reason
                why = "the agent gave up the serve"
                break
            elif msg == b"":
                break
            else:
                why = f"the agent sent {msg!r}"
                break
    except OSError as exc:
        log.error("uffd holder: the agent's socket failed: %s", exc)
    # The agent is gone before the last piece: nothing it did not serve may be read.
    before = now_ticks()
    killed = kill_namespace(pidns, init_pid, before)
    log.error("uffd holder: %s; killed %s", why, killed)
    if control is not None:
        ctl = control_mod.ControlDir(Path(control))
        try:
            # With the rootfs still to be rolled back, the verdict is the next agent's (it rolls
            # back first): the init would not start cold on that rootfs.
            if not any(ctl.exists(n) for n in (control_mod.RESTORE_COMPLETE, control_mod.RESTORE_FAILED,
                                               control_mod.COLD_START, control_mod.ROOTFS_PENDING)):
                ctl.write(control_mod.RESTORE_FAILED, REASON + "\n")
        except OSError as exc:
            log.error("uffd holder: cannot tell the init to start cold: %s", exc)
    # The killed tasks leave their faults once they die; only then close the copies.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_stat(str(p)) is not None and _zombie_or_alive(p) for p in killed):
        time.sleep(0.01)
    return 1


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            raise ConnectionError("the agent's socket closed mid-message")
        buf += got
    return buf


def _zombie_or_alive(pid: int) -> bool:
    st = procfs.read_stat(pid)
    return st is not None and st.state != "Z"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.pages.holder")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--pidns", type=int, required=True)
    p.add_argument("--init-pid", type=int, required=True)
    p.add_argument("--control")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C for the agent is not ours
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    shield_from_oom()
    sock = socket.socket(fileno=args.fd)
    try:
        return serve(sock, args.pidns, args.init_pid, args.control)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
