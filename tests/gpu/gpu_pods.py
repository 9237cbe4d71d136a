"""GPU pods through the sandbox's CRI, and the real plugin beside them: the helpers shared by
tests/gpu/test_gpu_e2e.py and bench/llm_restore.py (both import this file by its directory).

- :func:`start_plugin` runs ``rekindle plugin`` (tests/e2e/plugin_process.py) against the sandbox,
  its state and store under ``workdir``, and waits for its first sync.
- :func:`run_gpu_container` creates and starts a container of the ``host-usr`` image with the GPU
  as the device plugin gives it, the node's Python mounted, plus the caller's mounts.
- :func:`wait_file`, :func:`wait_status` (the plugin's status JSON), :func:`running`,
  :func:`gpu_memory`, :func:`container_logs`: small waits and reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from devtools.cri import ContainerState, Mount, Pod
from devtools.gpu import gpu_devices_and_mounts, gpu_env, host_python_mounts
from tests.e2e.plugin_process import PluginProcess

IMAGE = "localhost/rekindle/host-usr:1"


def start_plugin(sandbox: Any, workdir: Path, timeout: float = 90.0) -> PluginProcess:
    handle = SimpleNamespace(nri_socket=sandbox.paths.nri_socket, containerd_socket=sandbox.address,
                             state_dir=sandbox.paths.state)
    p = PluginProcess(handle, workdir)
    p.start(wait=False)
    p.wait_log("synchronized:", timeout=timeout)
    return p


def run_gpu_container(cri: Any, pod: Pod, gpu: int, command: list[str], mounts: Sequence[Mount],
                      name: str, env: Mapping[str, str] | None = None) -> str:
    devices, gpu_mounts = gpu_devices_and_mounts(gpu)
    cid = cri.create_container(pod, name, IMAGE, command=command, env={**gpu_env(), **(env or {})},
                               mounts=[*gpu_mounts, *host_python_mounts(), *mounts], devices=devices)
    cri.start_container(cid)
    return cid


def wait_file(path: Path, timeout: float, alive: Any = None) -> float:
    t0 = time.monotonic()
    while not path.exists():
        if alive is not None and not alive():
            raise AssertionError(f"the container exited before {path} appeared")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{path} did not appear in {timeout:.0f}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def wait_status(plugin: PluginProcess, pod: Pod, container: str, phases: set[str], timeout: float) -> dict:
    path = plugin.state_dir / "status" / pod.namespace / pod.name / f"{container}.json"
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        try:
            doc = json.loads(path.read_text())
            if doc["phase"] in phases:
                return doc
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"status of {pod.name}:{container} is {doc.get('phase')} ({doc.get('reason')}), "
                         f"wanted {phases}\nplugin log:\n{plugin.log()[-6000:]}")


def running(cri: Any, cid: str) -> Any:
    return lambda: cri.container_status(cid).state in (ContainerState.RUNNING, ContainerState.CREATED)


def gpu_memory() -> dict[str, int]:
    """MiB used per GPU UUID (nvidia-smi), empty without it."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-gpu=uuid,memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return {u.strip(): int(m) for u, m in (ln.split(",") for ln in out.splitlines() if "," in ln)}


def container_logs(cri: Any, cid: str) -> str:
    try:
        return "\n".join(cri.logs(cid, "stdout") + cri.logs(cid, "stderr"))
    except Exception as e:  # noqa: BLE001
        return f"(no logs: {e})"
