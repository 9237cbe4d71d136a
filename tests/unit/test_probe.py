"""runtime.probe against local servers that answer, refuse, or stall on purpose (slow-loris)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from runtime.probe import probe


async def _server(mode: str) -> tuple[asyncio.base_events.Server, int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if mode == "ok":
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
            elif mode == "error":
                await reader.readuntil(b"\r\n\r\n")
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\n\r\n")
            elif mode == "garbage":
                writer.write(b"SSH-2.0-OpenSSH\r\n")
            elif mode == "dribble":  # one byte at a time, never a line end
                for _ in range(100):
                    writer.write(b"H")
                    await writer.drain()
                    await asyncio.sleep(0.1)
            else:  # silent: accept, read, never answer
                await asyncio.sleep(30)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("mode, kind, expected", [
    ("ok", "http", True), ("error", "http", False), ("garbage", "http", False),
    ("silent", "http", False), ("dribble", "http", False), ("silent", "tcp", True),
], ids=["http-204", "http-503", "not-http", "silent", "dribble", "tcp-accept"])
def test_probe_outcomes_within_the_deadline(mode, kind, expected):
    async def body():
        server, port = await _server(mode)
        t0 = time.monotonic()
        ok = await probe("", kind, "127.0.0.1", port, "/ready", timeout=0.5)
        server.close()
        return ok, time.monotonic() - t0

    ok, took = asyncio.run(body())
    assert ok is expected
    assert took < 1.5, f"the probe took {took:.2f}s, well past its 0.5s deadline"


def test_refused_port_is_not_ready():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = s.getsockname()[1]
        assert asyncio.run(probe("", "tcp", "127.0.0.1", port, timeout=0.5)) is False


def test_slow_loris_targets_cost_no_threads():
    """Thirty probes at once against targets that stall or dribble: no thread is started or
    kept for them, and each ends at its deadline."""
    async def body():
        servers = [await _server(mode) for mode in ("silent", "dribble") * 15]
        before = threading.active_count()
        peak = before

        async def watch():
            nonlocal peak
            while True:
                peak = max(peak, threading.active_count())
                await asyncio.sleep(0.02)
        watcher = asyncio.create_task(watch())
        t0 = time.monotonic()
        results = await asyncio.gather(*(probe("", "http", "127.0.0.1", port, timeout=0.5) for _, port in servers))
        took = time.monotonic() - t0
        watcher.cancel()
        for server, _ in servers:
            server.close()
        return results, took, before, peak, threading.active_count()

    results, took, before, peak, after = asyncio.run(body())
    assert results == [False] * 30
    assert took < 2.0  # thirty at once, each bounded by its own 0.5 s deadline
    assert peak == before and after == before, (before, peak, after)
