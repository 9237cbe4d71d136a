"""Readiness probes (HTTP GET or TCP connect) run inside a pod's network namespace.

The target is the tenant's: it may accept and never answer, or dribble one byte at a time.
So a probe holds no thread while it waits. A socket belongs to the network namespace it was
created in, whichever thread uses it later; only the socket is made in the pod's netns: a
fresh thread enters the netns (setns changes the calling thread only), creates the socket and
ends, so a thread that left the host namespace is never reused for anything else. The connect
and the HTTP exchange then run as asyncio I/O on the caller's loop under one hard deadline for
the whole probe: a slow target costs one file descriptor until the deadline, never a thread.

``probe()`` is a coroutine; callers bound how many run at once (nri_plugin.probes).
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import logging
import os
import socket
import threading

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
MAX_STATUS_LINE = 4096
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


async def socket_in_netns(netns: str, family: socket.AddressFamily) -> socket.socket:
    """A non-blocking TCP socket of the network namespace ``netns`` (the caller's if empty)."""
    if not netns:
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
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
            sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
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


async def _exchange(sock: socket.socket, kind: str, host: str, port: int, path: str) -> bool:
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    if kind == "tcp":
        return True
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
    """True if the endpoint answers (TCP accept, or HTTP 2xx/3xx) from inside ``netns`` within
    ``timeout`` seconds, all of it: making the socket, connecting, sending, the status line.
    ``host`` is an IP address (the policy refuses names: resolving one could block)."""
    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    sock: socket.socket | None = None
    try:
        async with asyncio.timeout(timeout):
            sock = await socket_in_netns(netns, family)
            return await _exchange(sock, kind, host, port, path)
    except (OSError, TimeoutError) as exc:
        log.debug("probe %s://%s:%d%s in %s: %s", kind, host, port, path, netns or "host netns",
                  type(exc).__name__ if isinstance(exc, TimeoutError) else exc)
        return False
    finally:
        if sock is not None:
            sock.close()
