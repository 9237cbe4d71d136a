"""The one parser of ``/proc/<pid>/stat`` (runtime.proc.procfs.parse_stat): fields counted after the
command name's last ``)``, whatever the name holds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.proc import procfs

TAIL = "0 0 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 0 0 18446744073709551615"  # tty_nr .. itrealvalue, starttime, ...


def _line(pid: int, comm: str, state: str = "S", ppid: int = 1, pgrp: int = 7, session: int = 7,
          start: int = 4242) -> str:
    return f"{pid} ({comm}) {state} {ppid} {pgrp} {session} {TAIL.format(start=start)}\n"


@pytest.mark.parametrize("comm", ["sleep", "a b c", "x) S 1 2 3", "((", ")", ") (", "tab\tand\nnewline", ""])
def test_fields_after_any_command_name(comm: str) -> None:
    st = procfs.parse_stat(_line(123, comm, "T", 9, 10, 11, 987654))
    assert st == procfs.Stat(123, comm, "T", 9, 10, 11, 987654)


def test_bytes_and_undecodable_names() -> None:
    st = procfs.parse_stat(b"5 (\xff) ) Z 1 5 5 " + TAIL.format(start=77).encode())
    assert (st.pid, st.state, st.start_time) == (5, "Z", 77)
    assert st.comm.encode(errors="surrogateescape") == b"\xff) "


@pytest.mark.parametrize("bad", ["", "123", "123 (x S 1 2 3", "123 (x) S 1 2 3", "x (y) " + _line(1, "z")[6:],
                                 "123 (x) S one 2 3 " + TAIL.format(start=1)])
def test_not_a_stat_line(bad: str) -> None:
    with pytest.raises(ValueError):
        procfs.parse_stat(bad)


def test_a_stand_in_tree_and_a_thread(tmp_path: Path) -> None:
    (tmp_path / "42" / "task" / "43").mkdir(parents=True)
    (tmp_path / "42" / "stat").write_text(_line(42, "srv) x", start=1000))
    (tmp_path / "42" / "task" / "43" / "stat").write_text(_line(43, "worker", state="D", start=1001))
    assert procfs.start_time(42, str(tmp_path)) == 1000
    thread = procfs.read_stat(42, str(tmp_path), tid=43)
    assert thread is not None and thread.state == "D"
    assert procfs.start_time(44, str(tmp_path)) is None
    (tmp_path / "45").mkdir()
    (tmp_path / "45" / "stat").write_text("garbage")
    assert procfs.read_stat(45, str(tmp_path)) is None


def test_a_live_process_named_with_a_paren() -> None:
    name = "import sys; open('/proc/self/comm', 'w').write('a) b (c'); print(flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", name], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # named itself
        st = procfs.read_stat(child.pid)
        assert st is not None
        assert (st.pid, st.comm, st.ppid) == (child.pid, "a) b (c", os.getpid())
        assert procfs.start_time(child.pid) == st.start_time > 0
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
