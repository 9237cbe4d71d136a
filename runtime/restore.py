"""The restore flow: one artifact -> the workload running inside a waiting container.

The target container runs ``rekindle-init --mode restore`` as PID 1 and waits. Steps, timed:
  1. open the artifact (signature), verify every file's digest;
  2. re-check compatibility (node, CRIU, image, driver, GPUs visible to *this* container) and
     that the source's privilege does not exceed the target's (``runtime.security``: uid/gid,
     capabilities, privileged, seccomp, no_new_privs, LSM, user namespace, masked and read-only
     paths, device cgroup, sysctls) — CRIU restores what the source had;
  3. apply the writable-layer diff into the target rootfs (and /dev/shm);
  4. CRIU restore inside the target's namespaces and cgroups with the target's LSM labels
     forced, then the target's oom_score_adj, rlimits and mount flags forced on the stopped
     tree before it runs (runtime.mechanics, runtime.confine);
  5. CUDA: the target's GPU device nodes into the restored mount namespace, restore (remapped
     by UUID onto the GPUs this container was given) + unlock every CUDA process;
  6. ``restore-pid`` + ``restore-complete`` for the init.
Any failure raises; the caller writes ``restore-failed`` and the init kills whatever CRIU left
in its pid namespace and starts the original command.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Any

from . import control as control_mod
from . import overlay
from .checkpoint import (CRIU_DIR, RESTORE_PLAN, ROOTFS_DELETIONS, ROOTFS_TAR, SHM_DELETIONS, SHM_TAR,
                         Timings)
from .containers import ContainerInfo, process_tree, resolve_container
from .criu import MountPlanEntry
from .errors import ArtifactRejected, RekindleError
from .gpus import NVIDIA_MAJOR, spec_devices, visible_gpus
from .compat import CudaFacts, NodeFacts, check_compatibility
from .manifest import Gpu
from .security import LsmSupport, SecurityProfile, check_privilege, lsm_options
from .mechanics import restore_into
from .namespaces import host_pid_of
from .store import ArtifactStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreRequest:
    containerd_state: str
    container_id: str
    namespace: str
    name: str
    image: str
    image_ref: str
    log_dir: str


def cuda_facts(cuda: Any) -> CudaFacts | None:
    """Driver version and every GPU of the node, from the agent's CUDA checkpointer."""
    if cuda is None:
        return None
    try:
        return CudaFacts(cuda.driver_version(), tuple(Gpu(g.uuid, g.name) for g in cuda.gpus()))
    except RekindleError as exc:
        log.warning("CUDA facts unavailable: %s", exc)
        return None


def target_facts(facts: NodeFacts, target_spec: dict[str, Any]) -> NodeFacts:
    """The node's facts with the GPU list narrowed to what the target container can see."""
    if facts.cuda is None:
        return facts
    visible = visible_gpus(spec_devices(target_spec))
    by_uuid = {g.uuid: g for g in facts.cuda.gpus}
    gpus = tuple(Gpu(g.uuid, by_uuid[g.uuid].name if g.uuid in by_uuid else g.name) for g in visible)
    return dataclasses.replace(facts, cuda=CudaFacts(facts.cuda.driver_version, gpus or facts.cuda.gpus))


def _load_plan(path: str) -> dict[str, Any]:
    with open(path) as f:
        plan = json.load(f)
    if not isinstance(plan, dict) or not isinstance(plan.get("mounts"), list):
        raise ArtifactRejected(path, "malformed restore plan")
    return plan


def _plan_entries(plan: dict[str, Any]) -> list[MountPlanEntry]:
    return [MountPlanEntry(key=str(m["key"]), destination=str(m["destination"]), type=str(m["type"]),
                           mount_point=str(m.get("mount_point", ""))) for m in plan["mounts"]]


def _shm_dir(target: ContainerInfo) -> str | None:
    for m in target.spec_mounts:
        if os.path.normpath(m.get("destination", "")) == "/dev/shm" and m.get("type") == "bind":
            return m.get("source")
    return None


def ensure_device_nodes(host_pid: int, target_spec: dict[str, Any]) -> None:
    """Create the target's NVIDIA device nodes in the restored process's /dev.

    CRIU rebuilds the source's /dev tmpfs, holding the *source's* /dev/nvidiaN; after a
    remapped restore the driver reopens the target's GPU by its own node.
    """
    cmds = []
    for d in (target_spec.get("linux") or {}).get("devices") or []:
        if int(d.get("major", -1)) != NVIDIA_MAJOR and not str(d.get("path", "")).startswith("/dev/nvidia"):
            continue
        path = str(d["path"])
        mode = int(d.get("fileMode", 0o666)) & 0o7777
        cmds.append(f"[ -e {path} ] || {{ mknod -m {mode:o} {path} c {int(d['major'])} {int(d['minor'])}; }}")
    if not cmds:
        return
    subprocess.run(["nsenter", "-t", str(host_pid), "-m", "--", "/bin/sh", "-c", "; ".join(cmds)],
                   check=True, capture_output=True, timeout=10)


def restore(req: RestoreRequest, store: ArtifactStore, key: bytes, facts: NodeFacts, *,
            control: control_mod.ControlDir | None = None, cuda: Any = None,
            check_image: bool = True) -> dict[str, float]:
    t = Timings()
    with t.phase("verify"):
        artifact = store.open(req.namespace, req.name, key)
        artifact.verify_files()
    manifest = artifact.manifest
    with t.phase("inspect"):
        target = resolve_container(req.containerd_state, req.container_id)
        tfacts = target_facts(facts, target.spec)
        image = req.image if check_image else manifest.source.image
        image_ref = req.image_ref if check_image else manifest.source.image_ref
        reasons = check_compatibility(manifest, tfacts, image=image, image_ref=image_ref)
        security = SecurityProfile.from_oci_spec(target.spec, label=req.name)
        lsm = LsmSupport.detect()
        reasons += check_privilege(manifest.security, security, lsm=lsm)
        if manifest.cuda is not None and cuda is None:
            reasons.append("artifact holds CUDA state but this agent has no CUDA driver")
        if reasons:
            raise ArtifactRejected(f"{req.namespace}/{req.name}", "; ".join(reasons))
        plan = _load_plan(os.path.join(artifact.path, RESTORE_PLAN))
    work_dir = os.path.join(req.log_dir, f"restore-{req.namespace}-{req.name}-{req.container_id[:12]}")
    os.makedirs(work_dir, exist_ok=True)

    with t.phase("rootfs_apply"):
        overlay.apply(target.rootfs, os.path.join(artifact.path, ROOTFS_TAR),
                      os.path.join(artifact.path, ROOTFS_DELETIONS))
        shm = _shm_dir(target)
        if plan.get("shm") and shm:
            overlay.apply(shm, os.path.join(artifact.path, SHM_TAR), os.path.join(artifact.path, SHM_DELETIONS))

    with t.phase("criu_restore"):
        stdio = plan.get("stdio")
        result = restore_into(target, os.path.join(artifact.path, CRIU_DIR), _plan_entries(plan),
                              source_stdio=tuple(stdio) if isinstance(stdio, list) and len(stdio) == 3 else None,
                              work_dir=work_dir, lsm=lsm_options(security, lsm))
    if manifest.cuda is not None:
        from .cuda import build_gpu_map
        with t.phase("cuda_restore"):
            pidns = target.namespaces["pid"].inode
            host_pids = [host_pid_of(pidns, p) for p in manifest.cuda.pids]
            gpu_map = build_gpu_map([g.uuid for g in manifest.cuda.gpus],
                                    [g.uuid for g in (tfacts.cuda.gpus if tfacts.cuda else ())])
            if gpu_map:
                for pid in host_pids:
                    ensure_device_nodes(pid, target.spec)
            cuda.restore_all(host_pids, gpu_map)
        log.info("CUDA restored for %d process(es)%s", len(host_pids),
                 f", remapped {gpu_map}" if gpu_map else "")
    if control is not None:
        control.write_json(control_mod.TIMINGS, {"restore": dict(t)})
        control.write(control_mod.RESTORE_PID, f"{result.ns_pid}\n")
        control.write(control_mod.RESTORE_COMPLETE, req.name + "\n")
    log.info("restored %s/%s into %s: %d processes, %s", req.namespace, req.name, req.container_id[:12],
             len(process_tree(result.host_pid)), ", ".join(f"{k} {v:.2f}s" for k, v in t.items()))
    return dict(t)

