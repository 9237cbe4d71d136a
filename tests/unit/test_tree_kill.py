"""A failed restore's clean-up kills the restored tree only, by parentage, never every task of the
pid namespace; a container whose pid namespace is not its own is told apart from /proc.

A real pid namespace (``unshare --pid``) shaped like a ``shareProcessNamespace`` pod: its pid 1
stands in for the sandbox's pause, one child for the target container's init (with a "restored
tree" below it, two levels deep), another child for a sidecar."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime import restore
from runtime.container.containers import children
from runtime.container.namespaces import pid_namespace_shared
from runtime.pages import holder
from runtime.proc import tasks
from tests.waiting import wait_for

# ns pid 1 runs the "container init" (a shell whose tree is sleeps two deep) and a sidecar sleep.
# The init outlives its tree (as rekindle-init does): it execs a sleep once the tree is gone.
SCRIPT = ("sh -c 'sleep 1001 & sh -c \"sleep 1002 & wait\" & wait; exec sleep 1005' & "
          "sleep 1003 & wait")


@dataclass
class Shared:
    pause: int  # the namespace's pid 1
    init: int   # the target container's init
    sidecar: int
    tree: list[int]  # what the init forked


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _cmd(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


@pytest.fixture
def shared() -> Iterator[Shared]:
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", SCRIPT])
    try:
        pause = wait_for(lambda: children(proc.pid)[0] if children(proc.pid) else 0, 10, "the namespace's pid 1")

        def shape() -> Shared | None:
            kids = children(pause)
            init = [k for k in kids if _cmd(k).startswith("sh -c")]
            side = [k for k in kids if _cmd(k) == "sleep 1003"]
            if not init or not side:
                return None
            tree = tasks.descendants(init[0])
            if sorted(_cmd(p) for p in tree) != ["sh -c sleep 1002 & wait", "sleep 1001", "sleep 1002"]:
                return None
            return Shared(pause, init[0], side[0], tree)
        found = wait_for(shape, 10, "the namespace's tasks")
        assert found is not None
        yield found
    finally:
        proc.kill()  # unshare's child is pid 1 there: its end kills the namespace
        proc.wait()
        for p in tasks.descendants(proc.pid):
            tasks.kill_all([p])


def test_descendants_are_found_by_parentage(shared: Shared) -> None:
    assert shared.sidecar not in shared.tree and shared.init not in shared.tree
    assert set(tasks.descendants(shared.pause)) >= {shared.init, shared.sidecar, *shared.tree}


def test_a_shared_pid_namespace_is_told_apart_from_a_containers_own() -> None:
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "sleep", "1004"])
    try:
        own = wait_for(lambda: children(proc.pid)[0] if children(proc.pid) else 0, 10, "pid 1 of a new namespace")
        assert pid_namespace_shared(own) is None
        why = pid_namespace_shared(os.getpid())  # the node's namespace: a hostPID container's
        assert why is not None and "not its own" in why
    finally:
        proc.kill()
        proc.wait()


def test_a_pod_shared_namespace_is_refused_from_proc(shared: Shared) -> None:
    why = pid_namespace_shared(shared.init)
    assert why is not None and "not its own" in why, why
    assert pid_namespace_shared(shared.pause) is None


def test_a_failed_restores_clean_up_kills_the_restored_tree_only(shared: Shared) -> None:
    restore._kill_leftovers(shared.init)
    wait_for(lambda: not any(_alive(p) for p in shared.tree), 10, "the restored tree gone")
    # The sidecar, the namespace's pid 1 and the container's own init live on.
    assert _alive(shared.sidecar) and _alive(shared.pause) and _alive(shared.init)


def test_the_holders_kill_reaches_the_restored_tree_only(shared: Shared) -> None:
    pidns = os.stat(f"/proc/{shared.init}/ns/pid").st_ino
    killed = holder.kill_namespace(pidns, shared.init, holder.now_ticks())
    assert sorted(killed) == sorted(shared.tree)
    wait_for(lambda: not any(_alive(p) for p in shared.tree), 10, "the restored tree gone")
    assert _alive(shared.sidecar) and _alive(shared.pause) and _alive(shared.init)


def test_a_reused_init_pid_in_another_namespace_kills_nothing(shared: Shared) -> None:
    assert tasks.kill_descendants(shared.init, pidns=1, wait=0.1) == []
    assert all(_alive(p) for p in shared.tree)


def test_the_holder_makes_itself_the_last_oom_victim(tmp_path: Path) -> None:
    knob = tmp_path / "oom_score_adj"
    knob.write_text("0\n")
    assert holder.shield_from_oom(str(knob)) and knob.read_text() == "-1000"
    assert not holder.shield_from_oom(str(tmp_path / "gone" / "oom_score_adj"))  # refused: the serve goes on
