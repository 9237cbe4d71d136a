"""The entrypoint swap (nri_plugin/swap.py): which strategy a runtime gets, and the spec rewrite."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from nri_plugin.events import RuntimeInfo
from nri_plugin.swap import (
    ORIGINAL_ARGS_ANNOTATION,
    Strategy,
    choose,
    init_command,
    is_swapped,
    swap_by_spec_update,
    swapped_spec,
)
from runtime.control import CONTAINER_PATH, INIT_IN_CONTAINER, original_args

SPEC = {"ociVersion": "1.1.0", "process": {"args": ["python", "-m", "server"], "env": ["A=1"]},
        "annotations": {"io.kubernetes.cri.container-name": "app"}, "x-unknown": {"kept": True}}


@pytest.mark.parametrize("version, strategy", [
    ("v1.7.24", Strategy.SPEC_UPDATE), ("v2.1.9", Strategy.SPEC_UPDATE),
    ("v2.2.0", Strategy.ARGS_ADJUSTMENT), ("v2.3.1", Strategy.ARGS_ADJUSTMENT),
], ids=["1.7", "2.1", "2.2", "2.3"])
def test_args_adjustment_only_where_nri_takes_args(version, strategy):
    assert choose(RuntimeInfo.from_configure("containerd", version, has_timeouts=True)) is strategy


def test_init_command_puts_the_init_in_front_of_the_original_args():
    cmd = init_command("restore", 120, ["python", "-m", "server"])
    assert cmd == [INIT_IN_CONTAINER, "--mode", "restore", "--control", CONTAINER_PATH, "--timeout", "120", "--",
                   "python", "-m", "server"]
    assert is_swapped(cmd) and not is_swapped(["python"]) and not is_swapped([])


def test_swapped_spec_keeps_everything_else_and_records_the_original():
    before = copy.deepcopy(SPEC)
    new = swapped_spec(SPEC, "source", 1800)
    assert SPEC == before, "the input spec must not change"
    assert new["process"]["args"] == init_command("source", 1800, before["process"]["args"])
    assert json.loads(new["annotations"][ORIGINAL_ARGS_ANNOTATION]) == before["process"]["args"]
    assert original_args(new) == before["process"]["args"]  # what the engine reads back
    for key in ("ociVersion", "x-unknown"):
        assert new[key] == before[key]
    assert new["process"]["env"] == ["A=1"]
    assert new["annotations"]["io.kubernetes.cri.container-name"] == "app"


def test_a_replayed_swap_changes_nothing():
    once = swapped_spec(SPEC, "restore", 60)
    assert swapped_spec(once, "restore", 60) == once


@pytest.mark.parametrize("spec", [{}, {"process": None}, {"process": {"args": []}}, {"process": {"args": "sh"}}],
                         ids=["no-process", "null-process", "empty-args", "args-not-a-list"])
def test_a_spec_without_args_is_refused(spec):
    with pytest.raises(ValueError, match="no process.args"):
        swapped_spec(spec, "restore", 60)


class Specs:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.stored = copy.deepcopy(spec)
        self.updates = 0

    def get_spec(self, container_id: str) -> dict[str, Any]:
        return copy.deepcopy(self.stored)

    def update_spec(self, container_id: str, spec: dict[str, Any]) -> None:
        self.stored = copy.deepcopy(spec)
        self.updates += 1


def test_swap_by_spec_update_writes_the_swapped_spec_back():
    specs = Specs(SPEC)
    args = swap_by_spec_update(specs, "c1", "restore", 90)
    assert args == specs.stored["process"]["args"] == init_command("restore", 90, SPEC["process"]["args"])
    assert specs.updates == 1
