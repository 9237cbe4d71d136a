"""A restore whose process dies right after it is reported as such, not as restored: the status
record, the metrics and the Event say ``restore-exited`` with the exit status, through real
containerd + runc + CRIU and the plugin.

The workload belongs to its first pod: it reads its hostname (the pod's /etc/hostname) at start
and checks it every 0.1 s. Checkpointed, it runs on in its own pod; restored into another pod,
it wakes up under a new name and crashes (SIGSEGV: exit status 139), as a server does that
finds itself on an identity it did not start with."""

from __future__ import annotations

import pytest

from devtools.cri import ContainerState
from tests.e2e.plugin_process import PluginProcess
from tests.e2e.test_checkpoint_restore import wait_status
from tests.e2e.test_observability import _free_port, api, events_for, scrape, wait_metric  # noqa: F401
from tests.waiting import wait_for

BUSYBOX = "localhost/rekindle/busybox:1"
BELONGS_TO_ITS_POD = r"""
read -r first < /etc/hostname
echo "serving as $first"
: > "$REKINDLE_CONTROL_DIR/ready-for-checkpoint"
while read -r now < /etc/hostname && [ "$now" = "$first" ]; do sleep 0.1; done
echo "woke up as $now, not $first: giving up"
kill -SEGV $$
"""


@pytest.fixture(scope="module")
def plugin(sandbox, tmp_path_factory, api):  # noqa: F811 - the fake API server of test_observability
    work = tmp_path_factory.mktemp("exited")
    port = _free_port()
    p = PluginProcess(sandbox, work / "plugin", extra_args=[
        "--metrics-port", str(port), "--metrics-address", "127.0.0.1",
        "--events", "--kubeconfig", str(api.kubeconfig(work / "kubeconfig")), "--node-name", "node-e2e"])
    p.port = port  # type: ignore[attr-defined]
    p.start()
    yield p
    p.stop()


def settled(plugin: PluginProcess, pod: str, container: str, timeout: float = 60.0) -> dict:
    """The status record once it leaves restore-pending/restoring (phases as plain strings)."""
    import json

    from runtime.status import StatusBook

    def done() -> dict | None:
        st = StatusBook(plugin.state_dir).read("default", pod, container)
        doc = json.loads(st.to_json()) if st is not None else None
        return doc if doc and doc["phase"] not in ("restore-pending", "restoring") else None
    return wait_for(done, timeout, f"the restore of {pod} to settle", interval=0.1)


def test_a_restored_process_that_dies_at_once_is_reported_restore_exited(sandbox, pod, plugin, api):
    a = pod("exits-src", annotations={"rekindle.dev/checkpoint": "belongs-to-its-pod"})
    a_cid = sandbox.run_container(a, "app", BUSYBOX, command=["/bin/sh", "-c", BELONGS_TO_ITS_POD])
    st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"})
    assert st["phase"] == "published", st
    before = scrape(plugin.port)

    b = pod("exits-dst", annotations={"rekindle.dev/restore": "belongs-to-its-pod"})
    b_cid = sandbox.run_container(b, "app", BUSYBOX, command=["/bin/sh", "-c", BELONGS_TO_ITS_POD])
    st = settled(plugin, b.name, "app")
    assert st["phase"] == "restore-exited", (st["phase"], st["reason"])
    assert st["reason"] == "the restored process exited right after the restore (exit status 139: SIGSEGV)", st
    # It was restored (CRIU ran, the process woke up in B), then died: CRI agrees on the status.
    b_status = sandbox.cri.wait_container(b_cid, timeout=30)
    assert b_status.exit_code == 139, b_status
    # (the shim writes the log after the fact: wait for the line)
    wait_for(lambda: any("woke up as exits-dst" in line for line in sandbox.cri.logs(b_cid)), 10,
             "B's log to say the restored process woke up in B", interval=0.1)
    # The metrics and the Event say so; no restored outcome was counted.
    exited = 'rekindle_outcomes_total{outcome="restore_exited",reason="exited"}'
    after = wait_metric(plugin.port, exited, before.get(exited, 0.0) + 1)
    restored = 'rekindle_outcomes_total{outcome="restored",reason="none"}'
    assert after.get(restored, 0.0) == before.get(restored, 0.0)
    event = events_for(api, b.name, "RestoreExited")
    assert event["type"] == "Warning" and "exit status 139" in event["message"], event
    # The source, in its own pod, runs on.
    assert sandbox.cri.container_status(a_cid).state is ContainerState.RUNNING
