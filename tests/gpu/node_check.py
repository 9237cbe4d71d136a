"""Why a GPU test cannot run on this node (None when it can): the tests skip with this reason."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
from pathlib import Path

from devtools.sandbox import Runtime
from runtime.gpu.devices import node_gpus

REPO = Path(__file__).resolve().parents[2]


def why_skip(what: str) -> str | None:
    """``what``: the tests, for the message ("the GPU e2e test")."""
    if os.geteuid() != 0:
        return f"{what} needs root (containerd, CRIU)"
    if not node_gpus():
        return "no NVIDIA GPU on this node (/proc/driver/nvidia/gpus is empty)"
    try:
        ctypes.CDLL(os.environ.get("REKINDLE_LIBCUDA") or "libcuda.so.1")
    except OSError as e:
        return f"libcuda is not loadable: {e}"
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (the workloads run the node's PyTorch)"
    if not Runtime.V1_7.containerd.exists():
        return f"{Runtime.V1_7.containerd} missing (on a bare GPU node run hack/gpu-node-setup.sh)"
    from runtime.criu.command import CRIU
    missing = [t for t in ("runc", CRIU, "nsenter", "unshare") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (on a bare GPU node run hack/gpu-node-setup.sh)"
    if not (REPO / "build" / "rekindle-init").exists():
        return "build/rekindle-init missing (make)"
    return None
