"""Pre-warming through the real plugin: a second node's plugin, sharing only the store (and its
key) with the node that checkpoints, writes its cache entry of a marked version as it is
published, and the first restore there maps it; past the cache's byte bound, or for a version a
store writer changed, the warm-up is refused with the reason; a restore on the node takes the
disk first (the warm-up waits for it).

The second node is a second ``rekindle plugin`` process with its own state dir and node cache.
Two Rekindle plugins cannot both be registered with one containerd: both would act on every
annotated pod (NRI allows two plugins at different indexes, but their adjustments of one
container conflict). So while the first node's plugin is registered, the second one runs with
an NRI socket nobody serves: the real plugin, its real pre-warm loop, looking at the shared
store from outside; and to restore on the second node, the first node's plugin goes and the
second one registers with containerd instead (its state dir and cache as they were)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.plugin_process import PluginProcess
from tests.e2e.test_checkpoint_restore import wait_status
from tests.e2e.test_node_cache import ENV, HOLDER, IMAGE, _answered, _cache_use, _entries
from tests.waiting import wait_for

CACHE_ENV = {"REKINDLE_MAP": "all", "REKINDLE_CACHE_BYTES": "1Gi", "REKINDLE_RESTORE_PATH": "bulk",
             "REKINDLE_PREWARM_INTERVAL": "1"}


def _source(sandbox, pod, plugin, name: str, marked: bool = True) -> None:
    from devtools.gpu import host_python_mounts
    notes = {"rekindle.dev/checkpoint": name, **({"rekindle.dev/prewarm": "true"} if marked else {})}
    a = pod(f"src-{name}", annotations=notes)
    sandbox.run_container(a, "app", IMAGE, command=[sys.executable, "-c", HOLDER], mounts=host_python_mounts(), env=ENV)
    st = wait_status(plugin, "default", a.name, "app", {"published", "checkpoint-failed"}, timeout=180)
    assert st["phase"] == "published", st


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Node:
    """The second node: its own work dir (state, cache on a tmpfs of its own), the first node's store and key."""

    def __init__(self, sandbox, first: PluginProcess, workdir: Path, env: dict[str, str],
                 extra: list[str] | None = None) -> None:
        self.sandbox, self.first, self.workdir, self.env = sandbox, first, workdir, env
        self.shared = ["--store", str(first.store), "--hmac-key-file", str(first.state_dir / "hmac.key"),
                       *(extra or [])]
        self.cache = workdir / "state" / "cache"
        self.cache.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=1536m", "rekindle-test-cache2",
                        str(self.cache)], check=True)
        self.proc: PluginProcess | None = None
        self.pods: list = []  # restored on this node: gone before the first node's plugin is back

    def outside(self, metrics_port: int = 0) -> PluginProcess:
        """Running, not registered with containerd: it only looks at the store."""
        self.stop()
        p = PluginProcess(self.sandbox, self.workdir, extra_args=[
            *self.shared, "--socket-path", str(self.workdir / "no-nri.sock"), "--metrics-port", str(metrics_port)])
        p.env = self.env
        p.start(wait=False)
        p.wait_log("pre-warm: looking at the store", timeout=90)
        self.proc = p
        return p

    def registered(self) -> PluginProcess:
        """Registered with containerd in the first node's place (which is killed)."""
        self.stop()
        self.first.kill()
        p = PluginProcess(self.sandbox, self.workdir, extra_args=self.shared)
        p.env = self.env
        p.start()
        self.proc = p
        return p

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def close(self) -> None:
        from runtime.errors import RekindleError
        for p in self.pods:  # the first node's plugin would see them at its sync as its own
            try:
                self.sandbox.cri.stop_pod(p.id)
                self.sandbox.cri.remove_pod(p.id)
            except RekindleError:
                pass
        self.stop()
        subprocess.run(["umount", "--lazy", str(self.cache)], check=False)
        if self.first.proc is None or self.first.proc.poll() is not None:
            self.first.env = {}
            self.first.start()


@pytest.fixture()
def node(sandbox, plugin, tmp_path):
    made: list[Node] = []

    def make(env: dict[str, str] = CACHE_ENV, extra: list[str] | None = None) -> Node:
        n = Node(sandbox, plugin, tmp_path / f"node{len(made) + 2}", env, extra)
        made.append(n)
        return n
    yield make
    for n in made:
        n.close()


def _states(p: PluginProcess) -> dict[str, dict]:
    try:
        doc = json.loads((p.state_dir / "prewarm.json").read_text())
    except (OSError, ValueError):
        return {}
    return {a["artifact"]: a for a in doc["artifacts"]}


def _state_is(p: PluginProcess, artifact: str, states: set[str]) -> dict | None:
    st = _states(p).get(artifact)
    return st if st is not None and st["state"] in states else None


def _artifacts_list(p: PluginProcess, *extra: str) -> str:
    key = p.extra_args[p.extra_args.index("--hmac-key-file") + 1]
    store = p.extra_args[p.extra_args.index("--store") + 1]
    done = subprocess.run([sys.executable, "-m", "nri_plugin", "artifacts", "list", "--store", store,
                           "--state-dir", str(p.state_dir), "--hmac-key-file", key, *extra],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_marked_version_published_while_a_node_runs_is_warm_there_and_its_first_restore_maps(
        sandbox, pod, plugin, node):
    second = node()
    port = _free_port()
    b = second.outside(metrics_port=port)
    _source(sandbox, pod, plugin, "pw-cross")  # published by the first node while the second one runs
    st = wait_for(lambda: _state_is(b, "default/pw-cross", {"warm", "refused"}), 120, "the second node's warm-up")
    assert st["state"] == "warm", st
    assert st["bytes"] >= 96 << 20 and st["rate"] > 0, st
    assert _entries(b, "pw-cross"), "no complete entry in the second node's cache"
    print(f"\nwarm-up on the second node: {st['bytes'] / 2**20:.1f} MiB at {st['rate'] / 2**20:.1f} MiB/s "
          "(this 2-core CPU machine, shared)")
    assert "pre-warm: default/pw-cross" in b.log()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'rekindle_prewarm_state{artifact="default/pw-cross",state="warm"} 1.0' in metrics
    assert 'rekindle_prewarm_state{artifact="default/pw-cross",state="warming"} 0.0' in metrics
    listed = json.loads(_artifacts_list(b, "-o", "json"))
    row = next(r for r in listed if r["name"] == "pw-cross")
    assert row["prewarm"]["state"] == "warm" and row["cached_bytes"] > 0, row
    assert "pre-warm: warm" in _artifacts_list(b)

    b = second.registered()  # the second node's first restore of it
    from devtools.gpu import host_python_mounts
    dst = pod("dst-pw-cross", annotations={"rekindle.dev/restore": "pw-cross"})
    second.pods.append(dst)
    sandbox.run_container(dst, "app", IMAGE, command=[sys.executable, "-c", HOLDER], mounts=host_python_mounts(),
                          env=ENV)
    _answered(sandbox, b, dst)
    use = _cache_use(b, dst)
    assert use["state"] == "warm" and use["store_bytes_read"] == 0 and use["mapped_bytes"] >= 96 << 20, use


def test_a_listed_artifact_past_the_byte_bound_is_refused_with_the_reason(sandbox, pod, plugin, node):
    _source(sandbox, pod, plugin, "pw-big", marked=False)  # not marked: the node's list names it
    second = node({**CACHE_ENV, "REKINDLE_CACHE_BYTES": "64Mi"}, ["--prewarm", "default/pw-big"])
    b = second.outside()
    st = wait_for(lambda: _state_is(b, "default/pw-big", {"warm", "refused"}), 120, "the warm-up's verdict")
    assert st["state"] == "refused" and "more than the cache's bound of 64.0 MiB" in st["reason"], st
    assert _entries(b, "pw-big") == []
    assert not glob.glob(str(second.cache / "v1" / ".tmp-*"))
    assert "pre-warm: refused: its entry needs" in _artifacts_list(b)


def _bulk_file(plugin, name: str) -> str:
    version = os.path.join(plugin.store, "default", os.readlink(os.path.join(plugin.store, "default", name)))
    return max(glob.glob(os.path.join(version, "bulk", "*.bulk")), key=os.path.getsize)


def test_a_marked_version_a_store_writer_changed_is_refused_with_the_reason(sandbox, pod, plugin, node):
    """Its bulk bytes (marked in its manifest: found by the look through the store), or its
    manifest (listed by the node: a manifest whose signature fails says nothing it can trust,
    marked or not)."""
    _source(sandbox, pod, plugin, "pw-bytes")
    _source(sandbox, pod, plugin, "pw-manifest")
    victim = _bulk_file(plugin, "pw-bytes")
    with open(victim, "r+b") as f:  # a store writer changes a page of the bulk file
        f.seek(os.path.getsize(victim) // 2)
        f.write(b"\xa5" * 4096)
    manifest = os.path.join(os.path.dirname(os.path.dirname(_bulk_file(plugin, "pw-manifest"))), "manifest.json")
    data = open(manifest, "rb").read()
    with open(manifest, "wb") as f:  # and another one's manifest (valid JSON, still marked)
        f.write(data.replace(b'"pod":"', b'"pod":"x', 1))
    b = node(extra=["--prewarm", "default/pw-manifest"]).outside()
    st = wait_for(lambda: _state_is(b, "default/pw-bytes", {"warm", "refused"}), 120, "pw-bytes' verdict")
    assert st["state"] == "refused" and "does not match its digest" in st["reason"], st
    st = wait_for(lambda: _state_is(b, "default/pw-manifest", {"warm", "refused"}), 120, "pw-manifest's verdict")
    assert st["state"] == "refused" and "bad signature" in st["reason"], st
    assert _entries(b, "pw-bytes") == [] and _entries(b, "pw-manifest") == []
    # (other tests' marked artifacts are warmed too: once none is warming, nothing is left half-made)
    wait_for(lambda: not any(s["state"] == "warming" for s in _states(b).values()), 120, "the warm-ups to end")
    assert not glob.glob(str(b.state_dir / "cache" / "v1" / ".tmp-*"))
    text = _artifacts_list(b)
    assert "pre-warm: refused:" in text and "does not match its digest" in text, text


def test_a_restore_takes_the_disk_first_and_the_warm_up_waits_for_it(sandbox, pod, plugin, node, tmp_path):
    """A marked version published on a node is being written into its cache (held by the test
    after its first chunk) when a restore begins there; the restore is stopped after CRIU, before
    its fill, the disk-heavy part (the test's hold, too). Let go, the warm-up writes no further
    chunk while the restore runs: it is paused, its bytes unchanged, until the restore is done,
    then it finishes. The restore's phases are printed beside those of one with no warm-up."""
    from devtools.gpu import host_python_mounts
    for name in ("pw-base-1", "pw-base-2"):
        _source(sandbox, pod, plugin, name, marked=False)
    # Every marked artifact is warmed, one at a time: the other tests' ones go from the store
    # (their names unlinked, as a store writer may), so that the held warm-up is this one's.
    ns_dir = os.path.join(plugin.store, "default")
    for name in os.listdir(ns_dir):
        if not name.startswith(".") and not name.startswith("pw-base-"):
            os.unlink(os.path.join(ns_dir, name))
    second = node({**CACHE_ENV, "REKINDLE_TEST_PAUSE": f"criu,prewarm:{tmp_path}"})
    b = second.registered()

    def restore(name: str):
        dst = pod(f"dst-{name}", annotations={"rekindle.dev/restore": name})
        second.pods.append(dst)
        sandbox.run_container(dst, "app", IMAGE, command=[sys.executable, "-c", HOLDER],
                              mounts=host_python_mounts(), env=ENV)
        return dst

    (tmp_path / "criu.go").touch()  # the baseline restore: not stopped, nothing warming
    alone = restore("pw-base-1")
    _answered(sandbox, b, alone)
    (tmp_path / "criu.go").unlink()
    (tmp_path / "criu.reached").unlink()
    _source(sandbox, pod, b, "pw-during")  # marked, published on this node
    wait_for(lambda: (tmp_path / "prewarm.reached").exists(), 120, "the warm-up to be mid-entry")
    # (the state file is written at each look, every second here)
    held = wait_for(lambda: (lambda st: st if st and 0 < st["bytes"] < st["total"] else None)(
        _state_is(b, "default/pw-during", {"warming"})), 30, "the held warm-up's bytes in its state")
    during = restore("pw-base-2")
    wait_for(lambda: (tmp_path / "criu.reached").exists(), 120, "the restore to stop after CRIU")
    (tmp_path / "prewarm.go").touch()  # the warm-up goes on, a restore running
    st = wait_for(lambda: _state_is(b, "default/pw-during", {"warming"}) if _states(b).get(
        "default/pw-during", {}).get("paused") else None, 120, "the warm-up to wait for the restore")
    # Its threads had at most one chunk each in hand when the gate closed: no more than that.
    assert st["bytes"] <= held["bytes"] + 4 * (2 << 20) and st["bytes"] < st["total"], (held, st)
    (tmp_path / "criu.go").touch()
    _answered(sandbox, b, during)
    st = wait_for(lambda: _state_is(b, "default/pw-during", {"warm", "refused"}), 120, "the warm-up to finish")
    assert st["state"] == "warm", st
    assert "pre-warm resumed after a restore" in b.log()
    assert _entries(b, "pw-during")
    t_alone = json.loads((b.control_dir(alone.uid, "app") / "timings.json").read_text())["restore"]
    t_during = json.loads((b.control_dir(during.uid, "app") / "timings.json").read_text())["restore"]
    print("\nrestore phases, seconds: with no warm-up | begun during a warm-up, which waits for it "
          "(this 2-core CPU machine, shared; the second restore's stop after CRIU is the test's, in its total):")
    for k in t_alone:
        print(f"  {k:16s} {t_alone[k]:8.3f} | {t_during.get(k, float('nan')):8.3f}")


def _looks(p: PluginProcess, n: int) -> None:
    """Wait for ``n`` more looks (each records the state file anew)."""
    def updated() -> float:
        try:
            return float(json.loads((p.state_dir / "prewarm.json").read_text())["updated"])
        except (OSError, ValueError, KeyError):
            return 0.0
    seen = [updated()]

    def one_more() -> bool:
        now = updated()
        if now > seen[-1]:
            seen.append(now)
        return len(seen) > n
    wait_for(one_more, 60, f"{n} more looks")


def test_an_evicted_warm_version_is_warmed_again_once_it_fits_beside_the_others(sandbox, pod, plugin, node):
    """Two marked artifacts whose entries do not fit the cache together: one is warm, the other
    evicted, and that one is not written again while it would evict (no churn, look after look).
    Once room comes back (here the warm one's entry removed, as another eviction would), it is
    written again; the removed one then stays absent, the room taken."""
    names = ("pw-evict-a", "pw-evict-b")
    for name in names:
        _source(sandbox, pod, plugin, name)
    ns_dir = os.path.join(plugin.store, "default")
    for name in os.listdir(ns_dir):  # the other tests' marked artifacts would take the room too
        if not name.startswith(".") and name not in names:
            os.unlink(os.path.join(ns_dir, name))
    b = node({**CACHE_ENV, "REKINDLE_CACHE_BYTES": "180Mi"}).outside()  # an entry is 96 MiB and more

    def split() -> tuple[str, str] | None:
        states = [_states(b).get(f"default/{n}", {}) for n in names]
        kinds = [(s.get("state"), str(s.get("reason", "")).startswith("evicted")) for s in states]
        if sorted(kinds) == [("absent", True), ("warm", False)]:
            warm = names[kinds.index(("warm", False))]
            return warm, names[1 - names.index(warm)]
        return None
    warm, evicted = wait_for(split, 240, "one warm and the other evicted")
    _looks(b, 3)
    assert split() == (warm, evicted)
    assert b.log().count(f"writing default/{evicted} ") == 1, "written again while it would evict"
    for path in _entries(b, warm):
        shutil.rmtree(os.path.dirname(path))
    st = wait_for(lambda: _state_is(b, f"default/{evicted}", {"warm", "refused"}), 120, "the second warm-up")
    assert st["state"] == "warm", st
    assert _entries(b, evicted)
    _looks(b, 3)
    st = _states(b)[f"default/{warm}"]
    assert st["state"] == "absent" and st["reason"].startswith("evicted"), st
    assert b.log().count(f"writing default/{warm} ") == 1, "written again where there is no room"
