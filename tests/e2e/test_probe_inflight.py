"""The plugin's own tcp:// ready probe never leaves a connection for the checkpoint to find: a
workload that listens at once but accepts late (busy before it serves, a large backlog) is
checkpointed, not refused by CRIU with "In-flight connection"."""

from __future__ import annotations

import sys

from devtools.gpu import host_python_mounts
from tests.e2e.test_checkpoint_restore import wait_status
from tests.waiting import wait_for

HOST_USR = "localhost/rekindle/host-usr:1"

# Listens first, then is busy for ACCEPT_AFTER seconds (loading, say) before its accept loop:
# meanwhile connections complete in the kernel and wait in the backlog. Each one it takes it
# reads until the peer goes, then closes.
LATE_ACCEPT = r"""
import os, socket, sys, time
ls = socket.socket()
ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", 8080))
ls.listen(128)
print("listening", flush=True)
time.sleep(float(os.environ["ACCEPT_AFTER"]))
print("accepting", flush=True)
while True:
    conn, peer = ls.accept()
    try:
        while conn.recv(4096):
            pass
    except OSError as exc:
        print("connection from", peer, "ended:", exc, flush=True)
    conn.close()
"""


def test_tcp_probe_of_a_workload_that_accepts_late_does_not_fail_the_checkpoint(sandbox, pod, plugin):
    a = pod("late-accept", annotations={"rekindle.dev/checkpoint": "late-accept",
                                        "rekindle.dev/ready-probe": "tcp://:8080"})
    cid = sandbox.run_container(a, "app", HOST_USR, command=[sys.executable, "-c", LATE_ACCEPT],
                                mounts=host_python_mounts(),
                                env={"PATH": "/usr/bin:/bin", "ACCEPT_AFTER": "4", "PYTHONUNBUFFERED": "1"})
    st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=90)
    assert st["phase"] == "published", st["reason"]
    assert "In-flight connection" not in plugin.log()
    # Ready only after the workload started accepting: the probe's connection was taken, not queued.
    wait_for(lambda: any("accepting" in line for line in sandbox.cri.logs(cid)), 10,
             "the workload's log to say it accepts", interval=0.1)
