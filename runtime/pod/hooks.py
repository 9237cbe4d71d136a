"""The engine's release path: one HTTP POST in a pod's network namespace around a checkpoint.

An inference engine can give up what a checkpoint would otherwise have to move: vLLM's and
SGLang's ``/sleep?level=1`` copy the weights to pinned host memory and free the KV cache, and
``/wake_up`` brings both back. The plugin calls the pod's own endpoint before the freeze
(``rekindle.dev/before-checkpoint``) and after the restored process runs
(``rekindle.dev/after-restore``); a source it put to sleep it wakes again with the latter.

The target is the tenant's, so a call is made like a ready probe (``runtime.pod.probe``): the socket
is made in the pod's netns by a fresh thread that ends at once, the host is an IP address (the
policy refuses names), the connect, the request and the status line run under one deadline,
and the connection ends with a reset once the workload closed it (or a short wait), so it never
reaches a checkpoint. The body is an empty JSON object: vLLM's endpoints read their query,
SGLang's a JSON body (``{}``: every kind of memory). A call succeeds on a 2xx status; anything else is a ``HookFailed`` with
the reason. ``run`` is blocking (the engine's threads): it runs the call on a loop of its own.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import time
from dataclasses import dataclass

from runtime.errors import Reason, RekindleError
from runtime.pod import probe

DEFAULT_TIMEOUT = 120   # seconds: an engine's sleep copies its weights to host memory
MAX_TIMEOUT = 3600


@dataclass(frozen=True, slots=True)
class Call:
    host: str          # an IP address
    port: int
    target: str        # path and query, e.g. /sleep?level=1
    timeout: float = DEFAULT_TIMEOUT

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.target}"


class HookFailed(RekindleError):
    """The workload's before-checkpoint or after-restore call did not answer 2xx in time."""

    reason_class = Reason.RUNTIME


async def _call(netns: str, call: Call) -> int:
    """The status code the workload answered ``POST call.target`` with."""
    family = socket.AF_INET6 if ipaddress.ip_address(call.host).version == 6 else socket.AF_INET
    loop = asyncio.get_running_loop()
    sock: socket.socket | None = None
    host = f"[{call.host}]" if ":" in call.host else call.host
    request = (f"POST {call.target} HTTP/1.1\r\nHost: {host}:{call.port}\r\nUser-Agent: rekindle\r\n"
               "Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}").encode()
    try:
        async with asyncio.timeout(call.timeout):
            sock = await probe.socket_in_netns(netns, family)
            await loop.sock_connect(sock, (call.host, call.port))
            await loop.sock_sendall(sock, request)
            line = b""
            while b"\n" not in line:
                chunk = await loop.sock_recv(sock, probe.MAX_STATUS_LINE - len(line))
                if not chunk:
                    raise ConnectionError("the connection was closed before a status line")
                line += chunk
                if len(line) >= probe.MAX_STATUS_LINE:
                    raise ConnectionError("no status line in the first 4 KiB")
        code = status_code(line.split(b"\n", 1)[0])
        if code is None:
            raise ConnectionError(f"not an HTTP status line: {line[:80]!r}")
        await probe._drain(sock)
        return code
    finally:
        if sock is not None:
            probe._reset(sock)


def status_code(line: bytes) -> int | None:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1])


def run(netns: str, call: Call, what: str) -> float:
    """POST ``call`` inside ``netns`` (the caller's when empty); the seconds it took, or
    ``HookFailed`` naming ``what`` (the annotation) and why."""
    t0 = time.monotonic()
    try:
        code = asyncio.run(_call(netns, call))
    except TimeoutError:
        raise HookFailed(f"{what} POST {call} did not answer within {call.timeout:g}s") from None
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise HookFailed(f"{what} POST {call} failed: {why}") from None
    if not 200 <= code < 300:
        raise HookFailed(f"{what} POST {call} answered HTTP {code}")
    return round(time.monotonic() - t0, 3)
