"""Who writes a staging dir: node, boot, pid and its start time, so the sweep can tell a dead
publish (this node's, provably) from one in progress (maybe another node's)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from dataclasses import dataclass

from runtime import strict_json
from runtime.fs.fdfs import DIR_FLAGS, FILE_FLAGS, write_file
from runtime.proc import procfs

OWNER = ".owner.json"


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Owner:
    """Who writes a staging dir; ``alive()`` is only ever decided for this node's owners."""

    node: str
    boot_id: str
    pid: int
    start_time: int
    created: float

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(socket.gethostname(), _boot_id(), pid, procfs.start_time(pid) or 0, time.time())

    def provably_dead(self) -> bool:
        if self.node != socket.gethostname():
            return False
        if self.boot_id != _boot_id():
            return True
        return procfs.start_time(self.pid) != self.start_time


def read_owner(dir_fd: int) -> Owner | None:
    try:
        fd = os.open(OWNER, FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    try:
        d = strict_json.loads(raw, max_bytes=4096)  # planted: json.loads recursed on "[[[..."
        return Owner(str(d["node"]), str(d["boot_id"]), int(d["pid"]), int(d["start_time"]),
                     float(d["created"]))
    except (ValueError, KeyError, TypeError):
        return None


def write_owner(dir_path: str) -> None:
    """Record this process as the owner of ``dir_path`` (a staging dir, a restore's work dir)."""
    write_file(os.path.join(dir_path, OWNER), json.dumps(dataclasses.asdict(Owner.me())).encode())


def write_owner_at(dir_fd: int) -> None:
    """The same, into a directory held by fd that others can write (a store's staging dir): the
    record is a new file, never written through a name someone planted."""
    write_file(OWNER, json.dumps(dataclasses.asdict(Owner.me())).encode(), dir_fd=dir_fd, exclusive=True)


def read_owner_of(dir_path: str) -> Owner | None:
    """The owner recorded in ``dir_path``, None when there is none or it is unreadable."""
    try:
        fd = os.open(dir_path, DIR_FLAGS)
    except OSError:
        return None
    try:
        return read_owner(fd)
    finally:
        os.close(fd)
