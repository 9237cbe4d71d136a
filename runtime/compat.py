"""Whether an artifact can be restored on this node into a given container.

:func:`check_compatibility` lists every reason it cannot (architecture, CRIU version, image,
CUDA driver, GPU count and models); a kernel major.minor difference is only a warning unless
asked for. :class:`NodeFacts` describes the node, its CUDA driver and GPUs as a manifest's
:class:`runtime.manifest.CudaInfo` (without pids), narrowed to the target container's GPUs when
the caller knows them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from runtime.criu import criu_version, version_tuple
from runtime.errors import CriuError
from runtime.manifest import CudaInfo, Manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeFacts:
    hostname: str
    kernel: str
    arch: str
    criu_version: str | None
    cuda: CudaInfo | None  # the driver and the GPUs (of the target container, once narrowed)

    @classmethod
    def detect(cls, criu_version: str | None = None, cuda: CudaInfo | None = None) -> NodeFacts:
        """Facts of this node. ``criu_version`` None runs ``criu --version`` (None on failure);
        ``cuda`` is passed in by the caller (the cuda module owns libcuda)."""
        uts = os.uname()
        return cls(hostname=uts.nodename, kernel=uts.release, arch=uts.machine,
                   criu_version=criu_version or _criu_version(), cuda=cuda)


def _criu_version() -> str | None:
    try:
        return criu_version(timeout=5)
    except CriuError as exc:
        log.warning("criu --version failed: %s", exc)
        return None


def _major_minor(kernel: str) -> tuple[int, ...] | str:
    version = version_tuple(kernel)
    return version[:2] if version else kernel


def check_compatibility(manifest: Manifest, facts: NodeFacts, *, image: str, image_ref: str,
                        strict_kernel: bool = False) -> list[str]:
    """Every reason ``manifest`` cannot be restored on ``facts`` into a container of
    ``image``/``image_ref``. A kernel major.minor difference is logged as a warning and listed
    only with ``strict_kernel``; every other difference is listed."""
    reasons: list[str] = []
    src = manifest.node
    if src.arch != facts.arch:
        reasons.append(f"architecture differs: artifact {src.arch}, node {facts.arch}")
    if _major_minor(src.kernel) != _major_minor(facts.kernel):
        message = f"kernel differs: artifact {src.kernel}, node {facts.kernel}"
        if strict_kernel:
            reasons.append(message)
        else:
            log.warning("artifact %s/%s: %s", manifest.namespace, manifest.name, message)
    want = version_tuple(manifest.criu.version)
    have = version_tuple(facts.criu_version or "")
    if have is None or want is None:
        reasons.append(f"CRIU version unknown: artifact {manifest.criu.version!r}, "
                       f"node {facts.criu_version!r}")
    elif have < want:
        reasons.append(f"CRIU {facts.criu_version} is older than the artifact's "
                       f"{manifest.criu.version}")
    if manifest.source.image != image:
        reasons.append(f"image differs: artifact {manifest.source.image}, target {image}")
    if manifest.source.image_ref != image_ref:
        reasons.append(f"image digest differs: artifact {manifest.source.image_ref or 'unknown'}, "
                       f"target {image_ref or 'unknown'}")
    elif image and not image_ref:
        # Two unknowns are no match: neither side is known to be the image it names.
        reasons.append(f"image digest unknown on both sides for {image}")
    cuda = manifest.cuda
    if cuda is not None:
        if facts.cuda is None:
            reasons.append("artifact uses CUDA, node has no CUDA driver")
        else:
            if cuda.driver_version != facts.cuda.driver_version:
                reasons.append(f"CUDA driver differs: artifact {cuda.driver_version}, "
                               f"node {facts.cuda.driver_version}")
            if len(cuda.gpus) != len(facts.cuda.gpus):
                reasons.append(f"GPU count differs: artifact {len(cuda.gpus)}, "
                               f"target {len(facts.cuda.gpus)}")
            for i, (a, b) in enumerate(zip(cuda.gpus, facts.cuda.gpus)):
                if a.name != b.name:
                    reasons.append(f"GPU {i} model differs: artifact {a.name}, target {b.name}")
    return reasons
