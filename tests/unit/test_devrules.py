"""Device cgroup rules: parsing, runc's last-match semantics, and what one list allows beyond another."""

from __future__ import annotations

from typing import Any

import pytest

from runtime.container.devrules import DeviceRule, allowed, excess, parse_rules

DENY_ALL = {"allow": False, "access": "rwm"}


def rules(*specs: dict[str, Any]) -> tuple[DeviceRule, ...]:
    return parse_rules(list(specs))


@pytest.mark.parametrize("spec_rules, typ, major, minor, access, expected", [
    ([], "c", 1, 3, "r", False),
    ([DENY_ALL, {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"}], "c", 1, 3, "w", True),
    ([DENY_ALL, {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"}], "b", 1, 3, "w", False),
    ([DENY_ALL, {"allow": True, "type": "c", "major": 136, "access": "rw"}], "c", 136, 7, "w", True),
    ([DENY_ALL, {"allow": True, "type": "c", "major": 136, "access": "rw"}], "c", 136, 7, "m", False),
    ([{"allow": True}, {"allow": False, "type": "c", "major": 10, "minor": 229, "access": "w"}],
     "c", 10, 229, "r", True),
    ([{"allow": True}, {"allow": False, "type": "c", "major": 10, "minor": 229, "access": "w"}],
     "c", 10, 229, "w", False),
    ([{"allow": True, "type": "c", "major": 10, "minor": 229}, DENY_ALL], "c", 10, 229, "r", False),
], ids=["nothing-allowed", "allowed", "other-type", "any-minor", "bit-missing", "allow-all-deny-one-bit-other",
        "allow-all-deny-one-bit", "later-deny-wins"])
def test_last_matching_rule_decides_each_access_bit(spec_rules: list[dict[str, Any]], typ: str, major: int,
                                                    minor: int, access: str, expected: bool) -> None:
    assert allowed(parse_rules(spec_rules), typ, major, minor, access) is expected


def test_parse_leaves_out_nvidia_nodes_and_normalises_access() -> None:
    devices = [{"path": "/dev/nvidia-uvm", "type": "c", "major": 509, "minor": 0},
               {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}]
    got = parse_rules([DENY_ALL, {"allow": True, "type": "c", "major": 195, "minor": 3, "access": "wr"},
                       {"allow": True, "type": "c", "major": 195, "access": "m"},
                       {"allow": True, "type": "c", "major": 509, "minor": 0, "access": "rw"},
                       {"allow": True, "type": "c", "major": 10, "minor": 229, "access": "wr"}], devices)
    assert got == (DeviceRule(False, "a", -1, -1, "rwm"), DeviceRule(True, "c", 10, 229, "rw"))


BASE = ({"allow": False, "access": "rwm"}, {"allow": True, "type": "c", "major": 1, "minor": 3, "access": "rwm"})


@pytest.mark.parametrize("source, target, expected", [
    (BASE, BASE, []),
    (BASE + ({"allow": True, "type": "c", "major": 10, "minor": 229, "access": "rwm"},), BASE, ["c 10:229 rwm"]),
    (({"allow": True, "access": "rwm"},), BASE, None),
    (BASE + ({"allow": True, "type": "c", "major": 10, "access": "r"},),
     BASE + ({"allow": True, "type": "c", "major": 10, "minor": 200, "access": "r"},), ["c 10:* r", "c 10:3 r"]),
    (BASE, BASE + ({"allow": True, "type": "b", "major": 8, "minor": 0, "access": "r"},), []),
    (BASE + ({"allow": True, "type": "c", "major": 10, "minor": 200, "access": "rw"},),
     BASE + ({"allow": True, "type": "c", "major": 10, "minor": 200, "access": "rw"},
             {"allow": False, "type": "c", "major": 10, "minor": 200, "access": "w"}), ["c 10:200 w"]),
], ids=["same", "extra-device", "allow-all-vs-some", "any-minor-vs-one", "target-allows-more",
        "target-denies-a-bit-later"])
def test_excess_lists_what_only_the_source_allows(source: tuple[dict[str, Any], ...],
                                                  target: tuple[dict[str, Any], ...],
                                                  expected: list[str] | None) -> None:
    got = excess(rules(*source), rules(*target))
    if expected is None:  # allow-all: every unnamed device and every block device shows up
        assert "c *:* rwm" in got and "b *:* rwm" in got and "c 1:3 rwm" not in got
    else:
        assert got == expected
