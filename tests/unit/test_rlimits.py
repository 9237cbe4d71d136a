"""runtime.rlimits: /proc/<pid>/limits gives what prlimit gives."""

from __future__ import annotations

import os
import resource

import pytest

from runtime import rlimits


def test_proc_limits_of_this_process_match_prlimit():
    own = {r: resource.prlimit(0, r) for r in rlimits.RLIMITS}
    got = rlimits.read_proc_limits(os.getpid())
    assert {r: got[r] for r in rlimits.RLIMITS} == own
    assert len(got) >= len(own)  # and RLIMIT_LOCKS, which Python's resource module does not name


def test_unlimited_and_numbers_are_parsed_by_the_header_columns():
    text = open(f"/proc/{os.getpid()}/limits").read().splitlines()
    header = text[0]
    col = header.index("Soft Limit")
    line = "Max open files".ljust(col) + "321".ljust(21) + "unlimited".ljust(21) + "files"
    lines = [header] + [line] * (max(rlimits.RLIMITS) + 1)
    got = rlimits.parse_proc_limits("\n".join(lines))
    assert set(got.values()) == {(321, resource.RLIM_INFINITY)}


@pytest.mark.parametrize("text", ["", "Limit Soft Hard\n", "Limit                     Soft Limit\nMax cpu time"])
def test_malformed_text_is_refused(text):
    with pytest.raises(ValueError):
        rlimits.parse_proc_limits(text)


def test_every_resource_has_a_prlimit_option():
    assert rlimits._OPTION[resource.RLIMIT_NOFILE] == "--nofile"
    assert set(rlimits._OPTION) == set(rlimits.RLIMITS)
