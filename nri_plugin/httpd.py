"""The plugin's HTTP endpoint: ``/metrics`` (Prometheus), ``/readyz`` and ``/healthz``.

One small threaded server on its own daemon threads, never on the event loop: a slow scraper
or a hung store filesystem (``rekindle_store_free_bytes`` is read at scrape time) cannot delay
an NRI reply. ``/readyz`` and ``/healthz`` answer 200 or 503 with a one-line reason
(``nri_plugin.health``). GET and HEAD only; anything else is 404/405.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from .health import Health

log = logging.getLogger(__name__)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    registry: CollectorRegistry
    health: Health


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:  # one line per scrape is noise
        log.debug("http %s", fmt % args)

    def _send(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            try:
                body = encoder(self.server.registry)
            except Exception as exc:  # noqa: BLE001 - a failed collector is a 500, not a dead server
                log.warning("metrics collection failed: %s", exc)
                self._send(500, f"metrics collection failed: {exc}\n".encode())
                return
            self._send(200, body, content_type)
        elif path in ("/readyz", "/healthz"):
            ok, why = self.server.health.ready() if path == "/readyz" else self.server.health.live()
            self._send(200 if ok else 503, f"{'ok' if ok else 'not ok'}: {why}\n".encode())
        else:
            self._send(404, b"not found: /metrics, /readyz, /healthz\n")

    do_HEAD = do_GET

    def do_POST(self) -> None:
        self._send(405, b"method not allowed\n")

    do_PUT = do_DELETE = do_PATCH = do_POST


class HttpEndpoint:
    """``start()`` binds (an OSError says why it cannot) and serves on a daemon thread."""

    def __init__(self, address: str, port: int, registry: CollectorRegistry, health: Health) -> None:
        self.address = address
        self.port = port
        self._registry = registry
        self._health = health
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        cls = _Server6 if ":" in self.address else _Server
        server = cls((self.address, self.port), _Handler)
        server.registry = self._registry
        server.health = self._health
        self._server = server
        self.port = server.server_address[1]
        self._thread = threading.Thread(target=server.serve_forever, name="rekindle-http", daemon=True)
        self._thread.start()
        log.info("metrics and health on http://%s:%d (/metrics, /readyz, /healthz)", self.address or "0.0.0.0",
                 self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
