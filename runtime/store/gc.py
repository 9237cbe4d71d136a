"""Store garbage: who owns a staging dir, what is left over, and what may be swept or pruned.

On a shared store one node must never remove another node's publish in progress: a staging dir
records its owner (node, boot id, pid, start time). :func:`sweep` removes staging dirs whose owner
is provably dead on this node (another boot, or no process with that pid and start time) or older
than ``stale_after`` (anyone's), trash, leftover links, and versions no name points to that are
older than a grace period; never a version a reader holds (its OFD lock). :func:`prune` deletes
artifacts by age or keeps the newest N versions of a name, under the same rule.

Anything in the store may have been planted: its trees are walked and removed without recursion,
within bounds (``runtime.fs.fdfs``: depth and entries); a leftover past them is reported (its
``problem``) and removed like any other once abandoned, and no one entry stops the sweep.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from runtime.errors import ArtifactRejected, RekindleError, StoreError, TreeTooLarge
from runtime.fs.fdfs import DIR_FLAGS, remove_tree, tree_bytes
from runtime.proc.owner import Owner, read_owner
from runtime.store.volume import (
    LINK_PREFIX,
    STAGING_PREFIX,
    TRASH_PREFIX,
    VERSION_PREFIX,
    VERSION_RE,
    ArtifactStore,
    generation_of,
    is_valid_name,
    validate_namespace,
)

log = logging.getLogger(__name__)

STALE_AFTER = 24 * 3600.0  # another node's staging dir older than this is abandoned
GRACE = 600.0  # an unreferenced version younger than this may be about to be linked


@dataclass(frozen=True, slots=True)
class Leftover:
    """A non-artifact entry of the store (``artifacts list --all``)."""

    namespace: str
    entry: str
    kind: str  # staging | trash | unreferenced-version | link
    bytes: int
    owner: Owner | None
    age: float
    problem: str = ""  # why its tree was not walked to the end (past a bound: planted); bytes is 0


def _namespace_dirs(store: ArtifactStore, namespace: str | None) -> Iterator[tuple[str, int]]:
    """(namespace, its dir fd) for ``namespace`` or every namespace of the store; each fd is
    closed when the caller moves on (or stops); a namespace that cannot be opened is skipped."""
    for ns in [validate_namespace(namespace)] if namespace else store.namespaces():
        try:
            ns_fd = store._ns_fd(ns, ns)
        except RekindleError:
            continue
        try:
            yield ns, ns_fd
        finally:
            os.close(ns_fd)


def leftovers(store: ArtifactStore, namespace: str | None = None) -> list[Leftover]:
    """Staging dirs, trash, pointer temp links and versions no name points to. An entry that
    vanishes or cannot be read meanwhile is left out (others write the store at any moment)."""
    out: list[Leftover] = []
    now = time.time()
    for ns, ns_fd in _namespace_dirs(store, namespace):
        live = set()
        for name in os.listdir(ns_fd):
            if not name.startswith("."):
                with contextlib.suppress(RekindleError, OSError):
                    live.add(store.current_version(ns_fd, name))
        for entry in sorted(os.listdir(ns_fd)):
            kind = _leftover_kind(entry, live)
            if kind is None:
                continue
            try:
                out.append(_leftover(ns, ns_fd, entry, kind, now))
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("store leftover %s/%s: %s", ns, entry, exc)
    return out


def _leftover(ns: str, ns_fd: int, entry: str, kind: str, now: float) -> Leftover:
    st = os.stat(entry, dir_fd=ns_fd, follow_symlinks=False)
    owner, size, problem = None, 0, ""
    if stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(OSError):
            fd = os.open(entry, DIR_FLAGS, dir_fd=ns_fd)
            try:
                owner = read_owner(fd) if kind == "staging" else None
                size = tree_bytes(fd)
            except TreeTooLarge as exc:
                problem = str(exc)
            finally:
                os.close(fd)
    created = owner.created if owner else st.st_mtime
    return Leftover(ns, entry, kind, size, owner, max(0.0, now - created), problem)


def sweep(store: ArtifactStore, namespace: str | None = None, stale_after: float = STALE_AFTER,
          grace: float = GRACE, on_bad: Callable[[Leftover], None] | None = None) -> list[Leftover]:
    """Remove what is provably abandoned; returns what was removed. A leftover whose tree is past
    the walk's bounds is logged and given to ``on_bad`` (the plugin counts it in its metrics),
    and removed like any other once abandoned; one entry that cannot be removed stops nothing."""
    removed = []
    for item in leftovers(store, namespace):
        if item.problem:
            log.warning("store leftover %s %s/%s: %s (planted?)", item.kind, item.namespace, item.entry,
                        item.problem)
            if on_bad is not None:
                on_bad(item)
        if not _abandoned(item, stale_after, grace):
            continue
        try:
            ns_fd = store._ns_fd(item.namespace, item.namespace)
        except RekindleError as exc:
            log.warning("cannot sweep %s/%s: %s", item.namespace, item.entry, exc)
            continue
        try:
            if item.kind == "link":
                os.unlink(item.entry, dir_fd=ns_fd)
            elif item.kind in ("unreferenced-version", "trash"):
                if not store.remove_version(ns_fd, item.entry):
                    continue
            else:
                remove_tree(ns_fd, item.entry)
            removed.append(item)
            log.info("swept %s %s/%s (%d bytes)", item.kind, item.namespace, item.entry, item.bytes)
        except (OSError, RekindleError) as exc:
            log.warning("cannot sweep %s/%s: %s", item.namespace, item.entry, exc)
        finally:
            os.close(ns_fd)
    return removed


def _abandoned(item: Leftover, stale_after: float, grace: float) -> bool:
    if item.kind == "staging":
        if item.owner is not None and item.owner.provably_dead():
            return True
        return item.age > stale_after
    if item.kind == "trash":
        return True  # renamed away by a remover; its lock check guards readers
    return item.age > grace


def prune(store: ArtifactStore, namespace: str | None = None, older_than: float | None = None,
          keep_last: int | None = None) -> list[str]:
    """Delete artifacts whose current version is older than ``older_than`` seconds, and
    versions beyond the newest ``keep_last`` of a name; never one a restore is reading."""
    done: list[str] = []
    now_us = time.time_ns() // 1000
    for ns, ns_fd in _namespace_dirs(store, namespace):
        by_name: dict[str, list[tuple[int, str]]] = {}
        for entry in os.listdir(ns_fd):
            m = VERSION_RE.fullmatch(entry)
            if m:
                by_name.setdefault(m.group("name"), []).append((int(m.group("gen")), entry))
        for name, versions in sorted(by_name.items()):
            try:
                current = store.current_version(ns_fd, name) if is_valid_name(name) else None
            except ArtifactRejected:
                current = None
            if older_than is not None and current is not None:
                if now_us - generation_of(current) > older_than * 1e6:
                    try:
                        store.delete(ns, name)
                        done.append(f"{ns}/{name}")
                    except StoreError as exc:
                        log.info("prune: %s", exc)
                    continue
            if keep_last is not None:
                for _gen, version in sorted(versions, reverse=True)[max(keep_last, 1):]:
                    if version != current and store.remove_version(ns_fd, version):
                        done.append(f"{ns}/{version}")
    return done


def _leftover_kind(entry: str, live: set[str | None]) -> str | None:
    if entry.startswith(STAGING_PREFIX):
        return "staging"
    if entry.startswith(TRASH_PREFIX):
        return "trash"
    if entry.startswith(LINK_PREFIX):
        return "link"
    if entry.startswith(VERSION_PREFIX) and entry not in live:
        return "unreferenced-version"
    return None
