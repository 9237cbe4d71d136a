"""Ready-probes inside a real network namespace: the socket is the pod's, no thread stays there."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading

import pytest

from runtime.pod.probe import probe
from tests.waiting import wait_for

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("ready", flush=True)
s.serve_forever()
"""


@pytest.fixture
def netns():
    name = f"rk-probe-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def _thread_netns() -> set[str]:
    return {os.readlink(f"/proc/self/task/{tid}/ns/net") for tid in os.listdir("/proc/self/task")}


def test_probe_runs_in_the_pods_netns_and_leaves_no_thread_there(netns):
    with socket.socket() as host_side:
        host_side.bind(("127.0.0.1", 0))  # the same port on the host refuses connections
        port = host_side.getsockname()[1]
        server = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", SERVER, str(port)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            host_ns = _thread_netns()
            threads = threading.active_count()

            async def body():
                inside = await asyncio.gather(*(probe(f"/var/run/netns/{netns}", "http", "127.0.0.1", port,
                                                      "/healthz", timeout=2.0) for _ in range(8)))
                outside = await probe("", "tcp", "127.0.0.1", port, timeout=1.0)
                return inside, outside

            inside, outside = asyncio.run(body())
            assert inside == [True] * 8
            assert outside is False
            # The netns threads have handed their sockets over; they may take a moment to exit.
            wait_for(lambda: _thread_netns() == host_ns and threading.active_count() == threads, 2,
                     "the netns threads to exit", interval=0.01)
            assert len(host_ns) == 1 and _thread_netns() == host_ns, "a thread was left in the pod's netns"
            assert threading.active_count() == threads
        finally:
            server.kill()
            server.wait(5)
