"""rekindle.dev/on-restore-failure: fail through real containerd + runc + CRIU and the plugin: a
restore that fails (a flipped byte in the artifact, found by the engine after start; or no
artifact at all, found at CreateContainer) fails the container with the init's status 75 and the
reason in its log, and the original command never runs (it would write a marker first)."""

from __future__ import annotations

import pytest

from devtools.cri import ContainerState
from tests.e2e.test_checkpoint_restore import COUNTER, SERVER, checkpoint_source, wait_status

FAIL_CLOSED_STATUS = 75
# The original command: a marker in the control dir (the host sees it), then the server.
MARKED = ["/bin/sh", "-c", "echo ran > /rekindle/original-ran; exec " + " ".join(SERVER)]


@pytest.mark.parametrize("case", ["flipped-byte", "missing-artifact"])
def test_a_failed_restore_fails_the_container_and_never_runs_its_command(sandbox, pod, plugin, case):
    name = f"closed-{case}"
    if case == "flipped-byte":
        checkpoint_source(sandbox, pod, plugin, name)
        pages = sorted((plugin.store / "default" / name / "criu").glob("pages-*.img"))[0]
        data = bytearray(pages.read_bytes())
        data[len(data) // 2] ^= 0xFF
        pages.write_bytes(bytes(data))
        reason = "content changed"
    else:
        reason = f"default/{name} not found"
    b = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name, "rekindle.dev/on-restore-failure": "fail"})
    cid = sandbox.run_container(b, "server", COUNTER, command=MARKED)
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start", "restore-failed", "ignored"})
    assert st["phase"] == "restore-failed", st
    assert reason in st["reason"], st
    exited = sandbox.cri.wait_container(cid, states=(ContainerState.EXITED,), timeout=60)
    assert exited.exit_code == FAIL_CLOSED_STATUS, exited
    ctl = plugin.control_dir(b.uid, "server")
    assert not (ctl / "original-ran").exists() and not (ctl / "cold-start").exists()
    stderr = "\n".join(sandbox.cri.logs(cid, "stderr"))
    assert "not starting the original command (on-restore-failure: fail)" in stderr and reason in stderr, stderr
    log = plugin.log()
    assert "restore_failed" in log and f"default/{b.name}:server" in log
