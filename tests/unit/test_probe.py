"""runtime.pod.probe against local servers that answer, refuse, or stall on purpose (slow-loris)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from runtime.pod.probe import MAX_PARKED, probe, release


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


# --- the probe's own connection never reaches a checkpoint (CRIU: "In-flight connection") ----------

def _listener(backlog: int = 64) -> tuple[socket.socket, int]:
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(backlog)
    return ls, ls.getsockname()[1]


def test_tcp_probe_is_not_ready_while_its_connection_waits_in_the_accept_queue():
    ls, port = _listener()
    with ls:
        t0 = time.monotonic()
        assert asyncio.run(probe("", "tcp", "127.0.0.1", port, timeout=0.3)) is False
        assert time.monotonic() - t0 < 1.0
        # The connection it gave up on stays open while queued (a reset one would leave the
        # tables the next probe looks in); released, it is reset, not closed with a FIN: once the
        # workload takes it, its side is closed (CRIU dumps that), not half-open (CRIU refuses that).
        conn, _ = ls.accept()
        with conn:
            conn.setblocking(False)
            with pytest.raises(BlockingIOError):
                conn.recv(1)  # open: nothing to read, no end
            release("")
            conn.setblocking(True)
            with pytest.raises(ConnectionResetError):
                conn.recv(1)


def test_tcp_probe_waits_for_a_connection_parked_in_a_busy_reuseport_listener():
    """A prefork server's two SO_REUSEPORT listeners: a probe connection hashed to the busy one
    waits there while later ones are taken by the quick one; no probe is ready until it is taken."""
    quick = socket.socket()
    busy = socket.socket()
    for ls in (quick, busy):
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    quick.bind(("127.0.0.1", 0))
    port = quick.getsockname()[1]
    busy.bind(("127.0.0.1", port))
    stop = threading.Event()

    def take_quickly(ls: socket.socket, until: threading.Event) -> None:
        ls.settimeout(0.05)
        while not until.is_set():
            try:
                ls.accept()[0].close()
            except TimeoutError:
                pass

    with quick, busy:
        quick.listen(16)
        busy.listen(16)
        t = threading.Thread(target=take_quickly, args=(quick, stop))
        t.start()
        try:
            for _ in range(40):  # until one lands in the busy listener (1 in 2 each)
                if not asyncio.run(probe("", "tcp", "127.0.0.1", port, timeout=0.3)):
                    break
            else:
                pytest.fail("no probe connection was hashed to the busy listener")
            for _ in range(4):  # whichever listener takes the next ones, the parked one holds them back
                assert asyncio.run(probe("", "tcp", "127.0.0.1", port, timeout=0.3)) is False
            freed = threading.Event()  # the busy worker is free now: it takes what waited for it
            b = threading.Thread(target=take_quickly, args=(busy, freed))
            b.start()
            try:
                assert asyncio.run(probe("", "tcp", "127.0.0.1", port, timeout=2.0)) is True
            finally:
                freed.set()
                b.join()
            busy.setblocking(False)
            with pytest.raises(BlockingIOError):
                busy.accept()  # nothing of the probes' left in the busy queue
        finally:
            stop.set()
            t.join()
            release("")


def test_tcp_probes_of_a_workload_that_never_accepts_hold_a_bounded_number_of_connections():
    ls, port = _listener()
    with ls:
        try:
            for _ in range(MAX_PARKED + 3):
                assert asyncio.run(probe("", "tcp", "127.0.0.1", port, timeout=0.2)) is False
            ls.setblocking(False)
            queued = 0
            with pytest.raises(BlockingIOError):
                while True:
                    ls.accept()[0].close()
                    queued += 1
            assert queued == MAX_PARKED
        finally:
            release("")


def test_tcp_probe_is_ready_once_the_workload_accepted_and_leaves_nothing_queued():
    ls, port = _listener()
    taken: list[socket.socket] = []

    def accept_late() -> None:
        time.sleep(0.3)
        taken.append(ls.accept()[0])

    with ls:
        t = threading.Thread(target=accept_late)
        t.start()
        t0 = time.monotonic()
        assert asyncio.run(probe("", "tcp", "127.0.0.1", port, timeout=2.0)) is True
        assert time.monotonic() - t0 >= 0.3  # not before the accept
        t.join()
        ls.setblocking(False)
        with pytest.raises(BlockingIOError):
            ls.accept()  # nothing of the probe's left in the queue
        with taken[0], pytest.raises(ConnectionResetError):
            taken[0].recv(1)


def test_http_probe_resets_its_connection_when_the_server_keeps_it_open():
    ls, port = _listener()
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = ls.accept()
        with conn:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            conn.settimeout(5)
            try:
                seen.append(conn.recv(1))
            except OSError as exc:
                seen.append(type(exc).__name__.encode())

    with ls:
        t = threading.Thread(target=serve)
        t.start()
        assert asyncio.run(probe("", "http", "127.0.0.1", port, "/", timeout=1.0)) is True
        t.join(5)
    assert seen == [b"ConnectionResetError"]


def test_sock_diag_answers_are_read_strictly():
    import errno
    import struct

    from runtime.pod import probe as p
    req = p.diag_request(socket.AF_INET, ("10.0.0.1", 8080), ("10.0.0.2", 40000))
    assert len(req) == 16 + 56 and struct.unpack_from("=IH", req) == (72, p.SOCK_DIAG_BY_FAMILY)
    err = struct.pack("=IHHII", 36, p.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -errno.ENOENT) + bytes(16)
    assert p.diag_answer(err, 40000) is None
    with pytest.raises(OSError):
        p.diag_answer(struct.pack("=IHHII", 36, p.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -errno.EOPNOTSUPP), 1)
    with pytest.raises(OSError):
        p.diag_answer(b"\0" * 8, 1)
