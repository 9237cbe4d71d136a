"""The plugin SIGKILLed at each moment of a restore's writable-layer apply, then restarted: the
container runs on its image's rootfs (cold) or on the source's (restored), never on a mix, and
no undo journal is left in the rootfs.

The source's writable layer holds 501 files (an edited /etc/passwd and /etc/group, 498 new
files, the counter's state file), deletes a file of the image and a whole directory of it.
Moments (``runtime.testpause``): ``deleted`` (the deletions done, no file written yet),
``member`` (200 of the files written), ``applied`` (the whole layer applied, CRIU not begun),
``criu`` (CRIU done, the tree stopped for its fill). The kill used to leave the container on no
/etc/passwd, the source's, 0 to 400 of the files, and a ``/.rekindle-undo-<hex>/`` holding the
image's originals that a checkpoint of that pod would have captured.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import stat
from collections.abc import Iterator
from typing import Any

import pytest

from runtime.errors import RekindleError
from runtime.status import Phase, StatusBook
from tests.e2e.plugin_process import PluginProcess
from tests.waiting import wait_for

log = logging.getLogger(__name__)
COUNTER = "localhost/rekindle/counter:1"
FILES = 498  # + /etc/passwd, /etc/group and the counter's state file: 501 in the layer
SOURCE = ("mkdir /data && i=0 && while [ $i -lt %d ]; do echo \"file $i\" > /data/f$i; i=$((i+1)); done"
          " && echo 'svc:x:1000:1000::/:/bin/sh' >> /etc/passwd && echo 'svc:x:1000:' >> /etc/group"
          " && rm -rf /usr/sbin && exec /usr/local/bin/counter-server 8080") % FILES
# The restored pod's own command: it changes nothing in the rootfs, so a cold start leaves the
# image's rootfs to compare with.
IDLE = ["/bin/sh", "-c", "exec sleep 100000"]
MOMENTS = ["deleted", "member", "applied", "criu"]


def _mount_points(pid: int) -> set[str]:
    with open(f"/proc/{pid}/mountinfo") as f:
        return {line.split()[4].lstrip("/") for line in f} - {""}


def rootfs_of(pid: int) -> dict[str, Any]:
    """Every entry of a container's rootfs as its init sees it (mounts left out): type, mode,
    owner, and data or target, without following symlinks."""
    root = f"/proc/{pid}/root"
    skip = _mount_points(pid) | {".rekindle"}  # the init's own dir (its bind mount's parent)
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if rel_dir + d not in skip]
        for name in dirnames + filenames:
            rel = rel_dir + name
            if rel in skip:
                continue
            st = os.lstat(os.path.join(dirpath, name))
            info: dict[str, Any] = {"mode": oct(st.st_mode), "owner": (st.st_uid, st.st_gid)}
            if stat.S_ISREG(st.st_mode):
                with open(os.path.join(dirpath, name), "rb") as f:
                    info["sha"] = hashlib.sha256(f.read()).hexdigest()
                info["mtime_ns"] = st.st_mtime_ns
            elif stat.S_ISLNK(st.st_mode):
                info["target"] = os.readlink(os.path.join(dirpath, name))
            out[rel] = info
    return out


def init_pid(sandbox: Any, cid: str) -> int:
    from runtime.container.containers import resolve_container
    return resolve_container(str(sandbox.state_dir), cid).init_pid


@pytest.fixture(scope="module")
def world(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A plugin, a published source with the 501-file layer, and an unannotated pod of the same
    image (the image's rootfs)."""
    work = tmp_path_factory.mktemp("rootfs-faults")
    plugin = PluginProcess(sandbox, work / "plugin")
    plugin.start()
    pods = []
    try:
        src = sandbox.cri.run_pod_sandbox("rootfs-src", "default", annotations={"rekindle.dev/checkpoint": "layer501"})
        pods.append(src)
        src_cid = sandbox.run_container(src, "server", COUNTER, command=["/bin/sh", "-c", SOURCE])
        st = StatusBook(plugin.state_dir).wait("default", src.name, "server", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 180)
        assert st is not None and st.phase is Phase.PUBLISHED, (st, plugin.log()[-3000:])
        image = sandbox.cri.run_pod_sandbox("rootfs-image", "default")
        pods.append(image)
        image_cid = sandbox.run_container(image, "server", COUNTER, command=IDLE)
        source_fs, image_fs = rootfs_of(init_pid(sandbox, src_cid)), rootfs_of(init_pid(sandbox, image_cid))
        layer = [k for k, v in source_fs.items() if "sha" in v and v != image_fs.get(k)]
        assert len(layer) == FILES + 3 and "usr/sbin" in image_fs and "usr/sbin" not in source_fs
        yield {"plugin": plugin, "work": work, "source": source_fs, "image": image_fs}
    finally:
        plugin.stop()
        for p in pods:
            try:
                sandbox.cri.stop_pod(p.id)
                sandbox.cri.remove_pod(p.id)
            except RekindleError as e:  # as the pod fixture: a busy netns must not fail a test
                log.warning("cleaning up pod %s: %s", p.name, e)


def _restore(sandbox: Any, pod: Any, world: dict[str, Any], name: str) -> tuple[Any, str]:
    b = pod(name, annotations={"rekindle.dev/restore": "layer501"})
    return b, sandbox.run_container(b, "server", COUNTER, command=IDLE)


def _no_journal_anywhere(world: dict[str, Any], pid: int, cid: str) -> None:
    assert not [n for n in os.listdir(f"/proc/{pid}/root") if n.startswith(".rekindle-")], os.listdir(f"/proc/{pid}/root")
    assert not (world["plugin"].state_dir / "rootfs-undo" / cid).exists()


def _diff(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))[:20]


def test_a_restore_that_is_not_killed_brings_the_source_rootfs(sandbox, pod, world):
    """The comparison's baseline: restored, the rootfs is the source's, file by file."""
    plugin = world["plugin"]
    b, cid = _restore(sandbox, pod, world, "rootfs-restored")
    st = StatusBook(plugin.state_dir).wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 120)
    assert st is not None and st.phase is Phase.RESTORED, (st, plugin.log()[-3000:])
    pid = init_pid(sandbox, cid)
    got = rootfs_of(pid)
    assert got == world["source"], _diff(got, world["source"])
    _no_journal_anywhere(world, pid, cid)


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_plugin_killed_during_the_rootfs_apply_leaves_the_image_rootfs(sandbox, pod, world, moment):
    plugin: PluginProcess = world["plugin"]
    pause = world["work"] / f"pause-{moment}"
    pause.mkdir()
    plugin.stop()
    plugin.env = {"REKINDLE_TEST_PAUSE": f"{moment}:{pause}"}
    plugin.start()
    try:
        b, cid = _restore(sandbox, pod, world, f"rootfs-kill-{moment}")
        wait_for(lambda: (pause / f"{moment}.reached").exists(), 60, f"the restore to reach {moment}",
                 interval=0.02)
        plugin.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        plugin.proc.wait(10)  # type: ignore[union-attr]
    finally:
        plugin.env = {}
    plugin.start()
    st = StatusBook(plugin.state_dir).wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 120)
    assert st is not None and st.phase is Phase.COLD_START, (st, plugin.log()[-3000:])
    assert "agent restarted during the restore" in st.reason, st
    ctl = plugin.control_dir(b.uid, "server")
    wait_for(lambda: (ctl / "cold-start").exists(), 30, "the init to start cold")
    pid = init_pid(sandbox, cid)
    # The cold-started command runs on exactly the image's files: nothing of the source's layer,
    # nothing of what the apply had done so far, nothing of the image missing.
    got = rootfs_of(pid)
    assert got == world["image"], _diff(got, world["image"])
    _no_journal_anywhere(world, pid, cid)
    assert not (ctl / "rootfs-pending").exists()


def test_a_criu_failure_after_a_complete_apply_leaves_the_image_rootfs(sandbox, pod, world):
    """The diff applied completely used to stay when CRIU failed after it: the cold start ran on
    the source's files."""
    from runtime.criu.command import CRIU
    plugin: PluginProcess = world["plugin"]
    wrapper = world["work"] / "criu-refusing-restore"
    wrapper.write_text('#!/bin/sh\ncase " $* " in *" restore "*) echo "refused by the test" >&2; exit 1;; esac\n'
                       f'exec {CRIU} "$@"\n')
    wrapper.chmod(0o755)
    plugin.stop()
    plugin.env = {"REKINDLE_CRIU": str(wrapper)}
    plugin.start()
    rolled = plugin.log().count("rolled back the restore's rootfs changes")
    try:
        b, cid = _restore(sandbox, pod, world, "rootfs-criu-fails")
        st = StatusBook(plugin.state_dir).wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 120)
        assert st is not None and st.phase is Phase.COLD_START and "criu" in st.reason.lower(), st
        ctl = plugin.control_dir(b.uid, "server")
        wait_for(lambda: (ctl / "cold-start").exists(), 30, "the init to start cold")
        pid = init_pid(sandbox, cid)
        got = rootfs_of(pid)
        assert got == world["image"], _diff(got, world["image"])
        _no_journal_anywhere(world, pid, cid)
        assert not (ctl / "rootfs-pending").exists()
        assert plugin.log().count("rolled back the restore's rootfs changes") == rolled + 1
    finally:
        plugin.stop()
        plugin.env = {}
        plugin.start()


def test_a_source_holding_a_fifo_of_its_writable_layer_restores(sandbox, pod, world):
    """The fifo used to be left out of the capture: CRIU's restore reopens it by name and failed,
    on every restore of that artifact."""
    plugin: PluginProcess = world["plugin"]
    book = StatusBook(plugin.state_dir)
    a = pod("fifo-src", annotations={"rekindle.dev/checkpoint": "fifo-layer"})
    sandbox.run_container(a, "server", COUNTER, command=[
        "/bin/sh", "-c", "mkfifo -m 640 /run/pipe && exec 3<>/run/pipe && exec /usr/local/bin/counter-server 8080"])
    st = book.wait("default", a.name, "server", {Phase.PUBLISHED, Phase.CHECKPOINT_FAILED}, 180)
    assert st is not None and st.phase is Phase.PUBLISHED, (st, plugin.log()[-3000:])
    b = pod("fifo-dst", annotations={"rekindle.dev/restore": "fifo-layer"})
    cid = sandbox.run_container(b, "server", COUNTER, command=IDLE)
    st = book.wait("default", b.name, "server", {Phase.RESTORED, Phase.COLD_START}, 120)
    assert st is not None and st.phase is Phase.RESTORED, (st, plugin.log()[-3000:])
    pipe = os.lstat(f"/proc/{init_pid(sandbox, cid)}/root/run/pipe")
    assert stat.S_ISFIFO(pipe.st_mode) and stat.S_IMODE(pipe.st_mode) == 0o640, oct(pipe.st_mode)
