"""Force the target container's limits onto a restored process tree before it runs, and verify them.

CRIU restores the source's oom_score_adj (``prepare_proc_misc``), rlimits (the restorer blob) and
mount tree, with the mount flags of the image. ``runtime.criu.executor.restore_into`` runs CRIU with
``--leave-stopped`` and calls :func:`confine` while every restored process is still stopped:

- oom_score_adj: the target init's value (what the runtime applied from ``process.oomScoreAdj``,
  and what a cold start would inherit) is written to every process.
- rlimits: every hard limit is lowered to the target init's, every soft limit to at most the new
  hard limit. A limit the process had set lower is kept: up to its hard limit, a soft limit is the
  process's own choice. Processes of another uid (a non-root tree, a non-root target init) are
  read and lowered through ``runtime.proc.rlimits`` where the node lacks CAP_SYS_RESOURCE.
- mounts: every mount point of the target init's mount namespace must be a mount point in each
  mount namespace of the restored tree, holding at least the target's ``ro``, ``nosuid``,
  ``nodev`` and ``noexec`` flags (so a read-only rootfs, read-only volumes, ``readonlyPaths``,
  a read-only ``/sys``). Missing flags are added with ``runtime.container.mountattr``. A missing mount point
  whose path exists in the restored tree (say a masked path the source did not have: the process
  would see what the target hides) cannot be re-created and raises; one whose path does not exist
  there exposes nothing (a GPU's ``/proc/driver/nvidia/gpus/<bus>`` after a remap). The rootfs and
  the bind sources are already the target's: CRIU's ``--root`` and the ``--external`` mount map.
- Then everything is read back from ``/proc``; any difference raises :class:`ConfinementError`.
"""

from __future__ import annotations

import logging
import math
import os
import resource
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from runtime.container import mountattr
from runtime.container.containers import MountInfo, read_mountinfo
from runtime.errors import ConfinementError, ContainerNotFound, NamespaceError
from runtime.proc import rlimits

log = logging.getLogger(__name__)

PROC = "/proc"
RLIMITS = rlimits.RLIMITS
Limit = rlimits.Limit


@dataclass(frozen=True)
class Limits:
    oom_score_adj: int
    rlimits: dict[int, Limit]


def read_limits(pid: int) -> Limits:
    with open(f"{PROC}/{pid}/oom_score_adj") as f:
        oom = int(f.read().strip())
    return Limits(oom, rlimits.read_all(pid))


def _value(v: int) -> float:
    return math.inf if v == resource.RLIM_INFINITY else v


def clamp(current: Limit, target: Limit) -> Limit:
    """``current`` with its hard limit no higher than ``target``'s and its soft one no higher than that."""
    hard = current[1] if _value(current[1]) <= _value(target[1]) else target[1]
    soft = current[0] if _value(current[0]) <= _value(hard) else hard
    return soft, hard


def exceeds(current: Limit, target: Limit) -> bool:
    return _value(current[1]) > _value(target[1])


def mount_attrs(options: str) -> int:
    """MOUNT_ATTR_* bits of a mountinfo per-mount option string (``ro,nosuid,relatime``)."""
    bits = 0
    for opt in options.split(","):
        bits |= mountattr.ATTRS.get(opt, 0)
    return bits


def visible_mounts(mounts: Iterable[MountInfo]) -> dict[str, MountInfo]:
    """The mount seen at each mount point (the top of a stack of mounts at one point)."""
    mounts = list(mounts)
    below = {(m.parent_id, m.mount_point) for m in mounts}
    top: dict[str, MountInfo] = {}
    for m in mounts:
        if (m.mount_id, m.mount_point) not in below or m.mount_point not in top:
            top[m.mount_point] = m
    return top


def mount_fixes(target: Iterable[MountInfo], restored: Iterable[MountInfo]) -> tuple[dict[str, int], list[str]]:
    """(flags to add per mount point, target mount points the restored namespace lacks)."""
    want, have = visible_mounts(target), visible_mounts(restored)
    fixes: dict[str, int] = {}
    missing = []
    for point, m in sorted(want.items()):
        if point not in have:
            missing.append(point)
            continue
        add = mount_attrs(m.options) & ~mount_attrs(have[point].options)
        if add:
            fixes[point] = add
    return fixes, missing


def _attr_names(bits: int) -> str:
    return ",".join(n for n, b in mountattr.ATTRS.items() if bits & b)


def _by_mount_ns(pids: Sequence[int]) -> dict[int, int]:
    """{mount ns inode: one pid in it}."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            out.setdefault(os.stat(f"{PROC}/{pid}/ns/mnt").st_ino, pid)
        except FileNotFoundError:
            continue
    return out


def confine_mounts(target_init: int, pids: Sequence[int]) -> list[str]:
    """Give every mount namespace of ``pids`` the target's mount flags; returns what was changed."""
    target = read_mountinfo(target_init)
    changed = []
    for pid in _by_mount_ns(pids).values():
        fixes, missing = mount_fixes(target, read_mountinfo(pid))
        if not fixes and not missing:
            continue
        try:
            exposed = mountattr.adjust(pid, fixes, probe=missing)
        except NamespaceError as e:
            raise ConfinementError(str(e)) from e
        if exposed:  # the target hides something there, the restored tree shows what is below
            raise ConfinementError(f"the restored mount tree lacks the target's mounts at {', '.join(exposed)}")
        if not fixes:
            continue
        left, _ = mount_fixes(target, read_mountinfo(pid))
        if left:
            raise ConfinementError("restored mounts still lack the target's flags: " +
                                   "; ".join(f"{p} {_attr_names(b)}" for p, b in left.items()))
        changed += [f"{p} +{_attr_names(b)}" for p, b in fixes.items()]
    return changed


def confine_limits(target: Limits, pids: Sequence[int]) -> None:
    """Write the target's oom_score_adj and clamp every rlimit of each pid; then verify."""
    for pid in pids:
        try:
            with open(f"{PROC}/{pid}/oom_score_adj", "w") as f:
                f.write(str(target.oom_score_adj))
            current = rlimits.read_all(pid)
            lowered = {r: new for r, tl in target.rlimits.items() if (new := clamp(current[r], tl)) != current[r]}
            if lowered:
                rlimits.lower(pid, lowered)
        except (ProcessLookupError, FileNotFoundError):
            continue  # gone: nothing left to confine
        except OSError as e:
            raise ConfinementError(f"cannot set limits of restored process {pid}: {e}") from e
    for pid in pids:
        try:
            got = read_limits(pid)
        except (ProcessLookupError, FileNotFoundError):
            continue
        bad = [r for r, tl in target.rlimits.items() if exceeds(got.rlimits[r], tl)]
        if got.oom_score_adj != target.oom_score_adj or bad:
            raise ConfinementError(f"restored process {pid} kept oom_score_adj {got.oom_score_adj} "
                                   f"or rlimits {bad} above the target's")


def confine(target_init: int, pids: Sequence[int]) -> list[str]:
    """Force the target container's limits (read from its init) onto the stopped restored ``pids``."""
    try:
        limits = read_limits(target_init)
    except (OSError, ProcessLookupError) as e:
        raise ContainerNotFound(f"target init {target_init}: {e}") from e
    changed = confine_mounts(target_init, pids)
    confine_limits(limits, pids)
    log.info("confined %d restored process(es): oom_score_adj %d, rlimits clamped, mounts %s",
             len(pids), limits.oom_score_adj, ", ".join(changed) or "as the target's")
    return changed
