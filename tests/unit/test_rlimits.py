"""runtime.proc.rlimits: /proc/<pid>/limits gives what prlimit gives."""

from __future__ import annotations

import os
import resource

import pytest

from runtime.proc import rlimits


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


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a process of another uid)")
def test_a_process_of_another_uid_is_lowered_as_its_owner():
    import subprocess
    p = subprocess.Popen(["sleep", "30"], user=65534, group=65534, extra_groups=[])
    try:
        rlimits.lower_as_owner(p.pid, {resource.RLIMIT_NOFILE: (100, 200), resource.RLIMIT_CORE: (0, 0)})
        got = rlimits.read_proc_limits(p.pid)
        assert got[resource.RLIMIT_NOFILE] == (100, 200) and got[resource.RLIMIT_CORE] == (0, 0)
        rlimits.lower(p.pid, {resource.RLIMIT_NOFILE: (50, 50)})  # prlimit where allowed, else as owner
        assert rlimits.read_all(p.pid)[resource.RLIMIT_NOFILE] == (50, 50)
        with pytest.raises(rlimits.ConfinementError, match="as uid 65534"):  # a hard limit never rises
            rlimits.lower_as_owner(p.pid, {resource.RLIMIT_NOFILE: (50, 5000)})
    finally:
        p.kill()
        p.wait()
