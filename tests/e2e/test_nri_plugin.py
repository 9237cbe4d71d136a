"""The plugin against real containerd (1.7.24 by default; 2.1.9 where marked): handshake,
adjustments seen from inside running containers, the plugin or containerd going away, a handler
error answered empty, and slow-loris probe targets that must not stall other pods' creates."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import time

import pytest

from tests.e2e.plugin_process import PluginProcess
from tests.e2e.slow_servers import SlowServers
from tests.waiting import wait_for

BUSYBOX = "localhost/rekindle/busybox:1"
SLEEP = ["/bin/sh", "-c", "echo started; exec sleep 3600"]


@pytest.fixture
def plugin(sandbox, tmp_path):
    p = PluginProcess(sandbox, tmp_path / "plugin")
    p.start()
    yield p
    p.stop()


def _run(sandbox, pod, name="app", cmd=SLEEP):
    cid = sandbox.run_container(pod, name, BUSYBOX, command=cmd)
    return cid


def _exec(sandbox, cid, script):
    res = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", script], timeout=10)
    assert res.exit_code == 0, res.err
    return res.out


def test_handshake_registers_with_containerd(sandbox, plugin):
    log = sandbox.log_tail(400).replace("\\\"", "\"")
    assert 'plugin "50-rekindle" connected' in log
    assert "configured by containerd" in plugin.log()
    assert "CREATE_CONTAINER|POST_CREATE_CONTAINER|POST_START_CONTAINER|STOP_CONTAINER" in plugin.log()


def test_annotated_pod_gets_control_dir_env_and_init(sandbox, plugin, pod):
    p = pod(annotations={"rekindle.dev/checkpoint": "demo"})
    cid = _run(sandbox, p)
    env = _exec(sandbox, cid, "env")
    assert "REKINDLE_CONTROL_DIR=/rekindle" in env
    assert "SNAPSHOT_CONTROL_DIR=/rekindle" in env
    # The control dir is the host dir the plugin made for this pod/container.
    _exec(sandbox, cid, "echo hello > /rekindle/probe-file")
    host = plugin.control_dir(p.uid, "app") / "probe-file"
    assert host.read_text() == "hello\n"
    # The same dir at Dynamo's default path, for hooks that do not read the environment.
    _exec(sandbox, cid, "echo dynamo > /snapshot-control/probe-dynamo")
    assert (plugin.control_dir(p.uid, "app") / "probe-dynamo").read_text() == "dynamo\n"
    assert _exec(sandbox, cid, "cat /rekindle/probe-dynamo") == "dynamo\n"
    # The entrypoint was swapped: the init is PID 1, the workload its child.
    cmdline = _exec(sandbox, cid, "tr '\\0' ' ' < /proc/1/cmdline")
    assert cmdline.startswith("/.rekindle/bin/rekindle-init --mode source")
    assert "sleep 3600" in _exec(sandbox, cid, "ps -o pid,args")
    # The init is read-only inside the container.
    res = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "echo x > /.rekindle/bin/rekindle-init"], timeout=10)
    assert res.exit_code != 0


def test_pod_without_annotations_is_left_untouched(sandbox, plugin, pod):
    p = pod()
    cid = _run(sandbox, p)
    env = _exec(sandbox, cid, "env")
    assert "REKINDLE" not in env and "SNAPSHOT_CONTROL_DIR" not in env
    assert " /rekindle " not in _exec(sandbox, cid, "cat /proc/mounts")
    assert _exec(sandbox, cid, "tr '\\0' ' ' < /proc/1/cmdline").startswith("sleep 3600")


def test_malformed_annotation_starts_unadjusted_with_a_log_line(sandbox, plugin, pod):
    p = pod(name="bad-annotation", annotations={"rekindle.dev/checkpoint": "../etc"})
    cid = _run(sandbox, p)
    assert "REKINDLE" not in _exec(sandbox, cid, "env")
    line = plugin.wait_log("annotation rekindle.dev/checkpoint")
    assert "default/bad-annotation:app" in line and "artifact name must be" in line


def test_plugin_killed_midrun_containerd_goes_on_and_plugin_resyncs(sandbox, plugin, pod):
    plugin.kill()
    p = pod(annotations={"rekindle.dev/checkpoint": "while-away"})
    t0 = time.monotonic()
    cid = _run(sandbox, p)  # no plugin: created and started, unadjusted
    assert time.monotonic() - t0 < 10
    assert "REKINDLE" not in _exec(sandbox, cid, "env")
    plugin.start()  # comes back and is synchronized with what exists
    text = plugin.log()
    sync = [l for l in text.splitlines() if "synchronized:" in l][-1]
    assert int(sync.split("synchronized:")[1].split("pods")[0]) >= 1
    p2 = pod(annotations={"rekindle.dev/checkpoint": "after-return"})
    cid2 = _run(sandbox, p2)
    assert "REKINDLE_CONTROL_DIR=/rekindle" in _exec(sandbox, cid2, "env")


def test_plugin_reconnects_after_containerd_restart(sandbox, plugin, pod):
    sb = sandbox.sandbox
    before = plugin.log().count("registered as")
    pid = sb.pid()
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not sb.is_running(), 20, "containerd to exit", interval=0.1)
    plugin.wait_log("disconnected from the runtime")
    sb.up(import_images=False)
    plugin.wait_log("registered as", count=before + 1, timeout=30)
    plugin.wait_log("synchronized:", count=2, timeout=30)
    p = pod(annotations={"rekindle.dev/checkpoint": "after-restart"})
    cid = _run(sandbox, p)
    assert "REKINDLE_CONTROL_DIR=/rekindle" in _exec(sandbox, cid, "env")


def test_handshake_and_adjustment_on_containerd_2_1(sandbox_factory, pod, tmp_path):
    sb21 = sandbox_factory("2.1")
    plugin = PluginProcess(sb21, tmp_path / "plugin21")
    plugin.start()
    try:
        assert "configured by containerd 2.1" in plugin.log()
        assert "(NRI 0.8.0)" in plugin.log()
        p = pod(annotations={"rekindle.dev/checkpoint": "demo21"}, on=sb21)
        cid = _run(sb21, p)
        assert "REKINDLE_CONTROL_DIR=/rekindle" in _exec(sb21, cid, "env")
        assert _exec(sb21, cid, "tr '\\0' ' ' < /proc/1/cmdline").startswith("/.rekindle/bin/rekindle-init")
        q = pod(on=sb21)
        cid2 = _run(sb21, q)
        assert "REKINDLE" not in _exec(sb21, cid2, "env")
    finally:
        plugin.stop()


def test_entrypoint_swap_takes_the_route_of_the_runtimes_nri(sandbox, plugin, pod):
    """From NRI 0.10 (containerd 2.2 on) the init goes in through the CreateContainer reply's
    ``args`` adjustment: the spec containerd stores is the one NRI adjusted, written once when the
    container is made, and the plugin never writes it through the Containers API (an Update would
    move the record's ``updated_at`` past its ``created_at`` and leave the original-args
    annotation the rewrite adds). Before 0.10 the plugin rewrites the stored spec, once."""
    args_route = sandbox.runtime not in ("1.7", "2.1")
    p = pod(annotations={"rekindle.dev/checkpoint": "route"})
    cid = sandbox.cri.create_container(p, "app", BUSYBOX, command=SLEEP)
    stored = sandbox.containerd().get(cid)
    args = stored.spec["process"]["args"]
    # Either way the swap is in the stored spec before the CRI create returns.
    assert args[0] == "/.rekindle/bin/rekindle-init" and args[-len(SLEEP):] == SLEEP, args
    annotations = stored.spec.get("annotations", {})
    written_once = stored.raw.updated_at == stored.raw.created_at
    if args_route:
        assert written_once, (f"the stored spec was written again after the create "
                              f"({stored.raw.created_at.ToJsonString()} -> {stored.raw.updated_at.ToJsonString()})")
        assert "rekindle.dev/original-args" not in annotations
        assert "entrypoint swap: args-adjustment" in plugin.log()
    else:
        assert not written_once
        assert json.loads(annotations["rekindle.dev/original-args"]) == SLEEP
        assert "entrypoint swap: spec-update" in plugin.log()
    sandbox.cri.start_container(cid)
    # The task runs what was stored: the bundle's spec and PID 1 are the adjusted command.
    assert json.loads((sandbox.bundle(cid) / "config.json").read_text())["process"]["args"] == args
    assert _exec(sandbox, cid, "tr '\\0' '\\n' < /proc/1/cmdline").splitlines() == args
    assert sandbox.containerd().get(cid).raw.updated_at == stored.raw.updated_at  # nor after the start


def test_plugin_restart_resumes_a_pending_checkpoint(sandbox, plugin, pod):
    """Killed while a source warms up, the plugin picks the source up again on Synchronize."""
    p = pod(annotations={"rekindle.dev/checkpoint": "resumed"})
    sandbox.run_container(p, "server", "localhost/rekindle/counter:1",
                                command=["/usr/local/bin/counter-server", "8080"],
                                env={"WARMUP_MIB": "256", "WARMUP_PASSES": "12"})
    plugin.kill()  # before the workload is ready
    plugin.start()
    plugin.wait_log("resuming checkpoint watch after plugin restart")
    status = plugin.state_dir / "status" / "default" / p.name / "server.json"
    wait_for(lambda: json.loads(status.read_text())["phase"] in ("published", "checkpoint-failed"), 60,
             "the resumed checkpoint's outcome", interval=0.2, ignore=(OSError, ValueError))
    assert json.loads(status.read_text())["phase"] == "published", plugin.log()[-3000:]
    assert (plugin.store / "default" / "resumed" / "manifest.json").exists()


def test_create_fails_open_when_the_control_dir_cannot_be_made(sandbox, plugin, pod):
    """An OSError inside CreateContainer (here: a file where the pod's control root belongs)
    is answered empty: the container is created and runs its own command, the status says why."""
    p = pod(name="no-control-dir", annotations={"rekindle.dev/checkpoint": "blocked"})
    root = plugin.state_dir / "control"
    root.mkdir(parents=True, exist_ok=True)
    (root / p.uid).write_text("not a directory")
    cid = _run(sandbox, p)
    assert "REKINDLE" not in _exec(sandbox, cid, "env")
    assert _exec(sandbox, cid, "tr '\\0' ' ' < /proc/1/cmdline").startswith("sleep 3600")
    status = json.loads((plugin.state_dir / "status" / "default" / p.name / "app.json").read_text())
    assert status["phase"] == "cold-start" and "control" in status["reason"], status


def _threads(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def test_slow_probe_targets_do_not_stall_other_creates(sandbox, plugin, pod):
    """Twelve checkpoint sources whose HTTP ready-probes hit slow-loris targets, then twenty
    ordinary creates: every create is answered well inside NRI's 2 s budget, and the plugin's
    thread count stays flat while the slow targets are probed."""
    gateway = str(ipaddress.ip_network(sandbox.subnet)[1])  # the bridge: reachable from every pod
    containerd_log_start = sandbox.log_path.stat().st_size
    plugin_log_start = len(plugin.log())
    threads_before = _threads(plugin.proc.pid)
    # Bound to every address: the bridge gets the gateway address only with its first pod.
    with SlowServers("0.0.0.0", ["silent", "dribble", "dribble"] * 4) as slow:
        for i, port in enumerate(slow.ports):
            p = pod(name=f"loris-{i}", annotations={"rekindle.dev/checkpoint": f"loris-{i}",
                                                    "rekindle.dev/ready-probe": f"http://{gateway}:{port}/ready"})
            _run(sandbox, p)
        slow.wait_probed(times=2, timeout=60)

        slowest = 0.0
        for i in range(20):
            annotations = {"rekindle.dev/restore": f"missing-{i}"} if i % 2 == 0 else None
            p = pod(name=f"ordinary-{i}", annotations=annotations)
            t0 = time.monotonic()
            cid = sandbox.cri.create_container(p, "app", BUSYBOX, command=SLEEP)
            took = time.monotonic() - t0
            slowest = max(slowest, took)
            assert took < 2.0, f"CreateContainer of {p.name} took {took:.2f}s"
            sandbox.cri.start_container(cid)
        slow.wait_probed(times=6, timeout=60)  # the slow targets were probed all along
        threads_after = _threads(plugin.proc.pid)

    text = plugin.log()[plugin_log_start:]
    assert "overran its" not in text, [l for l in text.splitlines() if "overran its" in l][:5]
    with open(sandbox.log_path, errors="replace") as f:
        f.seek(containerd_log_start)
        runtime_log = f.read()
    for needle in ("closing plugin", "failed to handle event", "context deadline exceeded"):
        assert needle not in runtime_log, [l for l in runtime_log.splitlines() if needle in l][:5]
    assert threads_after <= threads_before + 8, (threads_before, threads_after)
    for i in range(0, 20, 2):
        status = json.loads((plugin.state_dir / "status" / "default" / f"ordinary-{i}" / "app.json").read_text())
        assert status["phase"] == "cold-start" and f"missing-{i}" in status["reason"], status
    print(f"slowest create {slowest:.2f}s; plugin threads {threads_before} -> {threads_after}")
