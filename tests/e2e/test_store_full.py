"""A checkpoint that runs out of space leaves nothing behind, and the source keeps running."""

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
