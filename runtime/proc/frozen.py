"""Which processes a checkpoint stopped, recorded on the node while they are stopped.

A checkpoint leaves the tree stopped from CRIU's dump until the capture ends, then continues
what it stopped, and only that: a task the workload itself keeps stopped (SIGSTOP, job control)
stays stopped, and its dump says so. An agent killed in between leaves the tree stopped; the
record (``<log_dir>/frozen-<container id>.json``: pid and start time of each process it
stopped) lets the next checkpoint of that container continue exactly those first, so it never
takes them for stopped by the workload (nor keeps the source frozen for good).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from collections.abc import Iterable

from runtime import strict_json
from runtime.fs.fdfs import write_file
from runtime.proc import procfs

log = logging.getLogger(__name__)


def _path(log_dir: str, container_id: str) -> str:
    return os.path.join(log_dir, f"frozen-{container_id}.json")


def thaw_left_over(log_dir: str, container_id: str) -> list[int]:
    """Continue the processes an earlier agent stopped for a checkpoint of this container and
    never continued (it died); the pids continued."""
    path = _path(log_dir, container_id)
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except FileNotFoundError:
        return []
    thawed = []
    try:
        entries = strict_json.loads(raw, max_bytes=1 << 20)["stopped"]
        for pid, start in entries:
            if isinstance(pid, int) and isinstance(start, int) and procfs.start_time(pid) == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                    thawed.append(pid)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("frozen record %s unreadable (%s); removed", path, exc)
    os.unlink(path)
    if thawed:
        log.warning("continued %d process(es) an earlier agent left stopped mid-checkpoint: %s",
                    len(thawed), thawed)
    return thawed


def record(log_dir: str, container_id: str, pids: Iterable[int]) -> None:
    """Record ``pids``, about to be stopped by the checkpoint (cleared once they run again)."""
    entries = [[p, s] for p in pids if (s := procfs.start_time(p)) is not None]
    write_file(_path(log_dir, container_id), json.dumps({"stopped": entries}).encode())


def clear(log_dir: str, container_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(log_dir, container_id))
