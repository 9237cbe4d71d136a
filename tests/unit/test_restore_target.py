"""restore_target.check: `rekindle restore` goes ahead only for a container the plugin prepared
(its init waiting in restore mode, the plugin's control dir, no outcome yet, nothing else
running). The bundle is faked; pid 1 of the "container" is a real process whose command line
is the init's (``exec -a``), so /proc is read as it would be."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nri_plugin import restore_target
from nri_plugin.swap import init_command
from runtime import control
from runtime.container.containers import ContainerInfo
from tests.waiting import wait_for

CID = "e" * 64


@pytest.fixture
def init():
    proc = subprocess.Popen(["/bin/bash", "-c", f"exec -a {control.INIT_IN_CONTAINER} sleep 60"])
    try:
        wait_for(lambda: restore_target._cmdline(proc.pid)[:1] == [control.INIT_IN_CONTAINER], 5,
                 "the stand-in init to exec", interval=0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _target(tmp_path: Path, pid: int, args: list[str], control_source: str | None) -> ContainerInfo:
    mounts = [{"destination": "/proc", "source": "proc"}]
    if control_source is not None:
        mounts.append({"destination": control.CONTAINER_PATH, "source": control_source, "type": "bind"})
    spec = {"process": {"args": args}, "mounts": mounts,
            "annotations": {"io.kubernetes.cri.image-name": "localhost/rekindle/counter:1"}}
    return ContainerInfo(id=CID, bundle=str(tmp_path), spec=spec, init_pid=pid, rootfs="/nonexistent",
                         upperdir="/nonexistent", namespaces={}, cgroup_version=2, cgroups={}, stdio=("", "", ""),
                         hostname="h")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    ctl = tmp_path / "state" / "control" / "pod-uid" / "app"
    ctl.mkdir(parents=True)
    return tmp_path / "state"


def check(monkeypatch, tmp_path, state, info: ContainerInfo) -> restore_target.Target:
    monkeypatch.setattr(restore_target, "resolve_container", lambda _state, _cid: info)
    return restore_target.check(str(tmp_path / "containerd"), str(state), CID)


def test_a_prepared_target_passes_with_its_image(monkeypatch, tmp_path, state, init):
    src = str(state / "control" / "pod-uid" / "app")
    t = check(monkeypatch, tmp_path, state, _target(tmp_path, init.pid, init_command("restore", 300, ["x"]), src))
    assert t.image == "localhost/rekindle/counter:1" and t.control.path == Path(src)


@pytest.mark.parametrize("args, control_dir, why", [
    (["/bin/sleep", "1000"], "ok", "it runs '/bin/sleep', not /.rekindle/bin/rekindle-init in restore mode"),
    (init_command("source", 300, ["x"]), "ok", "its init runs in source mode"),
    (init_command("restore", 300, ["x"]), None, "it has no control dir mounted at /rekindle"),
    (init_command("restore", 300, ["x"]), "/var/lib/elsewhere/control/u/app", "is not under"),
    (init_command("restore", 300, ["x"]), "ok/../../../../elsewhere", "is not under"),
], ids=["plain", "source-mode", "no-control-dir", "foreign-control-dir", "dot-dot"])
def test_what_is_refused(monkeypatch, tmp_path, state, init, args, control_dir, why):
    src = str(state / "control" / "pod-uid" / "app")
    source = None if control_dir is None else control_dir.replace("ok", src, 1)
    with pytest.raises(restore_target.TargetRefused, match="is not waiting for a restore") as exc:
        check(monkeypatch, tmp_path, state, _target(tmp_path, init.pid, args, source))
    assert why in str(exc.value) and "nothing was changed" in str(exc.value)


@pytest.mark.parametrize("outcome", [control.RESTORE_COMPLETE, control.RESTORE_FAILED, control.COLD_START])
def test_an_init_that_decided_already_is_refused(monkeypatch, tmp_path, state, init, outcome):
    src = state / "control" / "pod-uid" / "app"
    (src / outcome).write_text("x\n")
    with pytest.raises(restore_target.TargetRefused, match=f"decided already \\({outcome}"):
        check(monkeypatch, tmp_path, state, _target(tmp_path, init.pid, init_command("restore", 300, ["x"]), str(src)))


def test_a_pid_1_that_is_not_the_init_or_has_children_is_refused(monkeypatch, tmp_path, state):
    src = str(state / "control" / "pod-uid" / "app")
    args = init_command("restore", 300, ["x"])
    other = subprocess.Popen(["/bin/sleep", "60"])
    parent = subprocess.Popen(["/bin/bash", "-c", f"exec -a {control.INIT_IN_CONTAINER} bash -c 'sleep 60 & wait'"])
    try:
        with pytest.raises(restore_target.TargetRefused, match="no longer runs the init"):
            check(monkeypatch, tmp_path, state, _target(tmp_path, other.pid, args, src))
        from runtime.container.containers import children
        wait_for(lambda: children(parent.pid), 5, "the child to start", interval=0.02)
        with pytest.raises(restore_target.TargetRefused, match="has started processes"):
            check(monkeypatch, tmp_path, state, _target(tmp_path, parent.pid, args, src))
    finally:
        for p in (other, parent):
            p.kill()
            p.wait()
