"""The sandbox and the CRI client against real containerd: pods, containers, exec, logs, teardown."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from devtools.cri import ContainerState, CRIError, PodState, SecurityContext
from devtools.sandbox import Sandbox
from tests.waiting import wait_for

BUSYBOX = "localhost/rekindle/busybox:1"
COUNTER = "localhost/rekindle/counter:1"


def test_images_are_there(sandbox) -> None:
    images = sandbox.cri.list_images()
    assert "localhost/rekindle/pause:1" in images and BUSYBOX in images


def test_pod_container_exec_logs_ip(sandbox, pod) -> None:
    p = pod()
    ip = sandbox.cri.pod_ip(p.id)
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(sandbox.subnet)

    cid = sandbox.run_container(p, "main", BUSYBOX,
                                command=["/bin/sh", "-c", "echo hello-out; echo hello-err >&2; exec sleep 3600"],
                                env={"GREETING": "hi"})
    st = sandbox.cri.container_status(cid, verbose=True)
    assert st.state is ContainerState.RUNNING
    assert st.pid and Path(f"/proc/{st.pid}").exists()
    assert st.runtime_spec["process"]["args"][0] == "/bin/sh"
    assert sandbox.bundle(cid).joinpath("config.json").exists()

    r = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "echo $GREETING; tr '\\0' ' ' </proc/1/cmdline; echo; hostname"])
    assert r.exit_code == 0, r.err
    greeting, cmdline, hostname = r.out.splitlines()
    assert greeting == "hi"
    assert cmdline.strip() == "sleep 3600"  # own pid namespace (kubelet's default): PID 1 is the workload
    assert hostname == p.name
    assert sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "exit 7"]).exit_code == 7

    # Container IP as seen inside equals the pod IP (network namespace shared with the pause container).
    assert ip in sandbox.cri.exec_sync(cid, ["ip", "-4", "addr", "show", "eth0"]).out

    def logs_ready() -> bool:
        return sandbox.cri.logs(cid) == ["hello-out"] and sandbox.cri.logs(cid, "stderr") == ["hello-err"]
    _wait(logs_ready, 5, "container logs")
    assert Path(st.log_path).is_relative_to(p.log_directory)

    sandbox.cri.stop_container(cid, grace_seconds=1)
    assert sandbox.cri.container_status(cid).state is ContainerState.EXITED
    assert [c.id for c in sandbox.cri.list_containers(p.id)] == [cid]


def test_security_context_and_exit_code(sandbox, pod) -> None:
    p = pod()
    cid = sandbox.run_container(p, "user", BUSYBOX, command=["/bin/sh", "-c", "id -u; id -g; exit 3"],
                                security=SecurityContext(run_as_user=1000, run_as_group=1000,
                                                         drop_capabilities=("ALL",)))
    st = sandbox.cri.wait_container(cid, timeout=15)
    assert st.exit_code == 3
    _wait(lambda: sandbox.cri.logs(cid) == ["1000", "1000"], 5, "logs")


def test_spec_update_before_start_changes_args(sandbox, pod) -> None:
    p = pod()
    cid = sandbox.cri.create_container(p, "swap", BUSYBOX, command=["echo", "original"])
    with sandbox.containerd() as cc:
        rec = cc.get(cid)
        spec = rec.spec
        spec["process"]["args"] = ["echo", "swapped"]
        after = cc.update_spec(cid, spec)
    assert after.spec_type_url == rec.spec_type_url
    assert after.spec["process"]["args"] == ["echo", "swapped"]
    sandbox.cri.start_container(cid)
    sandbox.cri.wait_container(cid, timeout=15)
    _wait(lambda: sandbox.cri.logs(cid) == ["swapped"], 5, "logs")


def test_counter_image(sandbox, pod) -> None:
    if COUNTER not in sandbox.cri.list_images():
        pytest.skip("counter image not built (make, then sandbox up)")
    p = pod()
    cid = sandbox.run_container(p, "counter", COUNTER, command=["/bin/sh", "-c", "exec sleep 3600"])
    r = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "test -x /usr/local/bin/counter-server && cat /etc/counter/delete-me"])
    assert r.exit_code == 0 and r.out


def test_errors_name_the_operation(sandbox) -> None:
    with pytest.raises(CRIError, match="ContainerStatus") as e:
        sandbox.cri.container_status("does-not-exist")
    assert e.value.code is not None


def test_second_sandbox_2_1_and_clean_teardown(sandbox_factory, pod) -> None:
    extra = sandbox_factory("2.1")
    assert extra.cri.version().runtime_version.startswith("2.1")
    assert extra.nri_socket.exists()
    p = pod(on=extra)
    assert ipaddress.ip_address(extra.cri.pod_ip(p.id)) in ipaddress.ip_network(extra.subnet)
    cid = extra.run_container(p, "c", BUSYBOX, command=["sleep", "3600"])
    pid = extra.cri.container_status(cid, verbose=True).pid
    netns = [ns["path"] for ns in extra.cri.container_status(cid, verbose=True).runtime_spec["linux"]["namespaces"]
             if ns["type"] == "network"][0]
    assert Path(netns).exists()

    # containerd dies with the pod running (as in an interrupted session): down must clean up anyway.
    sb: Sandbox = extra.sandbox
    os.kill(sb.pid(), signal.SIGKILL)
    sb.down()
    assert not sb.is_running()
    assert not Path(f"/proc/{pid}").exists()
    assert not Path(netns).exists()
    assert not sb._shim_pids()
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(extra.dir) + "/" not in mounts
    assert subprocess.run(["ip", "link", "show", extra.sandbox.config.bridge], capture_output=True).returncode != 0

    # And it comes back; the killed pod is remembered by containerd only as not ready.
    sb.up()
    assert all(x.state is PodState.NOTREADY for x in extra.cri.list_pods() if x.id == p.id)


def test_restart_keeps_running_pods(sandbox, pod) -> None:
    """A containerd restart (as a node's service manager does it) leaves pods running."""
    p = pod()
    cid = sandbox.run_container(p, "c", BUSYBOX, command=["sleep", "3600"])
    pid = sandbox.cri.container_status(cid, verbose=True).pid
    before = sandbox.sandbox.pid()
    sandbox.sandbox.restart()
    assert sandbox.sandbox.pid() not in (None, before)
    assert Path(f"/proc/{pid}").exists()
    assert sandbox.cri.container_status(cid).state is ContainerState.RUNNING
    assert [x.state for x in sandbox.cri.list_pods() if x.id == p.id] == [PodState.READY]
    assert sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "echo alive"]).out.strip() == "alive"



def _wait(cond: Callable[[], object], timeout: float, what: str) -> None:
    wait_for(cond, timeout, what, interval=0.1)
