"""Multi-process and multi-GPU pods through the real sandbox and plugin, on a GPU node (two GPUs for
the tensor-parallel cases): what restores, and what is refused up front.

Cases (each appends one JSON object to ``$REKINDLE_MULTI_GPU_RESULTS``, default
``<REKINDLE_GPU_E2E_DIR>/multi-gpu.jsonl``: ``case``, ``outcome`` restored | cold-start | refused,
``reason``, ``identical``, ``restore_s``, ``cold_start_s``, plus details; hack/gpu-multi.sh
collects them into bench/results/h200x2/multi-gpu.json):

- ``vllm-shape``: a front process without CUDA (HTTP + pipes) and a CUDA engine process;
- ``two-cuda-one-gpu``: a front and two CUDA engines sharing the pod's one GPU;
- ``tp2-rebuild-same-gpus``: launcher + 2 NCCL ranks on 2 GPUs using rekindle_tp (group down
  before the checkpoint, rebuilt after); restored into another pod on the same GPUs;
- ``tp2-rebuild-swapped-gpus``: the same job, with each rank's memory moved onto the other GPU.
  The plugin pairs GPUs by minor number, so a pod of both GPUs of a 2-GPU node always gets them
  in the same order; this case runs the job on the node (no container, no CRIU), checkpoints
  both ranks through runtime.gpu.cuda and restores them with the GPUs swapped
  ({GPU0: GPU1, GPU1: GPU0}), then the ranks rebuild their group on the swapped devices;
- ``tp2-default-refused``: the job with its communicators alive on NCCL's default transports:
  the checkpoint must be refused before anything is locked, with the reason, and the job must
  go on unharmed.
Every process started here keeps NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1).

Variables: ``REKINDLE_MULTI_GPU_GIB`` (GiB per CUDA process, default 2), and those of
test_gpu_e2e.py (``REKINDLE_GPU_E2E_DIR``: plugin state and store).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
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
HELPER_DIR = REPO / "runtime" / "workload"
GIB = float(os.environ.get("REKINDLE_MULTI_GPU_GIB", "2"))
WORK = Path(os.environ.get("REKINDLE_GPU_E2E_DIR", "/dev/shm/rekindle-gpu-e2e"))
RESULTS = Path(os.environ.get("REKINDLE_MULTI_GPU_RESULTS", str(WORK / "multi-gpu.jsonl")))
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CTR = "app"


_SKIP = why_skip("the multi-GPU tests")
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

from tests.gpu import gpu_pods  # noqa: E402
from tests.gpu.gpu_pods import PluginProcess, container_logs, running, wait_file  # noqa: E402
from tests.gpu.workloads import gpu_holder, tp_worker  # noqa: E402  (client helpers only)


def need_gpus(n: int) -> list[Any]:
    gpus = list(node_gpus().values())
    if len(gpus) < n:
        pytest.skip(f"needs {n} GPUs; this node has {len(gpus)}")
    return gpus


def record(case: str, outcome: str, reason: str = "", identical: bool | None = None,
           restore_s: float | None = None, cold_start_s: float | None = None, **details: Any) -> dict[str, Any]:
    rec = {"case": case, "outcome": outcome, "reason": reason, "identical": identical,
           "restore_s": restore_s, "cold_start_s": cold_start_s, **details}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(json.dumps(rec, indent=1))
    return rec


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
    WORK.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK / "plugin-multi", ignore_errors=True)
    p = gpu_pods.start_plugin(sandbox, WORK / "plugin-multi")
    yield p
    p.stop()
    shutil.copy(p.log_path, RESULTS.parent / "plugin-multi.log")


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

def start(cri, pods: list[Pod], name: str, annotations: dict[str, str], gpus: list[int],
          command: list[str]) -> tuple[Pod, str, float]:
    """A pod with a container of the host-usr image on ``gpus``; returns (pod, container id, t0)."""
    pod = cri.run_pod_sandbox(name, annotations=annotations)
    pods.append(pod)
    mounts = [Mount("/workload", str(WORKLOADS), readonly=True),
              Mount("/opt/rekindle-tp", str(HELPER_DIR), readonly=True)]
    t0 = time.monotonic()
    cid = gpu_pods.run_gpu_container(cri, pod, gpus, command, mounts, CTR,  # type: ignore[arg-type]
                                     env={"PYTHONPATH": "/opt/rekindle-tp", **NO_MULTICAST})
    return pod, cid, t0


def status(plugin: PluginProcess, pod: Pod, phases: set[str], timeout: float = 600) -> dict:
    return gpu_pods.wait_status(plugin, pod, CTR, phases, timeout)


def nccl_findings(sandbox: Sandbox, cid: str) -> list[dict[str, Any]]:
    """What the preflight sees of NCCL in the container right now (for the record)."""
    from runtime import checkpointable as preflight
    from runtime.container.containers import process_tree, resolve_container

    try:
        tree = process_tree(resolve_container(str(sandbox.paths.state), cid).init_pid)
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return [{"error": str(e)}]
    kinds = (preflight.Kind.NCCL_COMMUNICATOR, preflight.Kind.NCCL_IDLE)
    return [{"pid": f.pid, "kind": f.kind.value, "summary": f.summary[:80], "evidence": f.evidence,
             "blocking": f.blocking} for f in preflight.inspect(tree).findings if f.kind in kinds]


def manifest(plugin: PluginProcess, name: str) -> dict[str, Any]:
    return json.loads((plugin.store / "default" / name / "manifest.json").read_text())


def drop_artifact(plugin: PluginProcess, name: str) -> None:
    """The store may be in memory: free each case's artifact (the name links to its version)."""
    link = plugin.store / "default" / name
    if link.is_symlink():
        shutil.rmtree(link.resolve(), ignore_errors=True)
        link.unlink(missing_ok=True)


def multi_proc(engines: int, port: int | None = None) -> list[str]:
    cmd = [sys.executable, "/workload/multi_proc.py", "--engines", str(engines), "--gib", str(GIB)]
    return cmd + (["--port", str(port)] if port is not None else [])


def tp_job(mode: str) -> list[str]:
    return [sys.executable, "/workload/tp_worker.py", "--mode", mode, "--gib", str(GIB)]


def multi_proc_case(case: str, cri, plugin, pods, engines: int, port: int | None) -> dict[str, Any]:
    """Front + engines on GPU 0 in pod A, checkpointed; restored into pod B on GPU 0."""
    need_gpus(1)
    name = case
    a, a_cid, _ = start(cri, pods, f"src-{name}", {"rekindle.dev/checkpoint": name}, [0], multi_proc(engines, port))
    a_dir = plugin.control_dir(a.uid, CTR)
    try:
        cold = wait_file(a_dir / "checksums.json", 600, running(cri, a_cid))
    except AssertionError:
        print(container_logs(cri, a_cid), file=sys.stderr)
        raise
    ready = json.loads((a_dir / "checksums.json").read_text())
    st = status(plugin, a, {"published", "checkpoint-failed"})
    if st["phase"] != "published":
        return record(case, "refused" if "refused" in st.get("reason", "") else "cold-start", st.get("reason", ""),
                      None, None, round(cold, 3))
    cuda_pids = manifest(plugin, name)["cuda"]["pids"]
    src = gpu_holder.request_verify(a_dir, timeout=120)
    assert src["same"], src

    b, b_cid, t1 = start(cri, pods, f"dst-{name}", {"rekindle.dev/restore": name}, [0], multi_proc(engines, port))
    st = status(plugin, b, {"restored", "cold-start"})
    restore_s = round(time.monotonic() - t1, 3)
    if st["phase"] != "restored":
        return record(case, "cold-start", st.get("reason", ""), False, restore_s, round(cold, 3),
                      cuda_pids=cuda_pids)
    b_dir = plugin.control_dir(b.uid, CTR)
    got = gpu_holder.request_verify(b_dir, timeout=120)
    details: dict[str, Any] = {"cuda_pids": cuda_pids, "engine_pids": got["pids"], "front_pid": ready["front_pid"],
                               "timings": st["timings"]}
    if port is not None:  # the API path: front (restored socket) -> pipe -> engine -> GPU
        with urllib.request.urlopen(f"http://{cri.pod_ip(b.id)}:{port}/checksums", timeout=60) as r:
            details["http_same"] = json.loads(r.read())["same"]
    identical = bool(got["same"] and got["checksums"] == ready["engines"])
    rec = record(case, "restored", "", identical, restore_s, round(cold, 3), **details)
    drop_artifact(plugin, name)
    assert identical, got
    assert len(cuda_pids) == engines, cuda_pids  # the front process was skipped
    assert details.get("http_same", True)
    assert cri.container_status(b_cid).state is ContainerState.RUNNING
    return rec


# --- tests ----------------------------------------------------------------------------------

def test_vllm_shape_front_without_cuda_and_cuda_engine(cri, plugin, pods):
    multi_proc_case("vllm-shape", cri, plugin, pods, engines=1, port=8000)


def test_two_cuda_processes_on_one_gpu(cri, plugin, pods):
    multi_proc_case("two-cuda-one-gpu", cri, plugin, pods, engines=2, port=None)


def test_tp2_with_rebuild_restored_on_the_same_gpus(sandbox, cri, plugin, pods):
    need_gpus(2)
    case = name = "tp2-rebuild-same-gpus"
    a, a_cid, t0 = start(cri, pods, f"src-{name}", {"rekindle.dev/checkpoint": name}, [0, 1], tp_job("rebuild"))
    a_dir = plugin.control_dir(a.uid, CTR)
    try:
        wait_file(a_dir / "ready-for-checkpoint", 600, running(cri, a_cid))
    except AssertionError:
        print(container_logs(cri, a_cid), file=sys.stderr)
        raise
    cold = round(time.monotonic() - t0, 3)
    findings = nccl_findings(sandbox, a_cid)  # the group is down: at most notes
    ranks = [json.loads((a_dir / f"rank{r}.json").read_text()) for r in range(2)]
    st = status(plugin, a, {"published", "checkpoint-failed"})
    if st["phase"] != "published":
        record(case, "refused" if "refused" in st.get("reason", "") else "cold-start", st.get("reason", ""),
               None, None, cold, preflight=findings)
        pytest.fail(f"checkpoint failed: {st.get('reason')}")
    src = tp_worker.request_verify(a_dir, 2)
    assert all(v["same"] and v["allreduce_ok"] and v["generation"] == 1 for v in src), src

    b, b_cid, t1 = start(cri, pods, f"dst-{name}", {"rekindle.dev/restore": name}, [0, 1], tp_job("rebuild"))
    st = status(plugin, b, {"restored", "cold-start"})
    restore_s = round(time.monotonic() - t1, 3)
    if st["phase"] != "restored":
        record(case, "cold-start", st.get("reason", ""), False, restore_s, cold, preflight=findings)
        pytest.fail(f"restore failed: {st.get('reason')}")
    b_dir = plugin.control_dir(b.uid, CTR)
    wait_file(b_dir / "rank0-outcome.json", 120, running(cri, b_cid))
    got = tp_worker.request_verify(b_dir, 2)
    identical = [v["checksums"] for v in got] == [r["checksums"] for r in ranks] and all(v["same"] for v in got)
    rec = record(case, "restored", "", identical, restore_s, cold, allreduce_ok=all(v["allreduce_ok"] for v in got),
                 worker_outcome=json.loads((b_dir / "rank0-outcome.json").read_text()), timings=st["timings"],
                 cuda_pids=manifest(plugin, name)["cuda"]["pids"], preflight=findings)
    drop_artifact(plugin, name)
    assert identical and rec["allreduce_ok"], got
    assert rec["worker_outcome"]["outcome"] == "restore-complete"


def test_tp2_with_rebuild_restored_onto_swapped_gpus(tmp_path: Path):
    gpus = need_gpus(2)
    from runtime import checkpointable as preflight
    from runtime.container.containers import process_tree
    from runtime.gpu.cuda import CudaCheckpointer

    case = "tp2-rebuild-swapped-gpus"
    env = {**os.environ, **NO_MULTICAST, "REKINDLE_CONTROL_DIR": str(tmp_path), "PYTHONPATH": str(HELPER_DIR)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    t0 = time.monotonic()
    log = open(tmp_path / "job.log", "wb")  # noqa: SIM115 - closed below
    job = subprocess.Popen([sys.executable, str(WORKLOADS / "tp_worker.py"), "--mode", "rebuild", "--gib", str(GIB)],
                           env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_file(tmp_path / "ready-for-checkpoint", 600, lambda: job.poll() is None)
        cold = round(time.monotonic() - t0, 3)
        ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        pids = [r["pid"] for r in ranks]
        report = preflight.inspect(process_tree(job.pid), pids)  # case (a): nothing live is left
        assert not report.blocking, report.reasons()
        before = compute_apps()
        swap = {gpus[0].uuid: gpus[1].uuid, gpus[1].uuid: gpus[0].uuid}
        with CudaCheckpointer() as ck:
            assert sorted(ck.find_cuda_pids(process_tree(job.pid))) == sorted(pids)  # the launcher has no CUDA
            ck.checkpoint_all(pids, lock_timeout_ms=30_000)
            t1 = time.monotonic()
            ck.restore_all(pids, swap)
            restore_s = round(time.monotonic() - t1, 3)
        (tmp_path / "restore-complete").write_text("swapped\n")
        wait_file(tmp_path / "rank1-outcome.json", 120, lambda: job.poll() is None)
        after = compute_apps()
        got = tp_worker.request_verify(tmp_path, 2)
        identical = [v["checksums"] for v in got] == [r["checksums"] for r in ranks]
        moved = all(before.get(p) and after.get(p) == sorted(swap[u] for u in before[p]) for p in pids)
        record(case, "restored", "", identical, restore_s, cold, path="in place: CUDA checkpoint + remapped restore",
               allreduce_ok=all(v["allreduce_ok"] for v in got), gpus_before=before, gpus_after=after,
               moved=moved, notes=[f.summary for f in report.notes])
        assert identical and all(v["allreduce_ok"] for v in got), got
        assert moved, (before, after)
    finally:
        (tmp_path / "stop").write_text("")
        try:
            job.wait(60)
        except subprocess.TimeoutExpired:
            job.kill()
        log.close()
        print((tmp_path / "job.log").read_text()[-3000:])


def compute_apps() -> dict[int, list[str]]:
    """pid -> UUIDs of the GPUs it has a context on (nvidia-smi), sorted."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=60).stdout
    apps: dict[int, list[str]] = {}
    for line in out.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit():
            apps.setdefault(int(pid), []).append(uuid.strip())
    return {p: sorted(u) for p, u in apps.items()}


def test_tp2_on_default_transports_is_refused_and_runs_on(sandbox, cri, plugin, pods):
    need_gpus(2)
    case = name = "tp2-default-refused"
    a, a_cid, t0 = start(cri, pods, f"src-{name}", {"rekindle.dev/checkpoint": name}, [0, 1], tp_job("live"))
    a_dir = plugin.control_dir(a.uid, CTR)
    try:
        wait_file(a_dir / "ready-for-checkpoint", 600, running(cri, a_cid))
    except AssertionError:
        print(container_logs(cri, a_cid), file=sys.stderr)
        raise
    cold = round(time.monotonic() - t0, 3)
    findings = nccl_findings(sandbox, a_cid)  # read-only; may run beside the plugin's own look
    ranks = [json.loads((a_dir / f"rank{r}.json").read_text()) for r in range(2)]
    st = status(plugin, a, {"published", "checkpoint-failed"})
    reason = st.get("reason", "")
    refused = st["phase"] == "checkpoint-failed" and reason.startswith("checkpoint refused:")
    # Nothing was locked: the job computes on, on the same memory.
    try:
        got = tp_worker.request_verify(a_dir, 2, timeout=60)
        unharmed = ([v["checksums"] for v in got] == [r["checksums"] for r in ranks]
                    and all(v["allreduce_ok"] for v in got))
    except TimeoutError as e:
        got, unharmed = [{"error": str(e)}], False
    record(case, "refused" if refused else ("restored" if st["phase"] == "published" else "cold-start"), reason,
           unharmed, None, cold, source_unharmed=unharmed, preflight=findings)
    assert refused, st
    assert "live NCCL communicator on P2P/CUMEM" in reason, reason
    assert "nccl-socket" in reason or "/dev/shm/nccl-" in reason, reason
    assert unharmed, got
    assert not (plugin.store / "default" / name).exists()
