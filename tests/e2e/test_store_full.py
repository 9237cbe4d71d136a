"""A checkpoint that runs out of space leaves nothing behind, and the source keeps running:
whether the store fills up during the dump or is full before the checkpoint starts."""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request

from tests.e2e.plugin_process import PluginProcess

COUNTER = "localhost/rekindle/counter:1"


def get(ip: str, path: str = "/") -> str:
    with urllib.request.urlopen(f"http://{ip}:8080{path}", timeout=3) as r:
        return r.read().decode()


def test_a_checkpoint_into_a_full_store_leaves_nothing_and_the_source_runs_on(sandbox, pod, tmp_path):
    from runtime.status import Phase, StatusBook
    plugin = PluginProcess(sandbox, tmp_path / "plugin")
    plugin.store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(plugin.store)], check=True)
    try:
        plugin.start()
        a = pod("src-full-store", annotations={"rekindle.dev/checkpoint": "too-big"})
        sandbox.run_container(a, "server", COUNTER, command=["/usr/local/bin/counter-server", "8080"],
                              env={"WARMUP_MIB": "64"})
        st = StatusBook(plugin.state_dir).wait("default", a.name, "server",
                                               {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 120)
        assert st is not None and st.phase is Phase.CHECKPOINT_FAILED, st
        assert "No space left on device" in st.reason or "ENOSPC" in st.reason or "space" in st.reason, st.reason
        # Nothing left behind: no staging dir, no version, no name.
        leftovers = [os.path.join(d, f) for d, dirs, files in os.walk(plugin.store) for f in dirs + files]
        assert leftovers in ([], [str(plugin.store / "default")]), leftovers
        ip = sandbox.cri.pod_ip(a.id)
        first = int(get(ip).split("count=")[1].split()[0])
        time.sleep(0.2)
        assert int(get(ip).split("count=")[1].split()[0]) == first + 1  # running, not stopped
        assert "verify=ok" in get(ip, "/verify")
        assert (plugin.control_dir(a.uid, "server") / "checkpoint-failed").exists()
    finally:
        plugin.stop()
        subprocess.run(["umount", "-l", str(plugin.store)], check=False)


def test_a_layer_over_the_pods_cap_is_refused_and_the_source_runs_on(sandbox, pod, tmp_path):
    """rekindle.dev/max-layer-size (within the node's --max-layer-bytes) bounds the capture."""
    from runtime.status import Phase, StatusBook
    plugin = PluginProcess(sandbox, tmp_path / "plugin")
    plugin.start()
    try:
        a = pod("src-big-layer", annotations={"rekindle.dev/checkpoint": "big-layer",
                                              "rekindle.dev/max-layer-size": "1Mi"})
        script = ("/bin/busybox dd if=/dev/urandom of=/big bs=1M count=4 2>/dev/null && "
                  "exec /usr/local/bin/counter-server 8080")
        sandbox.run_container(a, "server", COUNTER, command=["/bin/busybox", "sh", "-c", script])
        st = StatusBook(plugin.state_dir).wait("default", a.name, "server",
                                               {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 120)
        assert st is not None and st.phase is Phase.CHECKPOINT_FAILED, st
        assert "cap" in st.reason, st.reason
        assert not (plugin.store / "default" / "big-layer").exists()
        ip = sandbox.cri.pod_ip(a.id)
        assert "count=" in get(ip)  # resumed after the refused capture
    finally:
        plugin.stop()


def test_a_checkpoint_into_a_store_already_full_leaves_no_staging_dir(sandbox, pod, tmp_path):
    """Full before the checkpoint starts, not even the staging dir's owner record fits: the
    staging dir goes too (an ownerless one would be kept by the sweep for a day)."""
    from runtime.status import Phase, StatusBook
    plugin = PluginProcess(sandbox, tmp_path / "plugin")
    plugin.store.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(plugin.store)], check=True)
    try:
        plugin.start()
        (plugin.store / "default").mkdir(mode=0o700)
        fd = os.open(plugin.store / ".ballast", os.O_WRONLY | os.O_CREAT, 0o600)
        try:  # every block of the store
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        a = pod("src-store-was-full", annotations={"rekindle.dev/checkpoint": "no-room"})
        sandbox.run_container(a, "server", COUNTER, command=["/usr/local/bin/counter-server", "8080"])
        st = StatusBook(plugin.state_dir).wait("default", a.name, "server",
                                               {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 120)
        assert st is not None and st.phase is Phase.CHECKPOINT_FAILED, st
        assert "No space left on device" in st.reason, st.reason
        assert os.listdir(plugin.store / "default") == []
        assert "count=1 " in get(sandbox.cri.pod_ip(a.id))
    finally:
        plugin.stop()
        subprocess.run(["umount", "-l", str(plugin.store)], check=False)
