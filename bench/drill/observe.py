"""What the fault drill sees from outside the plugin: /proc, mountinfo, the plugin's log.

Contract: every function reads the host's view once and returns plain values; nothing here
changes anything. ``LogTail`` reads a growing log from an offset (the plugin logs ``phase
<name>: <s>`` when a phase ends, runtime/timings.py); ``Procs`` is one scan of /proc (pid, comm,
state, pid namespace, argv), so a check and its detail come from the same instant.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PHASE_RE = re.compile(r"phase (\w+): ([0-9.]+)s")


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    state: str  # R, S, D, T, t, Z, ...
    pidns: int
    argv: tuple[str, ...]


def scan() -> list[Proc]:
    """Every process of the host (those that vanish mid-scan are skipped)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            pidns = os.stat(f"/proc/{name}/ns/pid").st_ino
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = tuple(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        state = stat[stat.rindex(")") + 2:].split()[0]
        out.append(Proc(int(name), comm, state, pidns, argv))
    return out


def in_pidns(pidns: int, procs: list[Proc] | None = None) -> list[Proc]:
    return [p for p in (procs if procs is not None else scan()) if p.pidns == pidns]


def servers(pidns: int, comm: str = "counter-server", procs: list[Proc] | None = None) -> list[Proc]:
    """The workload's server processes in one pid namespace (not the init, whose argv names it)."""
    return [p for p in in_pidns(pidns, procs) if p.comm == comm]


def stopped(pidns: int, procs: list[Proc] | None = None) -> list[Proc]:
    return [p for p in in_pidns(pidns, procs) if p.state in ("T", "t")]


def criu(marker: str = "", procs: list[Proc] | None = None) -> list[Proc]:
    """CRIU processes (whose argv mentions ``marker``, e.g. a staging or restore work dir)."""
    return [p for p in (procs if procs is not None else scan())
            if p.argv and os.path.basename(p.argv[0]) == "criu" and any(marker in a for a in p.argv)]


def criu_op(op: str, marker: str) -> bool:
    return any(op in p.argv for p in criu(marker))


def mounts_under(*roots: Path | str) -> list[str]:
    """Mount points of the host mount namespace at or below any of ``roots``."""
    prefixes = [str(r).rstrip("/") for r in roots]
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if any(mp == p or mp.startswith(p + "/") for p in prefixes):
                out.append(mp)
    return out


def mount_table() -> Counter[str]:
    """The host's mounts as ``<mount point> <fstype> <source>`` (with multiplicity)."""
    out: Counter[str] = Counter()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            post = fields[fields.index("-") + 1:]
            mp = fields[4].encode().decode("unicode_escape")
            out[f"{mp} {post[0]} {post[1]}"] += 1
    return out


def checkpoint_stagings(state_dir: Path) -> list[Path]:
    """Private dumps of checkpoints still on the node (``<state>/logs/checkpoint-*/staging-*``)."""
    return sorted((state_dir / "logs").glob("checkpoint-*/staging-*"))


def restore_work_dirs(state_dir: Path) -> list[Path]:
    """Restore work dirs whose private copies are still there (``<state>/logs/restore-*/private``)."""
    return sorted(p.parent for p in (state_dir / "logs").glob("restore-*/private"))


class LogTail:
    """A growing text file read from a mark on; ``mark()`` remembers where a cell starts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.start = self.size()

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return 0

    def mark(self) -> int:
        self.start = self.size()
        return self.start

    def text(self, end: int | None = None) -> str:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.start)
                data = f.read() if end is None else f.read(max(0, end - self.start))
        except FileNotFoundError:
            return ""
        return data.decode(errors="replace")

    def phases(self, end: int | None = None) -> list[str]:
        """Phases that ended since the mark (up to byte ``end``), in order."""
        return [m.group(1) for m in PHASE_RE.finditer(self.text(end))]


def wait_until(cond: Callable[[], object], timeout: float, interval: float = 0.005) -> object:
    """Poll ``cond`` until it returns something true; that value, or None at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)
