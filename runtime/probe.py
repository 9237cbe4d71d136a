"""Readiness probes (HTTP GET or TCP connect) run inside a pod's network namespace.

setns(CLONE_NEWNET) changes the namespace of the calling *thread* only, so each probe runs in a
fresh thread that enters the pod's netns, opens its socket there and then ends; the plugin's
other threads never leave the host namespace.
"""

from __future__ import annotations

import ctypes
import http.client
import logging
import os
import socket
import threading

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _check(kind: str, host: str, port: int, path: str, timeout: float) -> bool:
    if kind == "tcp":
        with socket.create_connection((host, port), timeout=timeout):
            return True
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"User-Agent": "rekindle-probe"})
        status = conn.getresponse().status
        return 200 <= status < 400
    finally:
        conn.close()


def probe(netns: str, kind: str, host: str, port: int, path: str = "/", timeout: float = 1.0) -> bool:
    """True if the endpoint answers (TCP accept, or HTTP 2xx/3xx) from inside ``netns``."""
    result: list[bool] = []

    def run() -> None:
        try:
            if netns:
                _setns(netns)
            result.append(_check(kind, host, port, path, timeout))
        except (OSError, http.client.HTTPException) as exc:
            log.debug("probe %s://%s:%d%s in %s: %s", kind, host, port, path, netns, exc)
            result.append(False)

    t = threading.Thread(target=run, name="rekindle-probe", daemon=True)
    t.start()
    t.join(timeout + 1.0)
    return bool(result and result[0])
