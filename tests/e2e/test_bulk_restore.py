"""The bulk fill against trees the kernel acts on while CRIU leaves them stopped, through the
real sandbox (containerd + runc + CRIU) and the real plugin: a signal pending at restore (its
frame written on the stack before the fill ran), and a zombie in the tree."""

from __future__ import annotations

from devtools.cri import ContainerState
from runtime.containerd.cri_lookup import CRIError
from tests.e2e.test_multiprocess import BUSYBOX, wait_phase
from tests.waiting import wait_for

# A background child that exits around the checkpoint: its SIGCHLD is pending (or comes from
# the zombie CRIU recreates) when CRIU restores the shell, so the kernel writes the handler's
# frame onto the shell's stack as soon as CRIU lets the tree go, before the fill.
SIGCHLD_SHELL = "sleep 0.3 & touch $REKINDLE_CONTROL_DIR/ready-for-checkpoint; while :; do sleep 1; done"
# The old fill crashed 3 of 10 restores here (exit 139, once 134): 12 rounds miss it ~1% of runs.
ROUNDS = 12


def sleep_pids(sandbox, cid: str) -> set[str]:
    """Pids of the loop's `sleep 1` (a new one each second while the loop runs)."""
    out = sandbox.cri.exec_sync(cid, ["/bin/ps", "-o", "pid,args"]).out
    return {f[0] for f in (ln.split() for ln in out.splitlines()[1:]) if f[1:] == ["sleep", "1"]}


def test_a_signal_pending_at_restore_does_not_crash_the_restored_shell(sandbox, pod, plugin):
    """Each round a fresh checkpoint; the old fill overwrote the signal frame with dumped stack
    bytes and the handler returned to address 0 (exit 139)."""
    for i in range(ROUNDS):
        a = pod(f"sigchld-src-{i}", annotations={"rekindle.dev/checkpoint": f"sigchld-{i}"})
        sandbox.run_container(a, "sh", BUSYBOX, command=["/bin/sh", "-c", SIGCHLD_SHELL])
        wait_phase(plugin, a, "sh", {"published", "checkpoint-failed"}, "published")
        b = pod(f"sigchld-dst-{i}", annotations={"rekindle.dev/restore": f"sigchld-{i}"})
        cid = sandbox.run_container(b, "sh", BUSYBOX, command=["/bin/sh", "-c", SIGCHLD_SHELL])
        wait_phase(plugin, b, "sh", {"restored", "cold-start"}, "restored")
        # Alive and looping: its `sleep 1` is replaced by a new one, twice, after `restored`.
        seen: set[str] = set()

        def looping() -> bool:
            try:
                seen.update(sleep_pids(sandbox, cid))
            except CRIError:  # no exec into a container that exited meanwhile
                pass
            st = sandbox.cri.container_status(cid)
            if st.state is not ContainerState.RUNNING:
                raise AssertionError(f"round {i}: the restored shell exited ({st.exit_code})\n"
                                     f"{plugin.log()[-3000:]}")
            return len(seen) >= 3

        wait_for(looping, 15, f"round {i}: the restored loop to go on", interval=0.2)
        assert sandbox.cri.container_status(cid).state is ContainerState.RUNNING
        sandbox.cri.stop_pod(a.id)
        sandbox.cri.stop_pod(b.id)


# `sleep 0.5` ends after its parent shell became `sleep 100000` (exec), which never reaps it:
# a zombie for good. A second child says ready once it is one, and runs on.
ZOMBIE_PARENT = (
    "sleep 0.5 & z=$!; "
    "(until grep -q ') Z' /proc/$z/stat; do sleep 0.05; done; "
    "touch $REKINDLE_CONTROL_DIR/ready-for-checkpoint; exec sleep 100001) & "
    "exec sleep 100000")


def zombies(sandbox, cid: str) -> list[str]:
    out = sandbox.cri.exec_sync(cid, ["/bin/ps", "-o", "pid,stat,args"]).out
    return [ln for ln in out.splitlines()[1:] if ln.split()[1:2] == ["Z"]]


def test_a_tree_with_a_zombie_checkpoints_and_restores(sandbox, pod, plugin):
    """The checkpoint used to wait for the zombie to stop (10 s) and fail, the source frozen."""
    a = pod("zombie-src", annotations={"rekindle.dev/checkpoint": "zombie"})
    a_cid = sandbox.run_container(a, "app", BUSYBOX, command=["/bin/sh", "-c", ZOMBIE_PARENT])
    wait_phase(plugin, a, "app", {"published", "checkpoint-failed"}, "published", timeout=60)
    assert zombies(sandbox, a_cid)  # the source runs on as it was
    b = pod("zombie-dst", annotations={"rekindle.dev/restore": "zombie"})
    b_cid = sandbox.run_container(b, "app", BUSYBOX, command=["/bin/sh", "-c", ZOMBIE_PARENT])
    wait_phase(plugin, b, "app", {"restored", "cold-start"}, "restored", timeout=60)
    ps = sandbox.cri.exec_sync(b_cid, ["/bin/ps", "-o", "pid,stat,args"]).out
    assert zombies(sandbox, b_cid), f"the restored tree lost its zombie:\n{ps}"
    assert "sleep 100000" in ps and "sleep 100001" in ps, ps
    assert sandbox.cri.container_status(b_cid).state is ContainerState.RUNNING
