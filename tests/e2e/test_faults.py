"""Faults that land while the plugin works, on the real parts (bench/fault_drill.py found them).

A containerd restart is not a plugin restart: the plugin reconnects and containerd sends
Synchronize again, but a restore the plugin is still running must go on to the end, not be
declared cut short (which made the init start cold and kill the half-restored tree).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request

from tests.e2e.plugin_process import PluginProcess

COUNTER = "localhost/rekindle/counter:1"
SERVER = ["/usr/local/bin/counter-server", "8080"]
# Large enough that CRIU and the bulk fill take a few seconds after CRIU starts.
WARM = {"WARMUP_MIB": "2048", "WARMUP_PASSES": "1"}


def _get(ip: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{ip}:8080/", timeout=2) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _start_of(answer: str) -> tuple[str, str]:
    f = dict(re.findall(r"(\w+)=(.*?)(?= \w+=|$)", answer.strip()))
    return f["pid"], f["state"]


def _criu_restore_running(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"criu") and b"restore" in argv and any(marker.encode() in a for a in argv):
            return True
    return False


def test_a_containerd_restart_during_a_restore_lets_it_finish(sandbox, pod, tmp_path):
    from runtime.status import Phase, StatusBook
    plugin = PluginProcess(sandbox, tmp_path / "plugin")
    plugin.start()
    book = StatusBook(plugin.state_dir)
    try:
        a = pod("src-ctrd-restart", annotations={"rekindle.dev/checkpoint": "ctrd-restart"})
        sandbox.run_container(a, "server", COUNTER, command=SERVER, env=WARM)
        st = book.wait("default", a.name, "server", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 180)
        assert st is not None and st.phase is Phase.PUBLISHED, st
        source = _get(sandbox.cri.pod_ip(a.id))
        sandbox.cri.stop_pod(a.id)

        b = pod("dst-ctrd-restart", annotations={"rekindle.dev/restore": "ctrd-restart"})
        cid = sandbox.run_container(b, "server", COUNTER, command=SERVER, env=WARM)
        marker = f"/restore-default-ctrd-restart-{cid[:12]}-"
        deadline = time.monotonic() + 60
        while not _criu_restore_running(marker):
            assert time.monotonic() < deadline, f"criu restore never started:\n{plugin.log()[-3000:]}"
            time.sleep(0.01)
        synced = plugin.log().count("synchronized:")
        sandbox.sandbox.restart()
        plugin.wait_log("synchronized:", count=synced + 1, timeout=60)
        st = book.wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 180)
        log = plugin.log()
        assert st is not None and st.phase is Phase.RESTORED, (st, log[-3000:])
        # The reconnect came while the restore ran, and left it to its job.
        assert "dst-ctrd-restart:server: its restore job runs on after the reconnect" in log, log[-3000:]
        answer = _get(sandbox.cri.pod_ip(b.id))
        # The source's process (its pid, the state file it wrote at start), not a cold start.
        assert _start_of(answer) == _start_of(source), (answer, source)
        ctl = plugin.control_dir(b.uid, "server")
        assert not (ctl / "restore-failed").exists() and not (ctl / "cold-start").exists()
        out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", "ps -o comm | grep -cx counter-server"], timeout=10)
        assert out.out.strip() == "1", out
    finally:
        plugin.stop()


def _wait_log(plugin: PluginProcess, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(needle, plugin.log()):
        assert time.monotonic() < deadline, f"plugin log lacks {needle!r}:\n{plugin.log()[-3000:]}"
        time.sleep(0.05)


def test_a_checkpoint_begun_while_containerd_is_down_publishes_a_restorable_artifact(sandbox, pod, tmp_path):
    """The image id comes from containerd: asked while it restarts, the checkpoint waits for it
    (it once published an artifact with an empty id, which every restore then refused)."""
    from runtime.status import Phase, StatusBook
    plugin = PluginProcess(sandbox, tmp_path / "plugin")
    plugin.start()
    book = StatusBook(plugin.state_dir)
    try:
        a = pod("src-ctrd-down", annotations={"rekindle.dev/checkpoint": "ctrd-down"})
        gated = "while [ ! -e /rekindle/go ]; do sleep 0.05; done; exec " + " ".join(SERVER)
        sandbox.run_container(a, "server", COUNTER, command=["/bin/sh", "-c", gated])
        ctl = plugin.control_dir(a.uid, "server")

        def checkpoint_begins() -> None:  # while containerd is stopped
            (ctl / "go").write_text("")
            # The checkpoint asks containerd (the pod's containers, the image id) and waits.
            _wait_log(plugin, f"image digest of {re.escape(COUNTER)} unavailable|containerd did not answer", 60)

        sandbox.sandbox.restart(while_down=checkpoint_begins)
        st = book.wait("default", a.name, "server", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 120)
        assert st is not None and st.phase is Phase.PUBLISHED, (st, plugin.log()[-3000:])
        manifest = json.loads((plugin.store / "default" / "ctrd-down" / "manifest.json").read_text())
        assert manifest["source"]["image_ref"] == sandbox.cri.image_ref(COUNTER), manifest["source"]
        source = _get(sandbox.cri.pod_ip(a.id))

        b = pod("dst-ctrd-down", annotations={"rekindle.dev/restore": "ctrd-down"})
        sandbox.run_container(b, "server", COUNTER, command=["/bin/sh", "-c", gated])
        st = book.wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 120)
        assert st is not None and st.phase is Phase.RESTORED, (st, plugin.log()[-3000:])
        assert _start_of(_get(sandbox.cri.pod_ip(b.id))) == _start_of(source)
    finally:
        plugin.stop()
