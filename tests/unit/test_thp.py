"""The node's THP mode switched to always around CUDA checkpoints (runtime.proc.thp): once for
checkpoints at once, back after the last, put back at start-up after a kill; and on the real knob."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from runtime.proc import thp
from runtime.proc.thp import ThpSwitch, read_mode


def _knob(tmp_path: Path, mode: str = "madvise") -> Path:
    knob = tmp_path / "enabled"
    knob.write_text(" ".join(f"[{m}]" if m == mode else m for m in thp.MODES) + "\n")
    return knob


def test_the_mode_is_always_inside_and_back_after_with_nothing_recorded(tmp_path: Path) -> None:
    knob, record = _knob(tmp_path), tmp_path / "found"
    switch = ThpSwitch(str(record), str(knob))
    with switch.always():
        assert read_mode(str(knob)) == "always"
        assert record.read_text() == "madvise\n"  # what a restarted plugin would put back
    assert read_mode(str(knob)) == "madvise"
    assert not record.exists()


def test_checkpoints_at_once_share_one_switch_back_after_the_last(tmp_path: Path) -> None:
    knob, record = _knob(tmp_path, "never"), tmp_path / "found"
    switch = ThpSwitch(str(record), str(knob))
    inside, release = threading.Barrier(3), threading.Event()

    def checkpoint() -> None:
        with switch.always():
            inside.wait(10)
            release.wait(10)

    threads = [threading.Thread(target=checkpoint) for _ in range(2)]
    for t in threads:
        t.start()
    inside.wait(10)
    assert read_mode(str(knob)) == "always" and record.read_text() == "never\n"
    release.set()
    for t in threads:
        t.join()
    assert read_mode(str(knob)) == "never" and not record.exists()


def test_a_mode_already_always_is_left_alone(tmp_path: Path) -> None:
    knob, record = _knob(tmp_path, "always"), tmp_path / "found"
    with ThpSwitch(str(record), str(knob)).always():
        assert not record.exists()
    assert read_mode(str(knob)) == "always"


def test_a_killed_plugins_switch_is_put_back_at_start(tmp_path: Path) -> None:
    knob, record = _knob(tmp_path), tmp_path / "found"
    switch = ThpSwitch(str(record), str(knob))
    cm = switch.always()
    cm.__enter__()  # killed inside: never left
    assert read_mode(str(knob)) == "always"
    assert ThpSwitch(str(record), str(knob)).recover() == "madvise"
    assert read_mode(str(knob)) == "madvise" and not record.exists()
    assert ThpSwitch(str(record), str(knob)).recover() is None


def test_a_record_that_names_no_mode_is_dropped_not_written(tmp_path: Path) -> None:
    knob, record = _knob(tmp_path), tmp_path / "found"
    record.write_text("[madvise] x\n")
    assert ThpSwitch(str(record), str(knob)).recover() is None
    assert read_mode(str(knob)) == "madvise" and not record.exists()


def test_an_unreadable_knob_leaves_the_checkpoint_going(tmp_path: Path) -> None:
    switch = ThpSwitch(str(tmp_path / "found"), str(tmp_path / "missing"))
    with switch.always():
        pass
    assert not (tmp_path / "found").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(thp.ENABLED, os.W_OK), reason="needs root and the real knob")
def test_the_real_knob_is_switched_and_put_back(tmp_path: Path) -> None:
    before = read_mode()
    with ThpSwitch(str(tmp_path / "found")).always():
        assert read_mode() == "always"
    assert read_mode() == before


def test_a_plugin_stopped_mid_checkpoint_puts_the_mode_back_as_it_exits(tmp_path: Path) -> None:
    """An uninstall (SIGTERM) while a CUDA checkpoint holds the switch: the plugin's exit puts the
    recorded mode back (run_plugin's last step), and the checkpoint's own switch-back after it
    changes nothing."""
    knob, record = _knob(tmp_path), tmp_path / "found"
    switch = ThpSwitch(str(record), str(knob))
    with switch.always():
        assert read_mode(str(knob)) == "always"
        thp.put_back(str(record), str(knob))  # the plugin exits here
        assert read_mode(str(knob)) == "madvise" and not record.exists()
    assert read_mode(str(knob)) == "madvise" and not record.exists()
    thp.put_back(str(record), str(knob))  # nothing recorded: nothing done
    assert read_mode(str(knob)) == "madvise"
