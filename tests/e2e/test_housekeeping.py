"""Housekeeping of the real plugin process when another writer planted a deep tree in its store:
the sweep at start reports and removes it, and every other step runs all the same."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import urllib.request
from pathlib import Path

from runtime.proc.owner import OWNER, Owner
from tests.e2e.plugin_process import PluginProcess
from tests.unit.test_store_gc import deep_tree
from tests.waiting import wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {k: float(v) for k, _, v in (line.rpartition(" ") for line in text.splitlines()
                                        if line and not line.startswith("#"))}


def test_a_1500_deep_tree_planted_in_the_store_stops_no_housekeeping(sandbox, tmp_path: Path) -> None:
    port = _free_port()
    plugin = PluginProcess(sandbox, tmp_path / "plugin",
                           extra_args=["--metrics-port", str(port), "--metrics-address", "127.0.0.1"])
    gone_boot = json.dumps({**dataclasses.asdict(Owner.me()), "boot_id": "another-boot"})
    planted = plugin.store / "team-a" / ".staging-qwen-7b-00000000000000aa"
    deep_tree(planted, depth=1500)
    (planted / OWNER).write_text(gone_boot)
    restore = plugin.state_dir / "logs" / "restore-default-a-interrupted"
    (restore / "private" / "criu").mkdir(parents=True)
    (restore / "private" / "criu" / "pages-1.img").write_bytes(b"p" * 4096)
    (restore / OWNER).write_text(gone_boot)
    plugin.start()  # housekeeping runs at once, then every 10 minutes
    try:
        wait_for(lambda: not planted.exists() and not (restore / "private").exists(), 60,
                 "the planted tree and the interrupted restore's copies to be removed")
        m = _metrics(port)
        assert m["rekindle_store_bad_leftovers"] == 1
        assert m['rekindle_housekeeping_failures_total{step="store_sweep"}'] == 0
        assert "store leftover staging team-a/.staging-qwen-7b-00000000000000aa" in plugin.log()
        assert plugin.proc is not None and plugin.proc.poll() is None
    finally:
        plugin.stop()
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(tmp_path / "plugin")], check=True)
