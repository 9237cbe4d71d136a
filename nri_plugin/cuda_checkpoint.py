"""A drop-in for NVIDIA's ``cuda-checkpoint`` utility, on :class:`runtime.gpu.cuda.CudaCheckpointer`.

Contract (the flags and outputs CRIU's cuda plugin and scripts rely on):

- ``--toggle --pid N [--timeout MS] [--device-map OLD=NEW,...]``: running -> lock + checkpoint;
  checkpointed -> restore + unlock. Prints nothing on success.
- ``--action lock|checkpoint|restore|unlock --pid N [--timeout MS] [--device-map OLD=NEW,...]``:
  one driver call (``--timeout`` only for lock, ``--device-map`` only for restore). Prints nothing.
- ``--get-state --pid N``: prints ``running``, ``locked``, ``checkpointed``, ``failed`` (also
  ``checkpointing``/``restoring`` on newer drivers).
- ``--get-restore-tid --pid N``: prints the restore thread id (exit non-zero for a non-CUDA pid).
- ``-h``/``--help``: the usage text (mentions ``--action``, which CRIU's plugin greps for), exit 0.
- Exit status 0 on success, 1 on any error (usage, missing driver, failing call); errors go to
  stderr with the driver's error name, e.g. ``CUDA_ERROR_INVALID_VALUE``.
- Numbers are ASCII decimals checked against what the driver's C types hold before any call:
  ``--pid`` 1..pid_max-1 (``/proc/sys/kernel/pid_max``, else 2^22), ``--timeout`` 0..2^32-1 ms
  (0 = wait forever). ctypes would silently wrap a larger one (pid 2^32+1 is pid 1).

``python -m nri_plugin.cuda_checkpoint ...`` runs it; ``rekindle cuda-checkpoint ...`` mounts :func:`main`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from runtime.container.namespaces import pid_max
from runtime.errors import RekindleError
from runtime.gpu.cuda import CudaCheckpointer, ProcessState

log = logging.getLogger(__name__)

PROG = "cuda-checkpoint"
ACTIONS = ("lock", "checkpoint", "restore", "unlock")

HELP = """\
CUDA checkpoint and restore utility (Rekindle, driver API through libcuda).

Operations:
--get-state --pid <pid>
        Prints the current checkpoint state of the process specified by <pid>:
        running, locked, checkpointed or failed

--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] [--device-map <map>]
        Performs the specified action on <pid>.
        For the lock action a timeout can be provided, the lock operation will wait up to <ms>
        milliseconds for the operation to succeed.
        For the restore action, --device-map <oldUuid=newUuid,...> remaps GPUs; it must list
        every GPU the process uses.

--toggle --pid <pid> [--timeout <ms>] [--device-map <map>]
        Toggles the CUDA state in the specified process between the running and checkpointed states

--get-restore-tid --pid <pid>
        Retrieves the CUDA restore thread ID of the process specified by <pid>

--help, -h
        Prints this help message
"""


# The kernel's ceiling on pid_max (PID_MAX_LIMIT on 64-bit), when /proc does not say.
PID_MAX_LIMIT = 1 << 22
TIMEOUT_MAX_MS = (1 << 32) - 1  # CUcheckpointLockArgs.timeoutMs is an unsigned int


class UsageError(Exception):
    pass


def _pid_max() -> int:
    try:
        return pid_max()
    except (OSError, ValueError):
        return PID_MAX_LIMIT


def _number(flag: str, text: str, low: int, high: int) -> int:
    """``text`` as a decimal in [low, high]; argparse's ``int`` also takes ' 12', '1_0', '١٢'."""
    if not 0 < len(text) <= 20 or not text.isascii() or not text.isdigit():
        raise UsageError(f"{flag} wants a whole number: {text!r}")
    value = int(text)
    if not low <= value <= high:
        raise UsageError(f"{flag} {value} is out of range ({low}..{high})")
    return value


@dataclass(frozen=True)
class Command:
    op: str  # "toggle", "get-state", "get-restore-tid", "help", or an action name
    pid: int = 0
    timeout_ms: int = 0
    device_map: dict[str, str] = field(default_factory=dict)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def parse_device_map(text: str) -> dict[str, str]:
    """``OLD=NEW,OLD=NEW`` -> {old: new}; raises UsageError on a malformed entry."""
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        old, sep, new = item.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise UsageError(f"bad --device-map entry {item!r} (want oldUuid=newUuid)")
        if old.strip() in out:
            raise UsageError(f"GPU {old.strip()} appears twice in --device-map")
        out[old.strip()] = new.strip()
    if not out:
        raise UsageError("--device-map is empty")
    return out


def parse_args(argv: Sequence[str]) -> Command:
    p = _Parser(prog=PROG, add_help=False)
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("--toggle", action="store_true")
    p.add_argument("--get-state", action="store_true")
    p.add_argument("--get-restore-tid", action="store_true")
    p.add_argument("-a", "--action", choices=ACTIONS)
    p.add_argument("-p", "--pid")
    p.add_argument("-t", "--timeout", default="0")
    p.add_argument("-d", "--device-map")
    ns = p.parse_args(list(argv))
    if ns.help:
        return Command("help")
    ops = [name for name, on in (("toggle", ns.toggle), ("get-state", ns.get_state),
                                 ("get-restore-tid", ns.get_restore_tid)) if on]
    if ns.action:
        ops.append(ns.action)
    if len(ops) != 1:
        raise UsageError("give exactly one of --toggle, --action, --get-state, --get-restore-tid"
                         if ops else "no operation given")
    if ns.pid is None:
        raise UsageError("--pid is required")
    pid = _number("--pid", ns.pid, 1, _pid_max() - 1)
    timeout = _number("--timeout", ns.timeout, 0, TIMEOUT_MAX_MS)
    op = ops[0]
    dmap: dict[str, str] = {}
    if ns.device_map is not None:
        if op not in ("restore", "toggle"):
            raise UsageError("--device-map only applies to --action restore and --toggle")
        dmap = parse_device_map(ns.device_map)
    return Command(op, pid, timeout, dmap)


def run(cmd: Command, ckpt: CudaCheckpointer) -> str | None:
    """Carry out ``cmd``; returns what to print (None for nothing). Raises RekindleError."""
    pid = cmd.pid
    if cmd.op == "get-state":
        return str(ckpt.state(pid))
    if cmd.op == "get-restore-tid":
        return str(ckpt.restore_tid(pid))
    if cmd.op == "lock":
        ckpt.lock([pid], cmd.timeout_ms)
    elif cmd.op == "checkpoint":
        ckpt.checkpoint([pid])
    elif cmd.op == "restore":
        ckpt.restore([pid], cmd.device_map or None)
    elif cmd.op == "unlock":
        ckpt.unlock([pid])
    elif cmd.op == "toggle":
        state = ckpt.state(pid)
        if state == ProcessState.RUNNING:
            if not ckpt.checkpoint_all([pid], cmd.timeout_ms):
                raise RekindleError(f"cannot toggle pid {pid}: it has no CUDA context")
        elif state == ProcessState.CHECKPOINTED:
            ckpt.restore_all([pid], cmd.device_map or None)
        else:
            raise RekindleError(f"cannot toggle pid {pid}: it is {state}, not running or checkpointed")
    else:  # pragma: no cover - parse_args never yields it
        raise UsageError(f"unknown operation {cmd.op}")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        cmd = parse_args(args)
    except UsageError as exc:
        print(f"{PROG}: {exc}\n\n{HELP}", file=sys.stderr, end="")
        return 1
    if cmd.op == "help":
        print(HELP, end="")
        return 0
    try:
        with CudaCheckpointer() as ckpt:
            out = run(cmd, ckpt)
    except RekindleError as exc:
        print(f"{PROG}: {cmd.op} of pid {cmd.pid}: {exc}", file=sys.stderr)
        return 1
    if out is not None:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
