"""A PyTorch server holding GPU memory, checkpointed in pod A by annotation and restored into pod B,
through the real sandbox (containerd 1.7 + runc + CRIU + CNI) and the real plugin, on a GPU node.

The pods get their GPU as the NVIDIA device plugin gives it (device nodes + the driver's
libraries, devtools.gpu); the image is the empty merged-/usr rootfs
``localhost/rekindle/host-usr:1`` with the node's /usr and Python environment (PyTorch) mounted
read-only. The workload is tests/gpu/workloads/gpu_holder.py, mounted at /workload; it talks
through its control dir (checksums.json, verify-request / verify-result.json).

Variables: ``REKINDLE_GPU_TEST_GIB`` (GiB held, default 16), ``REKINDLE_GPU_E2E_XGPU_GIB``
(GiB for the cross-GPU case, default 4), ``REKINDLE_GPU_E2E_DIR`` (plugin state and artifact
store; default /dev/shm/rekindle-gpu-e2e: the CRIU images are as large as the GPU state),
``REKINDLE_GPU_E2E_OUT`` (where each test writes its timings JSON; default that dir).
On a GPU node without containerd, run hack/gpu-e2e.sh (bundle setup + this file).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.cri import ContainerState, Mount, Pod
from devtools.sandbox import Runtime, Sandbox, SandboxConfig
from runtime.gpu.devices import node_gpus
from tests.gpu.node_check import why_skip

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
WORKLOADS = Path(__file__).resolve().parent / "workloads"
IMAGE = "localhost/rekindle/host-usr:1"
GIB = float(os.environ.get("REKINDLE_GPU_TEST_GIB", "16"))
XGPU_GIB = float(os.environ.get("REKINDLE_GPU_E2E_XGPU_GIB", "4"))
WORK = Path(os.environ.get("REKINDLE_GPU_E2E_DIR", "/dev/shm/rekindle-gpu-e2e"))
OUT = Path(os.environ.get("REKINDLE_GPU_E2E_OUT", str(WORK)))
CONTAINER = "holder"


_SKIP = why_skip("the GPU e2e test")
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

from tests.gpu import gpu_pods  # noqa: E402
from tests.gpu.gpu_pods import PluginProcess, container_logs, gpu_memory, running, wait_file  # noqa: E402
from tests.gpu.workloads import gpu_holder  # noqa: E402  (client helpers only; torch is not imported)

# --- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    sb = Sandbox(SandboxConfig(runtime=Runtime.V1_7))
    started = not sb.is_running()
    sb.up()
    yield sb
    if started and os.environ.get("REKINDLE_E2E_KEEP") != "1":
        sb.down()


@pytest.fixture(scope="module")
def cri(sandbox: Sandbox):
    c = sandbox.cri(timeout=120.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def plugin(sandbox: Sandbox) -> Iterator[PluginProcess]:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    OUT.mkdir(parents=True, exist_ok=True)
    p = gpu_pods.start_plugin(sandbox, WORK / "plugin")
    yield p
    p.stop()
    shutil.copy(p.log_path, OUT / "plugin.log")


@pytest.fixture
def pods(cri) -> Iterator[list[Pod]]:
    made: list[Pod] = []
    yield made
    for p in reversed(made):
        try:
            cri.stop_pod(p.id)
            cri.remove_pod(p.id)
        except Exception as e:  # noqa: BLE001 - cleanup must go on
            print(f"cleanup of pod {p.name}: {e}", file=sys.stderr)


# --- helpers --------------------------------------------------------------------------------

def workload_mounts() -> list[Mount]:
    return [Mount("/workload", str(WORKLOADS), readonly=True)]


def run_gpu_container(cri, pod: Pod, gpu: int, command: list[str]) -> str:
    return gpu_pods.run_gpu_container(cri, pod, gpu, command, workload_mounts(), CONTAINER)


def holder_command(gib: float) -> list[str]:
    return [sys.executable, "/workload/gpu_holder.py", "--gib", str(gib)]


def wait_status(plugin: PluginProcess, pod: Pod, phases: set[str], timeout: float) -> dict:
    return gpu_pods.wait_status(plugin, pod, CONTAINER, phases, timeout)


def checkpoint_and_restore(cri, plugin: PluginProcess, pods: list[Pod], name: str, gib: float,
                           src_gpu: int, dst_gpu: int) -> dict[str, Any]:
    """Pod A on src_gpu checkpointed by annotation, pod B on dst_gpu restored; returns the record."""
    rec: dict[str, Any] = {"artifact": name, "gib": gib, "source_gpu": src_gpu, "target_gpu": dst_gpu,
                           "gpus": [g.uuid for g in node_gpus().values()]}
    a = cri.run_pod_sandbox(f"gpu-src-{name}", annotations={"rekindle.dev/checkpoint": name})
    pods.append(a)
    t0 = time.monotonic()
    a_cid = run_gpu_container(cri, a, src_gpu, holder_command(gib))
    a_dir = plugin.control_dir(a.uid, CONTAINER)
    try:
        rec["cold_start_s"] = round(wait_file(a_dir / "checksums.json", 600, running(cri, a_cid)), 3)
    except AssertionError:
        print(container_logs(cri, a_cid), file=sys.stderr)
        raise
    ready = json.loads((a_dir / "checksums.json").read_text())
    rec["holder"] = {k: ready[k] for k in ("import_torch_s", "fill_s")}
    rec["bytes"] = ready["checksums"]["bytes"]
    st = wait_status(plugin, a, {"published", "checkpoint-failed"}, 600)
    rec["checkpoint_status_s"] = round(time.monotonic() - t0, 3)
    assert st["phase"] == "published", st
    rec["checkpoint"] = st["timings"]
    try:
        rec["checkpoint_control_timings"] = json.loads((a_dir / "timings.json").read_text())
    except (OSError, ValueError):
        pass
    artifact = plugin.store / "default" / name
    rec["artifact_bytes"] = sum(f.stat().st_size for f in artifact.rglob("*") if f.is_file())
    # The source was resumed and still computes the same.
    src = gpu_holder.request_verify(a_dir, timeout=120)
    assert src["same"], src
    rec["memory_before_restore_mib"] = gpu_memory()

    b = cri.run_pod_sandbox(f"gpu-dst-{name}", annotations={"rekindle.dev/restore": name})
    pods.append(b)
    t1 = time.monotonic()
    b_cid = run_gpu_container(cri, b, dst_gpu, holder_command(gib))
    st = wait_status(plugin, b, {"restored", "cold-start"}, 600)
    rec["restore_status_s"] = round(time.monotonic() - t1, 3)
    rec["restore"] = st["timings"]
    if st["phase"] != "restored":
        rec["restore_failure"] = st.get("reason")
        (OUT / f"gpu-e2e-{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    assert st["phase"] == "restored", st
    b_dir = plugin.control_dir(b.uid, CONTAINER)
    got = gpu_holder.request_verify(b_dir, timeout=120)
    rec["restore_to_first_answer_s"] = round(time.monotonic() - t1, 3)
    rec["verify_after_restore"] = {k: got[k] for k in ("same", "compute_s")}
    rec["memory_after_restore_mib"] = gpu_memory()
    assert got["same"], got
    assert got["checksums"] == ready["checksums"], (got["checksums"], ready["checksums"])
    assert cri.container_status(b_cid).state is ContainerState.RUNNING
    (OUT / f"gpu-e2e-{name}.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec, indent=1))
    from runtime.store.volume import ArtifactStore
    ArtifactStore(str(plugin.store)).delete("default", name)  # the store is in memory
    return rec


# --- tests ----------------------------------------------------------------------------------

def test_torch_sees_its_gpu_in_a_container(cri, pods):
    """The image + mounts + devices are enough for PyTorch to compute on the pod's GPU."""
    pod = cri.run_pod_sandbox("gpu-probe")
    pods.append(pod)
    code = ("import time; t=time.monotonic(); import torch; i=time.monotonic()-t; "
            "x=torch.ones(1<<20, device='cuda'); "
            "print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0), "
            "'sum', float(x.sum()), 'import_s', round(i, 2), flush=True)")
    t0 = time.monotonic()
    cid = run_gpu_container(cri, pod, 0, [sys.executable, "-c", code])
    st = cri.wait_container(cid, states=(ContainerState.EXITED,), timeout=300)
    logs = container_logs(cri, cid)
    print(f"probe: exit {st.exit_code} in {time.monotonic() - t0:.2f}s\n{logs}")
    assert st.exit_code == 0, logs
    assert "sum 1048576.0" in logs, logs
    if "gpus 1 " not in logs:
        warnings.warn(f"the container sees more than its own GPU: {logs}")


def test_gpu_server_restored_into_another_pod(cri, plugin, pods):
    rec = checkpoint_and_restore(cri, plugin, pods, "gpu-holder", GIB, 0, 0)
    assert rec["bytes"] >= int(GIB * (1 << 30)) * 0.99


def test_gpu_server_restored_onto_another_gpu(cri, plugin, pods):
    gpus = list(node_gpus().values())
    if len(gpus) < 2:
        pytest.skip(f"restore onto another GPU needs 2 GPUs; this node has {len(gpus)}")
    rec = checkpoint_and_restore(cri, plugin, pods, "gpu-holder-x", XGPU_GIB, 0, 1)
    before, after = rec["memory_before_restore_mib"], rec["memory_after_restore_mib"]
    dst = gpus[1].uuid
    if before and after:
        assert after[dst] - before[dst] >= XGPU_GIB * 1024 * 0.9, (before, after)
