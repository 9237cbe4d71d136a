"""Checkpoint a stateful server in pod A by annotation, restore it into pod B, through the real
containerd 1.7.24 + runc + CRIU + CNI sandbox and the real plugin."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from plugin_process import PluginProcess, build_native

COUNTER = "localhost/rekindle/counter:1"
SERVER = ["/usr/local/bin/counter-server", "8080"]


@pytest.fixture(scope="module", autouse=True)
def _native():
    build_native()


@pytest.fixture(scope="module")
def plugin(sandbox, tmp_path_factory):
    p = PluginProcess(sandbox, tmp_path_factory.mktemp("cr") / "plugin")
    p.start()
    yield p
    p.stop()


def get(ip: str, path: str = "/", timeout: float = 3.0) -> str:
    with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=timeout) as r:
        return r.read().decode()


def wait_http(ip: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            get(ip, "/healthz", 1.0)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def wait_status(plugin: PluginProcess, ns: str, pod: str, ctr: str, phases: set[str], timeout: float = 60.0) -> dict:
    path = plugin.state_dir / "status" / ns / pod / f"{ctr}.json"
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        try:
            doc = json.loads(path.read_text())
            if doc["phase"] in phases:
                return doc
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"status of {ns}/{pod}:{ctr} is {doc.get('phase')} ({doc.get('reason')}), "
                         f"wanted {phases}\nplugin log:\n{plugin.log()[-4000:]}")


def fields(body: str) -> dict[str, str]:
    """`count=4 pid=9 state=written-at-start 17 deleted=yes` -> dict (values may hold spaces)."""
    return dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", body.strip()))


def checkpoint_source(sandbox, pod, plugin, name: str, ns: str = "default", after: str | None = None):
    ann = {"rekindle.dev/checkpoint": name}
    if after:
        ann["rekindle.dev/after-checkpoint"] = after
    a = pod(f"src-{name}", ns, annotations=ann)
    cid = sandbox.run_container(a, "server", COUNTER, command=SERVER)
    ip = sandbox.cri.pod_ip(a.id)
    wait_http(ip)
    for _ in range(3):
        get(ip)
    st = wait_status(plugin, ns, a.name, "server", {"published", "checkpoint-failed"})
    assert st["phase"] == "published", st
    return a, cid, ip


def test_counter_server_continues_in_another_pod(sandbox, pod, plugin):
    a, a_cid, a_ip = checkpoint_source(sandbox, pod, plugin, "counter-a")
    assert fields(get(a_ip))["count"] == "4"  # the source keeps running by default

    b = pod("dst-counter-a", annotations={"rekindle.dev/restore": "counter-a"})
    b_cid = sandbox.run_container(b, "server", COUNTER, command=SERVER)
    b_ip = sandbox.cri.pod_ip(b.id)
    assert b_ip != a_ip
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "restored", st
    wait_http(b_ip)
    got = fields(get(b_ip))
    # In-memory counter continued from the checkpoint (3 requests + the probe-free state),
    # the file the server wrote and the image file it deleted are as they were.
    assert got["count"] == "4", got
    assert got["state"].startswith("written-at-start"), got
    assert got["deleted"] == "yes", got
    for phase in ("verify", "rootfs_apply", "criu_restore"):
        assert phase in st["timings"]
    # exec reaches the restored process; its output goes to B's log.
    res = sandbox.cri.exec_sync(b_cid, ["/bin/sh", "-c", "ps -o pid,args"], timeout=10)
    assert "counter-server" in res.out
    time.sleep(0.5)
    assert any("GET /" in line for line in sandbox.cri.logs(b_cid)), sandbox.cri.logs(b_cid)
    # Stopping the pod stops it.
    sandbox.cri.stop_container(b_cid, grace_seconds=5)
    assert sandbox.cri.container_status(b_cid).exit_code == 0
