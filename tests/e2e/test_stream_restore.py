"""The streamed restore path (REKINDLE_RESTORE_PATH=stream) through containerd, runc, CRIU's
--lazy-pages hand-off and the real plugin: the tree runs right after CRIU while its bulk pages
are served through userfaultfd, verified piece by piece."""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.test_checkpoint_restore import COUNTER, READY, SERVER, fields, get, wait_http, wait_status, warm_up
from tests.waiting import wait_for


@pytest.fixture
def streaming(plugin):
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": "stream"}
    plugin.start()
    yield plugin
    plugin.kill()
    plugin.env = {}
    plugin.start()


def _checkpoint(sandbox, pod, plugin, name: str, mib: int, command=SERVER, extra_env=None):
    a = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name})
    env = {**READY, "WARMUP_MIB": str(mib), "WARMUP_PASSES": "1", **(extra_env or {})}
    sandbox.run_container(a, "server", COUNTER, command=command, env=env)
    ip = sandbox.cri.pod_ip(a.id)
    warm_up(ip, plugin.control_dir(a.uid, "server") / "ready-for-checkpoint", timeout=60)
    st = wait_status(plugin, "default", a.name, "server", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st
    return ip


def test_streamed_restore_serves_the_memory_while_the_process_runs(sandbox, pod, streaming):
    plugin = streaming
    src = _checkpoint(sandbox, pod, plugin, "streamed", 200)  # four 64 MiB pieces
    warm = get(src, "/verify")
    assert "verify=ok" in warm
    b = pod("dst-streamed", annotations={"rekindle.dev/restore": "streamed"})
    sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "200"})
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"}, timeout=120)
    assert st["phase"] == "restored", st
    assert "stream" in st["timings"] and "fill" not in st["timings"], st["timings"]
    ip = sandbox.cri.pod_ip(b.id)
    wait_http(ip)
    assert fields(get(ip))["count"] == "4"
    assert get(ip, "/verify") == warm
    log = plugin.log()
    assert "stream: 200.0 MiB verified" in log or "MiB verified" in log, log[-3000:]
    assert "the bulk path instead of the streamed one" not in log


def _holders(marker: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace")
        except OSError:
            continue
        if "runtime.pages.holder" in argv and marker in argv:
            out.append(pid)
    return out


def test_plugin_killed_while_it_serves_kills_the_tree_and_the_pod_starts_cold_once(sandbox, pod, streaming):
    """The agent is SIGKILLed while the restored process runs with most of its memory not served
    yet (faults only: no install thread). The holder keeps the uffds, so the process blocks on
    its next fault instead of reading zero pages, and the holder kills it at once. The agent,
    restarted, rolls the rootfs back and fails that restore; the init starts the original
    command once. Nothing of the restore is left."""
    plugin = streaming
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": "stream", "REKINDLE_STREAM_THREADS": "0"}
    plugin.start()
    served = plugin.log().count("MiB verified")  # the plugin's log runs on across tests
    _checkpoint(sandbox, pod, plugin, "served-then-killed", 256)
    b = pod("dst-served-then-killed", annotations={"rekindle.dev/restore": "served-then-killed"})
    cid = sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "256", "WARMUP_PASSES": "1"})
    ip = sandbox.cri.pod_ip(b.id)
    wait_status(plugin, "default", b.name, "server", {"restoring"}, timeout=30)
    # The restored process answers while its warm-up memory is still unserved.
    wait_for(lambda: fields(get(ip, "/", 1.0))["count"] == "4", 60, "the restored process to answer",
             interval=0.05, ignore=(OSError,))
    assert plugin.log().count("MiB verified") == served  # the serve has not ended
    restored = _tree_in(sandbox, cid)
    assert restored
    plugin.kill()
    # Killed by the holder, before any agent is back: never left running on zero pages.
    wait_for(lambda: not any(_alive(p) for p in restored), 10, "the holder to kill the restored tree")
    wait_for(lambda: not _holders(b.uid), 10, "the holder to exit")
    plugin.start()
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"})
    assert st["phase"] == "cold-start" and "agent restarted during the restore" in st["reason"], st
    # Whatever answers now is the cold start (count 1), never the restored tree on zero pages.
    wait_http(ip, timeout=60)
    assert fields(get(ip))["count"] == "1"
    assert "verify=ok" in get(ip, "/verify")
    wait_for(lambda: not _holders(b.uid), 10, "the holder to exit")
    time.sleep(1)  # a second cold start or a leftover would show up by now
    out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ps -o comm | grep -cx counter-server"], timeout=10)
    assert out.out.strip() == "1", out
    logs = "\n".join(sandbox.cri.logs(cid))
    assert "verify=bad" not in logs and logs.count("cold start:") <= 1, logs[-2000:]


# A server holding 160 MiB of seeded bytes; GET /verify forks a child that hashes them (the
# child's memory arrives through the uffd of the FORK event) and the parent hashes them too.
FORKING = r"""
import hashlib, os, random, socket
data = bytearray(random.Random(7).randbytes(160 << 20))
want = hashlib.sha256(data).hexdigest()
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8080))
srv.listen(8)
open(os.environ["REKINDLE_CONTROL_DIR"] + "/ready-for-checkpoint", "w").close()
while True:
    conn, _ = srv.accept()
    conn.recv(4096)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, hashlib.sha256(data).hexdigest().encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(pid, 0)
    body = f"parent={'ok' if hashlib.sha256(data).hexdigest() == want else 'bad'} " \
           f"child={'ok' if child == want else 'bad'} pid={os.getpid()}\n"
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    conn.close()
"""


def test_a_tree_that_forks_after_a_streamed_restore_gets_its_memory_in_the_child_too(sandbox, pod, streaming):
    import sys

    from devtools.gpu import host_python_mounts
    plugin = streaming
    plugin.kill()
    # Faults only (no install thread): the fork surely comes while the parent's pages are
    # missing, so the child's pages can only come through the FORK event's uffd.
    plugin.env = {"REKINDLE_RESTORE_PATH": "stream", "REKINDLE_STREAM_THREADS": "0"}
    plugin.start()
    host_usr = "localhost/rekindle/host-usr:1"
    env = {"PATH": "/usr/bin:/bin"}
    a = pod("src-forking", annotations={"rekindle.dev/checkpoint": "forking"})
    sandbox.run_container(a, "app", host_usr, command=[sys.executable, "-c", FORKING],
                          mounts=host_python_mounts(), env=env)
    st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st
    b = pod("dst-forking", annotations={"rekindle.dev/restore": "forking"})
    sandbox.run_container(b, "app", host_usr, command=[sys.executable, "-c", FORKING],
                          mounts=host_python_mounts(), env=env)
    ip = sandbox.cri.pod_ip(b.id)
    wait_status(plugin, "default", b.name, "app", {"restoring"}, timeout=30)
    got = wait_for(lambda: get(ip, "/verify", 60.0), 120, "the restored tree to answer", interval=0.05,
                   ignore=(OSError,))
    assert "parent=ok child=ok" in got, got
    wait_for(lambda: "forked;" in plugin.log(), 10, "the FORK event in the plugin log")
    assert "parent=ok child=ok" in get(ip, "/verify", 60.0)  # a second child, after the first left


def test_a_flipped_byte_in_a_streamed_piece_kills_the_running_tree_and_the_pod_starts_cold(sandbox, pod, streaming):
    """The tree already runs when the install threads reach the third piece, which does not match
    its digest: none of its bytes is installed, the tree is killed, the init starts cold once."""
    plugin = streaming
    _checkpoint(sandbox, pod, plugin, "flipped-piece", 200)
    bulk = sorted((plugin.store / "default" / "flipped-piece" / "bulk").glob("pages-*.bulk"))[0]
    with open(bulk, "r+b") as f:
        f.seek(130 << 20)
        byte = f.read(1)
        f.seek(130 << 20)
        f.write(bytes([byte[0] ^ 0xFF]))
    b = pod("dst-flipped-piece", annotations={"rekindle.dev/restore": "flipped-piece"})
    cid = sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "200", "WARMUP_PASSES": "1"})
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"}, timeout=120)
    assert st["phase"] == "cold-start" and "does not match its digest" in st["reason"], st
    ctl = plugin.control_dir(b.uid, "server")
    wait_for(lambda: (ctl / "cold-start").exists(), 30, "the init's cold start")  # after the plugin's record
    assert "does not match its digest" in (ctl / "cold-start").read_text()
    ip = sandbox.cri.pod_ip(b.id)
    wait_http(ip, timeout=60)
    assert fields(get(ip))["count"] == "1"
    assert "verify=ok" in get(ip, "/verify")
    time.sleep(1)
    out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ps -o comm | grep -cx counter-server"], timeout=10)
    assert out.out.strip() == "1", out
    wait_for(lambda: not _holders(b.uid), 10, "the holder to exit")


def _tree_in(sandbox, cid: str) -> list[int]:
    """Host pids of the container's processes but its init."""
    from runtime.container.containers import resolve_container
    from runtime.container.namespaces import used_pids
    info = resolve_container(str(sandbox.state_dir), cid)
    return [host for ns, host in used_pids(info.namespaces["pid"].inode).items() if ns != 1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_three_streamed_restores_of_one_artifact_at_once(sandbox, pod, streaming):
    """Three servers and holders side by side, each serving its own tree from the same files."""
    plugin = streaming
    src = _checkpoint(sandbox, pod, plugin, "streamed-thrice", 100)
    warm = get(src, "/verify")
    pods = [pod(f"dst-streamed-thrice-{i}", annotations={"rekindle.dev/restore": "streamed-thrice"}) for i in range(3)]
    cids = [sandbox.cri.create_container(p, "server", COUNTER, command=SERVER) for p in pods]
    for cid in cids:
        sandbox.cri.start_container(cid)
    for p in pods:
        st = wait_status(plugin, "default", p.name, "server", {"restored", "cold-start"}, timeout=120)
        assert st["phase"] == "restored", st
        assert "stream" in st["timings"], st["timings"]
        ip = sandbox.cri.pod_ip(p.id)
        wait_http(ip)
        assert fields(get(ip))["count"] == "4"
        assert get(ip, "/verify") == warm
    for p in pods:
        wait_for(lambda: not _holders(p.uid), 10, "the holders to exit")


def test_a_containerd_restart_while_it_serves_lets_the_serve_finish(sandbox, pod, streaming):
    """containerd restarts while the restored process runs with most of its memory not served
    (faults only): the plugin reconnects, the serve goes on, and once the process has touched
    all of it the pod is restored with the source's memory, not started cold."""
    plugin = streaming
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": "stream", "REKINDLE_STREAM_THREADS": "0"}
    plugin.start()
    served = plugin.log().count("MiB verified")
    src = _checkpoint(sandbox, pod, plugin, "served-ctrd-restart", 128)
    warm = get(src, "/verify")
    b = pod("dst-served-ctrd-restart", annotations={"rekindle.dev/restore": "served-ctrd-restart"})
    cid = sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "128", "WARMUP_PASSES": "1"})
    ip = sandbox.cri.pod_ip(b.id)
    wait_status(plugin, "default", b.name, "server", {"restoring"}, timeout=30)
    wait_for(lambda: fields(get(ip, "/", 1.0))["count"] == "4", 60, "the restored process to answer",
             interval=0.05, ignore=(OSError,))
    assert plugin.log().count("MiB verified") == served  # mid-serve
    synced = plugin.log().count("synchronized:")
    sandbox.sandbox.restart()
    plugin.wait_log("synchronized:", count=synced + 1, timeout=60)
    assert get(ip, "/verify", 60.0) == warm  # touches every page: the serve ends
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"}, timeout=60)
    assert st["phase"] == "restored", st
    assert plugin.log().count("MiB verified") == served + 1
    out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ps -o comm | grep -cx counter-server"], timeout=10)
    assert out.out.strip() == "1", out
    assert not (plugin.control_dir(b.uid, "server") / "cold-start").exists()
    wait_for(lambda: not _holders(b.uid), 10, "the holder to exit")


# A tenant that storms once restored: it holds STORM_MIB of seeded bytes, says ready, and waits
# for its restore (the rootfs-pending file the restore keeps in its control dir until it is final:
# never there in the source). Then, while its memory is still being served, it forks (children
# that exit at once) or moves those bytes away and back with mremap, in a loop until the restore
# is final or it is killed.
STORM = r"""
import ctypes, mmap, os, random, sys, time
mode, size = sys.argv[1], int(os.environ["STORM_MIB"]) << 20
ctl = os.environ["REKINDLE_CONTROL_DIR"]
m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m[:] = random.Random(7).randbytes(size)
open(ctl + "/ready-for-checkpoint", "w").close()
pending = ctl + "/rootfs-pending"
while not os.path.exists(pending):
    time.sleep(0.002)
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = libc.mremap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
spot = libc.mmap(None, size, 0, 0x22, -1, 0)
rounds, end = 0, time.monotonic() + 600
while os.path.exists(pending) and time.monotonic() < end:
    for _ in range(20):
        if mode == "fork":
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        else:
            assert libc.mremap(addr, size, size, 3, spot) == spot, ctypes.get_errno()
            assert libc.mremap(spot, size, size, 3, addr) == addr, ctypes.get_errno()
        rounds += 1
print(f"storm over after {rounds} rounds", flush=True)
while True:
    time.sleep(3600)
"""


def _fd_count(pid: int) -> int:
    """Open fds of ``pid`` and its descendants."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return total


def test_fork_and_mremap_storms_of_restored_tenants_end_their_serves_and_leave_others_alone(sandbox, pod, streaming):
    """Two tenants storm while their memory is served, one with forks, one with mremap: each
    serve ends within its artifact's own work (restored) or fails closed (the tree killed, the
    pod started cold with the reason), the plugin's fds come back, and an unrelated restore
    beside them gets a job slot and is restored (its time is printed beside its time alone)."""
    import sys

    from devtools.gpu import host_python_mounts
    plugin = streaming
    host_usr, mib = "localhost/rekindle/host-usr:1", 96
    env = {"PATH": "/usr/bin:/bin", "STORM_MIB": str(mib)}

    def storm_pod(name: str, mode: str, annotations: dict[str, str]):
        p = pod(name, annotations=annotations)
        sandbox.run_container(p, "app", host_usr, command=[sys.executable, "-c", STORM, mode],
                              mounts=host_python_mounts(), env=env)
        return p

    for mode in ("fork", "mremap"):
        storm_pod(f"src-storm-{mode}", mode, {"rekindle.dev/checkpoint": f"storm-{mode}"})
    _checkpoint(sandbox, pod, plugin, "storm-bystander", 64)
    for mode in ("fork", "mremap"):
        st = wait_status(plugin, "default", f"src-storm-{mode}", "app", {"published", "checkpoint-failed"},
                         timeout=120)
        assert st["phase"] == "published", st

    def bystander(name: str) -> float:
        b = pod(name, annotations={"rekindle.dev/restore": "storm-bystander"})
        t0 = time.monotonic()
        sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "64"})
        st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"}, timeout=120)
        assert st["phase"] == "restored", st
        return time.monotonic() - t0

    alone = bystander("dst-bystander-alone")
    fds = _fd_count(plugin.proc.pid)
    storms = [storm_pod(f"dst-storm-{mode}", mode, {"rekindle.dev/restore": f"storm-{mode}"})
              for mode in ("fork", "mremap")]
    for p in storms:
        wait_status(plugin, "default", p.name, "app", {"restoring"}, timeout=30)
    beside = bystander("dst-bystander-beside")
    ends = {}
    for p in storms:
        # before: the fork storm wedged its serve (the holder and the agent each blocked in a send)
        # and the mremap storm kept its serve going for as long as it stormed
        st = wait_status(plugin, "default", p.name, "app", {"restored", "cold-start"}, timeout=120)
        ends[p.name] = st
        if st["phase"] == "cold-start":
            assert any(why in st["reason"] for why in ("forked more than", "read and hashed", "installed to serve",
                                                       "installs refused", "not served within")), st
        else:
            served = st["timings"].get("stream", {})
            print(f"{p.name}: served {served}")
        wait_for(lambda: not _holders(p.uid), 30, "the holder to exit")
    wait_for(lambda: _fd_count(plugin.proc.pid) <= fds + 8, 30, "the plugin's fds to come back",
             interval=0.2)
    print(f"bystander restore: {alone:.2f}s alone, {beside:.2f}s beside two storms "
          f"(this shared 2-core machine); storms: "
          + "; ".join(f"{n}: {s['phase']} {s.get('reason', '')[:120]}" for n, s in ends.items()))


def test_a_fork_storm_while_every_page_is_owed_fails_the_serve_closed_at_the_fork_limit(sandbox, pod, streaming):
    """Faults only (no install thread), so every page stays owed for as long as the tenant does
    not touch it, and every fork's child is owed them too: the storm goes on until the live
    children pass the limit, and the serve fails closed (before: after some 560 forks the holder
    and then the agent blocked in their sends, the serve wedged and the pod stayed restoring)."""
    import sys

    from devtools.gpu import host_python_mounts
    plugin = streaming
    plugin.kill()
    plugin.env = {"REKINDLE_RESTORE_PATH": "stream", "REKINDLE_STREAM_THREADS": "0"}
    plugin.start()
    host_usr = "localhost/rekindle/host-usr:1"
    env = {"PATH": "/usr/bin:/bin", "STORM_MIB": "64"}
    a = pod("src-storm-owed", annotations={"rekindle.dev/checkpoint": "storm-owed"})
    sandbox.run_container(a, "app", host_usr, command=[sys.executable, "-c", STORM, "fork"],
                          mounts=host_python_mounts(), env=env)
    st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st
    fds = _fd_count(plugin.proc.pid)
    b = pod("dst-storm-owed", annotations={"rekindle.dev/restore": "storm-owed"})
    sandbox.run_container(b, "app", host_usr, command=[sys.executable, "-c", STORM, "fork"],
                          mounts=host_python_mounts(), env=env)
    st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"}, timeout=120)
    assert st["phase"] == "cold-start" and "forked more than 128 processes" in st["reason"], st
    wait_for(lambda: not _holders(b.uid), 30, "the holder to exit")
    wait_for(lambda: _fd_count(plugin.proc.pid) <= fds + 8, 30, "the plugin's fds to come back", interval=0.2)
    print(f"fork storm, faults only: {st['reason'][:200]}; plugin fds {fds} before, "
          f"{_fd_count(plugin.proc.pid)} after")
