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
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from runtime import procfs

# include/net/tcp_states.h: the states criu/sk-inet.c dumps as a connection.
CONNECTED = frozenset({1, 2, 4, 5, 8, 9, 11})
STATE_NAMES = {1: "ESTABLISHED", 2: "SYN_SENT", 4: "FIN_WAIT1", 5: "FIN_WAIT2", 8: "CLOSE_WAIT",
               9: "LAST_ACK", 11: "CLOSING"}


@dataclass(frozen=True, slots=True)
class TcpPlan:
    established: bool  # pass --tcp-established (else --tcp-close)
    reason: str
    connections: tuple[procfs.TcpSocket, ...] = ()


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def describe(s: procfs.TcpSocket) -> str:
    def end(a: tuple[str, int]) -> str:
        return f"[{a[0]}]:{a[1]}" if ":" in a[0] else f"{a[0]}:{a[1]}"
    return f"{end(s.local)} -> {end(s.remote)} {STATE_NAMES.get(s.state, s.state)}"


def connected_sockets(pids: Iterable[int], proc: str = procfs.PROC) -> list[procfs.TcpSocket]:
    """The connected TCP sockets the processes ``pids`` hold, each once."""
    tables: dict[str, dict[int, procfs.TcpSocket]] = {}
    found: dict[int, procfs.TcpSocket] = {}
    for pid in dict.fromkeys(pids):
        inodes = procfs.socket_inodes(procfs.fds(pid, proc))
        if not inodes:
            continue
        ns = procfs.netns_key(pid, proc)
        if ns not in tables:
            tables[ns] = procfs.tcp_sockets(pid, proc)
        for inode in inodes:
            sock = tables[ns].get(inode)
            if sock is not None and sock.state in CONNECTED:
                found[inode] = sock
    return [found[i] for i in sorted(found)]


def plan(pids: Iterable[int], proc: str = procfs.PROC) -> TcpPlan:
    socks = connected_sockets(pids, proc)
    if not socks:
        return TcpPlan(False, "no connected TCP socket")
    ends = {(s.local, s.remote) for s in socks}
    for s in socks:
        if not (is_loopback(s.local[0]) and is_loopback(s.remote[0])):
            return TcpPlan(False, f"{describe(s)} is not on loopback", tuple(socks))
        if s.peer_key not in ends:
            return TcpPlan(False, f"{describe(s)} has its other end outside the tree", tuple(socks))
    return TcpPlan(True, f"{len(socks)} loopback connection end(s), all between processes of the tree",
                   tuple(socks))
