"""The framework matrix on a GPU node, through the real sandbox (containerd + runc + CRIU + CNI) and
the real plugin: each way of serving in tests/gpu/workloads/framework_worker.py is checkpointed by
annotation, keeps serving the same answers, is restored into a new pod with identical answers,
restored once more from the node cache, and compiles or jits something new after each restore.

Cases: PyTorch eager; PyTorch with torch.compile and CUDA graphs; JAX with XLA's default
(preallocating) allocator and with ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``; CuPy with an NVRTC
kernel; a two-process PyTorch pod. JAX needs the toolkit's ``ptxas``: the node's CUDA toolkit
is mounted read-only, as a JAX image carries it. Each case writes
``$REKINDLE_GPU_E2E_OUT/frameworks-<case>.json`` (phases, answers, cache state).
"""

from __future__ import annotations

import glob
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.node_check import why_skip
from tests.waiting import wait_for

_SKIP = why_skip("the framework matrix")
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

from devtools.cri import ContainerState, Mount  # noqa: E402
from tests.gpu import gpu_pods  # noqa: E402
from tests.gpu.test_gpu_e2e import OUT, WORKLOADS, cri, plugin, pods, sandbox  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.gpu

CONTAINER = "worker"
CUDA_TOOLKIT = os.environ.get("REKINDLE_CUDA_TOOLKIT", "/usr/local/cuda")
JAX_ENV = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.10"}  # 14 GB preallocated on an H200, not 75 %
CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    "jax": (["--framework", "jax"], JAX_ENV),
    "torch-compile": (["--framework", "torch-compile"], {}),
    "cupy": (["--framework", "cupy"], {}),
    "torch-two-procs": (["--framework", "torch-eager", "--procs", "2"], {}),
    "jax-platform": (["--framework", "jax"], {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}),
    "torch-eager": (["--framework", "torch-eager"], {}),
}


def _mounts() -> list[Mount]:
    mounts = [Mount("/workload", str(WORKLOADS), readonly=True)]
    if os.path.isdir(CUDA_TOOLKIT):
        real = os.path.realpath(CUDA_TOOLKIT)
        mounts.append(Mount(CUDA_TOOLKIT, real, readonly=True))
    # Triton builds its launcher with the node's gcc, whose cc1 is under /usr/libexec, against
    # Python's headers: an image that runs torch.compile carries both
    mounts += [Mount(p, p, readonly=True) for p in ("/usr/libexec", "/usr/include") if os.path.isdir(p)]
    return mounts


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    return {**extra, "PATH": f"{CUDA_TOOLKIT}/bin:{path}", "TRITON_CACHE_DIR": "/tmp/triton",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}


def _ask(control: Path, timeout: float = 300.0) -> dict[str, Any]:
    reply = control / "reply.json"
    reply.unlink(missing_ok=True)
    rid = str(time.time_ns())
    tmp = control / ".ask.tmp"
    tmp.write_text(rid)
    os.replace(tmp, control / "ask")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            doc = json.loads(reply.read_text())
            if doc.get("id") == rid:
                return doc
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no reply in {timeout:.0f} s from {control}")


def _entries(plugin: Any, name: str) -> list[str]:
    out = []
    for path in glob.glob(str(plugin.state_dir / "cache" / "v1" / "*" / "entry.json")):
        try:
            if json.loads(Path(path).read_text())["label"] == f"default/{name}":
                out.append(path)
        except (OSError, ValueError, KeyError):
            continue
    return out


def _restore(cri: Any, plugin: Any, pods: list, name: str, tag: str, argv: list[str], env: dict[str, str],
             rec: dict[str, Any]) -> dict[str, Any]:
    pod = cri.run_pod_sandbox(f"fw-{name}-{tag}", annotations={"rekindle.dev/restore": name})
    pods.append(pod)
    t0 = time.monotonic()
    cid = gpu_pods.run_gpu_container(cri, pod, 0, [sys.executable, "/workload/framework_worker.py", *argv],
                                     _mounts(), CONTAINER, _env(env))
    st = gpu_pods.wait_status(plugin, pod, CONTAINER, {"restored", "cold-start"}, 600)
    out: dict[str, Any] = {"status_s": round(time.monotonic() - t0, 3), "phase": st["phase"],
                           "reason": st.get("reason"), "timings": st.get("timings")}
    rec[tag] = out
    assert st["phase"] == "restored", st
    control = plugin.control_dir(pod.uid, CONTAINER)
    out["reply"] = _ask(control)
    out["first_answer_s"] = round(time.monotonic() - t0, 3)
    try:
        out["cache"] = json.loads((control / "timings.json").read_text()).get("cache")
    except (OSError, ValueError):
        out["cache"] = None
    assert cri.container_status(cid).state is ContainerState.RUNNING
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_framework_checkpoints_keeps_serving_and_restores(cri, plugin, pods, case: str) -> None:
    argv, env = CASES[case]
    name = f"fw-{case}"
    rec: dict[str, Any] = {"case": case, "argv": argv, "env": env}
    try:
        a = cri.run_pod_sandbox(f"fw-src-{case}", annotations={"rekindle.dev/checkpoint": name})
        pods.append(a)
        t0 = time.monotonic()
        a_cid = gpu_pods.run_gpu_container(cri, a, 0, [sys.executable, "/workload/framework_worker.py", *argv],
                                           _mounts(), CONTAINER, _env(env))
        a_dir = plugin.control_dir(a.uid, CONTAINER)
        try:
            rec["cold_start_s"] = round(gpu_pods.wait_file(a_dir / "answers.json", 600,
                                                           gpu_pods.running(cri, a_cid)), 3)
        except AssertionError:
            print(gpu_pods.container_logs(cri, a_cid), file=sys.stderr)
            raise
        first = json.loads((a_dir / "answers.json").read_text())
        rec["source_answers"] = first
        st = gpu_pods.wait_status(plugin, a, CONTAINER, {"published", "checkpoint-failed"}, 600)
        rec["checkpoint"] = {"phase": st["phase"], "reason": st.get("reason"), "timings": st.get("timings")}
        assert st["phase"] == "published", st
        # the source serves on, the same answers, and compiles anew
        after = _ask(a_dir)
        rec["source_after_checkpoint"] = after
        assert after["answer"] == first["answer"] and after.get("child") == first.get("child"), (first, after)
        for tag in ("restored", "from-cache"):
            if tag == "from-cache":
                wait_for(lambda: _entries(plugin, name), 300, "the node cache entry")
            got = _restore(cri, plugin, pods, name, tag, argv, env, rec)
            reply = got["reply"]
            assert reply["answer"] == first["answer"], (first, reply)
            assert reply.get("child") == first.get("child"), (first, reply)
            # compiled anew in the restored process: the source's first compile after the
            # checkpoint computed the same (both are the image's first ask)
            for key in ("fresh", "child_fresh"):
                if key in after:
                    assert math.isclose(reply[key], after[key], rel_tol=1e-5), (key, after, reply)
        assert (rec["from-cache"]["cache"] or {}).get("state") == "warm", rec["from-cache"]
    finally:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"frameworks-{case}.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps(rec, indent=1))
    from runtime.store.volume import ArtifactStore  # noqa: PLC0415
    ArtifactStore(str(plugin.store)).delete("default", name)  # the store is in memory
