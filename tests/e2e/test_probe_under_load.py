"""tcp:// ready probes of sources under load never leave their own connection for the
checkpoint (CRIU's "In-flight connection"): servers with a second SO_REUSEPORT listener that is
busy, like a prefork server's slow worker, where a probe connection the kernel hashed to it
waits in that listener's queue while a later one is taken by the quick one; several probed and
checkpointed at once, beside a server that slow clients keep busy (its clients' queued
connections are skipped by the dump: ``--skip-in-flight``). ``REKINDLE_PROBE_LOAD_ROUNDS``
(default 1) rounds of 5 probed sources."""

from __future__ import annotations

import os
import socket
import sys
import threading

from devtools.gpu import host_python_mounts
from tests.e2e.test_checkpoint_restore import wait_status

HOST_USR = "localhost/rekindle/host-usr:1"
ROUNDS = int(os.environ.get("REKINDLE_PROBE_LOAD_ROUNDS", "1"))  # 4 sources a round

SERVER = r"""
import os, socket, threading, time
def listener(reuseport):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    ls.bind(("0.0.0.0", 9001))
    ls.listen(128)
    return ls
def drain(c):
    try:
        while c.recv(4096):
            pass
    except OSError:
        pass
    c.close()
def serve(ls, every):
    while True:
        time.sleep(every)  # busy between accepts
        c, _ = ls.accept()
        threading.Thread(target=drain, args=(c,), daemon=True).start()
if os.environ["MODE"] == "reuseport":
    quick, busy = listener(True), listener(True)
    threading.Thread(target=serve, args=(busy, 2.5), daemon=True).start()
    serve(quick, 0.0)
else:
    serve(listener(False), 0.3)
"""


class SlowClients:
    """From the host: one connection a second to each address, each sending a byte a second."""

    def __init__(self, ips: list[str]) -> None:
        self.ips = ips
        self.stop = threading.Event()
        self.socks: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(1.0):
            for ip in self.ips:
                try:
                    s = socket.create_connection((ip, 9001), timeout=1)
                    s.setblocking(False)
                    self.socks.append(s)
                except OSError:
                    pass
            for s in list(self.socks):
                try:
                    s.send(b"x")
                except OSError:
                    self.socks.remove(s)
                    s.close()

    def __enter__(self) -> SlowClients:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.socks:
            s.close()


def test_tcp_probed_sources_under_load_are_checkpointed(sandbox, pod, plugin):
    failures: list[str] = []
    client_skips: list[int] = []
    for r in range(ROUNDS):
        pods = []
        for i, mode in enumerate(("reuseport",) * 4 + ("loaded",)):
            ann = {"rekindle.dev/checkpoint": f"probe-load-{r}-{i}", "rekindle.dev/ready-probe": "tcp://127.0.0.1:9001"}
            p = pod(f"probe-load-{r}-{i}", annotations=ann)
            sandbox.run_container(p, "app", HOST_USR, command=[sys.executable, "-c", SERVER],
                                  mounts=host_python_mounts(), env={"PATH": "/usr/bin:/bin", "MODE": mode})
            pods.append((p, mode))
        loaded = [sandbox.cri.pod_ip(p.id) for p, mode in pods if mode == "loaded"]
        with SlowClients(loaded):  # the load: a server slow clients keep busy
            for p, mode in pods:
                st = wait_status(plugin, "default", p.name, "app", {"published", "checkpoint-failed"}, timeout=120)
                if st["phase"] != "published":
                    failures.append(f"{p.name} ({mode}): {st['reason'][-300:]}")
                    continue
                # CRIU skips a client's queued connection (the loaded server's); a probe's is
                # never there to skip: only the probes connect to the reuseport servers.
                skipped = [line for log in plugin.state_dir.glob(f"logs/checkpoint-default-{p.name}-*/dump.log")
                           for line in log.read_text(errors="replace").splitlines() if "Skipping in-flight" in line]
                if mode == "reuseport" and skipped:
                    failures.append(f"{p.name} ({mode}): a probe connection was in flight: {skipped}")
                if mode == "loaded":
                    client_skips.append(len(skipped))
        for p, _mode in pods:
            sandbox.cri.stop_pod(p.id)
            sandbox.cri.remove_pod(p.id)
    print(f"{4 * ROUNDS} reuseport sources and {ROUNDS} loaded, {len(failures)} failures; "
          f"clients' queued connections skipped per loaded checkpoint: {client_skips}")
    assert not failures, "\n".join(failures)
