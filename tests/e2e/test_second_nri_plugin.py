"""A restore beside a second NRI plugin that injects devices, mounts and environment at
CreateContainer, the way the GPU Operator's CDI NRI plugin does (tests/e2e/cdi_like_plugin.py),
on the same containerd. Rekindle runs at a higher index (the chart's default 90 against the other
plugin's 10), so it sees the container as the other plugin left it; its own adjustments touch
other fields, so containerd merges both without a conflict.

What the restore carries from the source is never applied to the target: a pod restored without
the CDI annotation gets neither the device, nor the mount, nor the environment the source had."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e import cdi_like_plugin as cdi
from tests.e2e.plugin_process import REPO
from tests.e2e.test_checkpoint_restore import COUNTER, READY, SERVER, fields, get, wait_http, wait_status, warm_up
from tests.waiting import wait_for

ANNOTATION = {"cdi.k8s.io/rekindle-test": cdi.ANNOTATION_VALUE}


@pytest.fixture
def other_plugin(sandbox, plugin, tmp_path):
    host = tmp_path / "cdi-lib"
    host.mkdir()
    (host / "marker").write_text("from-the-host\n")
    log = open(tmp_path / "cdi-like.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.cdi_like_plugin", str(sandbox.nri_socket), "10",
                             str(host)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    probe = sandbox.cri.run_pod_sandbox("cdi-like-probe", annotations=ANNOTATION)
    try:  # registered once a container of an annotated pod gets the mount
        def injected() -> bool:
            cid = sandbox.cri.create_container(probe, f"probe-{injected.n}", COUNTER, command=["/bin/sleep", "30"])
            injected.n += 1
            sandbox.cri.start_container(cid)
            out = sandbox.cri.exec_sync(cid, ["/bin/cat", "/opt/cdi/marker"], timeout=10).out
            return "from-the-host" in out
        injected.n = 0
        wait_for(injected, 30, "the second NRI plugin to inject its mount", interval=0.2)
    finally:
        sandbox.cri.stop_pod(probe.id)
    yield tmp_path / "cdi-like.log"
    proc.terminate()
    proc.wait(10)


def _inside(sandbox, cid: str) -> dict[str, str]:
    sh = (f"ls -l {cdi.DEVICE} 2>/dev/null | cut -c1; cat {cdi.MOUNT}/marker 2>/dev/null; "
          f"tr '\\0' '\\n' < /proc/1/environ | grep -c {cdi.ENV} ; true")
    out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", sh], timeout=10).out.split()
    return {"device": "c" if "c" in out else "", "mount": "from-the-host" if "from-the-host" in out else "",
            "env": out[-1] if out else ""}


def test_a_restore_beside_a_cdi_injecting_plugin_keeps_what_it_injected(sandbox, pod, plugin, other_plugin):
    a = pod("src-cdi", annotations={"rekindle.dev/checkpoint": "cdi", **ANNOTATION})
    src = sandbox.run_container(a, "server", COUNTER, command=SERVER, env={**READY, "WARMUP_MIB": "64"})
    assert _inside(sandbox, src) == {"device": "c", "mount": "from-the-host", "env": "1"}
    ip = sandbox.cri.pod_ip(a.id)
    warm_up(ip, plugin.control_dir(a.uid, "server") / "ready-for-checkpoint", timeout=60)
    st = wait_status(plugin, "default", a.name, "server", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st
    warm = get(ip, "/verify")

    b = pod("dst-cdi", annotations={"rekindle.dev/restore": "cdi", **ANNOTATION})
    dst = sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "64"})
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"}, timeout=120)
    assert st["phase"] == "restored", st
    wait_http(sandbox.cri.pod_ip(b.id))
    assert fields(get(sandbox.cri.pod_ip(b.id)))["count"] == "4"
    assert get(sandbox.cri.pod_ip(b.id), "/verify") == warm
    # The other plugin's adjustments are in the restored container; the container's own init
    # still holds the injected environment, and a process of the container sees the device and mount.
    assert _inside(sandbox, dst) == {"device": "c", "mount": "from-the-host", "env": "1"}
    assert f"into {b.name}/server" in other_plugin.read_text()
    assert "conflict" not in plugin.log()


def test_what_the_source_was_given_is_never_given_to_a_target_without_it(sandbox, pod, plugin, other_plugin):
    a = pod("src-cdi-only", annotations={"rekindle.dev/checkpoint": "cdi-only", **ANNOTATION})
    sandbox.run_container(a, "server", COUNTER, command=SERVER, env={**READY, "WARMUP_MIB": "64"})
    warm_up(sandbox.cri.pod_ip(a.id), plugin.control_dir(a.uid, "server") / "ready-for-checkpoint", timeout=60)
    st = wait_status(plugin, "default", a.name, "server", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st

    b = pod("dst-no-cdi", annotations={"rekindle.dev/restore": "cdi-only"})  # no CDI annotation
    dst = sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "64"})
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"}, timeout=120)
    wait_http(sandbox.cri.pod_ip(b.id), timeout=60)
    # The source's device rule is more than the target's spec grants: refused, started cold, and
    # the target has only what its own spec gave it.
    assert st["phase"] == "cold-start" and "less privileged than the source" in st["reason"], st
    assert "c 1:3" in st["reason"], st
    assert _inside(sandbox, dst) == {"device": "", "mount": "", "env": "0"}
    assert f"into {b.name}/" not in other_plugin.read_text()
    assert fields(get(sandbox.cri.pod_ip(b.id)))["count"] == "1"
