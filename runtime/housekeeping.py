"""Node-local housekeeping: private copies of interrupted restores are removed, old CRIU work/log
dirs and old status records are rotated away.

- :func:`rotate_logs` keeps the newest ``keep`` work dirs under ``<state>/logs`` (one per
  checkpoint or restore: CRIU's log, the restore's private copies while it runs) and removes
  older ones, and any older than ``max_age``; a dir touched within ``busy`` seconds is never
  removed, nor counted (a checkpoint or restore may be writing it).
- :func:`sweep_restore_copies` removes the private copies (``restore-*/private``) of restores
  whose process is provably dead (their work dir's owner record: node, boot id, pid and its
  start time), at once: an agent killed mid-restore leaves the staged artifact files there.
- :func:`expire_status` removes status records in a final phase not updated for ``max_age``
  (the pod is long gone), and the directories they leave empty.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from runtime.status import FINAL_PHASES, StatusBook
from runtime.owner import read_owner_of

log = logging.getLogger(__name__)

KEEP_LOGS = 100
MAX_AGE = 7 * 86400.0
BUSY = 3600.0


def rotate_logs(log_dir: str | os.PathLike[str], keep: int = KEEP_LOGS, max_age: float = MAX_AGE,
                busy: float = BUSY) -> list[str]:
    root = Path(log_dir)
    try:
        entries = [(e.stat(follow_symlinks=False).st_mtime, e) for e in os.scandir(root)
                   if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    now = time.time()
    entries.sort(key=lambda x: x[0], reverse=True)
    removed = []
    idle = [(mtime, entry) for mtime, entry in entries if now - mtime >= busy and not _waiting(entry.path)]
    for i, (mtime, entry) in enumerate(idle):
        if i >= keep or now - mtime > max_age:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    if removed:
        log.info("rotated %d old work/log dirs out of %s", len(removed), root)
    return removed


STAGED_PREFIX = "restore-staged-"  # copies staged ahead of a restore (nri_plugin.prefetch)


def _waiting(path: str) -> bool:
    """A copy staged ahead whose owner lives: its restore may still come and take it."""
    if not os.path.basename(path).startswith(STAGED_PREFIX):
        return False
    owner = read_owner_of(path)
    return owner is not None and not owner.provably_dead()


def sweep_restore_copies(log_dir: str | os.PathLike[str]) -> list[str]:
    """Remove the private files of interrupted work whose owner is provably dead: a restore's
    copies (``restore-*/private``) and a checkpoint's private staging (``checkpoint-*/staging-*``,
    a whole dump); the names of the work dirs swept (their logs stay for ``rotate_logs``)."""
    swept = []
    root = Path(log_dir)
    works = [(w, [w / "private"]) for w in sorted(root.glob("restore-*"))]
    works += [(w, sorted(w.glob("staging-*"))) for w in sorted(root.glob("checkpoint-*"))]
    for work, privates in works:
        privates = [p for p in privates if p.is_dir() and not p.is_symlink()]
        if not privates:
            continue
        owner = read_owner_of(str(work))
        if owner is None or not owner.provably_dead():
            continue  # running, or made before owners were recorded (rotate_logs takes those)
        for private in privates:
            shutil.rmtree(private, ignore_errors=True)
        swept.append(work.name)
    if swept:
        log.info("removed the private copies of %d interrupted restore(s) under %s", len(swept), log_dir)
    return swept


def expire_status(state_dir: str | os.PathLike[str], max_age: float = MAX_AGE) -> int:
    book = StatusBook(state_dir)
    now, removed = time.time(), 0
    for path in book.root.glob("*/*/*.json"):
        st = book.read_path(path)
        if st is None or st.phase not in FINAL_PHASES or now - (st.updated_at or 0) < max_age:
            continue
        path.unlink(missing_ok=True)
        removed += 1
        for parent in (path.parent, path.parent.parent):
            try:
                parent.rmdir()
            except OSError:
                break
    return removed
