"""CUDA checkpoint/restore of a real PyTorch process through runtime.gpu.cuda (needs a GPU, driver >= 580).

One holder process (tests/gpu/workloads/gpu_holder.py, ``$REKINDLE_GPU_TEST_GIB`` GiB, default 2)
serves the whole module; every test leaves it running and its checksums intact.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from runtime.errors import CudaError, CudaUnavailable
from runtime.gpu.cuda import CudaCheckpointer, ProcessState, default_library

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
HOLDER = Path(__file__).resolve().parent / "workloads" / "gpu_holder.py"
GIB = float(os.environ.get("REKINDLE_GPU_TEST_GIB", "2"))


def _why_skip() -> str | None:
    lib = default_library() or "libcuda.so.1"
    try:
        ctypes.CDLL(lib)
    except OSError:
        return f"{lib} is not loadable (no NVIDIA driver here)"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the GPU workload needs PyTorch)"
    try:
        with CudaCheckpointer() as ck:
            if not ck.gpus():
                return "no GPU visible to the CUDA driver"
    except CudaUnavailable as exc:
        return f"CUDA checkpoint API unavailable: {exc}"
    return None


_SKIP = _why_skip()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)


def _load_holder_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_holder", HOLDER)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hc = _load_holder_module()


@pytest.fixture(scope="module")
def ckpt() -> Iterator[CudaCheckpointer]:
    with CudaCheckpointer() as ck:
        yield ck


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen[bytes], Path, dict]]:
    work = tmp_path_factory.mktemp("holder")
    env = dict(os.environ, REKINDLE_CONTROL_DIR=str(work), PYTHONUNBUFFERED="1")
    log = open(work / "holder.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, str(HOLDER), "--gib", str(GIB)], env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        info = hc.wait_ready(work, lambda: proc.poll() is None, timeout=300)
        assert (work / "ready-for-checkpoint").exists()
        yield proc, work, info
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        sys.stderr.write((work / "holder.log").read_text(errors="replace")[-2000:])


def _verify(work: Path) -> None:
    res = hc.request_verify(work)
    assert res["same"], f"checksums changed: {res}"


def _gpu_used_mib() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


def _compute_pids() -> set[int] | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(x) for x in out.split()}


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "nri_plugin.cuda_checkpoint", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _absent_pid() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_driver_facts(ckpt: CudaCheckpointer) -> None:
    gpus = ckpt.gpus()
    assert gpus and all(g.uuid.startswith("GPU-") and len(g.uuid) == 40 for g in gpus)
    version = ckpt.driver_version()
    assert int(version.split(".")[0]) >= 570, version
    assert ckpt.cuda_version() >= 12080


def test_find_cuda_pids(ckpt: CudaCheckpointer, holder: tuple) -> None:
    proc, _, _ = holder
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        assert ckpt.find_cuda_pids([sleeper.pid, proc.pid, _absent_pid()]) == [proc.pid]
        assert ckpt.restore_tid(proc.pid) > 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_checkpoint_frees_gpu_and_restore_keeps_data(ckpt: CudaCheckpointer, holder: tuple) -> None:
    proc, work, _ = holder
    assert ckpt.state(proc.pid) == ProcessState.RUNNING
    before = _gpu_used_mib()
    ckpt.checkpoint_all([proc.pid], lock_timeout_ms=10_000)
    try:
        assert ckpt.state(proc.pid) == ProcessState.CHECKPOINTED
        after = _gpu_used_mib()
        if before is not None and after is not None:
            assert before - after >= 0.8 * GIB * 1024, (before, after)
            assert proc.pid not in (_compute_pids() or set())
        fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
        assert not any(f.startswith("/dev/nvidia") for f in fds), fds
    finally:
        ckpt.restore_all([proc.pid])
    assert ckpt.state(proc.pid) == ProcessState.RUNNING
    _verify(work)


def test_lock_unlock(ckpt: CudaCheckpointer, holder: tuple) -> None:
    proc, work, _ = holder
    ckpt.lock([proc.pid], 10_000)
    try:
        assert ckpt.state(proc.pid) == ProcessState.LOCKED
    finally:
        ckpt.unlock([proc.pid])
    assert ckpt.state(proc.pid) == ProcessState.RUNNING
    _verify(work)


def test_release_brings_back_a_process_left_checkpointed_or_locked(ckpt: CudaCheckpointer, holder: tuple) -> None:
    """What a restarted agent does before checkpointing a source its predecessor left behind."""
    proc, work, _ = holder
    ckpt.checkpoint_all([proc.pid], 10_000)
    assert ckpt.find_cuda_pids([proc.pid]) == [proc.pid]  # still found while checkpointed
    assert ckpt.release([proc.pid]) == [proc.pid]
    assert ckpt.state(proc.pid) == ProcessState.RUNNING
    ckpt.lock([proc.pid], 10_000)
    assert ckpt.release([proc.pid]) == [proc.pid]
    assert ckpt.state(proc.pid) == ProcessState.RUNNING
    assert ckpt.release([proc.pid]) == []  # running: nothing to do
    _verify(work)


def test_restore_with_explicit_identity_pairs(ckpt: CudaCheckpointer, holder: tuple) -> None:
    """Exercises CUcheckpointRestoreArgs.gpuPairs on a real driver: every GPU mapped to itself."""
    proc, work, _ = holder
    gpu_map = {g.uuid: g.uuid for g in ckpt.gpus()}
    ckpt.checkpoint_all([proc.pid], 10_000)
    try:
        ckpt.restore([proc.pid], gpu_map)
    except CudaError:
        ckpt.restore([proc.pid])  # leave the holder usable for the other tests
        raise
    finally:
        ckpt.unlock([proc.pid])
    _verify(work)


def test_cli_on_live_process(holder: tuple) -> None:
    proc, work, _ = holder
    pid = str(proc.pid)
    r = _cli("--get-state", "--pid", pid)
    assert (r.returncode, r.stdout.strip()) == (0, "running"), r.stderr
    r = _cli("--get-restore-tid", "--pid", pid)
    assert r.returncode == 0 and int(r.stdout.strip()) > 0, r.stderr
    assert _cli("--toggle", "--pid", pid, "--timeout", "10000").returncode == 0
    assert _cli("--get-state", "--pid", pid).stdout.strip() == "checkpointed"
    assert _cli("--toggle", "--pid", pid).returncode == 0
    assert _cli("--get-state", "--pid", pid).stdout.strip() == "running"
    _verify(work)


def test_bad_pid_named_error(ckpt: CudaCheckpointer) -> None:
    pid = _absent_pid()
    with pytest.raises(CudaError) as ei:
        ckpt.state(pid)
    assert ei.value.call == "cuCheckpointProcessGetState" and ei.value.name.startswith("CUDA_ERROR_")
    with pytest.raises(CudaError):
        ckpt.lock([pid], 1000)
    r = _cli("--get-state", "--pid", str(pid))
    assert r.returncode == 1 and "CUDA_ERROR_" in r.stderr, r.stderr
    r = _cli("--get-restore-tid", "--pid", str(os.getppid()))
    assert r.returncode != 0
