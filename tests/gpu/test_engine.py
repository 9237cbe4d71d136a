"""The engine-shaped worker (bench/workloads/engine_worker.py) through the real sandbox and the real
plugin on a GPU node: the release path. The source reserves ``GPU_FRACTION`` of the GPU (the 7.6 B
weights plus a zero-filled KV block pool, as vLLM's ``gpu_memory_utilization``); its checkpoint
calls ``/sleep?level=1`` first (weights to pinned host memory, KV cache freed), so the artifact
holds the weights and not the reservation; the plugin wakes the source once the checkpoint ends,
and wakes the restored process before it calls the restore done. Checked: the source's tokens
after its checkpoint and the restored pod's equal the source's first ones; the weights' host copy
is still page-locked after the restore (``is_pinned`` and the wake-up's copy rate, against the
source's own wake-up in the same run).

``REKINDLE_ENGINE_FRACTIONS`` (default ``0.4``) lists the fractions run and
``REKINDLE_ENGINE_HOSTS`` (default ``pinned``; ``pageable``) where the sleep keeps the weights,
one case each (``engine-release-[pageable-]<fraction>.json``); ``REKINDLE_ENGINE_STABLE`` (default
1) is the worker's ``STABLE_ADDRESSES`` (0: the weights' addresses change at a wake-up, and the
first decode records its graphs again);
``REKINDLE_ENGINE_RESTORES`` (default 1) restores its artifact that many times, one pod after
another (the later ones on host memory the first touched: ``restores_again``), each later one
once the first one's node cache entry is sealed (up to 120 s; ``entry_wait_s``), so that it
measures the node's warm path and not a second stream beside the cache's writer.
``REKINDLE_ENGINE_MAP`` (default: the plugin's) is the release-path source's
``rekindle.dev/map-ranges``. Every restore records ``first_answer_s``: from its container's
creation to the first completion a client of the pod got (asked again and again from the
creation on: :class:`FirstAnswer`), and ``restore_to_first_answer_s``: the same asked only once
the plugin's status said ``restored``, which waits for the restore to settle (a second, less the
CUDA restore).

The transparent path (no sleep, the whole reservation checkpointed) runs for the fractions in
``REKINDLE_ENGINE_TRANSPARENT`` (default none: its dump is as large as the reservation, and the
store is in memory): the zero KV pool must be stored as nothing. Checked: the source's tokens
after the restore; recorded: the artifact's size, what it takes on the store against its non-zero
4 KiB pages (scanned), the checkpoint's byte counts and the restore's phases against the
driver's copy. Each case writes ``$REKINDLE_GPU_E2E_OUT/engine-<path>-<fraction>.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.node_check import why_skip

_SKIP = why_skip("the engine release-path test")
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)

from devtools.cri import ContainerState, Mount  # noqa: E402
from tests.gpu import gpu_pods  # noqa: E402
from tests.gpu.test_gpu_e2e import OUT, REPO, cri, plugin, pods, sandbox  # noqa: E402,F401 - fixtures

pytestmark = pytest.mark.gpu

CONTAINER = "engine"
PORT = 8080
MODEL_DIR = Path(os.environ.get("REKINDLE_LLM_MODEL_DIR", "/var/tmp/rekindle-llm-model"))
FRACTIONS = [f for f in os.environ.get("REKINDLE_ENGINE_FRACTIONS", "0.4").split(",") if f]
TRANSPARENT = [f for f in os.environ.get("REKINDLE_ENGINE_TRANSPARENT", "").split(",") if f]
# Restores of the release-path artifact, one after another (the next on memory the last touched)
RESTORES = int(os.environ.get("REKINDLE_ENGINE_RESTORES", "1"))
# Where the release path's sleep keeps the weights (engine_worker's WEIGHTS_HOST), one case each
HOSTS = [h for h in os.environ.get("REKINDLE_ENGINE_HOSTS", "pinned").split(",") if h]
STABLE = os.environ.get("REKINDLE_ENGINE_STABLE", "1")  # engine_worker's STABLE_ADDRESSES
AFTER = {"rekindle.dev/after-restore": f"http://127.0.0.1:{PORT}/wake_up"}
# What the release path's restores map from the node's cache (the source's rekindle.dev/map-ranges;
# empty: the plugin's setting): all maps the pageable sleeping weights instead of filling them
MAP = os.environ.get("REKINDLE_ENGINE_MAP", "")
ANNOTATIONS = {"rekindle.dev/before-checkpoint": f"http://127.0.0.1:{PORT}/sleep?level=1",
               "rekindle.dev/after-restore": f"http://127.0.0.1:{PORT}/wake_up",
               **({"rekindle.dev/map-ranges": MAP} if MAP else {})}


@pytest.fixture(scope="module")
def model() -> Path:
    r = subprocess.run([sys.executable, "-m", "bench.llm_restore", "make-model", "--model-dir", str(MODEL_DIR)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    print(r.stdout.strip())
    return MODEL_DIR


def _get(ip: str, path: str, method: str = "GET", timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(f"http://{ip}:{PORT}{path}", data=b"{}" if method == "POST" else None,
                                 method=method)
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the pod's own address
        doc: dict[str, Any] = json.loads(r.read())
        return doc


class FirstAnswer:
    """The pod's first answer as a client sees it: ``/generate`` asked from the container's
    creation on, again after each refusal (nothing listens before CRIU; the restored process
    answers 503 until its wake-up), on a thread. The plugin's ``restored`` status comes later
    than the process's first answer: it waits for the restore to settle."""

    def __init__(self, ip: str, t0: float, deadline: float = 600) -> None:
        self.ip, self.t0, self.deadline = ip, t0, deadline
        self.seconds: float | None = None
        self.doc: dict[str, Any] | None = None
        self.tries = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while time.monotonic() - self.t0 < self.deadline:
            self.tries += 1
            try:
                doc = _get(self.ip, "/generate", timeout=60)
            except (OSError, urllib.error.URLError):  # refused, reset, 503 (HTTPError): not yet
                time.sleep(0.01)
                continue
            self.seconds, self.doc = round(time.monotonic() - self.t0, 3), doc
            return

    def wait(self, timeout: float = 120) -> tuple[float | None, dict[str, Any] | None]:
        self._thread.join(timeout)
        return self.seconds, self.doc


def _start(cri: Any, pod: Any, model: Path, fraction: str, host: str = "pinned") -> str:
    mounts = [Mount("/workload", str(REPO / "bench" / "workloads"), readonly=True),
              Mount("/model", str(model), readonly=True)]
    mounts += [Mount(d, d, readonly=True) for d in ("/usr/include", "/usr/libexec") if os.path.isdir(d)]
    env = {"MODEL_DIR": "/model", "GPU_FRACTION": fraction, "PORT": str(PORT), "WEIGHTS_HOST": host,
           "STABLE_ADDRESSES": STABLE}
    return gpu_pods.run_gpu_container(cri, pod, 0, [sys.executable, "/workload/engine_worker.py"], mounts,
                                      CONTAINER, env)


def _checkpointed(cri: Any, plugin: Any, pods: list[Any], model: Path, fraction: str, name: str,
                  annotations: dict[str, str], rec: dict[str, Any], timeout: float,
                  host: str = "pinned") -> tuple[Any, Path, Any]:
    """A source pod started, warm, and published (its pod, control dir and reference tokens);
    its cold start and checkpoint written into ``rec``."""
    a = cri.run_pod_sandbox(f"{name}-src", annotations=annotations)
    pods.append(a)
    t0 = time.monotonic()
    a_cid = _start(cri, a, model, fraction, host)
    a_dir = plugin.control_dir(a.uid, CONTAINER)
    try:
        rec["cold_start_s"] = round(gpu_pods.wait_file(a_dir / "worker-startup.json", 600,
                                                       gpu_pods.running(cri, a_cid)), 3)
    except AssertionError:
        print(gpu_pods.container_logs(cri, a_cid)[-8000:], file=sys.stderr)
        raise
    startup = json.loads((a_dir / "worker-startup.json").read_text())
    rec["source_memory"] = startup.get("memory")
    rec["source_startup"] = {k: startup.get(k) for k in ("phases_s", "decode_s", "stable_addresses",
                                                          "arena_bytes", "arena_error", "weights_host")}
    rec["gpu_memory_mib_source"] = gpu_pods.gpu_memory()
    st = gpu_pods.wait_status(plugin, a, CONTAINER, {"published", "checkpoint-failed"}, timeout)
    rec["checkpoint_status_s"] = round(time.monotonic() - t0, 3)
    rec["checkpoint"] = {"phase": st["phase"], "reason": st.get("reason"), "timings": st.get("timings")}
    assert st["phase"] == "published", st
    return a, a_dir, startup["reference_tokens"]


def _restored(cri: Any, plugin: Any, pods: list[Any], model: Path, fraction: str, pod_name: str, name: str,
              ref: Any, rec: dict[str, Any], host: str = "pinned") -> Any:
    """A pod restored from ``name``, checked awake with its weights where the source kept them
    (pinned memory still page-locked) and the source's tokens; its phases and wake-up written
    into ``rec``."""
    b = cri.run_pod_sandbox(pod_name, annotations={"rekindle.dev/restore": name, **AFTER})
    pods.append(b)
    b_ip = cri.pod_ip(b.id)
    t1 = time.monotonic()
    b_cid = _start(cri, b, model, fraction, host)
    answer = FirstAnswer(b_ip, t1)
    st = gpu_pods.wait_status(plugin, b, CONTAINER, {"restored", "cold-start"}, 600)
    rec["restore_status_s"] = round(time.monotonic() - t1, 3)
    rec["restore"] = {"phase": st["phase"], "reason": st.get("reason"), "timings": st.get("timings")}
    assert st["phase"] == "restored", st
    rec["first_answer_s"], first = answer.wait()  # as a client of the pod sees it
    rec["first_answer_tries"] = answer.tries
    assert first is not None and first["tokens"] == ref, (first, ref)
    got = _get(b_ip, "/generate")
    rec["restore_to_first_answer_s"] = round(time.monotonic() - t1, 3)  # after the settled status
    rec["restored_tokens_match"] = got["tokens"] == ref
    b_rec = _get(b_ip, "/startup")
    rec["restored_wakes"] = b_rec.get("wakes")
    rec["restored_memory"] = _get(b_ip, "/memory")
    rec["first_decode_after_wake_s"] = b_rec.get("first_decode_after_wake_s")
    rec["gpu_memory_mib_both"] = gpu_pods.gpu_memory()
    rec["route"] = json.loads((plugin.control_dir(b.uid, CONTAINER) / "timings.json").read_text()).get("route")
    assert got["tokens"] == ref, (got, ref)
    assert cri.container_status(b_cid).state is ContainerState.RUNNING
    # the artifact was taken asleep, before any wake-up: the one wake the restored process
    # records is the plugin's after-restore call, made in it
    assert len(rec["restored_wakes"] or []) == 1, rec["restored_wakes"]
    assert rec["restored_wakes"][0].get("host_pinned") is (host == "pinned"), rec["restored_wakes"]
    return b


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_engine_release_path_restores_awake(cri, plugin, pods, model, fraction: str, host: str) -> None:
    name = f"engine-{'' if host == 'pinned' else host + '-'}{fraction.replace('.', '')}"
    rec: dict[str, Any] = {"case": "release", "gpu_fraction": float(fraction), "weights_host": host,
                           "stable_addresses": STABLE != "0"}
    try:
        a, a_dir, ref = _checkpointed(cri, plugin, pods, model, fraction, name,
                                      {"rekindle.dev/checkpoint": name, **ANNOTATIONS}, rec, 600, host)
        artifact = plugin.store / "default" / name
        rec["artifact_bytes"] = sum(f.stat().st_size for f in artifact.rglob("*") if f.is_file())
        rec["checkpoint_pages"] = json.loads((a_dir / "timings.json").read_text()).get("pages")
        a_ip = cri.pod_ip(a.id)
        src = _get(a_ip, "/generate")
        rec["source_after_checkpoint"] = {"same_tokens": src["tokens"] == ref, "seconds": src["seconds"]}
        rec["source_wakes"] = _get(a_ip, "/startup").get("wakes")
        assert src["tokens"] == ref, (src, ref)
        assert not _get(a_ip, "/is_sleeping")["is_sleeping"]
        if float(fraction) > 0.5:  # two reservations do not fit one GPU: the source goes first
            cri.stop_pod(a.id)
            cri.remove_pod(a.id)
            pods.remove(a)

        # as examples/vllm/restore-deployment.yaml: a restore pod names the wake-up only (the
        # plugin refuses a before-checkpoint call on it, and the pod starts cold)
        for i in range(RESTORES):
            again: dict[str, Any] = {}
            if i:  # the first restore's figures stay at the top level, as before
                rec.setdefault("restores_again", []).append(again)
                again["entry_wait_s"] = _entry_sealed(plugin, name)
            b = _restored(cri, plugin, pods, model, fraction, f"{name}-dst{i or ''}", name, ref,
                          again if i else rec, host)
            if i + 1 < RESTORES:  # its GPU memory back before the next (on memory touched now)
                cri.stop_pod(b.id)
                cri.remove_pod(b.id)
                pods.remove(b)
    finally:
        OUT.mkdir(parents=True, exist_ok=True)
        tag = "" if host == "pinned" else f"{host}-"
        (OUT / f"engine-release-{tag}{fraction}.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps(rec, indent=1))
    from runtime.store.volume import ArtifactStore  # noqa: PLC0415
    ArtifactStore(str(plugin.store)).delete("default", name)  # the store is in memory


def _entry_sealed(plugin: Any, name: str, timeout: float = 120.0) -> float | None:
    """Seconds waited for the node cache's entry of ``name`` to be sealed (None: not in time; the
    restore goes ahead and its route says what it took)."""
    t = time.monotonic()
    try:
        plugin.wait_log(f"default/{name}: cached on this node as", timeout=timeout)
    except AssertionError:
        return None
    return round(time.monotonic() - t, 3)


def _nonzero_bytes(root: Path) -> int:
    """Bytes in the 4 KiB pages under ``root`` that hold anything but zeros; holes are zeros and
    are not read (SEEK_DATA)."""
    import numpy as np  # noqa: PLC0415 - the GPU node's Python has it

    page, block, total = 4096, 64 << 20, 0
    for f in (x for x in root.rglob("*") if x.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            size, off = os.fstat(fd).st_size, 0
            while off < size:
                try:
                    off = os.lseek(fd, off, os.SEEK_DATA)
                except OSError:
                    break  # nothing but a hole to the end
                end = os.lseek(fd, off, os.SEEK_HOLE)
                while off < end:
                    buf = os.pread(fd, min(block, end - off), off)
                    if not buf:
                        break
                    whole = len(buf) // page * page
                    pages = np.frombuffer(buf, np.uint64, whole // 8).reshape(-1, page // 8)
                    total += int(pages.any(axis=1).sum()) * page
                    if len(buf) > whole and any(buf[whole:]):
                        total += len(buf) - whole
                    off += len(buf)
        finally:
            os.close(fd)
    return total


@pytest.mark.parametrize("fraction", TRANSPARENT)
def test_engine_transparent_checkpoint_stores_its_zero_pool_as_nothing(cri, plugin, pods, model, fraction: str) -> None:
    name = f"engine-t{fraction.replace('.', '')}"
    rec: dict[str, Any] = {"case": "transparent", "gpu_fraction": float(fraction)}
    try:
        a, a_dir, ref = _checkpointed(cri, plugin, pods, model, fraction, name,
                                      {"rekindle.dev/checkpoint": name}, rec, 900)
        rec["checkpoint_pages"] = json.loads((a_dir / "timings.json").read_text()).get("pages")
        artifact = (plugin.store / "default" / name).resolve()
        files = [f for f in artifact.rglob("*") if f.is_file()]
        rec["artifact_bytes"] = sum(f.stat().st_size for f in files)
        rec["artifact_allocated_bytes"] = sum(f.stat().st_blocks * 512 for f in files)
        t_scan = time.monotonic()
        rec["artifact_nonzero_bytes"] = _nonzero_bytes(artifact)
        rec["scan_s"] = round(time.monotonic() - t_scan, 3)
        rec["allocated_vs_nonzero"] = round(rec["artifact_allocated_bytes"] / max(1, rec["artifact_nonzero_bytes"]), 4)
        src = _get(cri.pod_ip(a.id), "/generate")
        assert src["tokens"] == ref, (src, ref)

        b = cri.run_pod_sandbox(f"{name}-dst", annotations={"rekindle.dev/restore": name})
        pods.append(b)
        b_ip = cri.pod_ip(b.id)
        t1 = time.monotonic()
        b_cid = _start(cri, b, model, fraction)
        answer = FirstAnswer(b_ip, t1)
        st = gpu_pods.wait_status(plugin, b, CONTAINER, {"restored", "cold-start"}, 600)
        rec["restore_status_s"] = round(time.monotonic() - t1, 3)
        rec["restore"] = {"phase": st["phase"], "reason": st.get("reason"), "timings": st.get("timings"),
                          "route": st.get("route")}
        assert st["phase"] == "restored", st
        rec["first_answer_s"], first = answer.wait()
        assert first is not None and first["tokens"] == ref, (first, ref)
        got = _get(cri.pod_ip(b.id), "/generate")
        rec["restore_to_first_answer_s"] = round(time.monotonic() - t1, 3)
        b_timings = json.loads((plugin.control_dir(b.uid, CONTAINER) / "timings.json").read_text())
        rec["restore_stream"] = b_timings.get("stream")
        rec["restored_tokens_match"] = got["tokens"] == ref
        rec["gpu_memory_mib_both"] = gpu_pods.gpu_memory()
        assert got["tokens"] == ref, (got, ref)
        assert cri.container_status(b_cid).state is ContainerState.RUNNING
        # every byte of the pool is a zero; the store holds the rest, not the reservation
        assert rec["artifact_allocated_bytes"] <= rec["artifact_nonzero_bytes"] * 1.05 + (256 << 20), rec
    finally:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"engine-transparent-{fraction}.json").write_text(json.dumps(rec, indent=1) + "\n")
        print(json.dumps(rec, indent=1))
    from runtime.store.volume import ArtifactStore  # noqa: PLC0415
    ArtifactStore(str(plugin.store)).delete("default", name)
