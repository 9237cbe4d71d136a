"""The checkpoint flow: one running container -> one published artifact.

Steps, each timed (the timings go into the manifest and the container's status):
  1. resolve the container (bundle, init pid, overlay upperdir) and its workload tree;
  2. CUDA: find the tree's CUDA processes, lock all, checkpoint all (device memory -> host);
  3. CRIU dump of the workload tree (--leave-running), netns and mounts external;
  4. CUDA: resume the source (restore + unlock), unless it is to exit;
  5. capture the writable layer (and /dev/shm when it is an external mount);
  6. manifest (identity, node, CRIU, CUDA, security fingerprint, mount plan, digests), signed,
     published atomically;
  7. tell the source (``snapshot-complete``) and stop it if asked.
Any failure raises; the staging dir is removed, nothing appears under the artifact's name.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from . import control as control_mod
from . import overlay
from .containers import ContainerInfo, process_tree, resolve_container, workload_root
from .gpus import spec_devices, visible_gpus
from .manifest import CriuInfo, CudaInfo, Gpu, Manifest, MountInfo, NodeInfo, ProcessInfo, Source
from .security import SecurityProfile
from .mechanics import dump_workload
from .store import ArtifactStore

log = logging.getLogger(__name__)

CRIU_DIR = "criu"
ROOTFS_TAR = "rootfs-diff.tar"
ROOTFS_DELETIONS = "rootfs-deletions.json"
SHM_TAR = "shm.tar"
SHM_DELETIONS = "shm-deletions.json"
RESTORE_PLAN = "restore-plan.json"
ORIGINAL_ARGS_ANNOTATION = "rekindle.dev/original-args"
CUDA_LOCK_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class CheckpointRequest:
    containerd_state: str
    container_id: str
    namespace: str
    name: str
    pod: str
    pod_uid: str
    container: str
    image: str
    image_ref: str
    exit_after: bool
    log_dir: str


class Timings(dict[str, float]):
    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self[name] = round(time.monotonic() - t0, 3)
            log.info("phase %s: %.3fs", name, self[name])


def _original_args(spec: dict[str, Any]) -> list[str]:
    raw = (spec.get("annotations") or {}).get(ORIGINAL_ARGS_ANNOTATION)
    if raw:
        try:
            args = json.loads(raw)
            if isinstance(args, list) and all(isinstance(a, str) for a in args):
                return args
        except ValueError:
            pass
    return [str(a) for a in (spec.get("process") or {}).get("args") or []]


def capture_excludes(info: ContainerInfo) -> list[str]:
    """Paths never captured: every mount destination (their content is not the container's)."""
    dests = [m.get("destination", "") for m in info.spec_mounts]
    return sorted({*overlay.DEFAULT_EXCLUDES, *(d for d in dests if d),
                   control_mod.CONTAINER_PATH, os.path.dirname(control_mod.INIT_DIR_IN_CONTAINER)})


def checkpoint(req: CheckpointRequest, store: ArtifactStore, key: bytes, *,
               control: control_mod.ControlDir | None = None, cuda: Any = None) -> dict[str, float]:
    t = Timings()
    with t.phase("inspect"):
        info = resolve_container(req.containerd_state, req.container_id)
        root = workload_root(info)
        tree = process_tree(root.host)
    log.info("checkpoint %s/%s: container %s, workload %s (%d processes)",
             req.namespace, req.name, req.container_id[:12], root, len(tree))
    work_dir = os.path.join(req.log_dir, f"checkpoint-{req.namespace}-{req.name}-{int(time.time())}")
    os.makedirs(work_dir, exist_ok=True)

    cuda_host: list[int] = []
    cuda_info: CudaInfo | None = None
    if cuda is not None:
        with t.phase("cuda_find"):
            cuda_host = cuda.find_cuda_pids(tree)
    with store.stage(req.namespace, req.name) as staging:
        images = os.path.join(staging.path, CRIU_DIR)
        if cuda_host:
            gpus = [Gpu(g.uuid, g.name) for g in visible_gpus(spec_devices(info.spec))]
            if not gpus:  # a container given every GPU (privileged): what CUDA sees
                gpus = [Gpu(g.uuid, g.name) for g in cuda.gpus()]
            ns_of = {h: _ns_pid(h) for h in cuda_host}
            cuda_info = CudaInfo(cuda.driver_version(), tuple(gpus), tuple(sorted(ns_of.values())))
            stale = cuda.release(cuda_host)
            if stale:
                log.warning("CUDA processes %s were left locked or checkpointed (an earlier agent died "
                            "mid-checkpoint); resumed them first", stale)
            with t.phase("cuda_checkpoint"):
                cuda.checkpoint_all(cuda_host, lock_timeout_ms=CUDA_LOCK_TIMEOUT_MS)
        try:
            with t.phase("criu_dump"):
                dump = dump_workload(info, images, leave_running=True, work_dir=work_dir)
        finally:
            if cuda_host and not req.exit_after:
                with t.phase("cuda_resume_source"):
                    cuda.restore_all(cuda_host)
        with t.phase("rootfs_capture"):
            overlay.capture(info.upperdir, os.path.join(staging.path, ROOTFS_TAR),
                            os.path.join(staging.path, ROOTFS_DELETIONS), exclude=capture_excludes(info))
        if dump.shm_source:
            with t.phase("shm_capture"):
                overlay.capture(dump.shm_source, os.path.join(staging.path, SHM_TAR),
                                os.path.join(staging.path, SHM_DELETIONS), exclude=())
        plan = {
            "stdio": list(dump.stdio),
            "shell_job": dump.shell_job,
            "mounts": [{"key": m.key, "destination": m.destination, "type": m.type,
                        "mount_point": m.mount_point} for m in dump.mount_plan],
            "shm": bool(dump.shm_source),
        }
        with open(os.path.join(staging.path, RESTORE_PLAN), "w") as f:
            json.dump(plan, f, sort_keys=True, indent=1)
        uts = os.uname()
        manifest = Manifest(
            name=req.name, namespace=req.namespace,
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            source=Source(pod=req.pod, pod_uid=req.pod_uid, container=req.container,
                          container_id=req.container_id, image=req.image, image_ref=req.image_ref),
            node=NodeInfo(hostname=uts.nodename, kernel=uts.release, arch=uts.machine),
            criu=CriuInfo(dump.criu_version),
            cuda=cuda_info,
            security=SecurityProfile.from_oci_spec(info.spec, label=req.name),
            process=ProcessInfo(root_pid=dump.root_ns_pid, args=tuple(_original_args(info.spec))),
            mounts=tuple(MountInfo(m.key, m.destination, m.type) for m in dump.mount_plan),
            files=(),
            timings=dict(t),
        )
        with t.phase("publish"):
            staging.publish(manifest, key)

    if control is not None:
        control.write_json(control_mod.TIMINGS, {"checkpoint": dict(t)})
        control.write(control_mod.SNAPSHOT_COMPLETE, req.name + "\n")
    if req.exit_after:
        log.info("stopping the source workload %s as annotated", root)
        try:
            os.kill(root.host, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return dict(t)


def _ns_pid(host_pid: int) -> int:
    with open(f"/proc/{host_pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return host_pid
