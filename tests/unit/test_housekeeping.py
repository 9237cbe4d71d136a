"""Node-local rotation of work/log dirs and status records."""

from __future__ import annotations

import os
import time
from pathlib import Path

from runtime.housekeeping import expire_status, rotate_logs
from runtime.status import ContainerStatus, Phase, StatusBook


def _dir(root: Path, name: str, age: float) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "restore.log").write_text("x")
    t = time.time() - age
    os.utime(d, (t, t))
    return d


def test_rotate_logs_keeps_the_newest_and_never_a_busy_dir(tmp_path: Path) -> None:
    for i in range(6):
        _dir(tmp_path, f"restore-{i}", age=7200 + i * 60)  # restore-0 is the newest
    _dir(tmp_path, "checkpoint-busy", age=10)
    _dir(tmp_path, "restore-ancient", age=30 * 86400)
    removed = rotate_logs(tmp_path, keep=3, max_age=7 * 86400, busy=3600)
    assert sorted(removed) == ["restore-3", "restore-4", "restore-5", "restore-ancient"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-busy", "restore-0", "restore-1", "restore-2"]


def test_expire_status_removes_old_final_records_only(tmp_path: Path) -> None:
    book = StatusBook(tmp_path)
    for pod, phase in (("old-done", Phase.RESTORED), ("old-running", Phase.RESTORING), ("new-done", Phase.PUBLISHED)):
        book.write(ContainerStatus(namespace="ns", pod=pod, container="c", phase=phase))
    for pod in ("old-done", "old-running"):
        path = book.root / "ns" / pod / "c.json"
        st = ContainerStatus.from_json(path.read_text())
        st.updated_at = time.time() - 8 * 86400
        path.write_text(st.to_json())
    assert expire_status(tmp_path) == 1
    assert sorted(s.pod for s in book.list()) == ["new-done", "old-running"]
    assert not (book.root / "ns" / "old-done").exists()
