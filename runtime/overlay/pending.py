"""The rootfs changes of one restore until it is final, and their rollback, also by the next agent.

A restore applies the writable layer (and /dev/shm) through undo journals
(:mod:`runtime.overlay.undo`) under ``<undo root>/<container id>/``: node-local, in the agent's
state dir, never in the rootfs (nothing of them is seen by the container or captured by a later
checkpoint of it). They stay there until the restore is final:

- :meth:`Pending.begin` makes that directory (with an owner record, :mod:`runtime.proc.owner`) and
  writes :data:`runtime.control.ROOTFS_PENDING` into the container's control dir. The init never
  starts the original command while that file is there: a rollback is still owed.
- :meth:`Pending.journal` names the journal of the next apply (numbered: rolled back newest first).
- :meth:`Pending.commit`, once ``restore-complete`` is written: the journals are dropped, then
  the file.
- :meth:`Pending.roll_back`, when a step failed: every journal is rolled back and dropped; the
  file is removed only when the rollback was complete (an incomplete one leaves the container
  to be thrown away, never started on a half-changed rootfs).

:func:`recover` does the same for the next agent, once the owner of the journals is provably
dead: a restore cut short by the agent's death is rolled back before it is reported failed.
:func:`sweep` (housekeeping) drops the journals of dead owners whose rootfs is gone.
"""

from __future__ import annotations

import logging
import os
import shutil

from runtime import control as control_mod
from runtime.overlay import undo as overlay_undo
from runtime.proc.owner import read_owner_of, write_owner

log = logging.getLogger(__name__)


class Pending:
    def __init__(self, undo_root: str, container_id: str,
                 control: control_mod.ControlDir | None) -> None:
        if not container_id or "/" in container_id or container_id.startswith("."):
            raise ValueError(f"unusable container id {container_id!r}")
        self.path = os.path.join(undo_root, container_id)
        self.control = control
        self._count = 0
        self._begun = False

    @property
    def begun(self) -> bool:
        return self._begun

    def begin(self) -> None:
        self._begun = True
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        os.mkdir(self.path, 0o700)  # an earlier restore's journals must have been recovered first
        write_owner(self.path)
        if self.control is not None:
            self.control.write(control_mod.ROOTFS_PENDING, "a restore is changing the rootfs\n")

    def journal(self, target: str) -> str:
        self._count += 1
        return os.path.join(self.path, f"{self._count:02d}-{target}")

    def commit(self) -> None:
        self._clear_marker()
        _drop(self.path)

    def roll_back(self) -> list[str]:
        if not self._begun:
            return []
        problems = _roll_back_dir(self.path)
        if not problems:
            self._clear_marker()
        _drop(self.path)  # a rollback run again would meet the same problems
        who = os.path.basename(self.path)[:12]
        if problems:
            log.error("%s: the restore's rootfs changes could not all be rolled back: %s", who,
                      "; ".join(problems[:5]))
        else:
            log.info("%s: rolled back the restore's rootfs changes", who)
        return problems

    def _clear_marker(self) -> None:
        if self.control is not None:
            try:
                os.unlink(self.control.path / control_mod.ROOTFS_PENDING)
            except FileNotFoundError:
                pass


def _drop(path: str) -> None:
    """Remove a container's journals: renamed away first, so that a kill half way through leaves
    either all of them or none under the container's name."""
    trash = os.path.join(os.path.dirname(path), f".dropped-{os.path.basename(path)}")
    shutil.rmtree(trash, ignore_errors=True)  # one an earlier drop left, killed half way
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        pass
    shutil.rmtree(trash, ignore_errors=True)


def _roll_back_dir(path: str) -> list[str]:
    """Roll back the journals in ``path``, newest first; the problems met."""
    problems: list[str] = []
    try:
        names = sorted((n for n in os.listdir(path) if n[:2].isdigit()), reverse=True)
    except FileNotFoundError:
        return []
    for name in names:
        journal = os.path.join(path, name)
        try:
            problems += overlay_undo.roll_back(journal)
        except (OSError, ValueError, TypeError) as exc:
            problems.append(f"journal {name}: {exc}")
    return problems


def recover(undo_root: str, container_id: str, control: control_mod.ControlDir | None) -> list[str] | None:
    """Roll back what a dead agent's restore of ``container_id`` changed; None when there is
    nothing to roll back (or its owner may still be alive), else the problems met."""
    pending = Pending(undo_root, container_id, control)
    if not os.path.isdir(pending.path):
        return None  # none, or dropped after an incomplete rollback (the marker stays then)
    owner = read_owner_of(pending.path)
    if owner is not None and not owner.provably_dead():
        log.warning("%s: the rootfs journals in %s belong to live process %d; left alone",
                    container_id[:12], pending.path, owner.pid)
        return None
    log.info("%s: a restore cut short by the death of process %s left rootfs changes", container_id[:12],
             owner.pid if owner is not None else "?")
    pending._begun = True
    return pending.roll_back()


def sweep(undo_root: str) -> list[str]:
    """Drop the journals of dead owners whose rootfs is gone (the container was removed); the
    container ids swept. A rootfs still there is left to :func:`recover`: its restore may have
    completed (a workload runs on it)."""
    swept = []
    try:
        names = sorted(os.listdir(undo_root))
    except FileNotFoundError:
        return []
    for cid in names:
        path = os.path.join(undo_root, cid)
        if cid.startswith(".dropped-"):
            shutil.rmtree(path, ignore_errors=True)
            continue
        owner = read_owner_of(path)
        if owner is not None and not owner.provably_dead():
            continue
        try:
            journals = [os.path.join(path, n) for n in os.listdir(path)]
        except OSError:
            continue
        if any(overlay_undo.rootfs_present(j) for j in journals):
            continue
        _drop(path)
        swept.append(cid)
    if swept:
        log.info("dropped the rootfs journals of %d removed container(s)", len(swept))
    return swept
