"""Read-only views of one process in a procfs tree: its stat line, open fds, mappings, environment, sockets.

Contract:

- Every function takes the procfs root (``proc``, default ``/proc``) so tests can hand in a
  directory that stands in for it. Nothing here signals, ptraces or writes.
- A process that is gone, or a file that cannot be read, gives an empty result (never raises):
  callers judge what they can see, and CRIU sees the rest.
- :func:`parse_stat` is the one parser of a ``stat`` line: the command name may hold spaces and
  ``)``, so the fields are counted after its last ``)`` (``proc(5)``). :func:`read_stat` and
  :func:`start_time` read one process's (or thread's) line.
- :func:`fds` returns each fd's link text (``readlink``) and, where ``stat`` through the link
  works, its file type and device numbers; in a stand-in tree the links point nowhere and only
  the text is known.
- :func:`socket_inodes` are the inodes of ``socket:[N]`` links; :func:`tcp_sockets` reads the
  process's network namespace tables (``net/tcp``, ``net/tcp6``), keyed by inode (unix sockets:
  ``runtime.proc.unixdiag``, since their names can forge ``net/unix`` lines); IPv4-mapped IPv6
  addresses are given as IPv4, so both ends of a connection between a dual-stack and an IPv4
  socket name the same addresses.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import sys
from dataclasses import dataclass

PROC = "/proc"


@dataclass(frozen=True, slots=True)
class Fd:
    fd: int
    link: str  # readlink text: "/dev/nvidia0", "socket:[123]", "anon_inode:[io_uring]", ...
    mode: int | None = None  # st_mode through the link, when it could be stat'ed
    rdev: int | None = None

    @property
    def is_chr(self) -> bool:
        return self.mode is not None and stat.S_ISCHR(self.mode)

    @property
    def is_blk(self) -> bool:
        return self.mode is not None and stat.S_ISBLK(self.mode)


@dataclass(frozen=True, slots=True)
class Mapping:
    start: int
    end: int
    perms: str
    path: str  # "" for anonymous memory


@dataclass(frozen=True, slots=True)
class UnixSocket:
    inode: int
    path: str  # "@name" for an abstract socket, "" when unbound


@dataclass(frozen=True, slots=True)
class TcpSocket:
    inode: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int  # TCP_ESTABLISHED = 1, ... as in include/net/tcp_states.h

    @property
    def peer_key(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(local, remote) as the other end of this connection sees it."""
        return self.remote, self.local


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` the engine uses."""

    pid: int
    comm: str  # undecodable bytes as surrogate escapes
    state: str  # R, S, D, T, t, Z, X, ...
    ppid: int
    pgrp: int
    session: int
    start_time: int  # clock ticks since boot (field 22)


def parse_stat(line: bytes | str) -> Stat:
    """A ``stat`` line's fields; ValueError when it is not one."""
    raw = line.encode(errors="surrogateescape") if isinstance(line, str) else line
    head, paren, tail = raw.rpartition(b")")
    pid, open_paren, name = head.partition(b" (")
    rest = tail.split()
    if not paren or not open_paren or len(rest) < 20:
        raise ValueError(f"not a stat line: {raw[:80]!r}")
    return Stat(int(pid), name.decode(errors="surrogateescape"), rest[0].decode(errors="replace"),
                int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))


def read_stat(pid: int | str, proc: str = PROC, *, tid: int | str | None = None) -> Stat | None:
    """Process ``pid``'s stat line (or its thread ``tid``'s); None when it is gone or unreadable."""
    path = f"{proc}/{pid}/stat" if tid is None else f"{proc}/{pid}/task/{tid}/stat"
    try:
        with open(path, "rb") as f:
            return parse_stat(f.read())
    except (OSError, ValueError):
        return None


def start_time(pid: int | str, proc: str = PROC) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None when it is gone. With the pid, the
    identity of a process: a pid reused later has a later start."""
    st = read_stat(pid, proc)
    return st.start_time if st is not None else None


def _read(path: str, limit: int = 8 << 20) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return b""


def comm(pid: int, proc: str = PROC) -> str:
    return _read(f"{proc}/{pid}/comm", 64).decode(errors="replace").strip()


def environ(pid: int, proc: str = PROC) -> dict[str, str]:
    """The environment the process was started with (later setenv calls are not visible), or
    whatever the process wrote over it since: a claim of the process's, never evidence."""
    out: dict[str, str] = {}
    for item in _read(f"{proc}/{pid}/environ", 1 << 20).split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def fds(pid: int, proc: str = PROC) -> list[Fd]:
    base = f"{proc}/{pid}/fd"
    try:
        names = os.listdir(base)
    except OSError:
        return []
    out = []
    for name in sorted(names, key=lambda n: (len(n), n)):
        if not name.isdigit():
            continue
        path = os.path.join(base, name)
        try:
            link = os.readlink(path)
        except OSError:
            continue
        try:
            st = os.stat(path)
            out.append(Fd(int(name), link, st.st_mode, st.st_rdev))
        except OSError:
            out.append(Fd(int(name), link))
    return out


def maps(pid: int, proc: str = PROC) -> list[Mapping]:
    out = []
    for line in _read(f"{proc}/{pid}/maps", 64 << 20).decode(errors="replace").splitlines():
        fields = line.split(None, 5)
        if len(fields) < 5:
            continue
        try:
            start, end = (int(x, 16) for x in fields[0].split("-"))
        except ValueError:
            continue
        out.append(Mapping(start, end, fields[1], fields[5].strip() if len(fields) > 5 else ""))
    return out


def anon_mappings(pid: int, proc: str = PROC) -> set[tuple[int, int]]:
    """(start, end) of every private anonymous writable mapping of ``pid`` (unnamed, or named with
    PR_SET_VMA_ANON_NAME as ``[anon:...]``; not the heap or a stack)."""
    out = set()
    try:
        with open(f"{proc}/{pid}/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) < 5 or not fields[1].startswith("rw") or fields[1][3] != "p" or fields[4] != "0":
                    continue
                name = fields[5].strip() if len(fields) == 6 else ""
                if name and not name.startswith("[anon:"):
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                out.add((start, end))
    except OSError:
        pass
    return out


def socket_inodes(entries: list[Fd]) -> set[int]:
    out = set()
    for e in entries:
        if e.link.startswith("socket:[") and e.link.endswith("]"):
            try:
                out.add(int(e.link[8:-1]))
            except ValueError:
                pass
    return out


def netns_key(pid: int, proc: str = PROC) -> str:
    """Which network namespace the process is in (its ns link), or the pid when unknown."""
    try:
        return os.readlink(f"{proc}/{pid}/ns/net")
    except OSError:
        return f"pid:{pid}"


def _addr(text: str) -> tuple[str, int]:
    """``0100007F:1F90`` / 32 hex digits + port, in the kernel's host-order words -> (ip, port)."""
    hexaddr, _, hexport = text.partition(":")
    raw = bytes.fromhex(hexaddr)
    if sys.byteorder == "little":  # each 32-bit word is printed in host order
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # a dual-stack socket's IPv4 peer: named as its IPv4 end names itself
    return str(ip), int(hexport, 16)


def tcp_sockets(pid: int, proc: str = PROC) -> dict[int, TcpSocket]:
    """TCP sockets of the process's network namespace (``net/tcp`` and ``net/tcp6``), by inode;
    sockets no process owns (inode 0, e.g. TIME_WAIT) are left out."""
    out = {}
    for table in ("tcp", "tcp6"):
        lines = _read(f"{proc}/{pid}/net/{table}", 64 << 20).decode(errors="replace").splitlines()
        for line in lines[1:]:
            fields = line.split()
            if len(fields) < 10:
                continue
            try:
                inode = int(fields[9])
                sock = TcpSocket(inode, _addr(fields[1]), _addr(fields[2]), int(fields[3], 16))
            except ValueError:
                continue
            if inode:
                out[inode] = sock
    return out


def char_majors(name_prefix: str, proc: str = PROC) -> set[int]:
    """Character-device majors whose driver name starts with ``name_prefix`` (``/proc/devices``)."""
    out = set()
    in_chr = False
    for line in _read(f"{proc}/devices", 1 << 20).decode(errors="replace").splitlines():
        if line.strip().endswith(":"):
            in_chr = line.startswith("Character")
            continue
        fields = line.split()
        if in_chr and len(fields) == 2 and fields[0].isdigit() and fields[1].startswith(name_prefix):
            out.add(int(fields[0]))
    return out
