"""The undo journal outside the rootfs: an apply killed at any step, or a restore that fails after
a complete apply, is rolled back (also by another process) and nothing of it is left in the
rootfs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from runtime import control
from runtime.overlay import pending as overlay_pending
from runtime.overlay import undo as overlay_undo
from runtime.overlay.rootfs import PAUSE_AT_MEMBER, apply, capture
from tests.unit.test_overlay import image_tree, member, needs_root, overlay, snapshot, write_tar

__all__ = ["overlay"]  # the fixture, used by name
REPO = Path(__file__).resolve().parents[2]


def layer(tmp_path: Path) -> tuple[Path, Path]:
    """A source's layer: an edited passwd, a new group (the image's deleted), 300 new files (an
    empty one among them), deleted and emptied dirs, a file turned into a dir, a symlink, a fifo."""
    (tmp_path / "d.json").write_text(json.dumps([{"path": "etc/group", "type": "whiteout"},
                                                 {"path": "cache", "type": "opaque"},
                                                 {"path": "usr/lib", "type": "whiteout"}]))
    tar = write_tar(tmp_path / "d.tar", [
        member("etc", tarfile.DIRTYPE, pax={"SCHILY.xattr.user.new": "1"}),
        member("etc/passwd", data=b"root:x:0:0\nsvc:x:1000:1000\n"),
        member("etc/group", data=b"root:x:0:\nsvc:x:1000:\n"),
        member("cache", tarfile.DIRTYPE), member("cache/fresh"),
        member("opt/tool", tarfile.DIRTYPE), member("opt/tool/x"),
        member("var/data", tarfile.SYMTYPE, link="/elsewhere"),
        member("run", tarfile.DIRTYPE), member("run/pipe", tarfile.FIFOTYPE),
        member("new", tarfile.DIRTYPE), member("new/empty", data=b""),
        *(member(f"new/{i:03d}", data=b"%d" % i) for i in range(300))])
    return tar, tmp_path / "d.json"


def journals_left(rootfs: Path) -> list[str]:
    return [p.name for p in rootfs.iterdir() if p.name.startswith(".rekindle")]


@needs_root
def test_a_journal_outside_the_rootfs_rolls_back_a_complete_apply(tmp_path: Path, overlay: Any) -> None:
    """Today's bug: a diff that applied completely stayed when a later step (CRIU) failed."""
    lower = tmp_path / "lower"
    image_tree(lower)
    _, rootfs = overlay("c", lower)
    before = snapshot(rootfs)
    tar, dels = layer(tmp_path)
    journal = tmp_path / "undo" / "01-rootfs"
    journal.parent.mkdir()
    stats = apply(str(rootfs), str(tar), str(dels), journal=str(journal))
    assert stats.files == 305 and stats.fifos == 1 and (rootfs / "etc" / "passwd").read_bytes().startswith(b"root")
    assert journals_left(rootfs) == []  # the originals are in the journal, outside
    assert (journal / "journal").exists()
    assert overlay_undo.roll_back(str(journal)) == []
    assert snapshot(rootfs) == before


def _apply_in_child(tmp_path: Path, rootfs: Path, step: str) -> subprocess.Popen[bytes]:
    tar, dels = layer(tmp_path)
    code = ("import sys; from runtime.overlay.rootfs import apply; "
            "apply(sys.argv[1], sys.argv[2], sys.argv[3], journal=sys.argv[4]); "
            "from runtime.testpause import pause_for_test; pause_for_test('applied')")
    return subprocess.Popen([sys.executable, "-c", code, str(rootfs), str(tar), str(dels),
                             str(tmp_path / "undo" / "c1" / "01-rootfs")], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO),
                                 "REKINDLE_TEST_PAUSE": f"{step}:{tmp_path}"})


@needs_root
@pytest.mark.parametrize("step", ["deleted", "member", "applied"])
def test_an_apply_killed_at_any_step_is_rolled_back_by_the_next_process(
        tmp_path: Path, overlay: Any, step: str) -> None:
    lower = tmp_path / "lower"
    image_tree(lower)
    _, rootfs = overlay("c", lower)
    before = snapshot(rootfs)
    ctl = control.ControlDir(tmp_path / "ctl")
    ctl.prepare()
    pending = overlay_pending.Pending(str(tmp_path / "undo"), "c1", ctl)
    pending.begin()  # as the restore does, in the process that is killed
    child = _apply_in_child(tmp_path, rootfs, step)
    deadline = time.monotonic() + 30
    while not (tmp_path / f"{step}.reached").exists():
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    changed = snapshot(rootfs) != before
    assert changed and ctl.exists(control.ROOTFS_PENDING)
    if step == "member":
        assert len(os.listdir(rootfs / "new")) < PAUSE_AT_MEMBER  # half applied
    # The owner (this process, standing in for the dead agent) is gone: pretend so.
    (tmp_path / "undo" / "c1" / ".owner.json").unlink()
    assert overlay_pending.recover(str(tmp_path / "undo"), "c1", ctl) == []
    assert snapshot(rootfs) == before and journals_left(rootfs) == []
    assert not ctl.exists(control.ROOTFS_PENDING) and not (tmp_path / "undo" / "c1").exists()


@needs_root
def test_a_rollback_killed_half_way_is_run_again_to_the_same_rootfs(tmp_path: Path, overlay: Any) -> None:
    lower = tmp_path / "lower"
    image_tree(lower)
    _, rootfs = overlay("c", lower)
    before = snapshot(rootfs)
    tar, dels = layer(tmp_path)
    journal = tmp_path / "01-rootfs"
    apply(str(rootfs), str(tar), str(dels), journal=str(journal))
    code = ("import sys, runtime.overlay.undo as u, runtime.overlay.fs as f; real = f.remove; n = [0]\n"
            "def remove(parent, name):\n"
            "    n[0] += 1\n"
            "    if n[0] == 150: import os; os.kill(os.getpid(), 9)\n"
            "    return real(parent, name)\n"
            "u.remove = remove; u.roll_back(sys.argv[1])")
    killed = subprocess.run([sys.executable, "-c", code, str(journal)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert killed.returncode == -signal.SIGKILL
    assert snapshot(rootfs) != before
    assert overlay_undo.roll_back(str(journal)) == []
    assert snapshot(rootfs) == before


def test_a_record_cut_short_by_a_kill_is_ignored(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc" / "passwd").write_bytes(b"root")
    before = snapshot(rootfs)
    tar = write_tar(tmp_path / "d.tar", [member("etc/passwd", data=b"edited"), member("etc/new")])
    (tmp_path / "d.json").write_text("[]")
    journal = tmp_path / "j"
    apply(str(rootfs), str(tar), str(tmp_path / "d.json"), journal=str(journal))
    with open(journal / "journal", "ab") as f:
        f.write(b'["created", "etc/never-made", [1, ')  # the kill came in the middle of this write
    assert overlay_undo.roll_back(str(journal)) == []
    assert snapshot(rootfs) == before


def test_a_journal_whose_rootfs_is_gone_is_dropped_unread(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    tar = write_tar(tmp_path / "d.tar", [member("f")])
    (tmp_path / "d.json").write_text("[]")
    undo = tmp_path / "undo"
    undo.mkdir()
    (undo / "c1").mkdir()
    apply(str(rootfs), str(tar), str(tmp_path / "d.json"), journal=str(undo / "c1" / "01-rootfs"))
    assert overlay_pending.sweep(str(undo)) == []  # its rootfs is there: left to recover()
    rootfs.rename(tmp_path / "removed")
    rootfs.mkdir()  # another directory at that path (another inode)
    assert overlay_pending.sweep(str(undo)) == ["c1"]
    assert os.listdir(undo) == []


def test_an_undo_backup_an_older_agent_left_in_a_rootfs_is_never_captured(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    (upper / ".rekindle-undo-0123abcd").mkdir(parents=True)
    (upper / ".rekindle-undo-0123abcd" / "0").write_bytes(b"root:x:0:0")
    (upper / "app").mkdir()
    (upper / "app" / ".rekindle-undo-kept").write_bytes(b"not at the root: the workload's own")
    capture(str(upper), str(tmp_path / "d.tar"), str(tmp_path / "d.json"), exclude=[])
    with tarfile.open(tmp_path / "d.tar") as t:
        assert sorted(t.getnames()) == ["app", "app/.rekindle-undo-kept"]
