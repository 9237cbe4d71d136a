"""How CRIU treats a tree's TCP connections: keep them (``--tcp-established``) or close them.

Contract:

- :func:`plan` looks at every connected TCP socket the tree owns (an fd ``socket:[inode]`` of
  one of ``pids`` that ``net/tcp`` or ``net/tcp6`` of its network namespace lists in a state
  CRIU dumps as connected: ESTABLISHED, SYN_SENT, FIN_WAIT1/2, CLOSE_WAIT, LAST_ACK, CLOSING).
- Kept only when there is at least one and every one has both ends on loopback (127.0.0.0/8,
  ``::1``, or IPv4-mapped loopback) and its other end is a socket of the tree too: connections
  between processes of the pod (a launcher's TCPStore and its ranks) then come back as they
  were in the restored pod's fresh network namespace, where loopback addresses mean the same.
  Otherwise every connection is closed (the restored ends see a reset), as before: a restored
  pod has another IP and its remote peers never knew it.
- The decision goes into the restore plan, so the restore uses the same mode as the dump.
- CRIU puts kept connections into repair mode for the dump and, when it leaves the tree
  stopped (``--leave-stopped``), never takes them out: the source would resume on sockets that
  no longer send. :func:`repair_off` does what CRIU does on ``--leave-running``: repair mode
  off, ``SO_REUSEADDR`` back to its value before the dump (:func:`plan` records it), through a
  copy of each socket taken with ``pidfd_getfd(2)`` (Linux 5.6) and closed at once.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from runtime import libc
from runtime.proc import procfs

log = logging.getLogger(__name__)

# include/net/tcp_states.h: the states criu/sk-inet.c dumps as a connection.
CONNECTED = frozenset({1, 2, 4, 5, 8, 9, 11})
STATE_NAMES = {1: "ESTABLISHED", 2: "SYN_SENT", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 8: "CLOSE_WAIT",
               9: "LAST_ACK", 11: "CLOSING"}


SYS_PIDFD_GETFD = 438  # the same number on x86_64 and arm64
TCP_REPAIR = 19  # linux/tcp.h


@dataclass(frozen=True, slots=True)
class Holder:
    """One fd through which a kept socket can be reached, and its SO_REUSEADDR before the dump."""

    pid: int
    fd: int
    inode: int
    reuseaddr: int


@dataclass(frozen=True, slots=True)
class TcpPlan:
    established: bool  # pass --tcp-established (else --tcp-close)
    reason: str
    connections: tuple[procfs.TcpSocket, ...] = ()
    holders: tuple[Holder, ...] = ()  # when established: one per kept socket


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def describe(s: procfs.TcpSocket) -> str:
    def end(a: tuple[str, int]) -> str:
        return f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}"
    return f"{end(s.local)} -> {end(s.remote)} {STATE_NAMES.get(s.state, s.state)}"


REREADS = 2  # more reads of a namespace's tables while a socket of the tree is in none of them


def _tcp_table(pid: int, inodes: set[int], proc: str) -> dict[int, procfs.TcpSocket]:
    """The TCP sockets of ``pid``'s namespace. The kernel hands net/tcp out a page per read and
    resumes each read by position, so sockets coming and going elsewhere in the namespace (a
    tenant's churn) can make it skip a live one: while one of ``inodes`` (the tree's sockets) is
    missing, the tables are read again and the reads merged (a unix or UDP socket of the tree is
    missing from every read; that costs the rereads and nothing else)."""
    table = procfs.tcp_sockets(pid, proc)
    for _ in range(REREADS):
        if inodes <= table.keys():
            break
        table = {**procfs.tcp_sockets(pid, proc), **table}
    return table


def _connected(pids: Iterable[int], proc: str) -> dict[int, tuple[procfs.TcpSocket, int, int]]:
    """inode -> (socket, pid, fd) for every connected TCP socket the processes hold."""
    held: dict[int, tuple[list[procfs.Fd], str]] = {}
    by_ns: dict[str, tuple[int, set[int]]] = {}  # a pid of the namespace, the tree's socket inodes there
    for pid in dict.fromkeys(pids):
        entries = procfs.fds(pid, proc)
        inodes = procfs.socket_inodes(entries)
        if inodes:
            ns = procfs.netns_key(pid, proc)
            held[pid] = (entries, ns)
            by_ns.setdefault(ns, (pid, set()))[1].update(inodes)
    tables = {ns: _tcp_table(pid, inodes, proc) for ns, (pid, inodes) in by_ns.items()}
    found: dict[int, tuple[procfs.TcpSocket, int, int]] = {}
    for pid, (entries, ns) in held.items():
        for e in entries:
            inode = next(iter(procfs.socket_inodes([e])), None)
            sock = tables[ns].get(inode) if inode is not None else None
            if inode is not None and sock is not None and sock.state in CONNECTED and inode not in found:
                found[inode] = (sock, pid, e.fd)
    return found


def plan(pids: Iterable[int], proc: str = procfs.PROC, reuse: bool = True) -> TcpPlan:
    """The mode for ``pids``; when kept, each socket's SO_REUSEADDR is recorded (``reuse``,
    real processes only) for :func:`repair_off`."""
    found = _connected(pids, proc)
    socks = [found[i][0] for i in sorted(found)]
    if not socks:
        return TcpPlan(False, "no connected TCP socket")
    ends = {(s.local, s.remote) for s in socks}
    for s in socks:
        if not (is_loopback(s.local[0]) and is_loopback(s.remote[0])):
            return TcpPlan(False, f"{describe(s)} is not on loopback", tuple(socks))
        if s.peer_key not in ends:
            return TcpPlan(False, f"{describe(s)} has its other end outside the tree", tuple(socks))
    holders = []
    for inode in sorted(found):
        _, pid, fd = found[inode]
        value = 0
        if reuse:
            try:
                with _socket_of(pid, fd) as sk:
                    value = sk.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
            except OSError as exc:
                return TcpPlan(False, f"socket {inode} of pid {pid} cannot be reached ({exc})", tuple(socks))
        holders.append(Holder(pid, fd, inode, value))
    return TcpPlan(True, f"{len(socks)} loopback connection end(s), all between processes of the tree",
                   tuple(socks), tuple(holders))


def _socket_of(pid: int, fd: int) -> socket.socket:
    """A copy of ``pid``'s fd ``fd`` in this process (pidfd_getfd), as a socket object."""
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.call("syscall", SYS_PIDFD_GETFD, pidfd, fd, 0, what=f"pidfd_getfd({pid}, {fd})")
    finally:
        os.close(pidfd)
    return socket.socket(fileno=int(got))


def repair_off(holders: Iterable[Holder]) -> list[str]:
    """Take the kept sockets out of repair mode, as CRIU does when it lets a tree run on; returns
    what could not be done (the caller decides whether the source may go on)."""
    problems = []
    for h in holders:
        try:
            with _socket_of(h.pid, h.fd) as sk:
                sk.setsockopt(socket.SOL_TCP, TCP_REPAIR, 0)
                sk.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, h.reuseaddr)
        except OSError as exc:
            problems.append(f"socket {h.inode} (pid {h.pid} fd {h.fd}): {exc}")
    if problems:
        log.error("TCP sockets left in repair mode: %s", "; ".join(problems))
    return problems
