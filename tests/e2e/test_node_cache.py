"""The node cache through the plugin: the first restore of a version writes it, later ones map
and fill from it (no bulk byte read from the store), pods restored from one entry share its
pages; a changed entry is dropped and made again, a half-written one (its writer killed) is
swept and never used, and the byte bound evicts the least recently used entry.

The workload holds 96 MiB of seeded bytes in one anonymous mapping and answers their hash;
``--map-ranges all`` maps that range from the cache (``driver``, the default, maps only the
CUDA driver's host copy, which a CPU workload has not)."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from tests.e2e.test_checkpoint_restore import get, wait_status
from tests.e2e.test_stream_restore import _alive, _tree_in
from tests.waiting import wait_for

# The server both workloads run on their ``data``: its hash, and a write on /write.
SERVE = r"""
want = hashlib.sha256(data).hexdigest()
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", 8080))
srv.listen(8)
open(os.environ["REKINDLE_CONTROL_DIR"] + "/ready-for-checkpoint", "w").close()
while True:
    conn, _ = srv.accept()
    req = conn.recv(4096)
    if b"/write" in req:
        data[0] ^= 1; data[0] ^= 1  # a write: its page becomes the process's own
    body = f"{'ok' if hashlib.sha256(data).hexdigest() == want else 'bad'} {want[:16]}\n"
    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body.encode()))
    conn.close()
"""
HOLDER = r"""
import hashlib, os, random, socket
data = bytearray(random.Random(11).randbytes(96 << 20))
""" + SERVE
IMAGE, ENV = "localhost/rekindle/host-usr:1", {"PATH": "/usr/bin:/bin"}


def _entries(plugin, name: str) -> list[str]:
    """The complete entries of artifact ``name`` (the plugin, and its cache, outlive a test)."""
    out = []
    for path in sorted(glob.glob(str(plugin.state_dir / "cache" / "v1" / "*" / "entry.json"))):
        try:
            with open(path) as f:
                if json.load(f)["label"] == f"default/{name}":
                    out.append(path)
        except (OSError, ValueError, KeyError):
            continue
    return out


def _cache_use(plugin, pod) -> dict:
    return json.loads((plugin.control_dir(pod.uid, "app") / "timings.json").read_text())["cache"]


def _source(sandbox, pod, plugin, name: str, script: str = HOLDER, annotations: dict[str, str] | None = None) -> None:
    from devtools.gpu import host_python_mounts
    a = pod(f"src-{name}", annotations={"rekindle.dev/checkpoint": name, **(annotations or {})})
    sandbox.run_container(a, "app", IMAGE, command=[sys.executable, "-c", script], mounts=host_python_mounts(), env=ENV)
    st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st


def _restore(sandbox, pod, plugin, name: str, tag: str, wait: bool = True, security=None, script: str = HOLDER):
    from devtools.gpu import host_python_mounts
    b = pod(f"dst-{name}-{tag}", annotations={"rekindle.dev/restore": name})
    cid = sandbox.run_container(b, "app", IMAGE, command=[sys.executable, "-c", script], mounts=host_python_mounts(),
                                env=ENV, **({"security": security} if security else {}))
    if wait:
        _answered(sandbox, plugin, b)
    return b, cid


def _answered(sandbox, plugin, b) -> None:
    st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"}, timeout=120)
    assert st["phase"] == "restored", st
    got = wait_for(lambda: get(sandbox.cri.pod_ip(b.id), "/", 30.0), 60, "the restored holder to answer",
                   ignore=(OSError,))
    assert got.startswith("ok "), got


def _mapped_vma(pid: int) -> tuple[int, int]:
    """(Rss, Pss) in KiB of the process's mapping of a cache file."""
    with open(f"/proc/{pid}/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if "/map-" in line and line.split()[-1].endswith(".bin"):
            fields = {k.rstrip(":"): int(v.split()[0]) for k, v in (x.split(None, 1) for x in lines[i + 1:i + 24]
                                                                    if x.split(None, 1)[0].endswith(":")
                                                                    and x.split()[0][:-1].isalpha())}
            return fields["Rss"], fields["Pss"]
    raise AssertionError(f"pid {pid} maps no cache file")


@pytest.fixture(scope="module", autouse=True)
def cache_on_tmpfs(plugin):
    """The cache on a tmpfs of its own, as the chart has it (``cache.tmpfs``): the entries'
    pages are then the ones the restored pods map, and whether one fits is a matter of memory,
    not of how full this host's disk happens to be."""
    root = plugin.state_dir / "cache"
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=1536m", "rekindle-test-cache", str(root)],
                   check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", "--lazy", str(root)], check=False)


def _restart(plugin, env: dict[str, str]) -> None:
    plugin.kill()
    plugin.env = env
    plugin.start()


@pytest.fixture()
def cached_plugin(plugin):
    # The bulk path: the cache writer makes the entry from the store after the first restore (a
    # streamed first restore on this tmpfs makes it as it runs: the tests at the end).
    _restart(plugin, {"REKINDLE_MAP": "all", "REKINDLE_CACHE_BYTES": "1Gi", "REKINDLE_RESTORE_PATH": "bulk"})
    yield plugin
    _restart(plugin, {})


@pytest.mark.parametrize("asked, mapped", [("all", True), ("", False)])
def test_a_source_that_asks_for_its_ranges_mapped_gets_them_mapped_on_a_driver_node(sandbox, pod, plugin,
                                                                                     asked, mapped):
    """The node maps only the CUDA driver's host copy (the default), which this CPU workload has
    not; a source annotated ``rekindle.dev/map-ranges: all`` has its restores from the cache map
    its large ranges all the same (recorded in its signed manifest), one without fills them."""
    _restart(plugin, {"REKINDLE_CACHE_BYTES": "1Gi", "REKINDLE_RESTORE_PATH": "bulk"})
    name = f"cache-asks-{asked or 'node'}"
    try:
        _source(sandbox, pod, plugin, name, annotations={"rekindle.dev/map-ranges": asked} if asked else None)
        _restore(sandbox, pod, plugin, name, "1")
        wait_for(lambda: _entries(plugin, name), 120, "the cache entry to be written")
        b, cid = _restore(sandbox, pod, plugin, name, "2")
        use = _cache_use(plugin, b)
        assert use["state"] == "warm" and use["store_bytes_read"] == 0, use
        if mapped:
            assert use["mapped_bytes"] >= 96 << 20, use
            (pid,) = _tree_in(sandbox, cid)
            assert _mapped_vma(pid)[0] >= 90 << 10
        else:
            assert use["mapped_bytes"] == 0 and use["filled_bytes"] >= 96 << 20, use
    finally:
        _restart(plugin, {})


def _paused_writer(plugin, where) -> dict[str, str]:
    """Restart ``plugin`` with its cache writer pausing mid-entry (``where``/cache-write.*);
    returns the environment to restart it without the pause."""
    plain = {k: v for k, v in plugin.env.items() if k != "REKINDLE_TEST_PAUSE"}
    _restart(plugin, {**plain, "REKINDLE_TEST_PAUSE": f"cache-write:{where}"})
    return plain


def test_a_second_restore_maps_from_the_cache_and_two_pods_share_its_pages(sandbox, pod, cached_plugin):
    plugin = cached_plugin
    _source(sandbox, pod, plugin, "cache-share")
    first, _ = _restore(sandbox, pod, plugin, "cache-share", "1")
    assert _cache_use(plugin, first)["state"] == "cold"
    assert _cache_use(plugin, first)["store_bytes_read"] >= 96 << 20
    wait_for(lambda: _entries(plugin, "cache-share"), 120, "the cache entry to be written")

    b1, c1 = _restore(sandbox, pod, plugin, "cache-share", "2", wait=False)
    b2, c2 = _restore(sandbox, pod, plugin, "cache-share", "3", wait=False)
    for b in (b1, b2):
        _answered(sandbox, plugin, b)
        use = _cache_use(plugin, b)
        assert use["state"] == "warm", use
        assert use["store_bytes_read"] == 0 and use["mapped_bytes"] >= 96 << 20, use
    (p1,), (p2,) = _tree_in(sandbox, c1), _tree_in(sandbox, c2)
    # Both read every page (the hash): each holds the mapped range, and pays half of it.
    for pid in (p1, p2):
        rss, pss = _mapped_vma(pid)
        assert rss >= 90 << 10 and pss <= rss * 0.6, (pid, rss, pss)
    # A write stays the writer's: the other still answers the source's bytes, and so does it.
    assert get(sandbox.cri.pod_ip(b1.id), "/write", 30.0).startswith("ok ")
    assert get(sandbox.cri.pod_ip(b2.id), "/", 30.0).startswith("ok ")


@pytest.mark.parametrize("kind", ["map", "fill"])
def test_a_changed_entry_is_dropped_and_made_again(sandbox, pod, cached_plugin, kind):
    """A mapped range's file, or a fill file (whose bytes the fill copies without hashing them
    again): either changed, the entry is not used."""
    plugin = cached_plugin
    name = f"cache-change-{kind}"
    _source(sandbox, pod, plugin, name)
    _restore(sandbox, pod, plugin, name, "1")
    (entry,) = wait_for(lambda: _entries(plugin, name), 120, "the cache entry to be written")
    victim = sorted(glob.glob(os.path.join(os.path.dirname(entry), f"{kind}-*.bin")))[0]
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:  # root changing it behind the plugin's back
        f.seek(os.path.getsize(victim) - 4096)
        f.write(b"\xff" * 4096)
    os.chmod(victim, 0o444)
    b, _ = _restore(sandbox, pod, plugin, name, "2")
    assert _cache_use(plugin, b)["state"] == "cold"
    assert "dropped" in plugin.log()
    wait_for(lambda: _entries(plugin, name), 120, "the entry to be made again")
    c, _ = _restore(sandbox, pod, plugin, name, "3")
    assert _cache_use(plugin, c)["state"] == "warm"


def test_a_writer_killed_mid_entry_leaves_nothing_used_and_is_swept(sandbox, pod, cached_plugin, tmp_path):
    plugin = cached_plugin
    _source(sandbox, pod, plugin, "cache-kill")
    plain = _paused_writer(plugin, tmp_path)
    _restore(sandbox, pod, plugin, "cache-kill", "1")
    wait_for(lambda: (tmp_path / "cache-write.reached").exists(), 120, "the cache writer to be mid-entry")
    tmp = glob.glob(str(plugin.state_dir / "cache" / "v1" / ".tmp-*"))
    assert tmp, "no unfinished entry to sweep"
    _restart(plugin, plain)  # killed mid-write: the entry has bulk bytes but no entry.json
    assert not any(os.path.exists(t) for t in tmp), "the unfinished entry was not swept"
    b, _ = _restore(sandbox, pod, plugin, "cache-kill", "2")
    assert _cache_use(plugin, b)["state"] == "cold"


def test_the_byte_bound_evicts_the_least_recently_used_entry(sandbox, pod, plugin):
    # one 96 MiB entry fits, not two; the writer makes them (the bulk path)
    _restart(plugin, {"REKINDLE_MAP": "all", "REKINDLE_CACHE_BYTES": "150Mi", "REKINDLE_RESTORE_PATH": "bulk"})
    try:
        for name in ("cache-lru-a", "cache-lru-b"):
            _source(sandbox, pod, plugin, name)
        _restore(sandbox, pod, plugin, "cache-lru-a", "1")
        wait_for(lambda: len(_entries(plugin, "cache-lru-a")) == 1, 120, "a's entry")
        time.sleep(0.05)  # (mtime order)
        _restore(sandbox, pod, plugin, "cache-lru-b", "1")
        wait_for(lambda: _entries(plugin, "cache-lru-b"), 120, "b's entry")
        assert _entries(plugin, "cache-lru-a") == [] and "evicted" in plugin.log()
        b, _ = _restore(sandbox, pod, plugin, "cache-lru-b", "2")
        assert _cache_use(plugin, b)["state"] == "warm"
        a, _ = _restore(sandbox, pod, plugin, "cache-lru-a", "2")
        assert _cache_use(plugin, a)["state"] == "cold"
    finally:
        _restart(plugin, {})


def test_a_delete_is_not_held_up_by_the_cache_writer(sandbox, pod, cached_plugin, tmp_path):
    plugin = cached_plugin
    _source(sandbox, pod, plugin, "cache-delete")
    plain = _paused_writer(plugin, tmp_path)
    try:
        _restore(sandbox, pod, plugin, "cache-delete", "1")
        wait_for(lambda: (tmp_path / "cache-write.reached").exists(), 120, "the cache writer to be mid-entry")
        done = subprocess.run([sys.executable, "-m", "nri_plugin", "artifacts", "delete", "cache-delete",
                               "--store", str(plugin.store), "--state-dir", str(plugin.state_dir)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr  # it used to wait on the writer: "a restore is reading it"
        (tmp_path / "cache-write.go").touch()
    finally:
        _restart(plugin, plain)


@pytest.fixture()
def streaming_cache(plugin):
    _restart(plugin, {"REKINDLE_MAP": "all", "REKINDLE_CACHE_BYTES": "1Gi", "REKINDLE_RESTORE_PATH": "stream"})
    yield plugin
    _restart(plugin, {})


@pytest.fixture(params=["unregister", "continue"])
def streaming_cache_let_go(request, plugin):
    """``streaming_cache``, each way a serve lets a mapped piece go (``$REKINDLE_LET_GO``)."""
    _restart(plugin, {"REKINDLE_MAP": "all", "REKINDLE_CACHE_BYTES": "1Gi", "REKINDLE_RESTORE_PATH": "stream",
                      "REKINDLE_LET_GO": request.param})
    yield plugin
    _restart(plugin, {})


def _timings(plugin, pod) -> dict:
    return json.loads((plugin.control_dir(pod.uid, "app") / "timings.json").read_text())


def test_a_streamed_first_restore_makes_the_entry_as_it_runs_and_the_next_maps_it(sandbox, pod,
                                                                                   streaming_cache_let_go):
    """No entry yet, the cache a tmpfs, the streamed path: the restored process maps its range
    from the entry's file while the serve writes it (each piece verified, then let go), and the
    entry is finished from that file once the restore is done; the next restore maps it."""
    plugin = streaming_cache_let_go
    name = f"cache-stream-{plugin.env['REKINDLE_LET_GO']}"
    _source(sandbox, pod, plugin, name)
    first, c1 = _restore(sandbox, pod, plugin, name, "1")
    use, served = _cache_use(plugin, first), _timings(plugin, first)["stream"]
    assert use["state"] == "building" and use["mapped_bytes"] >= 96 << 20, use
    assert served["mapped_bytes"] == use["mapped_bytes"] and served["mapped_whole"], served
    (p1,) = _tree_in(sandbox, c1)
    rss, _pss = _mapped_vma(p1)  # a mapping of the entry's file, read whole by the hash
    assert rss >= 90 << 10, rss
    (entry,) = wait_for(lambda: _entries(plugin, name), 120, "the entry to be finished")
    assert "(written by its restore)" in plugin.log()
    assert not glob.glob(str(plugin.state_dir / "cache" / "v1" / ".tmp-*"))
    second, _ = _restore(sandbox, pod, plugin, name, "2")
    use = _cache_use(plugin, second)
    assert use["state"] == "warm" and use["store_bytes_read"] == 0, use
    # Both read the pages of the one file: the first pod's memory is the cache's, not its own copy.
    assert get(sandbox.cri.pod_ip(first.id), "/", 30.0).startswith("ok ")


def test_the_plugin_killed_while_it_streams_into_a_new_entry_leaves_no_entry(sandbox, pod, streaming_cache):
    """The agent is SIGKILLed mid-serve (faults only: the process has touched nothing of its
    range yet): the holder kills the tree, the unfinished entry is swept when the agent is back,
    the pod starts cold once, and the next restore makes the entry again."""
    plugin = streaming_cache
    _restart(plugin, {**plugin.env, "REKINDLE_STREAM_THREADS": "0"})
    _source(sandbox, pod, plugin, "cache-stream-kill")
    b, cid = _restore(sandbox, pod, plugin, "cache-stream-kill", "1", wait=False)
    wait_status(plugin, "default", b.name, "app", {"restoring"}, timeout=60)
    tmp = wait_for(lambda: glob.glob(str(plugin.state_dir / "cache" / "v1" / ".tmp-*")), 60,
                   "the entry being made")
    restored = wait_for(lambda: _tree_in(sandbox, cid), 60, "the restored process")
    wait_for(lambda: "stream_start" in plugin.log() or os.path.exists(tmp[0]), 10, "the serve")
    plugin.kill()
    wait_for(lambda: not any(_alive(p) for p in restored), 10, "the holder to kill the restored tree")
    _restart(plugin, {k: v for k, v in plugin.env.items() if k != "REKINDLE_STREAM_THREADS"})
    assert not any(os.path.exists(t) for t in tmp), "the unfinished entry was not swept"
    st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"})
    assert st["phase"] == "cold-start", st
    assert _entries(plugin, "cache-stream-kill") == []
    again, _ = _restore(sandbox, pod, plugin, "cache-stream-kill", "2")
    assert _cache_use(plugin, again)["state"] == "building"


def test_streamed_restores_of_one_version_at_once_share_the_entry_they_make(sandbox, pod, streaming_cache):
    """Three pods restore one artifact at once, no entry yet: the first begins it, the others
    join it. Each piece of the mapped range is written (and verified) once, by whichever serve
    needs it first, and let go in all three; their processes share those pages from the start.
    Faults only (no install thread): each serve lasts until its process has read its memory, so
    the three overlap for sure."""
    plugin = streaming_cache
    _restart(plugin, {**plugin.env, "REKINDLE_STREAM_THREADS": "0", "REKINDLE_MAX_PARALLEL": "3"})
    _source(sandbox, pod, plugin, "cache-join")
    pods = []
    for tag in ("1", "2", "3"):
        b, cid = _restore(sandbox, pod, plugin, "cache-join", tag, wait=False)
        wait_status(plugin, "default", b.name, "app", {"restoring"}, timeout=60)
        wait_for(lambda cid=cid: _tree_in(sandbox, cid), 60, "the restored process")
        pods.append((b, cid))
    assert plugin.log().count("joining node cache entry") == 2
    for b, _cid in pods:  # each reads its memory: its serve's faults, or pieces another serve wrote
        got = wait_for(lambda b=b: get(sandbox.cri.pod_ip(b.id), "/", 30.0), 60, "an answer", ignore=(OSError,))
        assert got.startswith("ok "), got
    states = []
    for b, _cid in pods:
        st = wait_status(plugin, "default", b.name, "app", {"restored", "cold-start"}, timeout=120)
        assert st["phase"] == "restored", st
        states.append(_cache_use(plugin, b)["state"])
    assert states == ["building", "joined", "joined"], states
    # The three serves verified the range once between them (each chunk read from the store once).
    verified = sum(_timings(plugin, b)["stream"]["bytes_verified"] for b, _cid in pods)
    mapped = _cache_use(plugin, pods[0][0])["mapped_bytes"]
    assert verified < 1.5 * mapped, (verified, mapped)
    wait_for(lambda: _entries(plugin, "cache-join"), 120, "the entry to be finished")
    assert plugin.log().count("(written by its restore)") >= 1
    for _b, cid in pods:  # the pages are the file's, shared three ways
        (pid,) = _tree_in(sandbox, cid)
        rss, pss = _mapped_vma(pid)
        assert rss >= 90 << 10 and pss <= rss * 0.5, (pid, rss, pss)


def test_a_restore_mapped_from_the_entry_serves_the_rest_when_asked(sandbox, pod, streaming_cache):
    """``REKINDLE_STREAM_WARM_REST=1``: a restore that maps its ranges from a complete entry
    serves the bulk pages it does not map (from the entry's fill files, each chunk verified) while
    the tree runs, instead of filling them before; without it they are filled first."""
    plugin = streaming_cache
    _source(sandbox, pod, plugin, "cache-rest")
    _restore(sandbox, pod, plugin, "cache-rest", "1")
    wait_for(lambda: _entries(plugin, "cache-rest"), 120, "the entry to be finished")
    filled, _ = _restore(sandbox, pod, plugin, "cache-rest", "2")
    use, timings = _cache_use(plugin, filled), _timings(plugin, filled)
    assert use["state"] == "warm" and use["filled_bytes"] > 0, use
    assert "stream" not in timings, timings
    _restart(plugin, {**plugin.env, "REKINDLE_STREAM_WARM_REST": "1"})
    served, _ = _restore(sandbox, pod, plugin, "cache-rest", "3")
    use, timings = _cache_use(plugin, served), _timings(plugin, served)
    assert use["state"] == "warm" and use["store_bytes_read"] == 0, use
    assert timings["stream"]["bytes_installed"] == use["filled_bytes"], (timings["stream"], use)
    assert timings["stream"]["mapped_bytes"] == 0, timings["stream"]
    assert get(sandbox.cri.pod_ip(filled.id), "/", 30.0).startswith("ok ")


@pytest.mark.parametrize("cap", ["SYS_ADMIN", "CHECKPOINT_RESTORE"])
def test_a_target_that_could_write_through_map_files_neither_makes_nor_maps_an_entry(sandbox, pod, streaming_cache,
                                                                                      cap):
    """A target holding CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE could open its mapping of an
    entry's file through /proc/self/map_files for writing: it restores without the node cache
    (the reason recorded), neither making the entry as it streams nor mapping a sealed one."""
    from devtools.cri import SecurityContext
    plugin, name = streaming_cache, f"cache-{cap.lower().replace('_', '-')}"
    capable = SecurityContext(add_capabilities=(cap,))
    _source(sandbox, pod, plugin, name)
    first, c1 = _restore(sandbox, pod, plugin, name, "1", security=capable)
    use = _cache_use(plugin, first)
    assert use["state"] == "off" and f"CAP_{cap}" in use["reason"] and use["entry"] == "", use
    with open(f"/proc/{_tree_in(sandbox, c1)[0]}/maps") as f:
        assert "/map-" not in f.read()
    assert not _entries(plugin, name) and not glob.glob(str(plugin.state_dir / "cache" / "v1" / ".tmp-*"))
    # An ordinary target makes the entry; the capable one still does not map it.
    second, _ = _restore(sandbox, pod, plugin, name, "2")
    assert _cache_use(plugin, second)["state"] == "building"
    wait_for(lambda: _entries(plugin, name), 120, "the entry to be finished")
    third, c3 = _restore(sandbox, pod, plugin, name, "3", security=capable)
    use = _cache_use(plugin, third)
    assert use["state"] == "off" and use["store_bytes_read"] >= 96 << 20, use
    with open(f"/proc/{_tree_in(sandbox, c3)[0]}/maps") as f:
        assert "/map-" not in f.read()


# 48 MiB of seeded bytes, 128 MiB written with zeros, 16 MiB seeded: one mapping, one bulk range
# at the dump (an engine's host copy with its KV pool inside)
POOL = r"""
import hashlib, os, random, socket
data = bytearray(192 << 20)
data[:48 << 20] = random.Random(11).randbytes(48 << 20)
data[176 << 20:] = random.Random(12).randbytes(16 << 20)
for i in range(48 << 20, 176 << 20, 4096):  # written, so present: CRIU dumps each page
    data[i] = 0
""" + SERVE


def test_a_zero_run_is_neither_mapped_nor_kept_in_the_entry(sandbox, pod, streaming_cache):
    """A long run of zeros inside a mapped range (an engine's KV pool) is a range of its own,
    never mapped: it stays anonymous memory (the zero page), where a mapping of the entry's
    tmpfs file would allocate every page the process reads. Both restores, the one that makes the
    entry and the one that maps it, find every byte; the entry holds about the seeded bytes."""
    plugin = streaming_cache
    _source(sandbox, pod, plugin, "cache-pool", script=POOL)
    first, c1 = _restore(sandbox, pod, plugin, "cache-pool", "1", script=POOL)
    use, served = _cache_use(plugin, first), _timings(plugin, first)["stream"]
    assert use["state"] == "building" and (48 << 20) <= use["mapped_bytes"] <= (72 << 20), use
    assert served["zero_bytes"] >= 120 << 20, served  # the pool: zero pages, not the entry's
    (entry,) = wait_for(lambda: _entries(plugin, "cache-pool"), 120, "the entry to be finished")
    root = os.path.dirname(entry)

    def held() -> int:
        return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(root) for f in fs)
    # every byte of the process's bulk memory but the zeros (the interpreter's own heap too)
    assert held() <= served["bytes_verified"] - (120 << 20), (held(), served)
    second, c2 = _restore(sandbox, pod, plugin, "cache-pool", "2", script=POOL)
    use = _cache_use(plugin, second)
    assert use["state"] == "warm" and use["store_bytes_read"] == 0 and use["mapped_bytes"] <= (72 << 20), use
    for b in (first, second):  # the hash read every page, zeros included
        assert get(sandbox.cri.pod_ip(b.id), "/", 30.0).startswith("ok ")
    assert held() <= served["bytes_verified"] - (120 << 20), (held(), served)  # reading the zeros took none
