"""A checkpoint and a restore beside the NRI project's own sample plugins, on the same containerd:
``device-injector`` (a device and a mount, from pod annotations) and ``logger`` (an environment
variable in every container), registered before Rekindle (index 10 against its 50) and after it
(90). containerd merges the adjustments of every plugin in index order; Rekindle's touch other
fields, so nothing conflicts either way, and the restored container has what the other plugins
gave it, restored warm.

The binaries are those of github.com/containerd/nri's plugins/ (their own Go modules), found in
``$REKINDLE_NRI_SAMPLE_PLUGINS`` (default /opt/rekindle/nri-plugins); without them the tests are
skipped and say so. tests/e2e/test_second_nri_plugin.py covers a CDI-style plugin of our own."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_checkpoint_restore import COUNTER, READY, SERVER, fields, get, wait_http, wait_status, warm_up
from tests.waiting import wait_for

PLUGINS = Path(os.environ.get("REKINDLE_NRI_SAMPLE_PLUGINS", "/opt/rekindle/nri-plugins"))
DEVICE, MOUNT, ENV = "/dev/rekindle-other0", "/opt/other", "REKINDLE_OTHER_PLUGIN"

pytestmark = pytest.mark.skipif(not (PLUGINS / "device-injector").exists() or not (PLUGINS / "logger").exists(),
                                reason=f"the NRI sample plugins device-injector and logger are not in {PLUGINS}")


def _annotations(host: Path) -> dict[str, str]:
    """device-injector's annotations for the container named ``server``."""
    return {
        "devices.noderesource.dev/container.server":
            f"- path: {DEVICE}\n  type: c\n  major: 1\n  minor: 3\n  file_mode: 0666\n",
        "mounts.noderesource.dev/container.server":
            f"- source: {host}\n  destination: {MOUNT}\n  type: bind\n  options: [rbind, ro]\n",
    }


def _connected(sandbox, name: str) -> bool:
    return f'plugin "{name}" connected' in sandbox.log_path.read_text(errors="replace").replace('\\"', '"')


@pytest.fixture(params=["10", "90"], ids=["before-rekindle", "after-rekindle"])
def others(request, sandbox, plugin, tmp_path) -> Iterator[tuple[str, Path, Path]]:
    """Both sample plugins at one index; yields the index, the host dir device-injector mounts
    and the plugins' log."""
    idx = request.param
    host = tmp_path / "other-lib"
    host.mkdir()
    (host / "marker").write_text("from-the-other-plugin\n")
    log_path = tmp_path / "others.log"
    procs = []
    with open(log_path, "wb") as log:
        common = ["-idx", idx, "-socket-path", str(sandbox.nri_socket)]
        procs.append(subprocess.Popen([str(PLUGINS / "device-injector"), *common], stdout=log,
                                      stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([str(PLUGINS / "logger"), *common, "-events", "CreateContainer",
                                       "-add-env", ENV], stdout=log, stderr=subprocess.STDOUT))
    try:
        for name in (f"{idx}-device-injector", f"{idx}-logger"):
            wait_for(lambda: _connected(sandbox, name), 30, f"{name} to register with containerd", interval=0.1)
        yield idx, host, log_path
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def _inside(sandbox, cid: str) -> dict[str, str]:
    """What the other plugins gave the container, as its processes see it."""
    sh = (f"ls -l {DEVICE} 2>/dev/null | cut -c1; cat {MOUNT}/marker 2>/dev/null; "
          f"tr '\\0' '\\n' < /proc/1/environ | grep ^{ENV}= ; true")
    out = sandbox.cri.exec_sync(cid, ["/bin/sh", "-c", sh], timeout=10).out.split()
    env = next((w.split("=", 1)[1] for w in out if w.startswith(f"{ENV}=")), "")
    return {"device": "c" if "c" in out else "", "mount": "from-the-other-plugin" if "from-the-other-plugin" in out
            else "", "env": "logger-pid" if env.startswith("logger-pid-") else env}


GIVEN = {"device": "c", "mount": "from-the-other-plugin", "env": "logger-pid"}


def test_a_checkpoint_and_restore_through_the_nri_sample_plugins_keep_their_adjustments(sandbox, pod, plugin,
                                                                                        others):
    idx, host, others_log = others
    artifact = f"sample-{idx}"
    a = pod("src-sample", annotations={"rekindle.dev/checkpoint": artifact, **_annotations(host)})
    src = sandbox.run_container(a, "server", COUNTER, command=SERVER, env={**READY, "WARMUP_MIB": "64"})
    assert _inside(sandbox, src) == GIVEN
    ip = sandbox.cri.pod_ip(a.id)
    warm_up(ip, plugin.control_dir(a.uid, "server") / "ready-for-checkpoint", timeout=60)
    st = wait_status(plugin, "default", a.name, "server", {"published", "checkpoint-failed"}, timeout=120)
    assert st["phase"] == "published", st
    warm = get(ip, "/verify")

    b = pod("dst-sample", annotations={"rekindle.dev/restore": artifact, **_annotations(host)})
    dst = sandbox.run_container(b, "server", COUNTER, command=SERVER, env={"WARMUP_MIB": "64"})
    st = wait_status(plugin, "default", b.name, "server", {"restored", "cold-start"}, timeout=120)
    assert st["phase"] == "restored", st
    wait_http(sandbox.cri.pod_ip(b.id))
    assert fields(get(sandbox.cri.pod_ip(b.id)))["count"] == "4"  # warm: the source's three and this one
    assert get(sandbox.cri.pod_ip(b.id), "/verify") == warm
    # The target's spec has every plugin's adjustments, and its processes see them.
    spec = sandbox.containerd().get(dst).spec
    assert any(m.get("destination") == MOUNT for m in spec["mounts"])
    assert any(d.get("path") == DEVICE for d in spec["linux"]["devices"])
    assert any(e.startswith(f"{ENV}=logger-pid-") for e in spec["process"]["env"])
    assert any(e == "REKINDLE_CONTROL_DIR=/rekindle" for e in spec["process"]["env"])
    assert _inside(sandbox, dst) == GIVEN
    log = others_log.read_text(errors="replace")
    assert f"{b.name}/server: injected device" in log.replace("default/", ""), log[-2000:]
    assert "conflict" not in plugin.log()
