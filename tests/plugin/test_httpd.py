"""The metrics and health endpoint under clients that do not play along: a thousand idle
connections from one pod, a hung /metrics collection, a flood from one address while another
waits, malformed and oversized requests. The real server (nri_plugin.httpd), real sockets."""

from __future__ import annotations

import http.client
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from nri_plugin import httpd
from nri_plugin.health import Health
from nri_plugin.httpd import HttpEndpoint
from nri_plugin.metrics import Metrics
from tests.waiting import wait_for


def get(port: int, path: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))


def closed_by_server(socks: list[socket.socket]) -> list[socket.socket]:
    """The sockets the server has closed (EOF or reset), without blocking."""
    done = []
    poller = select.poll()  # select() stops at fd 1024
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    for fd, _ in poller.poll(0):
        s = by_fd[fd]
        try:
            s.setblocking(False)
            if s.recv(1) == b"":
                done.append(s)
        except BlockingIOError:
            pass
        except ConnectionError:
            done.append(s)
    return done


@pytest.fixture
def endpoint() -> Iterator[HttpEndpoint]:
    # No event loop beats here: a stall threshold longer than any test.
    ep = HttpEndpoint("127.0.0.1", 0, Metrics().registry, Health(stall_after=3600))
    ep.start()
    yield ep
    ep.stop()


def test_a_thousand_idle_connections_cost_no_threads_and_are_closed_after_the_timeout(endpoint):
    """One client opens 1000 connections and sends nothing. The server's threads stay at the
    loop's; /healthz answers meanwhile; every idle connection is closed by the read timeout."""
    threads_before = threading.active_count()
    socks: list[socket.socket] = []
    try:
        for _ in range(1000):
            socks.append(connect(endpoint.port))
        assert get(endpoint.port, "/healthz", timeout=2) == (200, "ok: event loop running\n")
        assert get(endpoint.port, "/readyz", timeout=2)[0] == 503  # answered, not connected to NRI
        # Thread per connection (the old server: 1000 more) or a bounded few.
        assert threading.active_count() - threads_before <= 1 + httpd.COLLECTOR_THREADS
        assert endpoint.open_connections <= httpd.MAX_PER_CLIENT
        pending = list(socks)

        def all_closed() -> bool:
            for s in closed_by_server(pending):
                pending.remove(s)
            return not pending
        # READ_TIMEOUT after the last one opened; the margin is for a loaded machine.
        wait_for(all_closed, httpd.READ_TIMEOUT + 15, "the server to close every idle connection")
        wait_for(lambda: endpoint.open_connections == 0, 5, "no connection left open on the server")
        assert endpoint.displaced >= 1000 - httpd.MAX_PER_CLIENT - 2  # the flood displaced its own
        assert threading.active_count() - threads_before <= 1 + httpd.COLLECTOR_THREADS
        assert get(endpoint.port, "/healthz")[0] == 200
    finally:
        for s in socks:
            s.close()


def test_a_flood_from_one_address_displaces_only_its_own_waiting_connections():
    ep = HttpEndpoint("127.0.0.1", 0, Metrics().registry, Health(), max_per_client=4, max_connections=16)
    ep.start()
    socks = []
    try:
        other = connect(ep.port, "127.0.0.1")  # another pod, idle but within its share
        socks.append(other)
        wait_for(lambda: ep.open_connections == 1, 5, "the first connection to be accepted")
        flood = [connect(ep.port, "127.0.0.2") for _ in range(50)]
        socks += flood
        wait_for(lambda: ep.displaced == 50 - 4, 5, "the flood to displace its own connections")
        assert ep.open_connections == 1 + 4
        assert closed_by_server([other]) == []
        # the newest four of the flood are the ones left open
        wait_for(lambda: len(closed_by_server(flood[:-4])) == 46, 5, "the oldest 46 to be closed")
        assert closed_by_server(flood[-4:]) == []
        other.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        other.settimeout(5)
        assert other.recv(4096).startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        for s in socks:
            s.close()
        ep.stop()


def test_past_the_global_cap_the_longest_waiting_connection_makes_room():
    ep = HttpEndpoint("127.0.0.1", 0, Metrics().registry, Health(), max_per_client=100, max_connections=4)
    ep.start()
    socks = []
    try:
        for i in range(4):
            socks.append(connect(ep.port))
            wait_for(lambda: ep.open_connections == i + 1, 5, "the connection to be accepted")
        assert get(ep.port, "/healthz")[0] == 200  # a fifth: the oldest idle one goes
        wait_for(lambda: closed_by_server(socks[:1]), 5, "the oldest idle connection to be closed")
        assert closed_by_server(socks[1:]) == []
    finally:
        for s in socks:
            s.close()
        ep.stop()


class _Hanging:
    """A collector that blocks until released (a store filesystem that does not answer)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def collect(self):
        self.entered.release()
        self.release.wait(30)
        yield GaugeMetricFamily("slow", "a collector on a hung filesystem", value=1)


def test_health_answers_while_metrics_hangs_and_metrics_gives_up_after_its_timeout():
    registry = CollectorRegistry()
    hanging = _Hanging()
    registry.register(hanging)
    ep = HttpEndpoint("127.0.0.1", 0, registry, Health(), metrics_timeout=1.0)
    ep.start()
    result: list[tuple[int, str]] = []
    try:
        t = threading.Thread(target=lambda: result.append(get(ep.port, "/metrics", timeout=10)))
        t.start()
        assert hanging.entered.acquire(timeout=5)
        t0 = time.monotonic()
        assert get(ep.port, "/healthz", timeout=2)[0] == 200
        assert time.monotonic() - t0 < 0.5
        t.join(10)
        code, text = result[0]
        assert code == 503 and "metrics collection took over 1s" in text
    finally:
        hanging.release.set()
        ep.stop()


def test_when_every_connection_is_busy_a_new_one_is_closed_unanswered():
    registry = CollectorRegistry()
    hanging = _Hanging()
    registry.register(hanging)
    ep = HttpEndpoint("127.0.0.1", 0, registry, Health(), max_connections=2, metrics_timeout=20)
    ep.start()
    busy = []
    try:
        for _ in range(2):
            s = connect(ep.port)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            busy.append(s)
            assert hanging.entered.acquire(timeout=5)
        late = connect(ep.port)
        busy.append(late)
        wait_for(lambda: closed_by_server([late]), 5, "the connection past the cap to be closed")
        assert ep.refused == 1
        hanging.release.set()
        for s in busy[:2]:
            s.settimeout(5)
            assert s.recv(4096).startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        hanging.release.set()
        for s in busy:
            s.close()
        ep.stop()


def test_keep_alive_head_and_methods(endpoint):
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=5)
    try:
        for _ in range(3):  # one connection, several requests
            conn.request("GET", "/healthz")
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"ok: event loop running\n")
            assert r.getheader("Cache-Control") == "no-store"
        conn.request("HEAD", "/metrics")
        r = conn.getresponse()
        assert r.status == 200 and r.read() == b"" and int(r.getheader("Content-Length")) > 0
        conn.request("GET", "/metrics?x=1")
        r = conn.getresponse()
        assert r.status == 200 and b"rekindle_nri_connected" in r.read()
        conn.request("GET", "/nope")
        r = conn.getresponse()
        assert (r.status, r.read()) == (404, b"not found: /metrics, /readyz, /healthz\n")
    finally:
        conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=5)
    try:
        conn.request("POST", "/metrics", body=b"x")
        r = conn.getresponse()
        assert r.status == 405 and r.getheader("Allow") == "GET, HEAD"
        assert r.getheader("Connection") == "close"  # its body is never read
    finally:
        conn.close()


@pytest.mark.parametrize("data,want", [
    (b"GARBAGE\r\n\r\n", b"HTTP/1.1 400 "),
    (b"GET /healthz HTTP/2\r\n\r\n", b"HTTP/1.1 400 "),
    (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * (httpd.MAX_HEAD + 10) + b"\r\n\r\n", b""),  # too long: closed
])
def test_malformed_or_oversized_requests_end_the_connection(endpoint, data, want):
    s = connect(endpoint.port)
    try:
        s.sendall(data)
        s.settimeout(5)
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        assert got.startswith(want) if want else got == b""
    finally:
        s.close()
    assert get(endpoint.port, "/healthz")[0] == 200


def test_parse_head():
    r = httpd.parse_head(b"GET /metrics?a=b HTTP/1.1\r\nAccept: text/plain\r\nConnection: close\r\n\r\n")
    assert r == httpd.Request("GET", "/metrics", "text/plain", keep_alive=False, has_body=False)
    r = httpd.parse_head(b"GET / HTTP/1.0\r\n\r\n")
    assert r is not None and not r.keep_alive
    r = httpd.parse_head(b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n")
    assert r is not None and r.keep_alive and r.has_body
    assert httpd.parse_head(b"GET / HTTP/1.1\r\nno colon\r\n\r\n") is None
    assert httpd.parse_head(b"GET http://x/ HTTP/1.1\r\n\r\n") is None


def test_bind_error_is_an_oserror():
    ep = HttpEndpoint("127.0.0.1", 0, Metrics().registry, Health())
    port = ep.start()
    try:
        with pytest.raises(OSError):
            HttpEndpoint("127.0.0.1", port, Metrics().registry, Health()).start()
    finally:
        ep.stop()


def test_a_large_metrics_reply_arrives_whole_before_the_connection_closes():
    """Replies are flushed to the kernel before the server closes: a /metrics page much larger
    than asyncio's write buffer arrives complete to a client that reads slowly."""
    registry = CollectorRegistry()

    class Big:
        def collect(self):
            g = GaugeMetricFamily("big", "many series", labels=["i"])
            for i in range(8000):
                g.add_metric([str(i)], i)
            yield g
    registry.register(Big())
    ep = HttpEndpoint("127.0.0.1", 0, registry, Health())
    ep.start()
    s = connect(ep.port)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        got = b""
        s.settimeout(5)
        while chunk := s.recv(65536):
            got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        length = int([h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")][0].split(b":")[1])
        assert length > 100_000 and len(body) == length
        assert body.rstrip().endswith(b'big{i="7999"} 7999.0')
    finally:
        s.close()
        ep.stop()
