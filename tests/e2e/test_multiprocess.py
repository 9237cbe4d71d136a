"""Pods of several processes through the real sandbox (containerd 1.7 + runc + CRIU + CNI) and the
real plugin: a loopback TCP connection between two processes of the pod survives checkpoint and
restore into another pod; a tree CRIU could not dump (an io_uring instance) or holding a live
NCCL communicator dressed up as a restorable one is refused before anything is touched, and the
source runs on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.cri import ContainerState, Mount
from devtools.gpu import host_python_mounts
from runtime.status import Phase, StatusBook
from tests.e2e.plugin_process import PluginProcess
from tests.nccl_forge import FORGE_PROXY_SOCKET
from tests.waiting import wait_for

BUSYBOX = "localhost/rekindle/busybox:1"
HOST_USR = "localhost/rekindle/host-usr:1"

# An echo server (dual-stack, as busybox listens) and a client over one loopback connection
# (port 9000 = 0x2328). The client reads
# what appears in /tmp/send and writes the echo to /tmp/recv, so a test can talk through the very
# connection that was checkpointed. Ready once a first line made the round trip.
ECHO_PAIR = r"""
cd /tmp
nc -l -p 9000 -e /bin/cat &
until cat /proc/net/tcp /proc/net/tcp6 | grep -q ':2328 [0-9A-F]*:0000 0A'; do sleep 0.05; done
( while :; do
    if [ -f /tmp/send ]; then mv /tmp/send /tmp/sending; cat /tmp/sending; fi
    sleep 0.05
  done ) | nc 127.0.0.1 9000 > /tmp/recv &
until grep -q ':2328 01 ' /proc/net/tcp; do sleep 0.05; done
echo hello-before > /tmp/.s && mv /tmp/.s /tmp/send
until grep -q hello-before /tmp/recv; do sleep 0.05; done
touch "$REKINDLE_CONTROL_DIR/ready-for-checkpoint"
wait
"""


def wait_phase(plugin: PluginProcess, pod, ctr: str, phases: set[str], want: str, timeout: float = 90.0) -> dict:
    """Wait until the status is in ``phases``; fail with the reason and the log unless it is ``want``."""
    st = StatusBook(plugin.state_dir).wait(pod.namespace, pod.name, ctr, {Phase(p) for p in phases}, timeout)
    if st is None or st.phase.value != want:
        raise AssertionError(f"status of {pod.name}:{ctr} is {st.phase.value if st else None} "
                             f"({st.reason if st else ''}), wanted {want}\nplugin log:\n{plugin.log()[-6000:]}")
    return json.loads(st.to_json())


def say(sandbox, cid: str, line: str, timeout: float = 10.0) -> str:
    """Send a line through the pod's connection; return /tmp/recv once the echo came back."""
    res = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", f"echo {line} > /tmp/.s && mv /tmp/.s /tmp/send"])
    assert res.exit_code == 0, res
    deadline = time.monotonic() + timeout
    got = ""
    while time.monotonic() < deadline:
        got = sandbox.cri.exec_sync(cid, ["/bin/cat", "/tmp/recv"]).out
        if line in got:
            return got
        time.sleep(0.1)
    ps = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ps -o pid,args; cat /proc/net/tcp"]).out
    raise AssertionError(f"no echo of {line!r} within {timeout}s; /tmp/recv: {got!r}\n{ps}")


def nc_pids(sandbox, cid: str) -> dict[str, str]:
    out = sandbox.cri.exec_sync(cid, ["/bin/ps", "-o", "pid,args"]).out
    return {" ".join(f[1:]): f[0] for f in (ln.split() for ln in out.splitlines()[1:])
            if f and f[1] in ("nc", "cat", "/bin/cat")}


def test_loopback_connection_between_two_processes_survives_restore_into_another_pod(sandbox, pod, plugin):
    a = pod("tcp-src", annotations={"rekindle.dev/checkpoint": "tcp-pair"})
    a_cid = sandbox.run_container(a, "pair", BUSYBOX, command=["/bin/sh", "-c", ECHO_PAIR])
    wait_phase(plugin, a, "pair", {"published", "checkpoint-failed"}, "published")
    assert "TCP connections kept: 2 loopback connection end(s)" in plugin.log()
    # The source keeps running, its connection too.
    say(sandbox, a_cid, "ping-source")
    before = nc_pids(sandbox, a_cid)

    b = pod("tcp-dst", annotations={"rekindle.dev/restore": "tcp-pair"})
    b_cid = sandbox.run_container(b, "pair", BUSYBOX, command=["/bin/sh", "-c", ECHO_PAIR])
    wait_phase(plugin, b, "pair", {"restored", "cold-start"}, "restored")
    assert sandbox.cri.pod_ip(b.id) != sandbox.cri.pod_ip(a.id)
    # The restored client and server are the source's processes (same pids, nothing restarted),
    # and the connection between them carries data: the echo comes back through it.
    assert nc_pids(sandbox, b_cid) == before
    recv = say(sandbox, b_cid, "ping-restored")
    assert recv.splitlines()[0] == "hello-before" and "ping-source" not in recv, recv
    assert sandbox.cri.container_status(b_cid).state is ContainerState.RUNNING


IO_URING_HOLDER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
fd = libc.syscall(425, 4, (ctypes.c_uint32 * 30)())  # io_uring_setup, as libuv does
if fd < 0:
    print("io_uring_setup failed:", os.strerror(ctypes.get_errno()), flush=True)
    sys.exit(3)
control = os.environ["REKINDLE_CONTROL_DIR"]
open(os.path.join(control, "ready-for-checkpoint"), "w").close()
n = 0
while True:  # a heartbeat: proves the process never stopped
    n += 1
    with open("/tmp/.beat", "w") as f:
        f.write(str(n))
    os.replace("/tmp/.beat", "/tmp/beat")
    time.sleep(0.05)
"""


def beat(sandbox, cid: str) -> int:
    return int(sandbox.cri.exec_sync(cid, ["/usr/bin/cat", "/tmp/beat"]).out or 0)


def test_tree_with_io_uring_is_refused_before_anything_is_touched(sandbox, pod, plugin):
    a = pod("uring-src", annotations={"rekindle.dev/checkpoint": "uring"})
    cid = sandbox.run_container(a, "app", HOST_USR, command=[sys.executable, "-c", IO_URING_HOLDER],
                                mounts=host_python_mounts(), env={"PATH": "/usr/bin:/bin"})
    st = wait_phase(plugin, a, "app", {"published", "checkpoint-failed"}, "checkpoint-failed")
    assert st["reason"].startswith("checkpoint refused: an io_uring instance"), st
    assert "USE_LIBUV=0" in st["reason"] and "python" in st["reason"], st
    assert not [ln for ln in plugin.log().splitlines() if "criu dump" in ln and "uring" in ln]  # CRIU never ran
    assert not (plugin.store / "default" / "uring").exists()
    control = plugin.control_dir(a.uid, "app")
    assert "io_uring" in (control / "checkpoint-failed").read_text()
    # Never stopped, still running.
    first = beat(sandbox, cid)
    wait_for(lambda: beat(sandbox, cid) > first, 5, "the refused source to beat on", interval=0.1)
    assert sandbox.cri.container_status(cid).state is ContainerState.RUNNING


# A rank that claims sockets only in its start environment, turns that off inside the process,
# and hides NCCL's proxy socket in /proc/net/unix behind lines forged with socket names that hold
# a newline (varied until a forged line comes after the real one). No /dev/shm/nccl-* file: the
# socket is the only mark of the live communicator.
NCCL_FORGER = "import ctypes, os, socket, time\n" + FORGE_PROXY_SOCKET + r"""
assert keep, "no forged line came after the real one"
del os.environ["NCCL_P2P_DISABLE"], os.environ["NCCL_SHM_DISABLE"]  # P2P back on, after start
control = os.environ["REKINDLE_CONTROL_DIR"]
open(os.path.join(control, "ready-for-checkpoint"), "w").close()
n = 0
while True:
    n += 1
    with open("/tmp/.beat", "w") as f:
        f.write(str(n))
    os.replace("/tmp/.beat", "/tmp/beat")
    time.sleep(0.05)
"""


def test_live_nccl_communicator_passed_off_as_sockets_only_is_refused(sandbox, pod, plugin):
    """Through the plugin, in the pod's own network namespace (the agent reads its sockets
    through sock_diag from a thread that joins it): refused, and the source runs on."""
    a = pod("nccl-src", annotations={"rekindle.dev/checkpoint": "nccl"})
    cid = sandbox.run_container(a, "app", HOST_USR, command=[sys.executable, "-c", NCCL_FORGER],
                                mounts=host_python_mounts(),
                                env={"PATH": "/usr/bin:/bin", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"})
    st = wait_phase(plugin, a, "app", {"published", "checkpoint-failed"}, "checkpoint-failed")
    assert st["reason"].startswith("checkpoint refused: a live NCCL communicator"), st
    assert "names NET/Socket" in st["reason"] and "@/tmp/nccl-socket-0-" in st["reason"], st
    assert not (plugin.store / "default" / "nccl").exists()
    first = beat(sandbox, cid)
    wait_for(lambda: beat(sandbox, cid) > first, 5, "the refused source to beat on", interval=0.1)
    assert sandbox.cri.container_status(cid).state is ContainerState.RUNNING


TORCH_PYTHON = os.environ.get("REKINDLE_TORCH_PYTHON", "")
WORKLOADS = Path(__file__).resolve().parents[1] / "gpu" / "workloads"
HELPER_DIR = Path(__file__).resolve().parents[2] / "runtime" / "workload"


@pytest.mark.skipif(not TORCH_PYTHON, reason="needs a Python with torch (CPU is enough): set REKINDLE_TORCH_PYTHON")
def test_tensor_parallel_job_rebuilds_its_group_in_the_restored_pod(sandbox, pod, plugin):
    """The TP protocol on CPU (gloo): launcher + 2 ranks; the ranks take the group down, rank 0
    says ready, the agent checkpoints; the source and the restored copy each build a new group."""
    from tests.gpu.workloads import tp_worker  # noqa: PLC0415 - client helpers only

    prefix, base = subprocess.run([TORCH_PYTHON, "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                                  capture_output=True, text=True, check=True).stdout.split()
    mounts = [*host_python_mounts(prefix=prefix, base_prefix=base),
              Mount("/workload", str(WORKLOADS), readonly=True), Mount("/opt/rekindle-tp", str(HELPER_DIR), readonly=True)]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "/opt/rekindle-tp", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [TORCH_PYTHON, "/workload/tp_worker.py", "--backend", "gloo", "--gib", "0.0625"]
    a = pod("tp-src", annotations={"rekindle.dev/checkpoint": "tp-gloo"})
    sandbox.run_container(a, "tp", HOST_USR, command=command, mounts=mounts, env=env)
    wait_phase(plugin, a, "tp", {"published", "checkpoint-failed"}, "published", timeout=300)
    a_dir = plugin.control_dir(a.uid, "tp")
    ranks = [json.loads((a_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["allreduce_ok"] for r in ranks)
    src = tp_worker.request_verify(a_dir, 2)
    assert all(v["same"] and v["allreduce_ok"] and v["generation"] == 1 for v in src), src
    assert json.loads((a_dir / "rank1-outcome.json").read_text())["outcome"] == "snapshot-complete"

    b = pod("tp-dst", annotations={"rekindle.dev/restore": "tp-gloo"})
    b_cid = sandbox.run_container(b, "tp", HOST_USR, command=command, mounts=mounts, env=env)
    wait_phase(plugin, b, "tp", {"restored", "cold-start"}, "restored", timeout=300)
    b_dir = plugin.control_dir(b.uid, "tp")
    got = tp_worker.request_verify(b_dir, 2)
    assert [v["checksums"] for v in got] == [r["checksums"] for r in ranks], got
    assert all(v["allreduce_ok"] and v["generation"] == 1 for v in got), got
    assert json.loads((b_dir / "rank0-outcome.json").read_text())["outcome"] == "restore-complete"
    assert not (b_dir / "rank0.json").exists()  # nothing started over: the ranks were restored
    assert sandbox.cri.container_status(b_cid).state is ContainerState.RUNNING
