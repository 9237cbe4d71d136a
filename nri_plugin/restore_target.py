"""Is a container one Rekindle prepared for a restore? Asked by ``rekindle restore`` before it
touches the container at all.

A restore writes the artifact's files into the target's root filesystem and puts processes into
its namespaces: aimed at a live workload, it would overwrite that workload's files and then fail.
The plugin prepares a restore target at CreateContainer (``swap``): the container's process is
``rekindle-init --mode restore --control /rekindle ... -- CMD`` with the plugin's control dir
bind-mounted at ``/rekindle``, and the init waits there, alone in its pid namespace, until
``restore-complete``, ``restore-failed`` or its timeout. So a target must show all of it:

- its task bundle's spec (what runc ran) runs the init in restore mode;
- ``/rekindle`` is bind-mounted from a control dir under ``<state-dir>/control/``;
- no outcome is in that control dir yet (the init decides once, then runs the workload);
- the init is alive, still the init (its command line), and has no children.

Everything read here comes from the container or the node's containerd state and is only
compared, never followed or run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from runtime import control
from runtime.container.containers import ContainerInfo, children, resolve_container
from runtime.errors import Reason, RekindleError

from .handlers import IMAGE_NAME_ANNOTATION
from .swap import is_swapped


class TargetRefused(RekindleError):
    """The container is not a restore target Rekindle prepared; nothing was touched."""

    reason_class = Reason.RUNTIME

    def __init__(self, container_id: str, why: str) -> None:
        super().__init__(f"container {container_id[:12]} is not waiting for a restore: {why}; "
                         "nothing was changed (restore only into a container the plugin prepared: "
                         "rekindle.dev/restore on its pod)")


@dataclass(frozen=True)
class Target:
    info: ContainerInfo
    control: control.ControlDir
    image: str  # the image the pod asked for ("" if the spec does not say)


def init_mode(args: list[str]) -> str | None:
    """The ``--mode`` of a swapped command line (before its ``--``), or None."""
    if not is_swapped(args):
        return None
    for i, arg in enumerate(args[1:], 1):
        if arg == "--":
            return None
        if arg == "--mode" and i + 1 < len(args):
            return args[i + 1]
    return None


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(64 * 1024)
    except OSError:
        return []
    return [a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]]


def check(containerd_state: str, state_dir: str, container_id: str) -> Target:
    """The target, if it is one; :class:`TargetRefused` (or ContainerNotFound) otherwise."""
    info = resolve_container(containerd_state, container_id)
    args = [str(a) for a in (info.spec.get("process") or {}).get("args") or []]
    mode = init_mode(args)
    if mode != "restore":
        why = (f"its init runs in {mode} mode" if mode else
               f"it runs {args[0] if args else 'no command'!r}, not {control.INIT_IN_CONTAINER} in restore mode")
        raise TargetRefused(container_id, why)
    sources = [m.get("source") for m in info.spec_mounts if m.get("destination") == control.CONTAINER_PATH]
    if len(sources) != 1 or not isinstance(sources[0], str) or not sources[0]:
        raise TargetRefused(container_id, f"it has no control dir mounted at {control.CONTAINER_PATH}")
    given = Path(state_dir) / "control"
    roots = {Path(os.path.normpath(os.path.abspath(given))), Path(os.path.realpath(given))}
    root = Path(os.path.realpath(given))
    source = Path(os.path.normpath(sources[0]))
    if not any(r in source.parents for r in roots):
        raise TargetRefused(container_id, f"its control dir {source} is not under {root} "
                                          "(is --state-dir the plugin's?)")
    ctl = control.ControlDir(source)
    done = [n for n in (control.RESTORE_COMPLETE, control.RESTORE_FAILED, control.COLD_START) if ctl.exists(n)]
    if done:
        raise TargetRefused(container_id, f"its init has decided already ({', '.join(done)} in its control dir)")
    if _cmdline(info.init_pid)[:1] != [control.INIT_IN_CONTAINER]:
        raise TargetRefused(container_id, f"its pid 1 ({info.init_pid} on the host) no longer runs the init")
    if children(info.init_pid):
        raise TargetRefused(container_id, "its init has started processes (the workload runs)")
    image = info.annotations.get(IMAGE_NAME_ANNOTATION, "")
    return Target(info, ctl, image)
