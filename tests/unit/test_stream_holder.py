"""runtime.pages.holder, the second holder of a streamed restore's uffds: when the agent's end
of its socket goes before "done", it kills every process of the restored pid namespace but the
init and tells the init to start cold; after "done" it touches nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from runtime.control import ControlDir
from runtime.pages import stream
from tests.waiting import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")


@pytest.fixture
def pidns():
    """A pid namespace whose init (a sleep) has one child (another sleep)."""
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", "sh", "-c", "sleep 300 & exec sleep 301"])
    try:
        def ns_init() -> int | None:
            kids = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
            return int(kids[0]) if kids else None
        init = wait_for(ns_init, 10, "the namespace's init")
        sleep = wait_for(lambda: (open(f"/proc/{init}/task/{init}/children").read().split() or [None])[0],
                         10, "its child")
        yield os.stat(f"/proc/{init}/ns/pid").st_ino, init, int(sleep)
    finally:
        proc.kill()
        proc.wait(10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_agent_gone_mid_serve_kills_the_tree_but_the_init_and_asks_for_a_cold_start(pidns, tmp_path) -> None:
    ns, init, sleep = pidns
    holder = stream.Holder(ns, init, str(tmp_path))
    r, w = os.pipe()  # stands for a uffd
    holder.hold([r], wait=True)
    os.close(r)
    holder.sock.close()  # the agent's end goes (as when it is SIGKILLed)
    assert holder.proc.wait(10) == 1
    wait_for(lambda: not _alive(sleep), 5, "the tree's process to die")
    assert _alive(init)
    assert "went away" in ControlDir(tmp_path).read(stream_holder_failed())
    os.close(w)


def test_done_closes_the_copies_and_kills_nothing(pidns, tmp_path) -> None:
    ns, init, sleep = pidns
    holder = stream.Holder(ns, init, str(tmp_path))
    r, w = os.pipe()
    holder.hold([r], wait=True)
    os.close(r)
    holder.done()
    assert holder.proc.returncode == 0
    os.close(w)
    time.sleep(0.2)
    assert _alive(sleep) and not (tmp_path / stream_holder_failed()).exists()


def test_an_agent_that_gives_up_kills_the_tree_and_leaves_the_reason_to_itself(pidns, tmp_path) -> None:
    ns, init, sleep = pidns
    holder = stream.Holder(ns, init, str(tmp_path))
    holder.abort()
    assert holder.proc.returncode == 1
    wait_for(lambda: not _alive(sleep), 5, "the tree's process to die")
    assert not (tmp_path / stream_holder_failed()).exists()


def stream_holder_failed() -> str:
    from runtime.control import RESTORE_FAILED
    return RESTORE_FAILED


def _held(holder: stream.Holder) -> int:
    return len(os.listdir(f"/proc/{holder.proc.pid}/fd"))


def test_a_held_uffd_gets_no_answer_and_a_drop_closes_its_copy(pidns, tmp_path) -> None:
    """A fork storm hands the holder a uffd per fork: nothing comes back for them (before, an
    answer each, never read: after ~280 the holder blocked in its send, then the agent in its
    own), and the copy of an exited child's uffd is closed when the agent drops it."""
    ns, init, sleep = pidns
    holder = stream.Holder(ns, init, str(tmp_path))
    r, w = os.pipe()  # stands for a uffd
    holder.hold([r], wait=True)
    before = _held(holder)
    numbers = [n for _ in range(200) for n in holder.hold([r])]
    holder.hold([], wait=True)  # every one of them held by now
    assert _held(holder) == before + 200
    holder.sock.settimeout(0)
    with pytest.raises(BlockingIOError):
        holder.sock.recv(1)  # no answer left behind
    holder.sock.settimeout(stream.HOLDER_SEND_TIMEOUT)
    for n in numbers:
        holder.drop(n)
    wait_for(lambda: _held(holder) == before, 10, "the dropped copies to be closed")
    holder.done()
    assert holder.proc.returncode == 0
    os.close(r)
    os.close(w)
    assert _alive(sleep)
