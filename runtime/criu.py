"""The CRIU command line: typed options, one runner, the external-mount plan, the pstree image.

Contract:

- :class:`DumpOptions` / :class:`RestoreOptions` hold every option Rekindle passes;
  :func:`criu_argv` turns one into argv (always ``-o <log> -v4``), :func:`run_criu` runs it
  (optionally wrapped, e.g. by ``nsenter``) with a timeout and raises
  ``CriuError(op, <last error lines of the log>, log_path)`` on any failure.
- Restore can leave the tree stopped (``--leave-stopped``: the caller confines it, then sends
  SIGCONT) and force LSM labels (``--lsm-profile``, ``--lsm-mount-context``).
- TCP: ``--tcp-close`` by default (dump: established connections are not dumped; restore: they
  come back closed; listening sockets restore, so a server keeps serving in a new netns with a new
  IP as long as it listened on a wildcard address); ``tcp_established`` passes
  ``--tcp-established`` instead (connections dumped and restored as they were: only for loopback
  connections inside the tree, see ``runtime.tcpmode``; dump and restore must agree).
- Fixed choices: ``--file-locks``; ``--network-lock skip`` on
  dump (the netns is external: nothing to lock, and nodes may lack iptables-restore);
  ``--manage-cgroups=ignore`` (cgroups are placed by the caller: the target's, never the source's).
- Mount plan: :func:`plan_external_mounts` makes every bind mount of the OCI spec and every
  cgroup/cgroup2 mount external, keys ``m0``, ``m1``, … in destination order;
  :func:`map_mounts` resolves each key to the TARGET container's host source (bind: the target
  spec's source at that destination; cgroup: the host dir the target's mount shows) and raises
  CriuError naming any entry without a counterpart.
- :func:`image_pids` reads ``pstree.img``: every pid and thread id of the image.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime import criu_image
from runtime.containers import ContainerInfo, MountInfo, read_mountinfo
from runtime.errors import CriuError
from runtime.layout import MountPlanEntry

log = logging.getLogger(__name__)

# Distribution builds older than 4.1 fail on recent kernels; a local build is preferred.
CRIU = os.environ.get("REKINDLE_CRIU") or next(
    (p for p in ("/usr/local/sbin/criu", "/usr/local/bin/criu") if os.access(p, os.X_OK)), "criu"
)
NET_KEY = "extnet"
SETPRIV = shutil.which("setpriv") or ""


@dataclass
class DumpOptions:
    images_dir: str
    pid: int
    work_dir: str | None = None
    log_name: str = "dump.log"
    leave_running: bool = True
    leave_stopped: bool = False  # the tree stays stopped after the dump (the caller resumes it)
    netns_inode: int | None = None
    external_mounts: list[MountPlanEntry] = field(default_factory=list)
    shell_job: bool = False
    ext_unix_sk: bool = False
    tcp_established: bool = False  # --tcp-established instead of --tcp-close
    ghost_limit: int | None = None
    extra: list[str] = field(default_factory=list)


@dataclass
class RestoreOptions:
    images_dir: str
    root: str
    pidfile: str
    work_dir: str | None = None
    log_name: str = "restore.log"
    inherit_fds: list[tuple[int, str]] = field(default_factory=list)  # (fd in criu, resource key)
    join_ns: list[tuple[str, str]] = field(default_factory=list)  # (kind, path)
    external_mounts: list[str] = field(default_factory=list)  # "mnt[key]:host_source"
    shell_job: bool = False
    ext_unix_sk: bool = False
    tcp_established: bool = False  # as the dump was taken (RestorePlan.tcp_established)
    leave_stopped: bool = True  # the caller checks the log, fills bulk pages and confines, then resumes
    lsm_profile: str | None = None  # "apparmor:<profile>" / "selinux:<label>"
    lsm_mount_context: str | None = None
    extra: list[str] = field(default_factory=list)


def log_path(opts: DumpOptions | RestoreOptions) -> str:
    return os.path.join(opts.work_dir or opts.images_dir, opts.log_name)


def criu_argv(opts: DumpOptions | RestoreOptions, criu: str = CRIU) -> list[str]:
    work = opts.work_dir or opts.images_dir
    common = ["-D", opts.images_dir, "-W", work, "-o", log_path(opts), "-v4", "--file-locks",
              "--tcp-established" if opts.tcp_established else "--tcp-close", "--manage-cgroups=ignore"]
    if opts.shell_job:
        common.append("--shell-job")
    if opts.ext_unix_sk:
        common.append("--ext-unix-sk")
    if isinstance(opts, DumpOptions):
        argv = [criu, "dump", "-t", str(opts.pid), *common, "--network-lock", "skip"]
        if opts.leave_stopped:
            argv.append("--leave-stopped")
        elif opts.leave_running:
            argv.append("--leave-running")
        if opts.netns_inode is not None:
            argv += ["--external", f"net[{opts.netns_inode}]:{NET_KEY}"]
        for m in opts.external_mounts:
            argv += ["--external", f"mnt[{m.mount_point or m.destination}]:{m.key}"]
        if opts.ghost_limit is not None:
            argv += ["--ghost-limit", str(opts.ghost_limit)]
    else:
        argv = [criu, "restore", *common, "-d", "--pidfile", opts.pidfile, "--root", opts.root]
        for fd, key in opts.inherit_fds:
            argv += ["--inherit-fd", f"fd[{fd}]:{key}"]
        for kind, path in opts.join_ns:
            argv += ["--join-ns", f"{kind}:{path}"]
        for ext in opts.external_mounts:
            argv += ["--external", ext]
        if opts.leave_stopped:
            argv.append("--leave-stopped")
        if opts.lsm_profile:
            argv += ["--lsm-profile", opts.lsm_profile]
        if opts.lsm_mount_context:
            argv += ["--lsm-mount-context", opts.lsm_mount_context]
    return argv + list(opts.extra)


# Error lines CRIU logs on every run of these nodes although nothing failed (no CAP_SYS_RESOURCE
# to raise its own RLIMIT_NOFILE).
HARMLESS_ERRORS = (re.compile(r"rlimit: Can't setup RLIMIT_NOFILE for self"),)


def log_errors(path: str, n: int = 8) -> str:
    """The last error lines of a CRIU log (else its last lines), without the harmless ones that
    would otherwise lead every failure reason."""
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        return f"(no log: {e})"
    errs = [ln for ln in lines if ("Error" in ln or "error" in ln.split(":", 1)[0])
            and not any(p.search(ln) for p in HARMLESS_ERRORS)]
    return " | ".join((errs or lines)[-n:]).strip()


def unexpected_errors(path: str) -> list[str]:
    """Error lines of a CRIU log beyond the known harmless ones. CRIU 4.2.1 exits 0 even when it
    could not read a shmem pages file ("Failed getting raw image fd"); the restored mapping then
    has wrong contents. A restore is only accepted with a clean log."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if "Error (" in ln]
    except OSError as exc:
        return [f"(no log: {exc})"]
    return [ln for ln in lines if not any(p.search(ln) for p in HARMLESS_ERRORS)]


def run_criu(
    opts: DumpOptions | RestoreOptions,
    wrapper: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    timeout: float = 600.0,
    criu: str = CRIU,
) -> float:
    """Run criu (prefixed by ``wrapper``); return its wall time. CriuError on failure or timeout."""
    op = "dump" if isinstance(opts, DumpOptions) else "restore"
    os.makedirs(opts.work_dir or opts.images_dir, exist_ok=True)
    argv = [*_dies_with_parent(), *wrapper, *_dies_with_parent(), *criu_argv(opts, criu)]
    lp = log_path(opts)
    log.info("criu %s: %s", op, " ".join(argv))
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv, pass_fds=tuple(pass_fds), start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except OSError as e:
        raise CriuError(op, f"cannot run {argv[0]}: {e}", lp) from e
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise CriuError(op, f"timed out after {timeout}s: {log_errors(lp)}", lp) from None
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = out.decode(errors="replace").strip().splitlines()[-3:]
        raise CriuError(op, f"exit {proc.returncode}: {log_errors(lp)}" + (f" [{' | '.join(tail)}]" if tail else ""), lp)
    log.info("criu %s done in %.3fs", op, seconds)
    return seconds


def _dies_with_parent() -> list[str]:
    """A prefix that makes what it runs get SIGKILL when its parent dies.

    Used twice: before the wrapper (so the nsenter parent dies with the agent) and right before
    criu (whose parent is that nsenter). An agent killed mid-restore then leaves no CRIU behind
    that could finish the restore after the init has fallen back to the cold start.
    """
    return [SETPRIV, "--pdeathsig", "KILL", "--"] if SETPRIV else []


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.error("criu process group %d did not die", proc.pid)


def criu_version(criu: str = CRIU) -> str:
    try:
        out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CriuError("version", str(e)) from e
    m = re.search(r"Version:\s*(\S+)", out)
    if not m:
        raise CriuError("version", f"unexpected output: {out.strip()!r}")
    return m.group(1)


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def check(criu: str = CRIU) -> None:
    """``criu check``; CriuError with its output when the kernel lacks something CRIU needs."""
    try:
        res = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CriuError("check", str(e)) from e
    if res.returncode != 0:
        raise CriuError("check", (res.stdout + res.stderr).strip()[-500:])


# ---- external mounts ----

def _is_bind(m: dict[str, Any]) -> bool:
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
    mountinfo: list[MountInfo], spec: dict[str, Any], rootfs: str | None = None
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


def map_mounts(plan: list[MountPlanEntry], target: ContainerInfo) -> list[str]:
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
                target_mi, host_mi = read_mountinfo(target.init_pid), read_mountinfo("self")
            tm = [m for m in target_mi if m.mount_point == e.destination and m.fstype in ("cgroup", "cgroup2")]
            if not tm:
                raise CriuError("restore", f"mount {e.key} ({e.destination}, {e.type}) has no counterpart in container {target.id}")
            src = host_path_of_mount(tm[-1], host_mi or [])
        out.append(f"mnt[{e.key}]:{src}")
    return out


# ---- pstree.img ----

def image_pids(images_dir: str) -> set[int]:
    """Every pid and thread id the image will need in the target pid namespace."""
    out: set[int] = set()
    for e in criu_image.read_pstree(images_dir):
        out.add(e.pid)
        out.update(e.threads)
    return out


def image_is_shell_job(images_dir: str) -> bool:
    """True when the tree's session or process group leader is outside the image."""
    entries = criu_image.read_pstree(images_dir)
    pids = {e.pid for e in entries}
    return any(e.sid not in pids or e.pgid not in pids for e in entries)
