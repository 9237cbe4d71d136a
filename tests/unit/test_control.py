"""The control directory (runtime/control.py): validated names, a clean start, writes that never
follow what the workload planted, capped reads."""

from __future__ import annotations

import os
import stat

import pytest

from runtime import control
from runtime.errors import AnnotationError


@pytest.mark.parametrize("uid, container", [
    ("../../etc", "app"), ("", "app"), ("u1\n", "app"),
    ("u1", "../x"), ("u1", "App"), ("u1", "a" * 64), ("u1", "app\n"),
], ids=["uid-traversal", "uid-empty", "uid-newline", "ctr-traversal", "ctr-upper", "ctr-too-long", "ctr-newline"])
def test_names_from_the_pod_are_checked_before_they_become_paths(tmp_path, uid, container):
    with pytest.raises(AnnotationError):
        control.control_dir_for(tmp_path, uid, container)


def test_prepare_makes_a_sticky_shared_dir_and_clears_the_last_attempts_files(tmp_path):
    ctl = control.control_dir_for(tmp_path, "0b6c-uid", "app")
    assert ctl.path == tmp_path / "control" / "0b6c-uid" / "app"
    ctl.path.mkdir(parents=True)
    for name in control.PROTOCOL_FILES:
        (ctl.path / name).write_text("old")
    (ctl.path / "model-cache").write_text("the workload's own")
    ctl.prepare()
    assert stat.S_IMODE(os.stat(ctl.path).st_mode) == 0o1777
    assert sorted(p.name for p in ctl.path.iterdir()) == ["model-cache"]


def test_ready_names_the_first_ready_file_ours_before_dynamos(tmp_path):
    ctl = control.ControlDir(tmp_path)
    assert ctl.ready() is None
    (tmp_path / "ready-for-snapshot").write_text("")
    assert ctl.ready() == "ready-for-snapshot"
    (tmp_path / "ready-for-checkpoint").write_text("")
    assert ctl.ready() == "ready-for-checkpoint"


def test_write_replaces_a_planted_symlink_instead_of_following_it(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("keep")
    ctl = control.ControlDir(tmp_path / "ctl")
    ctl.path.mkdir()
    (ctl.path / control.RESTORE_FAILED).symlink_to(outside)
    ctl.write(control.RESTORE_FAILED, "reason\n")
    assert outside.read_text() == "keep"
    assert not (ctl.path / control.RESTORE_FAILED).is_symlink()
    assert ctl.read(control.RESTORE_FAILED) == "reason\n"
    assert [p.name for p in ctl.path.iterdir()] == [control.RESTORE_FAILED], "no temp file left behind"


def test_read_follows_no_symlink_and_is_capped(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("host secret")
    ctl = control.ControlDir(tmp_path / "ctl")
    ctl.path.mkdir()
    (ctl.path / "restore-pid").symlink_to(secret)
    assert ctl.read("restore-pid") is None
    assert ctl.exists("restore-pid")  # a dangling or planted link still counts as present
    (ctl.path / "big").write_bytes(b"x" * (control.MAX_READ * 4))
    assert len(ctl.read("big") or "") == control.MAX_READ
    assert ctl.read("absent") is None


def test_remove_leaves_the_workloads_directories_alone(tmp_path):
    ctl = control.control_dir_for(tmp_path, "uid-1", "app")
    ctl.prepare()
    ctl.write_json(control.TIMINGS, {"restore": {"total": 1.5}})
    (ctl.path / "cache").mkdir()
    ctl.remove()
    assert sorted(p.name for p in ctl.path.iterdir()) == ["cache"]


@pytest.mark.parametrize("annotations, args, want", [
    ({control.ORIGINAL_ARGS_ANNOTATION: '["python", "serve.py"]'}, ["/init", "--", "python"], ["python", "serve.py"]),
    ({control.ORIGINAL_ARGS_ANNOTATION: "not json"}, ["sh", "-c", "x"], ["sh", "-c", "x"]),
    ({control.ORIGINAL_ARGS_ANNOTATION: '["ok", 7]'}, ["sh"], ["sh"]),
    ({}, ["sh"], ["sh"]),
], ids=["annotation", "bad-json", "not-all-strings", "no-annotation"])
def test_original_args_prefer_a_well_formed_annotation(annotations, args, want):
    assert control.original_args({"annotations": annotations, "process": {"args": args}}) == want
