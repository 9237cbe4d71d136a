"""Which container the real plugin acts on, through real containerd: a pod with two containers
and none named is not checkpointed (and says why); a restarted source container whose artifact
is published does not checkpoint again, unless the pod asks to overwrite."""

from __future__ import annotations

from runtime.store.volume import ArtifactStore
from tests.e2e.test_checkpoint_restore import COUNTER, SERVER, checkpoint_source, wait_status

BUSYBOX = "localhost/rekindle/busybox:1"
SLEEP = ["/bin/sh", "-c", "exec sleep 3600"]


def test_two_containers_and_none_named_take_no_checkpoint(sandbox, pod, plugin):
    p = pod("two-ctr", annotations={"rekindle.dev/checkpoint": "two-ctr"})
    app = sandbox.run_container(p, "app", BUSYBOX, command=SLEEP)
    sandbox.run_container(p, "sidecar", BUSYBOX, command=SLEEP)
    res = sandbox.cri.exec_sync(app, ["/bin/sh", "-c", "touch /rekindle/ready-for-checkpoint"], timeout=10)
    assert res.exit_code == 0, res.err
    st = wait_status(plugin, "default", p.name, "app", {"skipped", "published", "checkpoint-failed"})
    assert st["phase"] == "skipped", st
    assert "several containers (sidecar besides this one)" in st["reason"]
    assert "rekindle.dev/container" in st["reason"]
    failed = plugin.control_dir(p.uid, "app") / "checkpoint-failed"
    assert failed.read_text().startswith("skipped: the pod runs several containers")
    assert not (plugin.store / "default" / "two-ctr").exists()
    assert "several containers" in plugin.log()


def test_restarted_source_does_not_checkpoint_again_unless_asked(sandbox, pod, plugin):
    a, cid, _ip = checkpoint_source(sandbox, pod, plugin, "once")
    key = (plugin.state_dir / "hmac.key").read_bytes()
    with ArtifactStore(str(plugin.store)).open("default", "once", key) as art:
        first = art.manifest.generation
    # The kubelet restarts the container: a new one, same name, next attempt, same pod.
    sandbox.cri.stop_container(cid, grace_seconds=2)
    again = sandbox.run_container(a, "server", COUNTER, command=SERVER, attempt=1)
    st = wait_status(plugin, "default", a.name, "server", {"skipped"}, timeout=20)
    assert "is already published" in st["reason"] and st["container_id"] == again
    env = sandbox.cri.exec_sync(again, ["/bin/sh", "-c", "env"], timeout=10).out
    assert "REKINDLE_CONTROL_DIR" not in env  # left alone: runs as a plain container
    with ArtifactStore(str(plugin.store)).open("default", "once", key) as art:
        assert art.manifest.generation == first

    b = pod("src-once-again", annotations={"rekindle.dev/checkpoint": "once", "rekindle.dev/overwrite": "true"})
    sandbox.run_container(b, "server", COUNTER, command=SERVER)
    st = wait_status(plugin, "default", b.name, "server", {"published", "checkpoint-failed", "skipped"})
    assert st["phase"] == "published", st
    with ArtifactStore(str(plugin.store)).open("default", "once", key) as art:
        assert art.manifest.generation > first and art.manifest.source.pod == b.name
