"""Memory written with zeros (an engine's KV cache) is stored as nothing and comes back as zeros.

The source: a Python server holding 48 MiB of seeded bytes and 96 MiB it wrote with zeros (each
page touched, so CRIU dumps it). The checkpoint punches every whole zero chunk out of the bulk
file: the artifact takes about the seeded bytes; the restore reads none of the zero chunks
(filled: left as the untouched pages they are; streamed: zero pages mapped in) and the restored
server finds both parts as they were."""

from __future__ import annotations

import json
import sys

import pytest

from tests.e2e.test_checkpoint_restore import get, wait_status
from tests.e2e.test_cow_sharing import _stored
from tests.waiting import wait_for

ZEROS = r"""
import hashlib, os, random, socket
data = bytearray(random.Random(7).randbytes(48 << 20))
want = hashlib.sha256(data).hexdigest()
kv = bytearray(96 << 20)
for i in range(0, len(kv), 4096):  # written, so present: CRIU dumps each page
    kv[i] = 0
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8080))
srv.listen(8)
open(os.environ["REKINDLE_CONTROL_DIR"] + "/ready-for-checkpoint", "w").close()
while True:
    conn, _ = srv.accept()
    conn.recv(4096)
    body = (f"data={'ok' if hashlib.sha256(data).hexdigest() == want else 'bad'} "
            f"kv={'ok' if kv.count(0) == len(kv) else 'bad'} pid={os.getpid()}\n")
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    conn.close()
"""


@pytest.mark.parametrize("path", ["bulk", "stream"])
def test_zero_memory_is_stored_as_nothing_and_restored_as_zeros(sandbox, pod, plugin, path):
    from devtools.gpu import host_python_mounts
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": path}
    plugin.start()
    try:
        image, env = "localhost/rekindle/host-usr:1", {"PATH": "/usr/bin:/bin"}
        name = f"zeros-{path}"
        a = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name})
        sandbox.run_container(a, "app", image, command=[sys.executable, "-c", ZEROS],
                              mounts=host_python_mounts(), env=env)
        st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=120)
        assert st["phase"] == "published", st
        assert "data=ok kv=ok" in get(sandbox.cri.pod_ip(a.id), "/", 60.0)
        stored = _stored((plugin.store / "default" / name).resolve())
        print(f"artifact {name}: {stored}")
        assert stored["moved"] >= (48 + 96) << 20, stored  # the zeros were dumped and moved
        assert stored["bulk"] <= stored["moved"] - (90 << 20), stored  # but not stored
        # the checkpoint says so beside its phases
        timings = json.loads((plugin.control_dir(a.uid, "app") / "timings.json").read_text())
        pages = timings["pages"]
        assert pages["zero_bytes"] >= 90 << 20 and pages["moved_bytes"] >= (48 + 96) << 20, pages
        # and its status counts the bytes stored, not the files' sizes
        assert st["bytes"] == timings["stored_bytes"] <= stored["size"] - (90 << 20), (st, timings, stored)

        b = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name})
        sandbox.run_container(b, "app", image, command=[sys.executable, "-c", ZEROS],
                              mounts=host_python_mounts(), env=env)
        st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"}, timeout=120)
        assert st["phase"] == "restored", st
        got = wait_for(lambda: get(sandbox.cri.pod_ip(b.id), "/", 60.0), 60, "the restored server to answer",
                       ignore=(OSError,))
        assert "data=ok kv=ok" in got, got
    finally:
        plugin.kill()
        plugin.env = {}
        plugin.start()
