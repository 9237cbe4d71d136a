"""Shared anonymous memory through the plugin (containerd 1.7 + runc + CRIU + CNI): the shape of an
engine's pinned host buffers (``MAP_SHARED|MAP_ANONYMOUS``), here shared by a server and the worker
it forked. CRIU dumps it as a shared segment; the split moves its pages to a bulk file of their
own (the checkpoint's byte counts say so), every path but the stock one fills them before the tree
runs (``fill_shared``), the stock one hands them back to CRIU, and the restored pair still shares
the buffer: a byte the worker writes after the restore is the server's too."""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.test_checkpoint_restore import get, wait_status
from tests.waiting import wait_for

PAIR = r"""
import hashlib, mmap, os, random, socket, time
buf = mmap.mmap(-1, 48 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
buf[:] = random.Random(5).randbytes(48 << 20)
want = hashlib.sha256(buf).hexdigest()
r, w = os.pipe()
if os.fork() == 0:  # the worker: on a byte from the server, writes the buffer's last byte
    os.close(w)
    while os.read(r, 1):
        buf[-1] = (buf[-1] + 1) % 256
    os._exit(0)
os.close(r)
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8080))
srv.listen(8)
open(os.environ["REKINDLE_CONTROL_DIR"] + "/ready-for-checkpoint", "w").close()
while True:
    conn, _ = srv.accept()
    req = conn.recv(4096)
    if b"/poke" in req:
        before = buf[-1]
        os.write(w, b"x")
        deadline = time.monotonic() + 10  # the worker's write, seen through the shared pages
        while buf[-1] == before and time.monotonic() < deadline:
            time.sleep(0.001)
        body = f"shared={'yes' if buf[-1] == (before + 1) % 256 else 'no'}\n"
        buf[-1] = before
    else:
        body = f"data={'ok' if hashlib.sha256(buf).hexdigest() == want else 'bad'}\n"
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    conn.close()
"""
IMAGE, ENV = "localhost/rekindle/host-usr:1", {"PATH": "/usr/bin:/bin"}


@pytest.mark.parametrize("path", ["auto", "bulk", "stream", "stock"])
def test_shared_anonymous_memory_moves_to_the_bulk_path_and_stays_shared(sandbox, pod, plugin, path):
    from devtools.gpu import host_python_mounts
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": path}
    plugin.start()
    try:
        name = f"shared-{path}"
        a = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name})
        sandbox.run_container(a, "app", IMAGE, command=[sys.executable, "-c", PAIR],
                              mounts=host_python_mounts(), env=ENV)
        st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=120)
        assert st["phase"] == "published", st
        pages = json.loads((plugin.control_dir(a.uid, "app") / "timings.json").read_text())["pages"]
        assert pages["shared_bytes"] >= 48 << 20, pages  # the buffer, as CRIU dumped it
        assert pages["shared_moved_bytes"] >= 48 << 20, pages  # all of it to its bulk file
        version = (plugin.store / "default" / name).resolve()
        assert [p.stat().st_size for p in version.glob("bulk/shmem-*.bulk")] >= [48 << 20], list(version.glob("bulk/*"))
        assert get(sandbox.cri.pod_ip(a.id), "/", 30.0).startswith("data=ok")

        b = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name})
        sandbox.run_container(b, "app", IMAGE, command=[sys.executable, "-c", PAIR],
                              mounts=host_python_mounts(), env=ENV)
        st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"}, timeout=120)
        assert st["phase"] == "restored", st
        ip = sandbox.cri.pod_ip(b.id)
        got = wait_for(lambda: get(ip, "/", 30.0), 60, "the restored server to answer", ignore=(OSError,))
        assert got.startswith("data=ok"), got
        assert get(ip, "/poke", 30.0).startswith("shared=yes")
        restored = json.loads((plugin.control_dir(b.uid, "app") / "timings.json").read_text())
        assert ("fill_shared" in restored["restore"]) == (path != "stock"), restored
    finally:
        plugin.kill()
        plugin.env = {}
        plugin.start()
