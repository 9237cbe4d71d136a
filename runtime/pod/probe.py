"""Readiness probes (HTTP GET or TCP connect) run inside a pod's network namespace.

The target is the tenant's: it may accept and never answer, or dribble one byte at a time.
So a probe holds no thread while it waits. A socket belongs to the network namespace it was
created in, whichever thread uses it later; only the socket is made in the pod's netns: a
fresh thread enters the netns (setns changes the calling thread only), creates the socket and
ends, so a thread that left the host namespace is never reused for anything else. The connect
and the HTTP exchange then run as asyncio I/O on the caller's loop under one hard deadline for
the whole probe: a slow target costs one file descriptor until the deadline, never a thread.

A probe's own connection must never reach a checkpoint: CRIU refuses to dump a listening
socket with a connection still in its accept queue ("In-flight connection"), and a workload
under load may accept late. So a probe succeeds only once the workload has accepted its
connection: the TCP probe then asks the pod's sock_diag (netlink, made in the pod's netns like
the TCP socket) about the server's side of it, which gets an inode only when ``accept()`` hands
it to the workload; the HTTP probe has its answer, and reads on until the workload closes (or a
short wait). Every probe socket is closed with SO_LINGER 0, a reset, so that the workload's side
is closed too, not left established or half-closed (CRIU would refuse either).
A TCP connection is never reset while it waits in an accept queue: a reset one stays queued but
leaves the tables sock_diag looks in, so nothing could tell when it was gone. Accept queues are
not one queue either: a prefork server's workers each listen with SO_REUSEPORT and the kernel
hashes each connection to one of them, so a later connection taken by a quick worker says
nothing of an earlier one waiting for a busy worker (measured: 4 checkpoints in 20 failed that
way under load). So a TCP probe that runs out of time parks its connection, still open, and
every later probe of that network namespace looks it up again: it is ready only once its own
connection and every parked one were accepted (or are gone); each is reset once accepted. At
most ``MAX_PARKED`` per namespace (a probe finding them all still queued connects no more);
``release(netns)`` resets what is left when nobody probes that pod any more.

``probe()`` is a coroutine; callers bound how many run at once (nri_plugin.probes).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass

from runtime import libc

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
MAX_STATUS_LINE = 4096
MAX_DRAIN = 64 * 1024   # bytes of an HTTP answer read while waiting for the workload to close
DRAIN_WAIT = 0.2        # how long an HTTP probe waits, after the status line, for that close
ACCEPT_POLL = 0.02      # how often a TCP probe asks whether its connection was accepted
MAX_PARKED = 8          # connections a namespace's TCP probes keep open while they wait in a queue

# sock_diag (linux/sock_diag.h, linux/inet_diag.h)
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
TCP_ESTABLISHED = 1
# The workload's side closing first (FIN_WAIT1, FIN_WAIT2, TIME_WAIT, CLOSING): only a socket it
# accepted can; a queued one is reset, never closed with a FIN.
CLOSED_BY_WORKLOAD = frozenset({4, 5, 6, 11})
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NLMSG = struct.Struct("=IHHII")                  # nlmsghdr
_REQ = struct.Struct("=BBBxI")                    # inet_diag_req_v2 up to its sockid
_SOCKID = struct.Struct(">HH16s16s")               # ports (network order), addresses
_SOCKID_TAIL = struct.Struct("=III")              # idiag_if, idiag_cookie[2]
_MSG_HEAD = struct.Struct("=BBBB")                # inet_diag_msg: family, state, timer, retrans
_MSG_TAIL = struct.Struct("=IIIII")               # expires, rqueue, wqueue, uid, inode
_ERR = struct.Struct("=i")                        # nlmsgerr.error (-errno)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc.call("setns", fd, CLONE_NEWNET, what=f"setns({path})")
    finally:
        os.close(fd)


async def socket_in_netns(netns: str, family: socket.AddressFamily | int,
                          kind: int = socket.SOCK_STREAM, proto: int = 0) -> socket.socket:
    """A non-blocking socket (TCP unless told) of the network namespace ``netns`` (the
    caller's if empty)."""
    if not netns:
        sock = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
        sock.setblocking(False)
        return sock
    loop = asyncio.get_running_loop()
    made: asyncio.Future[socket.socket] = loop.create_future()

    def deliver(sock: socket.socket | None, exc: BaseException | None) -> None:
        if made.cancelled():
            if sock is not None:
                sock.close()
        elif exc is not None or sock is None:
            made.set_exception(exc or OSError("no socket was made"))
        else:
            made.set_result(sock)

    def in_netns() -> None:
        # This thread's netns changes for good; it ends right after, never to be reused.
        try:
            _setns(netns)
            sock = socket.socket(family, kind | socket.SOCK_CLOEXEC, proto)
            sock.setblocking(False)
        except OSError as exc:
            loop.call_soon_threadsafe(deliver, None, exc)
        else:
            loop.call_soon_threadsafe(deliver, sock, None)

    threading.Thread(target=in_netns, name="rekindle-netns", daemon=True).start()
    return await made


def _status_ok(line: bytes) -> bool:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        return False
    return 200 <= int(parts[1]) < 400


def _addr(family: int, host: str) -> bytes:
    packed = socket.inet_pton(family, host)
    return packed.ljust(16, b"\0")


def diag_request(family: int, local: tuple[str, int], peer: tuple[str, int], seq: int = 1) -> bytes:
    """A sock_diag lookup of one TCP socket by its exact addresses, ``local`` being its own."""
    body = (_REQ.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF)
            + _SOCKID.pack(local[1], peer[1], _addr(family, local[0]), _addr(family, peer[0]))
            + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    return _NLMSG.pack(_NLMSG.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0) + body


def diag_answer(data: bytes, peer_port: int) -> tuple[int, int] | None:
    """(state, inode) of the socket a lookup found, or None when there is none (ENOENT, or the
    listener, which a lookup falls back to once the connection is gone). OSError when the
    kernel cannot answer at all (no sock_diag for TCP)."""
    if len(data) < _NLMSG.size:
        raise OSError(f"short sock_diag answer ({len(data)} bytes)")
    _length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data)
    if kind == NLMSG_ERROR and len(data) >= _NLMSG.size + _ERR.size:
        err = -_ERR.unpack_from(data, _NLMSG.size)[0]
        if err == errno.ENOENT:
            return None
        raise OSError(err, f"sock_diag: {os.strerror(err)}")
    if kind != SOCK_DIAG_BY_FAMILY or len(data) < _NLMSG.size + _MSG_HEAD.size + _SOCKID.size + 12 + _MSG_TAIL.size:
        raise OSError(f"unexpected sock_diag answer (type {kind}, {len(data)} bytes)")
    _family, state, _timer, _retrans = _MSG_HEAD.unpack_from(data, _NLMSG.size)
    _sport, dport, _src, _dst = _SOCKID.unpack_from(data, _NLMSG.size + _MSG_HEAD.size)
    _exp, _rq, _wq, _uid, inode = _MSG_TAIL.unpack_from(data, _NLMSG.size + _MSG_HEAD.size + _SOCKID.size + 12)
    if dport != peer_port:
        return None
    return state, inode


@dataclass(eq=False)
class _Conn:
    """A TCP probe's connection, addressed as the pod's sock_diag sees the workload's side."""

    sock: socket.socket
    server: tuple[str, int]
    client: tuple[str, int]


# netns -> TCP probe connections not yet seen accepted (never reset while they may be queued)
_parked: dict[str, list[_Conn]] = {}


def release(netns: str) -> None:
    """Reset what the probes of ``netns`` still hold (its wait for ready ended)."""
    for conn in _parked.pop(netns, []):
        _reset(conn.sock)


async def _lookup(diag: socket.socket, conn: _Conn, seq: int) -> tuple[int, int] | None:
    loop = asyncio.get_running_loop()
    await loop.sock_sendall(diag, diag_request(conn.sock.family, conn.server, conn.client, seq))
    return diag_answer(await loop.sock_recv(diag, 8192), conn.client[1])


async def _tcp(sock: socket.socket, host: str, port: int, netns: str) -> bool:
    """Connect; ready once the workload accepted this connection and every parked one of
    ``netns`` (its side has an inode: a file of the workload's), or they are gone. This one
    stays parked until then, also when the caller's deadline ends the wait."""
    loop = asyncio.get_running_loop()
    parked = _parked.setdefault(netns, [])
    diag = await socket_in_netns(netns, socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
    seq = 0
    try:
        mine: _Conn | None = None
        while True:
            for conn in list(parked):
                seq += 1
                try:
                    found = await _lookup(diag, conn, seq)
                except OSError as exc:
                    # A kernel without TCP sock_diag: the connect is all we can know (as before).
                    log.warning("cannot tell whether %s:%d accepted the probe's connection (%s); "
                                "taking the connect as ready", host, port, exc)
                    release(netns)
                    return mine is not None
                if found is not None and found[0] == TCP_ESTABLISHED and found[1] == 0:
                    continue  # still in an accept queue
                parked.remove(conn)
                taken = found is not None and (found[0] in CLOSED_BY_WORKLOAD or found[1] != 0)
                if conn is mine and not taken:
                    return False  # refused or reset before the workload took it
                if conn is not mine:
                    _reset(conn.sock)
            if mine is not None and not parked:
                return True
            if mine is None:
                if len(parked) >= MAX_PARKED:
                    return False  # the workload takes none of them: no more connections to it
                await loop.sock_connect(sock, (host, port))
                mine = _Conn(sock, sock.getpeername()[:2], sock.getsockname()[:2])
                parked.append(mine)
                continue
            await asyncio.sleep(ACCEPT_POLL)
    finally:
        diag.close()
        if not parked:
            _parked.pop(netns, None)


async def _drain(sock: socket.socket) -> None:
    """Read the rest of an answer until the workload closes, for a short while at most (its
    own short deadline, after the probe's: an answer in time is not undone by a slow close)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(DRAIN_WAIT):
            got = 0
            while got < MAX_DRAIN:
                chunk = await loop.sock_recv(sock, 4096)
                if not chunk:
                    return
                got += len(chunk)
    except (OSError, TimeoutError):
        pass


def _reset(sock: socket.socket) -> None:
    """Close with a reset: no FIN handshake that would leave the workload's side half-closed."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


async def _exchange(sock: socket.socket, kind: str, host: str, port: int, path: str, netns: str) -> bool:
    loop = asyncio.get_running_loop()
    if kind == "tcp":
        return await _tcp(sock, host, port, netns)
    await loop.sock_connect(sock, (host, port))
    hostname = f"[{host}]" if ":" in host else host
    request = (f"GET {path} HTTP/1.1\r\nHost: {hostname}:{port}\r\nUser-Agent: rekindle-probe\r\n"
               "Connection: close\r\n\r\n").encode()
    await loop.sock_sendall(sock, request)
    line = b""
    while b"\n" not in line:
        chunk = await loop.sock_recv(sock, MAX_STATUS_LINE - len(line))
        if not chunk:
            return False
        line += chunk
        if len(line) >= MAX_STATUS_LINE:
            return False
    return _status_ok(line.split(b"\n", 1)[0])


async def probe(netns: str, kind: str, host: str, port: int, path: str = "/", timeout: float = 1.0) -> bool:
    """True if the endpoint answers from inside ``netns`` within ``timeout`` seconds, all of it:
    making the socket, connecting, the workload accepting the connection (TCP) or sending, the
    status line (HTTP 2xx/3xx). The connection is reset when done, whatever the answer.
    ``host`` is an IP address (the policy refuses names: resolving one could block)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock: socket.socket | None = None
    try:
        try:
            async with asyncio.timeout(timeout):
                sock = await socket_in_netns(netns, family)
                ok = await _exchange(sock, kind, host, port, path, netns)
        except (OSError, TimeoutError) as exc:
            log.debug("probe %s://%s:%d%s in %s: %s", kind, host, port, path, netns or "host netns",
                      type(exc).__name__ if isinstance(exc, TimeoutError) else exc)
            return False
        if kind == "http":
            await _drain(sock)
        return ok
    finally:
        if sock is not None and not any(c.sock is sock for c in _parked.get(netns, ())):
            _reset(sock)
