"""What a running container is, seen from the host: bundle, spec, init pid, rootfs, namespaces.

Contract:

- :func:`resolve_container` (containerd state dir, container id, containerd namespace) and
  :func:`inspect_bundle` (any OCI bundle with ``config.json`` + ``init.pid``, as runc and the
  containerd shim leave them) return a frozen :class:`ContainerInfo`. Everything is read from the
  bundle and the host's procfs; no runtime API is called. A missing bundle, spec, pid file or
  process raises :class:`ContainerNotFound`; an unexpected layout (rootfs not on overlay) raises
  :class:`NamespaceError`.
- :func:`workload_root` is the init's single child (the container's PID 1 is ``rekindle-init``,
  the checkpointed tree is its child), as a :class:`Pid` with host and namespace numbers.
- :func:`process_tree` lists a tree's pids (host numbers), breadth first, via
  ``/proc/<pid>/task/*/children``.
- Cgroups: v1 maps every hierarchy of ``/proc/<pid>/cgroup`` (key: its controller list, e.g.
  ``cpu,cpuacct`` or ``name=systemd``; ``""`` for a cgroup2 hierarchy) to a host directory through
  the cgroup mounts of ``/proc/self/mountinfo``; v2 has the single key ``""``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

from runtime.container import oci
from runtime.errors import ContainerNotFound, NamespaceError

log = logging.getLogger(__name__)

PROC = "/proc"
NAMESPACES = ("net", "ipc", "uts", "pid", "mnt", "cgroup")


@dataclass(frozen=True)
class NsRef:
    """A namespace of the container's init: the host path of its link and its inode."""

    path: str
    inode: int


@dataclass(frozen=True)
class Pid:
    """A process as the host numbers it and as its own (innermost) pid namespace numbers it."""

    host: int
    ns: int


@dataclass(frozen=True)
class MountInfo:
    """One line of ``/proc/<pid>/mountinfo``."""

    mount_id: int
    parent_id: int
    dev: str
    root: str
    mount_point: str
    options: str
    fstype: str
    source: str
    super_options: str


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    bundle: str
    spec: oci.Spec = field(repr=False, compare=False, hash=False)
    init_pid: int
    rootfs: str
    upperdir: str
    namespaces: dict[str, NsRef] = field(compare=False, hash=False)
    cgroup_version: int
    cgroups: dict[str, str] = field(compare=False, hash=False)
    stdio: tuple[str, str, str]
    hostname: str

    def ns_path(self, kind: str) -> str:
        return self.namespaces[kind].path

    @property
    def spec_mounts(self) -> list[oci.Mount]:
        return list(self.spec.get("mounts") or [])

    @property
    def annotations(self) -> dict[str, str]:
        """The spec's annotations (containerd's CRI writes the image and the pod there), string values only."""
        notes = self.spec.get("annotations")
        return {str(k): v for k, v in notes.items() if isinstance(v, str)} if isinstance(notes, dict) else {}


def _unescape(s: str) -> str:
    """Undo mountinfo's octal escapes (\\040 for space, ...)."""
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and s[i + 1 : i + 4].isdigit() and len(s[i + 1 : i + 4]) == 3:
            out.append(chr(int(s[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[MountInfo]:
    mounts = []
    for line in text.splitlines():
        if not line.strip():
            continue
        pre, _, post = line.partition(" - ")
        a = pre.split()
        b = post.split()
        mounts.append(
            MountInfo(
                mount_id=int(a[0]),
                parent_id=int(a[1]),
                dev=a[2],
                root=_unescape(a[3]),
                mount_point=_unescape(a[4]),
                options=a[5],
                fstype=b[0],
                source=_unescape(b[1]) if len(b) > 1 else "",
                super_options=b[2] if len(b) > 2 else "",
            )
        )
    return mounts


def read_mountinfo(pid: int | str = "self") -> list[MountInfo]:
    try:
        with open(f"{PROC}/{pid}/mountinfo") as f:
            return parse_mountinfo(f.read())
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ContainerNotFound(f"process {pid} is gone: {e}") from e


def parse_nspid(status: str) -> list[int] | None:
    """The ``NSpid`` line of a /proc status text: the pid in every pid namespace, outermost
    first; None without one."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    return None


def ns_pids(host_pid: int) -> list[int]:
    """``NSpid`` of a process: its pid in every pid namespace, outermost first."""
    try:
        with open(f"{PROC}/{host_pid}/status") as f:
            status = f.read()
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ContainerNotFound(f"process {host_pid} is gone") from e
    return parse_nspid(status) or [host_pid]


def children(host_pid: int) -> list[int]:
    """Direct children of a process (every thread's children), host pids."""
    out: list[int] = []
    try:
        tids = os.listdir(f"{PROC}/{host_pid}/task")
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            with open(f"{PROC}/{host_pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except FileNotFoundError:
            continue
    return out


def process_tree(host_pid: int) -> list[int]:
    """The tree rooted at ``host_pid``, breadth first, root first (host pids)."""
    seen, queue, order = {host_pid}, [host_pid], [host_pid]
    while queue:
        for c in children(queue.pop(0)):
            if c not in seen:
                seen.add(c)
                queue.append(c)
                order.append(c)
    return order


def threads(host_pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"{PROC}/{host_pid}/task"))
    except FileNotFoundError:
        return []


def workload_root(info: ContainerInfo) -> Pid:
    """The container init's single child: the root of the tree to checkpoint."""
    kids = children(info.init_pid)
    if not kids:
        raise ContainerNotFound(f"container {info.id}: init {info.init_pid} has no child (no workload)")
    if len(kids) > 1:
        raise ContainerNotFound(
            f"container {info.id}: init {info.init_pid} has {len(kids)} children {sorted(kids)}; "
            "expected exactly one workload root"
        )
    host = kids[0]
    return Pid(host=host, ns=ns_pids(host)[-1])


def _ns_ref(pid: int, kind: str) -> NsRef:
    path = f"{PROC}/{pid}/ns/{kind}"
    return NsRef(path=path, inode=os.stat(path).st_ino)


def cgroup_paths(pid: int | str, mountinfo: list[MountInfo] | None = None) -> tuple[int, dict[str, str]]:
    """(version, {hierarchy key: host dir}) for a process, resolved through the host's cgroup mounts."""
    mounts = mountinfo if mountinfo is not None else read_mountinfo("self")
    try:
        with open(f"{PROC}/{pid}/cgroup") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ContainerNotFound(f"process {pid} is gone") from e
    return parse_cgroup_paths(text, mounts)


def parse_cgroup_paths(cgroup_text: str, mounts: list[MountInfo]) -> tuple[int, dict[str, str]]:
    """(version, {hierarchy key: host dir}) from a /proc/<pid>/cgroup text and the host's mounts."""
    v2_root = next((m for m in mounts if m.mount_point == "/sys/fs/cgroup" and m.fstype == "cgroup2"), None)
    version = 2 if v2_root is not None else 1
    paths: dict[str, str] = {}
    for line in cgroup_text.splitlines():
        if not line.strip():
            continue
        _hid, controllers, path = line.split(":", 2)
        if version == 2 and controllers:
            continue
        if controllers:
            wanted = set(controllers.split(","))
            cands = [
                m for m in mounts
                if m.fstype == "cgroup" and wanted <= set(m.super_options.split(","))
            ]
        else:
            cands = [m for m in mounts if m.fstype == "cgroup2"]
            if v2_root is not None:
                cands = [v2_root]
        for m in cands:
            root = m.root.rstrip("/")
            if path == m.root or path.startswith(root + "/"):
                paths[controllers] = os.path.normpath(m.mount_point + "/" + path[len(root):])
                break
        else:
            log.debug("cgroup %s:%s has no host mount", controllers, path)
    return version, paths


def overlay_upperdir(mounts: list[MountInfo]) -> str:
    root = [m for m in mounts if m.mount_point == "/"]
    if not root:
        raise NamespaceError("no / mount in the container's mountinfo")
    m = root[-1]
    if m.fstype != "overlay":
        raise NamespaceError(f"container rootfs is {m.fstype}, not overlay")
    for opt in m.super_options.split(","):
        if opt.startswith("upperdir="):
            return opt[len("upperdir="):]
    raise NamespaceError("overlay rootfs has no upperdir (read-only rootfs?)")


def read_stdio(pid: int) -> tuple[str, str, str]:
    """What fds 0-2 of ``pid`` point at (``pipe:[ino]``, a path, or '' when unreadable)."""
    out = []
    for fd in range(3):
        try:
            out.append(os.readlink(f"{PROC}/{pid}/fd/{fd}"))
        except OSError:
            out.append("")
    return out[0], out[1], out[2]


def inspect_bundle(bundle: str, container_id: str | None = None) -> ContainerInfo:
    """ContainerInfo of the running container whose OCI bundle is ``bundle``."""
    cid = container_id or os.path.basename(os.path.normpath(bundle))
    try:
        with open(os.path.join(bundle, "config.json")) as f:
            spec = json.load(f)
    except FileNotFoundError as e:
        raise ContainerNotFound(f"container {cid}: no bundle spec at {bundle}/config.json") from e
    try:
        with open(os.path.join(bundle, "init.pid")) as f:
            init_pid = int(f.read().strip())
    except (FileNotFoundError, ValueError) as e:
        raise ContainerNotFound(f"container {cid}: no usable init.pid in {bundle} (task not running?)") from e
    if not os.path.exists(f"{PROC}/{init_pid}"):
        raise ContainerNotFound(f"container {cid}: init pid {init_pid} is not running")
    root_path = (spec.get("root") or {}).get("path", "rootfs")
    rootfs = root_path if os.path.isabs(root_path) else os.path.join(bundle, root_path)
    try:
        namespaces = {k: _ns_ref(init_pid, k) for k in NAMESPACES if os.path.exists(f"{PROC}/{init_pid}/ns/{k}")}
        upper = overlay_upperdir(read_mountinfo(init_pid))
        version, cgroups = cgroup_paths(init_pid)
        stdio = read_stdio(init_pid)
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ContainerNotFound(f"container {cid}: init pid {init_pid} vanished: {e}") from e
    info = ContainerInfo(
        id=cid,
        bundle=bundle,
        spec=spec,
        init_pid=init_pid,
        rootfs=rootfs,
        upperdir=upper,
        namespaces=namespaces,
        cgroup_version=version,
        cgroups=cgroups,
        stdio=stdio,
        hostname=spec.get("hostname", ""),
    )
    log.debug("container %s: init %d rootfs %s cgroups v%d %s", cid, init_pid, rootfs, version, cgroups)
    return info


def bundle_path(state_dir: str, container_id: str, namespace: str = "k8s.io") -> str:
    return os.path.join(state_dir, "io.containerd.runtime.v2.task", namespace, container_id)


def resolve_container(state_dir: str, container_id: str, namespace: str = "k8s.io") -> ContainerInfo:
    """ContainerInfo of a containerd task, from its shim bundle under the containerd state dir."""
    bundle = bundle_path(state_dir, container_id, namespace)
    if not os.path.isdir(bundle):
        raise ContainerNotFound(f"container {container_id}: no task bundle at {bundle}")
    return inspect_bundle(bundle, container_id)
