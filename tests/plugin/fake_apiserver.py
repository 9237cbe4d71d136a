"""An http.server in the test process playing the Kubernetes API server for the plugin's
reports: it records every request (method, path, content type, JSON body) and answers with a
status the test chooses (``answer``: a fixed code, or a list consumed one per request), or
holds the request for ``hold`` seconds (an API server that hangs). The plugin reaches it through
a kubeconfig file (``kubeconfig(path)``), exactly as it would reach a real one.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml


@dataclass
class Request:
    method: str
    path: str
    content_type: str
    body: Any
    auth: str


class FakeApiServer:
    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.answer: int | list[int] = 201
        self.hold = 0.0
        self.arrived = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                req = Request(self.command, self.path, self.headers.get("Content-Type", ""),
                              json.loads(raw) if raw else None, self.headers.get("Authorization", ""))
                with server.arrived:
                    server.requests.append(req)
                    server.arrived.notify_all()
                    code = server.answer.pop(0) if isinstance(server.answer, list) else server.answer
                if server.hold:
                    time.sleep(server.hold)
                if code < 300:
                    body: Any = req.body if req.method == "POST" else {
                        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "default"}}
                else:
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                            "reason": "Injected", "message": f"injected {code}"}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_PATCH = do_GET = do_PUT = _handle

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def kubeconfig(self, path: Path, token: str = "test-token") -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "plugin", "user": {"token": token}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "plugin"}}],
            "current-context": "fake",
        }))
        return path

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Request]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{len(self.requests)} requests after {timeout}s, wanted {count}: "
                                         f"{[(r.method, r.path) for r in self.requests]}")
                self.arrived.wait(left)
            return list(self.requests)
