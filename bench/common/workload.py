"""The restore benches' workloads: a GPU holder of N GiB (tests/gpu/workloads/gpu_holder.py),
the Qwen2-7B-shaped LLM server (bench/workloads/llm_worker.py) or the demo's CPU counter; how
each starts in a pod, when it is ready to checkpoint, and whether a restored one answers as
its source did."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common.units import GIB
from devtools.cri import Mount, Pod
from tests.gpu import gpu_pods
from tests.gpu.workloads import gpu_holder  # client helpers; torch is not imported

REPO = Path(__file__).resolve().parents[2]

CONTAINER = "worker"
PORT = 8080
CASES = {"synthetic-16gib": 16.0, "synthetic-49gib": 49.0, "llm-7b": None, "cpu-1gib": 1.0}
COUNTER = "localhost/rekindle/counter:1"  # cpu-1gib: the demo's server, no GPU (checks the runner)


class Workload:
    """Start, readiness and 'is it the same' for one kind of worker (``args``: the bench's, with
    ``compile_mode`` and ``model_dir`` for the LLM)."""

    def __init__(self, case: str, args: argparse.Namespace) -> None:
        self.case, self.args = case, args
        self.gib = CASES[case]
        self.reference: Any = None

    @property
    def cpu(self) -> bool:
        return self.case.startswith("cpu-")

    def start(self, cri: Any, pod: Pod) -> str:
        if self.cpu:
            cid = cri.create_container(pod, CONTAINER, COUNTER, command=["/usr/local/bin/counter-server", str(PORT)],
                                       env={"WARMUP_MIB": str(int(self.gib * 1024)), "WARMUP_PASSES": "20"})
            cri.start_container(cid)
            return cid
        if self.gib is None:
            cmd = [sys.executable, "/workload/llm_worker.py"]
            env = {"MODEL_DIR": "/model", "COMPILE_MODE": self.args.compile_mode, "PORT": str(PORT)}
            mounts = [Mount("/workload", str(REPO / "bench" / "workloads"), readonly=True),
                      Mount("/model", str(self.args.model_dir), readonly=True),
                      *[Mount(d, d, readonly=True) for d in ("/usr/include", "/usr/libexec") if os.path.isdir(d)]]
        else:
            cmd = [sys.executable, "/workload/gpu_holder.py", "--gib", str(self.gib)]
            env = {}
            mounts = [Mount("/workload", str(REPO / "tests" / "gpu" / "workloads"), readonly=True)]
        return gpu_pods.run_gpu_container(cri, pod, 0, cmd, mounts, CONTAINER, env)

    def ready_file(self) -> str:
        if self.cpu:
            return "ready-for-checkpoint"
        return "checksums.json" if self.gib else "worker-startup.json"

    def cold_record(self, ctl: Path, cri: Any = None, pod: Pod | None = None) -> dict[str, Any]:
        if self.cpu:
            self.reference = _get(cri.pod_ip(pod.id), "/verify")
            return {"gpu_bytes": 0}
        doc = json.loads((ctl / self.ready_file()).read_text())
        if self.gib:
            self.reference = doc["checksums"]
            return {"import_torch_s": doc["import_torch_s"], "fill_s": doc["fill_s"],
                    "gpu_bytes": doc["checksums"]["bytes"]}
        self.reference = doc["reference_tokens"]
        return {"phases_s": doc.get("phases_s"), "gpu_bytes": int(doc.get("gpu_reserved_gib", 0) * GIB),
                "compile_error": doc.get("compile_error")}

    def answer(self, cri: Any, pod: Pod, ctl: Path) -> tuple[bool, dict[str, Any]]:
        if self.cpu:
            got = _get(cri.pod_ip(pod.id), "/verify")
            return got == self.reference, {"verify": got.strip()}
        if self.gib:
            got = gpu_holder.request_verify(ctl, timeout=300)
            return bool(got["same"]) and got["checksums"] == self.reference, {"compute_s": got["compute_s"]}
        ip = cri.pod_ip(pod.id)
        t0 = time.monotonic()
        last: Exception | None = None
        while time.monotonic() - t0 < 180:
            try:
                with urllib.request.urlopen(f"http://{ip}:{PORT}/generate", timeout=120) as r:
                    got = json.loads(r.read())
                return got.get("tokens") == self.reference, {"generate_s": got.get("seconds")}
            except OSError as e:
                last = e
                time.sleep(0.05)
        raise AssertionError(f"no answer from {ip}: {last}")


def _get(ip: str, path: str) -> str:
    """GET ``path`` on the pod at ``ip``, retried for a minute while it does not answer."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://{ip}:{PORT}{path}", timeout=10) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
