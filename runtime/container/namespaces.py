"""Entering a container's namespaces from a (multi-threaded) Python process, safely.

Contract: Python never calls ``setns``/``unshare`` itself (namespace entry is per thread and
breaks a threaded interpreter); every entry is a child process run through util-linux ``nsenter``
/ ``unshare``, built by :func:`nsenter_argv` / :func:`in_pid_ns_argv`. Commands are bounded by a
timeout and raise :class:`NamespaceError` naming the command and its stderr on failure.

Helpers for the CRIU executor: raise a pid namespace's ``ns_last_pid``, list the pids in
use in a pid namespace (from the host's procfs), map a namespace pid to its host pid, read and
reset a UTS namespace's hostname/domainname, and move processes into cgroups.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterable, Sequence

from runtime.container.containers import children, parse_nspid
from runtime.errors import ContainerNotFound, NamespaceError

log = logging.getLogger(__name__)

PROC = "/proc"
NSENTER = "nsenter"
UNSHARE = "unshare"
SH = "/bin/sh"
DEFAULT_TIMEOUT = 10.0

_NS_FLAGS = {"mnt": "-m", "uts": "-u", "ipc": "-i", "net": "-n", "pid": "-p", "cgroup": "-C", "user": "-U"}


def nsenter_argv(pid: int, kinds: Iterable[str], argv: Sequence[str]) -> list[str]:
    """``nsenter -t PID <flags> -- argv``; with ``pid`` the child is forked into the pid ns."""
    flags = [_NS_FLAGS[k] for k in kinds]
    return [NSENTER, "-t", str(pid), *flags, "--", *argv]


def in_pid_ns_argv(pid: int, argv: Sequence[str]) -> list[str]:
    """Run argv inside the pid namespace of ``pid`` with a private mount ns and a /proc of that pid ns.

    The mount namespace is a private copy of the caller's (host paths stay valid); only /proc is
    replaced, so inside it ``/proc/1`` is the container's init.
    """
    return nsenter_argv(
        pid, ["pid"], [UNSHARE, "-m", "--mount-proc", "--propagation", "private", "--", *argv]
    )


def run_cmd(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT, what: str = "") -> str:
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise NamespaceError(f"{what or argv[0]}: timed out after {timeout}s: {' '.join(argv)}") from e
    except OSError as e:
        raise NamespaceError(f"{what or argv[0]}: cannot run {argv[0]}: {e}") from e
    if res.returncode != 0:
        raise NamespaceError(
            f"{what or argv[0]}: exit {res.returncode}: {res.stderr.strip() or res.stdout.strip()}"
        )
    return res.stdout


def set_ns_last_pid(init_pid: int, value: int) -> None:
    """Make the next pid allocated in init_pid's pid namespace ``value + 1``.

    The sysctl acts on the writer's active pid namespace, so the writer is forked into it.
    """
    run_cmd(
        nsenter_argv(init_pid, ["pid"], [SH, "-c", f"echo {int(value)} > /proc/sys/kernel/ns_last_pid"]),
        what="set ns_last_pid",
    )
    log.debug("pid ns of %d: ns_last_pid=%d", init_pid, value)


def pid_max() -> int:
    with open(f"{PROC}/sys/kernel/pid_max") as f:
        return int(f.read())


def _ns_inode(pid: int | str, kind: str) -> int | None:
    try:
        return os.stat(f"{PROC}/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _last_nspid(status_path: str) -> int | None:
    try:
        with open(status_path) as f:
            nspid = parse_nspid(f.read())
    except OSError:
        return None
    return nspid[-1] if nspid else None


def pid_namespace_shared(init_pid: int) -> str | None:
    """Why the pid namespace of the container whose init is host pid ``init_pid`` is not the
    container's own, or None: its init is pid 1 there only when the runtime made the namespace
    for it (``hostPID``: the node's namespace; ``shareProcessNamespace``: the pod's, whose pid 1
    is the sandbox's pause)."""
    nspid = _last_nspid(f"{PROC}/{init_pid}/status")
    if nspid is None:
        return f"the container's init (pid {init_pid}) is gone"
    if nspid == 1:
        return None
    return (f"the container's pid namespace is not its own (the pod's: shareProcessNamespace, or the "
            f"node's: hostPID): its init is pid {nspid} there, not 1")


def pid_namespace_of(pid: int) -> int | None:
    """The inode of ``pid``'s pid namespace; None once it is gone."""
    return _ns_inode(str(pid), "pid")


def processes_in(pidns_inode: int) -> list[int]:
    """Host pids of every process (thread group) living in the pid namespace ``pidns_inode``."""
    return sorted(int(n) for n in os.listdir(PROC) if n.isdigit() and _ns_inode(n, "pid") == pidns_inode)


def used_pids(pidns_inode: int) -> dict[int, int]:
    """{namespace pid or tid: host tid} of every task living in the pid namespace ``pidns_inode``."""
    used: dict[int, int] = {}
    for name in os.listdir(PROC):
        if not name.isdigit() or _ns_inode(name, "pid") != pidns_inode:
            continue
        try:
            tids = os.listdir(f"{PROC}/{name}/task")
        except OSError:
            continue
        for tid in tids:
            nspid = _last_nspid(f"{PROC}/{name}/task/{tid}/status")
            if nspid is not None:
                used[nspid] = int(tid)
    return used


def host_pid_of(pidns_inode: int, ns_pid: int, hint_parent: int | None = None) -> int:
    """Host pid of the process numbered ``ns_pid`` in the pid namespace ``pidns_inode``."""
    if hint_parent is not None:
        for c in children(hint_parent):
            if _last_nspid(f"{PROC}/{c}/status") == ns_pid and _ns_inode(c, "pid") == pidns_inode:
                return c
    for nspid, host in used_pids(pidns_inode).items():
        if nspid == ns_pid and os.path.exists(f"{PROC}/{host}/status") and _is_leader(host):
            return host
    raise ContainerNotFound(f"no process with pid {ns_pid} in pid namespace {pidns_inode}")


def _is_leader(host_tid: int) -> bool:
    try:
        with open(f"{PROC}/{host_tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1]) == host_tid
    except OSError:
        return False
    return False


def read_uts(init_pid: int) -> tuple[str, str]:
    """(hostname, domainname) of init_pid's UTS namespace."""
    out = run_cmd(
        nsenter_argv(init_pid, ["uts"], [SH, "-c", "cat /proc/sys/kernel/hostname /proc/sys/kernel/domainname"]),
        what="read hostname",
    )
    lines = out.splitlines() + ["", ""]
    return lines[0], lines[1]


def set_uts(init_pid: int, hostname: str, domainname: str | None = None) -> None:
    """Set the hostname (and domainname) of init_pid's UTS namespace (values passed as argv, not shell)."""
    script = 'printf %s "$1" > /proc/sys/kernel/hostname'
    args = [hostname]
    if domainname is not None:
        script += ' && printf %s "$2" > /proc/sys/kernel/domainname'
        args.append(domainname)
    run_cmd(nsenter_argv(init_pid, ["uts"], [SH, "-c", script, "sh", *args]), what="set hostname")


def enter_cgroups_argv(cgroup_dirs: Iterable[str], argv: Sequence[str]) -> list[str]:
    """Wrap argv so that it (and everything it forks) starts inside the given cgroup dirs."""
    procs = [os.path.join(d, "cgroup.procs") for d in cgroup_dirs]
    script = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
    return [SH, "-c", script, "sh", str(len(procs)), *procs, *argv]


def move_to_cgroups(pids: Iterable[int], cgroup_dirs: Iterable[str]) -> None:
    """Write every pid into ``cgroup.procs`` of every dir (v1: one per hierarchy; v2: the unified dir)."""
    pids = list(pids)
    for d in cgroup_dirs:
        path = os.path.join(d, "cgroup.procs")
        for pid in pids:
            try:
                with open(path, "w") as f:
                    f.write(str(pid))
            except ProcessLookupError:
                continue
            except OSError as e:
                raise NamespaceError(f"cannot move pid {pid} into {d}: {e}") from e
