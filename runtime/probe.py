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
is closed too, not left established or half-closed (CRIU would refuse either). A probe that ran
out of time leaves its reset connection queued until the workload accepts it; accept queues are
first in, first out, so a later probe that succeeds proves every earlier one was taken too, and
the checkpoint that follows a success finds none of them.

``probe()`` is a coroutine; callers bound how many run at once (nri_plugin.probes).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import ipaddress
import logging
import os
import socket
import struct
import threading

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
MAX_STATUS_LINE = 4096
MAX_DRAIN = 64 * 1024   # bytes of an HTTP answer read while waiting for the workload to close
DRAIN_WAIT = 0.2        # how long an HTTP probe waits, after the status line, for that close
ACCEPT_POLL = 0.02      # how often a TCP probe asks whether its connection was accepted

# sock_diag (linux/sock_diag.h, linux/inet_diag.h)
NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
TCP_ESTABLISHED = 1
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NLMSG = struct.Struct("=IHHII")                  # nlmsghdr
_REQ = struct.Struct("=BBBxI")                    # inet_diag_req_v2 up to its sockid
_SOCKID = struct.Struct(">HH16s16s")               # ports (network order), addresses
_SOCKID_TAIL = struct.Struct("=III")              # idiag_if, idiag_cookie[2]
_MSG_HEAD = struct.Struct("=BBBB")                # inet_diag_msg: family, state, timer, retrans
_MSG_TAIL = struct.Struct("=IIIII")               # expires, rqueue, wqueue, uid, inode
_ERR = struct.Struct("=i")                        # nlmsgerr.error (-errno)
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
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


async def _accepted(diag: socket.socket, family: int, server: tuple[str, int], client: tuple[str, int]) -> bool:
    """Wait until the workload accepted our connection (its side has an inode: a file of the
    workload's); False once that side is gone without it. The caller's deadline bounds it."""
    loop = asyncio.get_running_loop()
    seq = 0
    while True:
        seq += 1
        await loop.sock_sendall(diag, diag_request(family, server, client, seq))
        try:
            found = diag_answer(await loop.sock_recv(diag, 8192), client[1])
        except OSError as exc:
            # A kernel without TCP sock_diag: the connect is all we can know (as before).
            log.warning("cannot tell whether %s:%d accepted the probe's connection (%s); "
                        "taking the connect as ready", server[0], server[1], exc)
            return True
        if found is None or found[0] != TCP_ESTABLISHED:
            return False
        if found[1] != 0:
            return True
        await asyncio.sleep(ACCEPT_POLL)


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
    await loop.sock_connect(sock, (host, port))
    if kind == "tcp":
        family = sock.family
        diag = await socket_in_netns(netns, socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
        try:
            server = sock.getpeername()[:2]
            client = sock.getsockname()[:2]
            return await _accepted(diag, family, server, client)
        finally:
            diag.close()
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
        if sock is not None:
            _reset(sock)
