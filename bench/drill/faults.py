"""The three faults of the drill and the store's small disk.

Contract:
- ``StoreDisk`` mounts a tmpfs of ``size_mib`` on a dir (before the plugin starts): the plugin's
  store, and its node-local work dir ``<state>/logs`` (where a checkpoint dumps before it
  publishes, and a restore keeps its private copies); it can fill it to the last byte with one
  file at its root (a dot name, so the store never lists it) and free it again. ``fit(room)`` shrinks it beforehand to what it
  holds plus the room a cell needs: filling a GiB takes about a second, longer than most
  phases, and a fill must take hold within the phase it aims at.
- ``inject(fault, rig)`` lands one fault now and returns an ``Injected``: the plugin log offset
  at which the fault took hold (what had ended by then says which phase it hit) and what was
  seen right then. KILL sends SIGKILL to the plugin, looks at what it left (CRIU processes, the
  store's leftovers) and starts it again; CONTAINERD restarts the sandbox's containerd in place
  (pods and shims stay) and waits for the plugin to reconnect on its own; DISK_FULL fills the
  store and the node's work disk (a restore writes only there), and ``heal`` frees both once the
  outcome is recorded.
"""

from __future__ import annotations

import enum
import errno
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.drill import observe
from runtime.store import gc as store_gc

FILL_NAME = ".drill-fill"


class Fault(enum.Enum):
    KILL = "kill"
    CONTAINERD = "containerd"
    DISK_FULL = "disk-full"

    @property
    def title(self) -> str:
        return {"kill": "plugin SIGKILL + restart", "containerd": "containerd restart",
                "disk-full": "store and node disks full"}[self.value]


class StoreDisk:
    def __init__(self, path: Path, size_mib: int, label: str = "store") -> None:
        self.path = path
        self.label = label
        self.size_mib = size_mib
        self.fill_path = path / FILL_NAME

    def mount(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m,mode=0700", "drill-store",
                        str(self.path)], check=True)

    def umount(self) -> None:
        self.unfill()
        subprocess.run(["umount", "-l", str(self.path)], check=False, capture_output=True)

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def used(self) -> int:
        st = os.statvfs(self.path)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def fit(self, room: int | None) -> None:
        """Resize the tmpfs to what it holds plus ``room`` bytes (None: back to ``size_mib``), so
        that filling it at the moment takes little time: the fill lands in the phase it aims at."""
        size = f"{self.size_mib}m" if room is None else f"{-(-(self.used() + room) // (1 << 20))}m"
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def fill_now(self) -> int:
        """Shrink the disk to what it holds plus a little, then take the rest: the fill takes
        hold at once, whatever the phase writes meanwhile (a remount below what is already used
        fails: then again, from what is used by now)."""
        for _ in range(10):
            size = -(-(self.used() + (8 << 20)) // (1 << 20))
            if subprocess.run(["mount", "-o", f"remount,size={size}m", str(self.path)],
                              capture_output=True).returncode == 0:
                break
        return self.fill()

    def fill(self) -> int:
        """Take every free byte of the store; returns how many were taken."""
        fd = os.open(self.fill_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        taken = 0
        try:
            want = self.free()
            if want:
                try:
                    os.posix_fallocate(fd, os.fstat(fd).st_size, want)
                    taken += want
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
            chunk = b"\0" * 65536
            while len(chunk) >= 1:  # whatever fallocate left, byte-exact
                try:
                    taken += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    chunk = chunk[:len(chunk) // 2]
        finally:
            os.close(fd)
        return taken

    def unfill(self) -> None:
        self.fill_path.unlink(missing_ok=True)


@dataclass
class Injected:
    fault: Fault
    at: int  # plugin log offset when the fault took hold
    seconds: float  # how long landing it took (a restart, a fill)
    seen: dict[str, Any] = field(default_factory=dict)


def inject(fault: Fault, rig: Any, marker: str, pidns: int = 0) -> Injected:
    """Land ``fault`` now. ``marker``: a path fragment naming this cell's CRIU and work dirs;
    ``pidns``: the pod's pid namespace (what the killed plugin left stopped there is noted)."""
    t0 = time.monotonic()
    if fault is Fault.KILL:
        rig.plugin.kill()
        at = rig.tail.size()
        seen: dict[str, Any] = {}
        # CRIU runs under --pdeathsig: it must go with the plugin, within a moment.
        alive = observe.wait_until(lambda: not observe.criu(marker), 5.0, 0.01)
        seen["criu_after_kill"] = "gone" if alive else [p.pid for p in observe.criu(marker)]
        if pidns:
            seen["stopped_after_kill"] = [f"{p.pid}:{p.comm}" for p in observe.stopped(pidns)]
        seen["leftovers_after_kill"] = [
            f"{x.kind}:{x.entry}" + ("" if x.kind != "staging" else " (no owner)" if x.owner is None
                                     else " (owner dead)" if x.owner.provably_dead() else " (owner alive)")
            for x in store_gc.leftovers(rig.store)]
        seen["restore_dirs_after_kill"] = [p.name for p in observe.restore_work_dirs(rig.plugin.state_dir)]
        rig.restart_plugin()
        return Injected(fault, at, time.monotonic() - t0, seen)
    if fault is Fault.CONTAINERD:
        synced = rig.plugin.log().count("synchronized:")
        at = rig.tail.size()
        rig.sandbox.restart()
        rig.plugin.wait_log("synchronized:", count=synced + 1, timeout=90)
        return Injected(fault, at, time.monotonic() - t0, {"reconnected_after_s": round(time.monotonic() - t0, 2)})
    taken = {d.label: d.fill_now() for d in rig.disks}
    at = rig.tail.size()
    return Injected(fault, at, time.monotonic() - t0, {"filled_bytes": taken})


def heal(fault: Fault, rig: Any) -> None:
    if fault is Fault.DISK_FULL:
        for d in rig.disks:
            d.unfill()
