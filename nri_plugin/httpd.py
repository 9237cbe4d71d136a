"""The plugin's HTTP endpoint: ``/metrics`` (Prometheus), ``/readyz`` and ``/healthz``.

Any pod that can reach the port is a client, so the server's cost is bounded whatever they do:

- one asyncio event loop on its own daemon thread (never the plugin's loop: a slow scraper
  cannot delay an NRI reply) holds every connection; a connection costs no thread;
- at most ``max_connections`` connections open, and at most ``max_per_client`` from one
  address. A connection past either cap closes, at once, the oldest connection of that scope
  that is still waiting for its request (idle: nothing asked yet, or between keep-alive
  requests); when none is waiting (all are being answered), the new one is closed unanswered.
  So one client opening a thousand idle connections holds ``max_per_client`` of them and
  displaces only its own, and a probe, which sends its request at once, gets through;
- a client has ``read_timeout`` seconds to send a whole request head (``MAX_HEAD`` bytes at
  most), on a new connection and again between keep-alive requests; then it is closed;
- ``/readyz`` and ``/healthz`` are answered on the loop itself (a lock and a clock), so they
  answer while ``/metrics`` is slow; ``/metrics`` is collected on ``COLLECTOR_THREADS`` threads
  (``rekindle_store_free_bytes`` reads the store filesystem, which may hang) and answers 503
  after ``metrics_timeout`` seconds.

Threads: the loop's and at most ``COLLECTOR_THREADS``, however many clients. GET and HEAD
only; anything else is 404/405. No request bodies: a request announcing one is answered and
its connection closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from .health import Health

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64     # a scraper or two and the kubelet's probes need a handful
MAX_PER_CLIENT = 8       # connections from one address (a pod, or the node: kubelet, host scrapers)
READ_TIMEOUT = 5.0       # seconds to send one request head (the probes' timeouts are 3-5 s)
METRICS_TIMEOUT = 10.0   # seconds a /metrics collection may take before 503
MAX_HEAD = 8192          # bytes of request line and headers
COLLECTOR_THREADS = 2

_TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    accept: str
    keep_alive: bool
    has_body: bool


def parse_head(head: bytes) -> Request | None:
    """The request line and headers up to the blank line; None when that is not HTTP/1.x."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[1].startswith("/"):
        return None
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    connection = headers.get("connection", "").lower()
    keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
    has_body = "transfer-encoding" in headers or headers.get("content-length", "0") != "0"
    return Request(method, target.split("?", 1)[0], headers.get("accept", ""), keep_alive, has_body)


def _response(code: int, body: bytes, content_type: str, keep_alive: bool, head_only: bool,
              extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    lines = [f"HTTP/1.1 {code} {HTTPStatus(code).phrase}",
             f"Content-Type: {content_type}",
             f"Content-Length: {len(body)}",
             "Cache-Control: no-store",
             f"Connection: {'keep-alive' if keep_alive else 'close'}"]
    lines += [f"{k}: {v}" for k, v in extra]
    out = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return out if head_only else out + body


class _Conn:
    """One accepted connection: who it is from and how to close it."""

    __slots__ = ("peer", "transport")

    def __init__(self, peer: str, transport: asyncio.WriteTransport) -> None:
        self.peer = peer
        self.transport = transport


class HttpEndpoint:
    """``start()`` binds (an OSError says why it cannot) and serves on a daemon thread."""

    def __init__(self, address: str, port: int, registry: CollectorRegistry, health: Health, *,
                 max_connections: int = MAX_CONNECTIONS, max_per_client: int = MAX_PER_CLIENT,
                 read_timeout: float = READ_TIMEOUT, metrics_timeout: float = METRICS_TIMEOUT) -> None:
        self.address = address
        self.port = port
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.read_timeout = read_timeout
        self.metrics_timeout = metrics_timeout
        self._registry = registry
        self._health = health
        # Touched on the loop's thread only.
        self._open: dict[_Conn, None] = {}
        self._waiting: dict[_Conn, None] = {}  # insertion order: the longest waiting first
        self._per_peer: Counter[str] = Counter()
        self.refused = 0   # closed unanswered at accept: every connection of its scope was busy
        self.displaced = 0  # waiting connections closed to make room for a new one
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._collectors: concurrent.futures.ThreadPoolExecutor | None = None
        self._failed: OSError | None = None

    @property
    def open_connections(self) -> int:
        """Connections open now (kept on the loop's thread; a snapshot elsewhere)."""
        return len(self._open)

    def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.address, self.port))
            sock.listen(128)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        self._collectors = concurrent.futures.ThreadPoolExecutor(COLLECTOR_THREADS, "rekindle-metrics")
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock, started), name="rekindle-http", daemon=True)
        self._thread.start()
        started.wait()
        if self._failed is not None:
            raise self._failed
        log.info("metrics and health on http://%s:%d (/metrics, /readyz, /healthz)", self.address or "0.0.0.0",
                 self.port)
        return self.port

    def stop(self) -> None:
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None:
            loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self._collectors is not None:
            self._collectors.shutdown(wait=False, cancel_futures=True)  # a hung collection keeps its thread
            self._collectors = None

    # ------------------------------------------------------------------ the loop's thread
    def _run(self, sock: socket.socket, started: threading.Event) -> None:
        try:
            asyncio.run(self._serve(sock, started))
        except OSError as exc:  # before serving: start() raises it
            self._failed = exc
            sock.close()
        finally:
            started.set()

    async def _serve(self, sock: socket.socket, started: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._client, sock=sock, limit=MAX_HEAD)
        started.set()
        async with server:
            await self._stopping.wait()
            server.close()
            for conn in list(self._open):
                self._close(conn)

    def _admit(self, conn: _Conn) -> bool:
        """Room for conn, displacing the longest-waiting connection of a full scope; False: none."""
        if self._per_peer[conn.peer] >= self.max_per_client and not self._displace(conn.peer):
            return False
        if len(self._open) >= self.max_connections and not self._displace(None):
            return False
        self._open[conn] = None
        self._per_peer[conn.peer] += 1
        return True

    def _displace(self, peer: str | None) -> bool:
        victim = next((c for c in self._waiting if peer is None or c.peer == peer), None)
        if victim is None:
            return False
        self.displaced += 1
        self._close(victim)
        return True

    def _close(self, conn: _Conn) -> None:
        self._waiting.pop(conn, None)
        if conn in self._open:
            del self._open[conn]
            self._per_peer[conn.peer] -= 1
            if not self._per_peer[conn.peer]:
                del self._per_peer[conn.peer]
        conn.transport.abort()  # its reader sees EOF; nothing buffered is sent

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        conn = _Conn(str(peer[0]) if peer else "", writer.transport)
        if not self._admit(conn):
            self.refused += 1
            writer.transport.abort()
            return
        # drain() returns only once the reply is all in the kernel: closing with abort()
        # afterwards loses nothing, and a client that does not read hits the timeout.
        writer.transport.set_write_buffer_limits(high=0)
        try:
            await self._serve_requests(conn, reader, writer)
        except (TimeoutError, ConnectionError):
            pass  # a client that does not read its reply
        finally:
            self._close(conn)

    async def _serve_requests(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            self._waiting[conn] = None
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return  # too slow, too long, or gone (or displaced)
            if conn not in self._open:
                return  # displaced while its head arrived
            self._waiting.pop(conn, None)
            request = parse_head(head)
            if request is None:
                writer.write(_response(400, b"bad request\n", _TEXT, False, False))
                await asyncio.wait_for(writer.drain(), self.read_timeout)
                return
            keep_alive = request.keep_alive and not request.has_body
            code, body, content_type, extra = await self._answer(request)
            writer.write(_response(code, body, content_type, keep_alive, request.method == "HEAD", extra))
            await asyncio.wait_for(writer.drain(), self.read_timeout)
            if not keep_alive:
                return

    async def _answer(self, request: Request) -> tuple[int, bytes, str, tuple[tuple[str, str], ...]]:
        if request.method not in ("GET", "HEAD"):
            return 405, b"method not allowed\n", _TEXT, (("Allow", "GET, HEAD"),)
        if request.path == "/metrics":
            code, body, content_type = await self._metrics(request.accept)
            return code, body, content_type, ()
        if request.path in ("/readyz", "/healthz"):
            ok, why = self._health.ready() if request.path == "/readyz" else self._health.live()
            return 200 if ok else 503, f"{'ok' if ok else 'not ok'}: {why}\n".encode(), _TEXT, ()
        return 404, b"not found: /metrics, /readyz, /healthz\n", _TEXT, ()

    async def _metrics(self, accept: str) -> tuple[int, bytes, str]:
        encoder, content_type = choose_encoder(accept)
        assert self._collectors is not None
        future = asyncio.get_running_loop().run_in_executor(self._collectors, encoder, self._registry)
        try:
            body = await asyncio.wait_for(future, self.metrics_timeout)
        except TimeoutError:
            log.warning("metrics collection took over %.0fs (a hung store filesystem?)", self.metrics_timeout)
            return 503, f"metrics collection took over {self.metrics_timeout:.0f}s\n".encode(), _TEXT
        except Exception as exc:  # noqa: BLE001 - a failed collector is a 500, not a dead server
            log.warning("metrics collection failed: %s", exc)
            return 500, f"metrics collection failed: {exc}\n".encode(), _TEXT
        return 200, body, content_type
