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
- :func:`run_steps` runs such steps one after the other, each on its own: one that fails is
  logged and reported, and the others still run.

Trees are removed without recursion and without following a symlink (``runtime.fs.fdfs``); one that
cannot be removed is logged and the next one is taken.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import RekindleError
from runtime.fs.fdfs import remove_tree_path
from runtime.proc.owner import read_owner_of
from runtime.status import FINAL_PHASES, StatusBook

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
            if _remove(entry.path):
                removed.append(entry.name)
    if removed:
        log.info("rotated %d old work/log dirs out of %s", len(removed), root)
    return removed


def _remove(path: str) -> bool:
    try:
        remove_tree_path(path)
        return True
    except (OSError, RekindleError) as exc:
        log.warning("cannot remove %s: %s", path, exc)
        return False


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
        removed = [_remove(str(private)) for private in privates]  # each one tried
        if all(removed):
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
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("cannot remove status record %s: %s", path, exc)
            continue
        removed += 1
        for parent in (path.parent, path.parent.parent):
            try:
                parent.rmdir()
            except OSError:
                break
    return removed


@dataclass(frozen=True)
class Step:
    name: str  # a fixed word (a metrics label): store_sweep, restore_copies, logs, status
    run: Callable[[], object]


def run_steps(steps: Sequence[Step], failed: Callable[[str], None] | None = None) -> list[str]:
    """Run every step; one that raises (whatever it raises: a planted tree once made the store
    sweep raise RecursionError) is logged and given to ``failed``, and the next one still runs.
    Returns the names of the steps that failed."""
    failures = []
    for step in steps:
        try:
            step.run()
        except Exception:  # noqa: BLE001 - housekeeping is never fatal, and one step stops no other
            log.exception("housekeeping step %s failed", step.name)
            failures.append(step.name)
            if failed is not None:
                failed(step.name)
    return failures
