"""The streamed restore path (REKINDLE_RESTORE_PATH=stream) through containerd, runc, CRIU's
--lazy-pages hand-off and the real plugin: the tree runs right after CRIU while its bulk pages
are served through userfaultfd, verified piece by piece."""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.test_checkpoint_restore import (COUNTER, READY, SERVER, fields, get, wait_http, wait_status,
                                               warm_up)
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
