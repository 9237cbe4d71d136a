"""`rekindle restore` (the node operator's manual path) against real containerd + runc + CRIU:
it refuses a container the plugin did not prepare before it touches it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.test_checkpoint_restore import COUNTER, checkpoint_source

REPO = Path(__file__).resolve().parents[2]


def cli_restore(sandbox, plugin, container_id: str, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nri_plugin", "restore", "--container-id", container_id, "--namespace", "default",
         "--name", name, "--state-dir", str(plugin.state_dir), "--store", str(plugin.store),
         "--containerd-socket", str(sandbox.containerd_socket), "--containerd-state", str(sandbox.state_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=120)


def tree(root: str) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` (not following links) -> (mode, size)."""
    out: dict[str, tuple[int, int]] = {}
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            st = os.lstat(os.path.join(d, n))
            out[os.path.relpath(os.path.join(d, n), root)] = (st.st_mode, st.st_size)
    return out


def test_restore_into_a_running_container_it_did_not_prepare_is_refused_untouched(sandbox, pod, plugin):
    from runtime.container.containers import resolve_container
    checkpoint_source(sandbox, pod, plugin, "cli-live-target")
    # A live container of the same image, not annotated: Rekindle never prepared it.
    live = pod("cli-live")
    cid = sandbox.run_container(live, "app", COUNTER, command=["/bin/sleep", "1000"])
    target = resolve_container(str(sandbox.state_dir), cid)
    before = tree(target.upperdir)

    res = cli_restore(sandbox, plugin, cid, "cli-live-target")
    assert res.returncode == 1, res
    assert res.stderr.splitlines() == [
        f"rekindle: error: container {cid[:12]} is not waiting for a restore: it runs '/bin/sleep', not "
        "/.rekindle/bin/rekindle-init in restore mode; nothing was changed (restore only into a container "
        "the plugin prepared: rekindle.dev/restore on its pod)"], res.stderr
    # Nothing of the artifact reached it: not its files, not its processes.
    assert tree(target.upperdir) == before
    assert not Path(target.rootfs, "var/lib/counter/state.txt").exists()
    ps = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ps -o args"], timeout=10)
    assert "counter-server" not in ps.out and "sleep 1000" in ps.out, ps.out
    assert sandbox.cri.container_status(cid).state.name == "RUNNING"
