"""Which mounts CRIU treats as external, and where each one comes from in the target container.

Contract:
- :func:`plan_external_mounts` (dump) makes every bind mount of the OCI spec that is mounted in
  the workload, and every cgroup/cgroup2 mount, external; keys ``m0``, ``m1``, … in destination
  order (a destination reached through a symlink keeps the mount point it resolves to, inside
  the rootfs as runc resolves it).
- :func:`map_mounts` (restore) resolves each key to the TARGET container's host source (bind:
  the target spec's source at that destination; cgroup: the host dir the target's mount shows,
  as a path in the mount namespace of ``view_pid``, the one CRIU runs in: ``runtime.container.hostview``)
  and raises CriuError naming any entry without a counterpart.
"""

from __future__ import annotations

import logging
import os

from runtime.container import oci
from runtime.container.containers import ContainerInfo, MountInfo, read_mountinfo
from runtime.errors import CriuError
from runtime.layout import MountPlanEntry

log = logging.getLogger(__name__)


def _is_bind(m: oci.Mount) -> bool:
    return m.get("type") == "bind" or any(o in ("bind", "rbind") for o in m.get("options") or [])


def resolve_in_root(rootfs: str, path: str, depth: int = 0) -> str:
    """Resolve symlinks of an absolute in-container path, staying inside rootfs (like runc does)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    cur = "/"
    for i, part in enumerate(parts):
        cand = os.path.normpath(os.path.join(cur, part)) if part != ".." else os.path.dirname(cur)
        host = os.path.join(rootfs, cand.lstrip("/"))
        if os.path.islink(host) and depth < 40:
            target = os.readlink(host)
            base = "/" if target.startswith("/") else cur
            cur = resolve_in_root(rootfs, os.path.join(base, target), depth + 1)
        else:
            cur = cand
        if not cur.startswith("/"):
            cur = "/"
    return cur


def plan_external_mounts(
    mountinfo: list[MountInfo], spec: oci.Spec, rootfs: str | None = None
) -> list[MountPlanEntry]:
    """Externals for a dump: every spec bind mount present in the workload's mountinfo and every cgroup mount."""
    points = {m.mount_point for m in mountinfo}
    found: dict[str, tuple[str, str]] = {}  # destination -> (type, mount point)
    for m in spec.get("mounts") or []:
        if not _is_bind(m):
            continue
        dest = os.path.normpath(m["destination"])
        point = dest
        if point not in points and rootfs:
            point = resolve_in_root(rootfs, dest)
        if point not in points:
            log.warning("spec bind mount %s is not mounted in the workload; not external", dest)
            continue
        found[dest] = ("bind", point)
    for mi in mountinfo:
        if mi.fstype in ("cgroup", "cgroup2") and mi.mount_point not in found:
            found[mi.mount_point] = (mi.fstype, mi.mount_point)
    plan = []
    for i, dest in enumerate(sorted(found)):
        typ, point = found[dest]
        plan.append(MountPlanEntry(key=f"m{i}", destination=dest, type=typ,
                                   mount_point=point if point != dest else ""))
    return plan


def host_path_of_mount(m: MountInfo, host_mounts: list[MountInfo]) -> str:
    """Host path showing the same thing as mount ``m`` (same device, longest root prefix)."""
    best: MountInfo | None = None
    for h in host_mounts:
        if h.dev != m.dev:
            continue
        hr = h.root.rstrip("/")
        if (m.root == h.root or m.root.startswith(hr + "/")) and (best is None or len(h.root) > len(best.root)):
            best = h
    if best is None:
        raise CriuError("restore", f"no host mount of device {m.dev} root {m.root} (for {m.mount_point})")
    return os.path.normpath(best.mount_point + "/" + m.root[len(best.root.rstrip("/")):])


def map_mounts(plan: list[MountPlanEntry], target: ContainerInfo, view_pid: int | str = "self") -> list[str]:
    """``mnt[key]:host_source`` for every plan entry, resolved in the target container."""
    spec_binds = {os.path.normpath(m["destination"]): m for m in target.spec_mounts if _is_bind(m)}
    target_mi: list[MountInfo] | None = None
    host_mi: list[MountInfo] | None = None
    out = []
    for e in plan:
        if e.type == "bind":
            m = spec_binds.get(e.destination)
            if m is None:
                raise CriuError("restore", f"mount {e.key} ({e.destination}, bind) has no counterpart in container {target.id}")
            src = m["source"]
        else:
            if target_mi is None:
                target_mi, host_mi = read_mountinfo(target.init_pid), read_mountinfo(view_pid)
            tm = [m for m in target_mi if m.mount_point == e.destination and m.fstype in ("cgroup", "cgroup2")]
            if not tm:
                raise CriuError("restore", f"mount {e.key} ({e.destination}, {e.type}) has no counterpart in container {target.id}")
            src = host_path_of_mount(tm[-1], host_mi or [])
        out.append(f"mnt[{e.key}]:{src}")
    return out
