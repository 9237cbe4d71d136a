"""Read and lower another process's rlimits, also on nodes without CAP_SYS_RESOURCE.

``prlimit(2)`` on a process whose uids or gids differ from the caller's needs CAP_SYS_RESOURCE,
for a read as well (``check_prlimit_permission``); some hardened nodes drop it from every
bounding set, so a restored non-root tree (and a non-root target init) is out of the agent's reach
that way. Two ways around it, each used only when ``prlimit`` says EPERM:

- read: ``/proc/<pid>/limits`` is world-readable and prints the same values (one line per resource
  in resource order, ``unlimited`` for RLIM_INFINITY, the soft and hard limits in the columns the
  header names);
- lower: a helper (util-linux ``prlimit``) run as the process's own uid and gid, which the kernel
  lets set any limit of a process of exactly those credentials as long as no hard limit rises.
  A process whose real, effective and saved ids differ is refused (no one set of ids would do).
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import subprocess
from collections.abc import Mapping

from runtime.errors import ConfinementError

PROC = "/proc"
RLIMITS = tuple(sorted({getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_")}))
# util-linux prlimit's option for each resource: the name without RLIMIT_, lower case (OFILE is
# BSD's alias of NOFILE, which prlimit does not know)
_OPTION = {getattr(resource, n): "--" + n.removeprefix("RLIMIT_").lower()
           for n in dir(resource) if n.startswith("RLIMIT_") and n != "RLIMIT_OFILE"}
HELPER_TIMEOUT = 5.0

Limit = tuple[int, int]  # (soft, hard) as resource.prlimit gives them; RLIM_INFINITY for none


def _parse_value(text: str) -> int:
    return resource.RLIM_INFINITY if text == "unlimited" else int(text)


def parse_proc_limits(text: str) -> dict[int, Limit]:
    """{resource: (soft, hard)} from the text of /proc/<pid>/limits."""
    lines = text.splitlines()
    if not lines or "Soft Limit" not in lines[0]:
        raise ValueError("no header line")
    col = lines[0].index("Soft Limit")
    out: dict[int, Limit] = {}
    for r, line in enumerate(lines[1:]):
        fields = line[col:].split()
        if len(fields) < 2:
            raise ValueError(f"short line {line!r}")
        out[r] = (_parse_value(fields[0]), _parse_value(fields[1]))
    missing = set(RLIMITS) - set(out)
    if missing:
        raise ValueError(f"no line for resources {sorted(missing)}")
    return out


def read_proc_limits(pid: int) -> dict[int, Limit]:
    with open(f"{PROC}/{pid}/limits") as f:
        text = f.read()
    try:
        return parse_proc_limits(text)
    except ValueError as e:
        raise OSError(errno.EINVAL, f"/proc/{pid}/limits: {e}") from e


def read_all(pid: int) -> dict[int, Limit]:
    """Every rlimit of ``pid``: prlimit where allowed, else /proc/<pid>/limits."""
    try:
        return {r: resource.prlimit(pid, r) for r in RLIMITS}
    except PermissionError:
        return {r: v for r, v in read_proc_limits(pid).items() if r in RLIMITS}


def _owner(pid: int) -> tuple[int, int]:
    """The one uid and gid ``pid`` runs as (real = effective = saved), or raise."""
    with open(f"{PROC}/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
    uids, gids = fields["Uid"].split()[:3], fields["Gid"].split()[:3]
    if len(set(uids)) != 1 or len(set(gids)) != 1:
        raise ConfinementError(f"cannot lower the limits of process {pid}: its uids {uids} or gids {gids} "
                               "differ, and this node lacks CAP_SYS_RESOURCE")
    return int(uids[0]), int(gids[0])


def _text(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


def lower_as_owner(pid: int, limits: Mapping[int, Limit]) -> None:
    """Set ``limits`` (none raising a hard limit) on ``pid`` from a helper running as its owner."""
    helper = shutil.which("prlimit")
    if helper is None:
        raise ConfinementError("util-linux prlimit is missing: cannot lower the limits of a process "
                               "of another uid without CAP_SYS_RESOURCE")
    uid, gid = _owner(pid)
    args = [helper, "--pid", str(pid), *(f"{_OPTION[r]}={_text(s)}:{_text(h)}" for r, (s, h) in sorted(limits.items()))]
    try:
        done = subprocess.run(args, user=uid, group=gid, extra_groups=[], capture_output=True, text=True,
                              timeout=HELPER_TIMEOUT, env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"},
                              close_fds=True, cwd="/")
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfinementError(f"cannot lower the limits of process {pid} as uid {uid}: {e}") from e
    if done.returncode != 0:
        if not os.path.exists(f"{PROC}/{pid}"):
            raise ProcessLookupError(pid)
        raise ConfinementError(f"cannot lower the limits of process {pid} as uid {uid}: "
                               f"{done.stderr.strip() or f'exit {done.returncode}'}")


def lower(pid: int, limits: Mapping[int, Limit]) -> None:
    """Set ``limits`` on ``pid``: with prlimit where allowed, else as its owner."""
    pending = dict(limits)
    for r, value in limits.items():
        try:
            resource.prlimit(pid, r, value)
        except PermissionError:
            break
        del pending[r]
    if pending:
        lower_as_owner(pid, pending)
