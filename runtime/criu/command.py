"""The CRIU command line: typed options, argv, one runner, the CRIU version.

Contract:

- :class:`DumpOptions` / :class:`RestoreOptions` hold every option Rekindle passes;
  :func:`criu_argv` turns one into argv (always ``-o <log> -v4``), :func:`run_criu` runs it
  (optionally wrapped, e.g. by ``nsenter``, and started by a ``launcher``: ``runtime.container.hostview``'s,
  which runs it in the runtime's mount namespace) with a timeout and raises
  ``CriuError(op, <last error lines of the log>, log_path)`` on any failure. ``view_root`` is where
  the plugin's files are in the view CRIU runs in (prefixed to the images, work, log and pidfile
  paths in argv; the options and ``log_path`` keep the plugin's own paths).
- Restore can leave the tree stopped (``--leave-stopped``: the caller confines it, then sends
  SIGCONT) and force LSM labels (``--lsm-profile``, ``--lsm-mount-context``).
- TCP: ``--tcp-close`` by default (dump: established connections are not dumped; restore: they
  come back closed; listening sockets restore, so a server keeps serving in a new netns with a new
  IP as long as it listened on a wildcard address); ``tcp_established`` passes
  ``--tcp-established`` instead (connections dumped and restored as they were: only for loopback
  connections inside the tree, see ``runtime.proc.tcpmode``; dump and restore must agree).
  ``--skip-in-flight`` on dump: a connection still in a listener's accept queue (a client of a
  server under load) belongs to the source's address; the restored pod has another one and an
  empty queue, like every established connection it does not keep. The source's queue is
  untouched. Without it a server taking connections as they come refused most checkpoints
  under load (2 of 4 with slow clients at 1/s).
- Fixed choices: ``--file-locks``; ``--network-lock skip`` on
  dump (the netns is external: nothing to lock, and nodes may lack iptables-restore);
  ``--manage-cgroups=ignore`` (cgroups are placed by the caller: the target's, never the source's).
- Version: :func:`criu_version` runs ``criu --version``; :func:`parse_version` and
  :func:`version_tuple` are the one parser of its output (the doctor, the node facts and the
  test suite's skip reasons use them); :data:`MIN_VERSION` is the oldest CRIU Rekindle runs.
Which mounts are external is ``runtime.container.mount_plan``'s job; reading CRIU's log,
``runtime.criu.log``'s; the image files, ``runtime.criu.image_files``'s.
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

from runtime.criu.log import log_errors
from runtime.errors import CriuError
from runtime.layout import MountPlanEntry

log = logging.getLogger(__name__)

# Distribution builds older than 4.1 fail on recent kernels; a local build is preferred.
CRIU = os.environ.get("REKINDLE_CRIU") or next(
    (p for p in ("/usr/local/sbin/criu", "/usr/local/bin/criu") if os.access(p, os.X_OK)), "criu"
)
NET_KEY = "extnet"
# 3.17 fails on current kernels (vDSO); 4.1 cannot dump TCP sockets on kernels >= 6.16.
MIN_VERSION = (4, 2)
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
    view_root: str = ""  # the plugin's tree in CRIU's view ("": CRIU shares the plugin's)
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
    view_root: str = ""  # the plugin's tree in CRIU's view ("": CRIU shares the plugin's)
    extra: list[str] = field(default_factory=list)


def log_path(opts: DumpOptions | RestoreOptions) -> str:
    return os.path.join(opts.work_dir or opts.images_dir, opts.log_name)


def criu_argv(opts: DumpOptions | RestoreOptions, criu: str = CRIU) -> list[str]:
    work = opts.work_dir or opts.images_dir
    at = opts.view_root
    # File mappings are checked by size only: the image (by digest), the driver version, the
    # writable layer and the files from bind mounts (runtime.hostfiles) are matched before a
    # restore already, and CRIU's default build-id check reads every mapped library's ELF
    # section headers, which no loader ever faulted in (about 10 ms a library from disk; 0.27 s
    # of an LLM worker's 0.68 s CRIU restore on the H200).
    common = ["-D", at + opts.images_dir, "-W", at + work, "-o", at + log_path(opts), "-v4", "--file-locks",
              "--tcp-established" if opts.tcp_established else "--tcp-close", "--manage-cgroups=ignore",
              "--file-validation", "filesize"]
    if opts.shell_job:
        common.append("--shell-job")
    if opts.ext_unix_sk:
        common.append("--ext-unix-sk")
    if isinstance(opts, DumpOptions):
        argv = [criu, "dump", "-t", str(opts.pid), *common, "--network-lock", "skip", "--skip-in-flight"]
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
        # --root and the external mounts' sources are the runtime's paths: never mapped.
        argv = [criu, "restore", *common, "-d", "--pidfile", at + opts.pidfile, "--root", opts.root]
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


def run_criu(
    opts: DumpOptions | RestoreOptions,
    wrapper: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    timeout: float = 600.0,
    criu: str = CRIU,
    launcher: Sequence[str] = (),
) -> float:
    """Run criu (prefixed by ``wrapper``, then ``launcher``); return its wall time. CriuError on
    failure or timeout."""
    op = "dump" if isinstance(opts, DumpOptions) else "restore"
    os.makedirs(opts.work_dir or opts.images_dir, exist_ok=True)
    argv = [*_dies_with_parent(), *wrapper, *_dies_with_parent(), *launcher, *criu_argv(opts, criu)]
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


_VERSION_LINE = re.compile(r"^Version:\s*(\S+)", re.M)


def parse_version(output: str) -> str | None:
    """The version in ``criu --version`` output (``Version: 4.2.1``), or None."""
    m = _VERSION_LINE.search(output)
    return m.group(1) if m else None


def version_tuple(version: str) -> tuple[int, ...] | None:
    """``4.2.1`` (or a kernel release, ``6.8.0-45-generic``) -> (4, 2, 1); None when it does not
    start with a number."""
    m = re.match(r"(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def criu_version(criu: str = CRIU, timeout: float = 10) -> str:
    """The version of the CRIU binary ``criu``; CriuError when it cannot say."""
    try:
        out = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=timeout).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise CriuError("version", str(e)) from e
    version = parse_version(out)
    if version is None:
        raise CriuError("version", f"unexpected output: {out.strip()!r}")
    return version
