"""Which GPUs a container can see, by the NVIDIA device nodes it was given.

:class:`~runtime.manifest.Gpu` is a GPU as every part of Rekindle names it: its UUID (``GPU-xxxxxxxx-...``, as the
driver and nvidia-smi print it; ``runtime.gpu.driver.parse_uuid`` reads it) and its model name.
The driver's listing (:func:`node_gpus`) keys them by device minor, CUDA's
(``CudaCheckpointer.gpus``) by ordinal (the list position); a manifest stores them as they are.

A GPU is visible to a container when its ``/dev/nvidia<minor>`` node is in the container's
devices (that is how the NVIDIA device plugin and CDI hand GPUs to pods). The driver lists every
GPU with its minor number and UUID under ``/proc/driver/nvidia/gpus/<bus-id>/information``.
Order: by minor number, which is the order CUDA enumerates them in a container that sees a
subset (PCI order).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from runtime.container import oci
from runtime.manifest import Gpu

PROC_GPUS = "/proc/driver/nvidia/gpus"
NVIDIA_MAJOR = 195
_DEV = re.compile(r"^/dev/nvidia(\d+)$")


def node_gpus(proc_gpus: str = PROC_GPUS) -> dict[int, Gpu]:
    """Every NVIDIA GPU of the node by device minor, in minor order; empty without the driver."""
    out: dict[int, Gpu] = {}
    try:
        entries = os.listdir(proc_gpus)
    except OSError:
        return {}
    for bus in entries:
        fields: dict[str, str] = {}
        try:
            with open(os.path.join(proc_gpus, bus, "information")) as f:
                for line in f:
                    k, _, v = line.partition(":")
                    fields[k.strip()] = v.strip()
        except OSError:
            continue
        if "Device Minor" in fields and "GPU UUID" in fields:
            out[int(fields["Device Minor"])] = Gpu(fields["GPU UUID"], fields.get("Model", ""))
    return dict(sorted(out.items()))


def minors_of(devices: Iterable[tuple[str, int, int]]) -> list[int]:
    """GPU minors among (path, major, minor) device entries."""
    minors = set()
    for path, major, minor in devices:
        m = _DEV.match(path)
        if m or (major == NVIDIA_MAJOR and minor < 128):
            minors.add(minor if not m else int(m.group(1)))
    return sorted(minors)


def visible_gpus(devices: Iterable[tuple[str, int, int]], proc_gpus: str = PROC_GPUS) -> list[Gpu]:
    """The node GPUs a container with these device entries can see, in minor order."""
    wanted = set(minors_of(devices))
    return [g for minor, g in node_gpus(proc_gpus).items() if minor in wanted]


def spec_devices(spec: oci.Spec) -> list[tuple[str, int, int]]:
    """(path, major, minor) of every device in an OCI spec."""
    out = []
    for d in (spec.get("linux") or {}).get("devices") or []:
        try:
            out.append((str(d["path"]), int(d.get("major", -1)), int(d.get("minor", -1))))
        except (KeyError, TypeError, ValueError):
            continue
    return out
