"""Give a CRI container a GPU the way the NVIDIA device plugin / CDI do, for tests and demos.

Contract:
- :func:`gpu_devices_and_mounts` returns the CRI devices and mounts for the node GPUs at the
  given indexes (position in :func:`runtime.gpu.devices.node_gpus`, i.e. by minor number): the
  ``/dev/nvidia<minor>`` node of each, the shared control nodes (``/dev/nvidiactl``,
  ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools``, and ``/dev/nvidia-caps/*`` where present),
  and the driver's user-space libraries read-only (``$REKINDLE_NVIDIA_DRIVER_ROOT``, default
  ``/usr/local/nvidia``, where present). Host and container paths are the same, as the device
  plugin does it.
- :func:`host_python_mounts` makes the node's own Python (and the virtual environment it runs
  in, e.g. one holding PyTorch) usable in a container whose image is an empty merged-/usr
  rootfs (``localhost/rekindle/host-usr:1``): ``/usr/bin``, ``/usr/sbin``, ``/usr/lib``,
  ``/usr/lib64``, ``/etc/ld.so.cache`` and the environment's prefix, all read-only.
- :func:`gpu_env` is the environment such a container needs to find libcuda.
Nothing here talks to containerd; the results go into ``CRIClient.create_container``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from devtools.cri import Device, Mount
from runtime.gpu.devices import node_gpus

DRIVER_ROOT = os.environ.get("REKINDLE_NVIDIA_DRIVER_ROOT", "/usr/local/nvidia")
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CAPS_DIR = "/dev/nvidia-caps"


class GpuNotFound(LookupError):
    """The node has no GPU at the requested index."""


def gpu_minor(index: int) -> int:
    """The minor number of the node GPU at index (index itself when the driver lists none)."""
    minors = list(node_gpus())
    if not minors:
        return index
    if not 0 <= index < len(minors):
        raise GpuNotFound(f"GPU index {index}: the node has {len(minors)} GPU(s)")
    return minors[index]


def gpu_devices_and_mounts(gpu_index: int | Sequence[int], driver_root: str = DRIVER_ROOT,
                           dev: str = "/dev") -> tuple[list[Device], list[Mount]]:
    """CRI devices and mounts that give a container the GPU(s) at gpu_index."""
    indexes = [gpu_index] if isinstance(gpu_index, int) else list(gpu_index)
    devices = [Device(f"/dev/nvidia{m}", os.path.join(dev, f"nvidia{m}"))
               for m in sorted({gpu_minor(i) for i in indexes})]
    for node in CONTROL_NODES:
        host = os.path.join(dev, os.path.basename(node))
        if os.path.exists(host):
            devices.append(Device(node, host))
    caps = os.path.join(dev, os.path.basename(CAPS_DIR))
    if os.path.isdir(caps):
        for name in sorted(os.listdir(caps)):
            devices.append(Device(f"{CAPS_DIR}/{name}", os.path.join(caps, name)))
    mounts = [Mount(driver_root, driver_root, readonly=True)] if os.path.isdir(driver_root) else []
    return devices, mounts


def _env_prefix(prefix: str) -> str:
    """The folder to mount for an environment prefix: its parent when it is a hidden ``.venv``."""
    prefix = os.path.realpath(prefix)
    return os.path.dirname(prefix) if os.path.basename(prefix).startswith(".") else prefix


def host_python_mounts(prefix: str = sys.prefix, base_prefix: str = sys.base_prefix) -> list[Mount]:
    """Read-only mounts that make the node's Python at prefix run in a host-usr container."""
    paths = [p for p in ("/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib64") if os.path.isdir(p)]
    if os.path.isfile("/etc/ld.so.cache"):
        paths.append("/etc/ld.so.cache")
    for p in (_env_prefix(base_prefix), _env_prefix(prefix)):
        if p != "/usr" and not p.startswith("/usr/") and p not in paths:
            paths.append(p)
    return [Mount(p, p, readonly=True) for p in paths]


def gpu_env(driver_root: str = DRIVER_ROOT) -> dict[str, str]:
    """Environment for a GPU container of the host-usr image."""
    libs = [os.path.join(driver_root, d) for d in ("lib64", "lib")]
    inherited = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    return {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LD_LIBRARY_PATH": ":".join(dict.fromkeys(libs + inherited)),
        "HOME": "/tmp",
        "PYTHONUNBUFFERED": "1",
        # Shared machines: never let a library turn on NVLink multicast.
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
