"""Runs CRIU inside a container's namespaces and cgroups: dump its workload tree, restore a tree into another.

Contract (the container's PID 1 is ``rekindle-init``; the tree to move is its single child):

- :func:`dump_workload` runs CRIU inside the source container's pid namespace with a /proc of that
  namespace (``nsenter -p`` + ``unshare -m --mount-proc``), so the image holds namespace pids. The
  netns, every spec bind mount and every cgroup mount are external (see ``runtime.container.mount_plan``). It
  returns what restore needs and the manifest stores: the mount plan, the source's stdio links
  (``pipe:[ino]`` keys for ``--inherit-fd``), and the host source of ``/dev/shm`` when that is an
  external bind (CRIU does not save it; the caller tars it).
- :func:`restore_into` restores an image into a running target container whose init waits in
  restore mode. CRIU runs in the mount namespace of the target's runtime (its shim's), where
  its bind sources and rootfs are, even when the plugin has one of its own
  (``runtime.container.hostview.criu_launch``: the plugin's CRIU, loader and libraries, nothing of the
  host's). Before CRIU: the mount plan is mapped to the target's sources, every pid and thread
  id of the image is checked free in the target pid ns and the ns's ``ns_last_pid`` is raised above
  them (CRIU and its helpers are forked into that ns too, and would take them). CRIU then runs in
  the target's pid ns and cgroups (so the restored memory is charged to the target from the first
  page), on the target rootfs (host path), joins its ipc and uts namespaces, and gets the target's
  netns and stdio pipes (the target init's fds 0-2: the container log) via ``--inherit-fd``.
  CRIU leaves every restored task stopped (``--leave-stopped``) and, when asked, forces the
  target's LSM labels (``--lsm-profile``/``--lsm-mount-context``, see ``runtime.security``).
  After CRIU: the restored root must be a child of the target init (CRIU exits, ``-d`` leaves the
  root an orphan, the kernel reparents it to the pid ns's init): verified, else NamespaceError.
  The tree is (re)written into the target cgroups and the target's hostname/domainname, which
  CRIU overwrites with the source's, are put back. While still stopped, the tree gets the
  target's oom_score_adj, rlimits and mount flags (``runtime.container.confine``, verified, else
  ConfinementError); only then is it sent SIGCONT. The caller then writes ``restore-pid`` and
  ``restore-complete``; on any error it writes ``restore-failed`` (the init kills leftovers,
  stopped ones included).
- Shell jobs: when the tree's session/process-group leader is outside the tree (the init did not
  ``setsid`` the workload), ``--shell-job`` is passed on dump and restore; the restored tree then
  gets CRIU's session, which lies outside the target pid ns.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.container import hostview
from runtime.container import namespaces as ns
from runtime.container.confine import confine
from runtime.container.containers import ContainerInfo, Pid, process_tree, read_mountinfo, read_stdio, workload_root
from runtime.container.mount_plan import map_mounts, plan_external_mounts
from runtime.criu import command as criu_mod
from runtime.criu.command import DumpOptions, RestoreOptions
from runtime.criu.image_files import image_is_shell_job, image_pids
from runtime.criu.log import unexpected_errors
from runtime.errors import CriuError, NamespaceError
from runtime.layout import MountPlanEntry
from runtime.proc import procfs
from runtime.proc.tasks import descendants, kill_all, wait_stopped
from runtime.security import LsmOptions

log = logging.getLogger(__name__)

PID_HEADROOM = 64  # pids above the image's highest for CRIU's own processes
PID_WAIT = 3.0  # seconds to wait for image pids still held by dying processes


@dataclass(frozen=True)
class DumpResult:
    root_ns_pid: int
    root_host_pid: int
    tree: tuple[int, ...]  # host pids (as CRIU left them when asked to leave them stopped)
    mount_plan: list[MountPlanEntry]
    criu_version: str
    seconds: float
    stdio: tuple[str, str, str]
    shm_source: str | None
    shell_job: bool
    log_path: str


@dataclass(frozen=True)
class RestoreResult:
    ns_pid: int
    host_pid: int
    tree: tuple[int, ...]  # host pids of the restored tree, every thread stopped
    seconds: float
    criu_seconds: float
    log_path: str


def _session_ids(host_pid: int) -> tuple[int, int]:
    with open(f"/proc/{host_pid}/stat", "rb") as f:
        st = procfs.parse_stat(f.read())
    return st.pgrp, st.session


def _is_shell_job(tree: list[int]) -> bool:
    members = set(tree)
    for pid in tree:
        try:
            pgrp, sid = _session_ids(pid)
        except OSError:
            continue
        if pgrp not in members or sid not in members:
            return True
    return False



def dump_workload(
    info: ContainerInfo,
    images_dir: str,
    leave_running: bool = True,
    work_dir: str | None = None,
    timeout: float = 1800.0,
    leave_stopped: bool = False,
    tcp_established: bool = False,
) -> DumpResult:
    """Dump the workload tree of ``info`` (its init's single child) into ``images_dir``.

    ``leave_stopped``: the tree stays stopped after the dump, so the caller can capture the
    writable layer and /dev/shm at the same instant as the memory, then resume it (SIGCONT).
    ``tcp_established``: keep TCP connections (``runtime.proc.tcpmode`` decides), else close them."""
    root: Pid = workload_root(info)
    if os.stat(f"/proc/{root.host}/ns/pid").st_ino != info.namespaces["pid"].inode:
        raise NamespaceError(f"workload {root.host} is not in container {info.id}'s pid namespace")
    mounts = read_mountinfo(root.host)
    plan = plan_external_mounts(mounts, info.spec, info.rootfs)
    tree = process_tree(root.host)
    shell_job = _is_shell_job(tree)
    stdio = read_stdio(root.host)
    shm = next((m.get("source") for m in info.spec_mounts
                if os.path.normpath(m.get("destination", "")) == "/dev/shm"
                and any(e.destination == "/dev/shm" and e.type == "bind" for e in plan)), None)
    opts = DumpOptions(
        images_dir=images_dir,
        pid=root.ns,
        work_dir=work_dir,
        leave_running=leave_running,
        leave_stopped=leave_stopped,
        netns_inode=os.stat(f"/proc/{root.host}/ns/net").st_ino,
        external_mounts=plan,
        shell_job=shell_job,
        tcp_established=tcp_established,
    )
    version = criu_mod.criu_version()
    os.makedirs(images_dir, exist_ok=True)
    log.info("dump container %s: root %s, %d processes, %d external mounts, shell_job=%s, tcp=%s",
             info.id, root, len(tree), len(plan), shell_job, "established" if tcp_established else "close")
    seconds = criu_mod.run_criu(opts, wrapper=ns.in_pid_ns_argv(info.init_pid, []), timeout=timeout)
    if leave_stopped:
        # What CRIU froze: short-lived children listed before may be gone, new ones were dumped.
        tree = process_tree(root.host)
        wait_stopped(tree)
    return DumpResult(root_ns_pid=root.ns, root_host_pid=root.host, tree=tuple(tree), mount_plan=plan,
                      criu_version=version, seconds=seconds, stdio=stdio, shm_source=shm,
                      shell_job=shell_job, log_path=criu_mod.log_path(opts))


def _prepare_pid_ns(target: ContainerInfo, images_dir: str) -> None:
    needed = image_pids(images_dir)
    deadline = time.monotonic() + PID_WAIT
    while True:  # leftovers of a failed attempt may still be dying (reaped by the target init)
        taken = sorted(needed & ns.used_pids(target.namespaces["pid"].inode).keys())
        if not taken or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if taken:
        raise NamespaceError(
            f"container {target.id}: pids {taken} of the image are already used in its pid namespace"
        )
    top = max(needed)
    if top + PID_HEADROOM >= ns.pid_max():
        raise NamespaceError(f"image pid {top} is too close to pid_max {ns.pid_max()}")
    ns.set_ns_last_pid(target.init_pid, top)


def _open_inherited(target: ContainerInfo, source_stdio: tuple[str, str, str] | None) -> list[tuple[int, str]]:
    """fds (opened here, passed to CRIU) and the image resources they stand for."""
    fds: list[tuple[int, str]] = [(os.open(target.ns_path("net"), os.O_RDONLY), criu_mod.NET_KEY)]
    seen = set()
    for i, link in enumerate(source_stdio or ()):
        if not link.startswith("pipe:[") or link in seen:
            continue
        seen.add(link)
        try:
            fd = os.open(f"/proc/{target.init_pid}/fd/{i}", os.O_RDWR)
        except OSError as e:
            log.warning("target %s fd %d cannot be reopened (%s); restoring stdio %d onto /dev/null", target.id, i, e, i)
            fd = os.open(os.devnull, os.O_RDWR)
        fds.append((fd, link))
    return fds


def restore_into(
    target: ContainerInfo,
    images_dir: str,
    mount_plan: list[MountPlanEntry],
    source_stdio: tuple[str, str, str] | None = None,
    work_dir: str | None = None,
    timeout: float = 1800.0,
    cgroups_first: bool = True,
    lsm: LsmOptions = LsmOptions(),
    tcp_established: bool = False,
    lazy_pages: bool = False,
    inherit: Sequence[tuple[int, str]] = (),
) -> RestoreResult:
    """Restore the tree in ``images_dir`` into ``target`` (whose init waits in restore mode).

    ``source_stdio`` is ``DumpResult.stdio`` (None: stdio pipes are not re-attached).
    ``lsm`` is what :func:`runtime.security.lsm_options` says CRIU must force.
    ``tcp_established``: the mode the dump was taken with (``RestorePlan.tcp_established``).
    ``lazy_pages``: ``--lazy-pages``: the lazy pagemap entries are served through userfaultfd by
    whoever listens on ``lazy-pages.socket`` in the work dir (``runtime.criu.lazy_pages``).
    ``inherit``: more (fd, key) for ``--inherit-fd`` (the node cache's files that ranges map,
    ``runtime.pages.mapping``); the caller keeps and closes them.
    ``cgroups_first=False`` runs CRIU in the caller's cgroups and only moves the tree afterwards
    (memory restored until then stays charged to the caller's cgroup).
    """
    t0 = time.monotonic()
    work = work_dir or images_dir
    os.makedirs(work, exist_ok=True)
    pidfile = os.path.join(work, "restore.pid")
    if os.path.exists(pidfile):
        os.unlink(pidfile)
    with hostview.criu_launch(target.init_pid, criu_mod.CRIU) as launch:
        externals = map_mounts(mount_plan, target, view_pid=launch.mounts_pid)
        hostname, domainname = ns.read_uts(target.init_pid)
        _prepare_pid_ns(target, images_dir)
        fds = _open_inherited(target, source_stdio)
        try:
            opts = RestoreOptions(
                images_dir=images_dir,
                root=target.rootfs,
                pidfile=pidfile,
                work_dir=work_dir,
                inherit_fds=[*fds, *inherit],
                join_ns=[("ipc", "/proc/1/ns/ipc"), ("uts", "/proc/1/ns/uts")],
                external_mounts=externals,
                shell_job=image_is_shell_job(images_dir),
                tcp_established=tcp_established,
                leave_stopped=True,
                lsm_profile=lsm.profile,
                lsm_mount_context=lsm.mount_context,
                view_root=launch.root,
                # The mount-v2 engine copies sharing groups from the target rootfs, which fails
                # (EINVAL) when CRIU runs in the plugin's pod and sees that mount as a propagated
                # slave; the compatibility engine works from the host and from the pod alike.
                extra=["--mntns-compat-mode", *(["--lazy-pages"] if lazy_pages else []), *launch.extra],
            )
            # The launcher makes its own mount namespace and /proc (of the target's pid ns).
            wrapper = (ns.in_pid_ns_argv(target.init_pid, []) if launch.same
                       else ns.nsenter_argv(target.init_pid, ["pid"], []))
            if cgroups_first:
                wrapper = ns.enter_cgroups_argv(target.cgroups.values(), wrapper)
            criu_seconds = criu_mod.run_criu(opts, wrapper=wrapper, pass_fds=[*(fd for fd, _ in (*fds, *inherit)),
                                                                                *launch.pass_fds],
                                             timeout=timeout, launcher=launch.argv,
                                             criu=hostview.criu_binary(launch, criu_mod.CRIU))
        finally:
            for fd, _ in fds:
                os.close(fd)
    lp = criu_mod.log_path(opts)
    try:
        with open(pidfile) as f:
            ns_pid = int(f.read().strip())
    except (OSError, ValueError) as e:
        raise CriuError("restore", f"no usable pidfile {pidfile}: {e}", lp) from e
    host_pid = ns.host_pid_of(target.namespaces["pid"].inode, ns_pid, hint_parent=target.init_pid)
    # Every descendant of the target's init in its pid namespace is one CRIU restored: not only
    # the root's (a task CRIU forks from a session leader through a helper is reparented to the
    # namespace's init when the helper exits, as zdtm's session00 shows); never a task that
    # entered the namespace from outside (an exec), which the tree's kill must not reach.
    pidns = target.namespaces["pid"].inode
    tree = [host_pid, *sorted(p for p in descendants(target.init_pid)
                              if p != host_pid and ns.pid_namespace_of(p) == pidns)]
    try:
        ppid = _ppid(host_pid)
        if ppid != target.init_pid:
            raise NamespaceError(f"restored root {host_pid} has parent {ppid}, not the target init {target.init_pid}")
        errors = unexpected_errors(lp)
        if errors:
            raise CriuError("restore", "exit 0 but the log has errors: " + " | ".join(errors[-4:]), lp)
        wait_stopped(tree)
        ns.move_to_cgroups(tree, target.cgroups.values())
        ns.set_uts(target.init_pid, hostname, domainname)
        confine(target.init_pid, tree)
    except BaseException:
        kill_all(tree)  # stopped since CRIU: it never ran
        raise
    seconds = time.monotonic() - t0
    log.info("restored into %s (stopped): ns pid %d host pid %d, %d processes in %.3fs (criu %.3fs)",
             target.id, ns_pid, host_pid, len(tree), seconds, criu_seconds)
    return RestoreResult(ns_pid=ns_pid, host_pid=host_pid, tree=tuple(tree), seconds=seconds,
                         criu_seconds=criu_seconds, log_path=lp)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    return 0
