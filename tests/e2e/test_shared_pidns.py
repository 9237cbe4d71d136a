"""A container whose pid namespace is not its own, through real containerd and the plugin: a
``shareProcessNamespace`` pod (the pod's namespace, pid 1 the sandbox's pause) and a ``hostPID``
pod (the node's) are neither checkpointed nor restored, with the reason recorded: a failed
restore's clean-up must never reach the pod's other containers or the node's processes."""

from __future__ import annotations

import pytest

from devtools.cri import NamespaceMode
from tests.e2e.test_checkpoint_restore import COUNTER, SERVER, assert_cold, checkpoint_source, wait_status

BUSYBOX = "localhost/rekindle/busybox:1"


@pytest.mark.parametrize("mode, why", [(NamespaceMode.POD, "shareProcessNamespace"), (NamespaceMode.NODE, "hostPID")],
                         ids=["shareProcessNamespace", "hostPID"])
def test_a_restore_into_a_shared_pid_namespace_starts_cold_with_the_reason(sandbox, pod, plugin, mode, why):
    checkpoint_source(sandbox, pod, plugin, f"shared-{mode.name.lower()}")
    b = pod(f"dst-shared-{mode.name.lower()}", annotations={"rekindle.dev/restore": f"shared-{mode.name.lower()}"},
            pid_mode=mode)
    cid = sandbox.run_container(b, "server", COUNTER, command=SERVER)
    st = assert_cold(sandbox, plugin, b, cid, sandbox.cri.pod_ip(b.id), "restore refused")
    assert "pid namespace is not its own" in st["reason"] and why in st["reason"], st


def test_a_checkpoint_of_a_shared_pid_namespace_is_refused_with_the_reason(sandbox, pod, plugin):
    a = pod("src-shared-pod", annotations={"rekindle.dev/checkpoint": "shared-src"}, pid_mode=NamespaceMode.POD)
    sandbox.run_container(a, "server", COUNTER, command=SERVER)
    st = wait_status(plugin, "default", a.name, "server", {"published", "checkpoint-failed", "skipped"})
    assert st["phase"] == "checkpoint-failed", st
    assert "checkpoint refused" in st["reason"] and "pid namespace is not its own" in st["reason"], st
    assert not (plugin.store / "default" / "shared-src").exists()
