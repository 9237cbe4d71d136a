"""Pre-warming: the node cache's entry of a marked artifact written as soon as a version is published.

An artifact is marked by its signed manifest (the source pod's ``rekindle.dev/prewarm``) or by
the node's ``--prewarm`` list (``namespace/name``, the chart's ``prewarm.artifacts``). The store
is a shared file system (NFS maybe: no inotify from other nodes), so :class:`Prewarmer` looks
every ``--prewarm-interval`` seconds, and each look is bounded: it reads the link of at most
:data:`MAX_NAMES` names (the listed ones first, then what the store lists), and opens (checks the
signature of) only a version it has not seen before. A marked version not in the cache yet is
handed to the cache's one writer (``CacheWriter.warm``): its spans chosen as a restore would
choose them (from the version's verified restore plan and CRIU mm images), the entry written by
``NodeCache.write`` like any other (each byte checked against the signed digests, within the
byte, entry, memory and disk guards, another version of the artifact evicted first).

A restore takes the disk first: the warm-up reads on the prefetch's few threads (its short disk
queue) at the idle I/O class, and before each chunk waits while a restore runs on this node
(:class:`DiskGate`). Each marked artifact's state on this node (:class:`State`) is kept in
``<state-dir>/prewarm.json`` for ``rekindle status`` and ``rekindle artifacts list``, and in
the ``rekindle_prewarm_*`` metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from runtime import layout, libc, names
from runtime.errors import RekindleError
from runtime.fs.fdfs import remove_tree_path
from runtime.housekeeping import STAGED_PREFIX
from runtime.pages import mapping as bulk_map
from runtime.pages import nodecache
from runtime.proc.owner import write_owner
from runtime.route import RestorePath
from runtime.store import Artifact, ArtifactStore, readahead
from runtime.testpause import pause_for_test

from .disk_gate import DiskGate
from .prewarm_state import State, Status, parse_names

if TYPE_CHECKING:
    from .cache import CacheWriter
    from .config import Settings
    from .metrics import Metrics

log = logging.getLogger(__name__)

MAX_NAMES = 256  # names looked at per look, at most (a store writer can make many)
DEFAULT_INTERVAL = 30.0
STATE_FILE = "prewarm.json"


class PrewarmEngine(Protocol):
    """What the pre-warmer needs of the plugin's engine (``nri_plugin.agent.NodeEngine``): the
    node cache, its one writer and the gate restores hold."""

    @property
    def cache(self) -> nodecache.NodeCache | None: ...

    @property
    def cache_writer(self) -> CacheWriter | None: ...

    @property
    def disk(self) -> DiskGate: ...


IOPRIO_WHO_PROCESS, IOPRIO_CLASS_IDLE, IOPRIO_CLASS_SHIFT = 1, 3, 13
_SYS_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}.get(os.uname().machine)
_idle_io = threading.local()


def _lower_io_priority() -> None:
    """This thread's reads at the idle I/O class (once per thread; schedulers without classes ignore it)."""
    if getattr(_idle_io, "set", False) or _SYS_IOPRIO_SET is None:
        return
    _idle_io.set = True
    libc.function("syscall")(_SYS_IOPRIO_SET, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT)


class Pacer:
    """The ``pace`` hook of one warm-up: counts its bytes and rate, waits while a restore runs."""

    def __init__(self, status: Status, gate: DiskGate, stop: threading.Event,
                 changed: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic) -> None:
        self.status, self.gate, self.stop, self.changed, self.clock = status, gate, stop, changed, clock
        self._lock = threading.Lock()
        self._t0 = clock()
        self._paused_for = 0.0
        self.first_pause: float | None = None  # seconds into the warm-up a restore first held the disk
        self.pauses = 0  # chunks that waited for a restore (the writer's threads each wait)
        self._said = False
        self._hold = threading.Lock()  # a test's pause mid-warm-up holds every thread of it
        self._held = False

    @property
    def paused_for(self) -> float:
        with self._lock:
            return self._paused_for

    def __call__(self, n: int) -> None:
        _lower_io_priority()
        with self._hold:
            if self.status.bytes and not self._held:
                self._held = True
                pause_for_test("prewarm")
        if self.stop.is_set():
            raise RekindleError("the plugin is stopping")
        if self.gate.busy():
            with self._lock:
                self.status.paused = True
                self.pauses += 1
            self.changed()
            t = self.clock()
            if self.first_pause is None:
                self.first_pause = t - self._t0
            self.gate.wait_idle(self.stop)
            with self._lock:
                self._paused_for += self.clock() - t
                self.status.paused = False
                say, self._said = not self._said, True
            if say:
                log.info("%s: pre-warm resumed after a restore", self.status.artifact)
        with self._lock:
            self.status.bytes += n
            busy = max(1e-6, self.clock() - self._t0 - self._paused_for)
            self.status.rate = self.status.bytes / busy


def _names_in(path: str, limit: int) -> list[str]:
    """Up to ``limit`` entries of ``path`` not starting with a dot (read no further: a store
    writer can make a directory of any size)."""
    out: list[str] = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                if len(out) >= limit:
                    break
                if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False) != entry.is_symlink():
                    out.append(entry.name)
    except FileNotFoundError:
        return []
    return sorted(out)


def _plan_spans(artifact: Artifact, mode: bulk_map.MapMode, work_root: str
                ) -> tuple[tuple[layout.BulkFile, ...], list[bulk_map.Span]]:
    """The bulk files and the spans a restore of ``artifact`` would map (``runtime.restore``'s
    ``_use_cache``), from verified copies of its restore plan and CRIU mm images only."""
    os.makedirs(work_root, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"{STAGED_PREFIX}prewarm-", dir=work_root)
    try:
        write_owner(work)  # swept if this process dies with it
        private = os.path.join(work, "private")

        def skip(path: str) -> bool:
            base = os.path.basename(path)
            return not (path == layout.RESTORE_PLAN or (path == f"{layout.CRIU_DIR}/{base}"
                                                        and base.startswith("mm-") and base.endswith(".img")))
        artifact.materialize(private, skip=skip)
        with open(os.path.join(private, layout.RESTORE_PLAN), "rb") as f:
            plan = layout.RestorePlan.from_json(f.read())
        cuda_pids = artifact.manifest.cuda.pids if artifact.manifest.cuda else ()
        spans = bulk_map.choose(plan.bulk, os.path.join(private, layout.CRIU_DIR), mode, cuda_pids,
                                nodecache.stored_sums(artifact, plan.bulk))
        return plan.bulk, spans
    finally:
        with contextlib.suppress(OSError, RekindleError):
            remove_tree_path(work)


class Prewarmer:
    def __init__(self, store: ArtifactStore, key: bytes, cache: nodecache.NodeCache,
                 warm: Callable[[str, Callable[[], object]], bool], mode: bulk_map.MapMode, gate: DiskGate,
                 work_dir: str, *, named: Sequence[tuple[str, str]] = (), discover: bool = True,
                 state_path: str | None = None, threads: int = readahead.THREADS, max_names: int = MAX_NAMES,
                 on_change: Callable[[list[Status]], None] | None = None) -> None:
        self.store, self.key, self.cache, self.warm_on, self.mode = store, key, cache, warm, mode
        self.gate, self.work_dir, self.named, self.discover = gate, work_dir, tuple(named), discover
        self.state_path, self.threads, self.max_names, self.on_change = state_path, threads, max_names, on_change
        self.stop = threading.Event()
        self._seen: dict[tuple[str, str], str] = {}  # name -> the version last looked at
        # Warm versions the cache let go: name -> (version, entry bytes), warmed again once they
        # fit without evicting another (two marked artifacts that do not fit together never churn).
        self._evicted: dict[tuple[str, str], tuple[str, int]] = {}
        self._status: dict[tuple[str, str], Status] = {(ns, n): Status(f"{ns}/{n}") for ns, n in self.named}
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # the look and the writer both record

    # --- looking ------------------------------------------------------------------------------

    def candidates(self) -> list[tuple[str, str]]:
        """The names this look reads the link of: the listed ones, those it knows of (a name
        deleted from the store is looked at once more, and forgotten), then (``discover``) the
        store's, :attr:`max_names` in all."""
        out = list(self.named[:self.max_names])
        with self._lock:
            known = sorted(set(self._status) | set(self._seen))
        out += [k for k in known if k not in out][:max(0, self.max_names - len(out))]
        if not self.discover:
            return out
        try:
            for ns in _names_in(self.store.root, self.max_names):
                if len(out) >= self.max_names:
                    break
                if not names.is_dns_label(ns):
                    continue
                for name in _names_in(os.path.join(self.store.root, ns), self.max_names):
                    if len(out) >= self.max_names:
                        break
                    if names.is_artifact_name(name) and (ns, name) not in out:
                        out.append((ns, name))
        except OSError as exc:
            log.info("pre-warm: the store cannot be listed: %s", exc)
        return out

    def look(self) -> None:
        """One look: each candidate whose name points to a version not seen before is opened;
        a marked one is queued for the writer."""
        for ns, name in self.candidates():
            try:
                self._look_at(ns, name)
            except Exception:  # noqa: BLE001 - one bad name never stops the others
                log.exception("pre-warm: looking at %s/%s failed", ns, name)
        self._refresh()
        self._publish()

    def _version(self, ns: str, name: str) -> str | None:
        try:
            ns_fd = os.open(os.path.join(self.store.root, ns), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            return self.store.current_version(ns_fd, name)
        finally:
            os.close(ns_fd)

    def _look_at(self, ns: str, name: str) -> None:
        listed = (ns, name) in self.named
        try:
            version = self._version(ns, name)
        except (OSError, RekindleError) as exc:
            version = None
            if listed:
                self._set(ns, name, State.REFUSED, reason=f"the store's name: {exc}")
                return
        if version is None:
            if listed:
                self._set(ns, name, State.ABSENT, version="", reason="not published")
            else:
                with self._lock:
                    self._status.pop((ns, name), None)
            self._seen.pop((ns, name), None)
            return
        if self._seen.get((ns, name)) == version:
            return
        self._seen[(ns, name)] = version
        try:
            with self.store.open(ns, name, self.key, version=version) as artifact:
                marked = artifact.manifest.prewarm or listed
                if not marked:
                    with self._lock:
                        self._status.pop((ns, name), None)
                    return
                manifest_id, mode = artifact.manifest_id, self._mode_of(artifact)
        except RekindleError as exc:  # a bad signature, a manifest not of this name, ...
            if listed or (ns, name) in self._status:
                self._set(ns, name, State.REFUSED, version=version, reason=str(exc))
            return
        if self.cache.has(manifest_id, mode):
            self._set(ns, name, State.WARM, version=version, entry_bytes=self._entry_bytes(manifest_id, mode))
            return
        status = self._set(ns, name, State.WARMING, version=version)
        log.info("pre-warm: %s/%s %s published, queued for this node's cache", ns, name, version)
        if not self.warm_on(manifest_id, lambda: self._write(ns, name, version, manifest_id, mode, status)):
            log.info("pre-warm: %s/%s: its entry is queued already", ns, name)

    def _mode_of(self, artifact: Artifact) -> bulk_map.MapMode:
        """What a restore of it maps, so what its entry holds: its source's choice, else the node's."""
        return bulk_map.for_artifact(artifact.manifest.map_ranges, self.mode)

    def _entry_bytes(self, manifest_id: str, mode: bulk_map.MapMode) -> int:
        key = nodecache.entry_key(manifest_id, mode)
        return next((e.bytes for e in self.cache.entries() if e.key == key), 0)

    # --- writing (on the cache writer's thread) ------------------------------------------------

    def _write(self, ns: str, name: str, version: str, manifest_id: str, mode: bulk_map.MapMode,
               status: Status) -> None:
        if self.stop.is_set():
            return
        try:
            with self.store.open(ns, name, self.key, version=version) as artifact:
                if artifact.manifest_id != manifest_id:
                    raise RekindleError("the version changed since it was looked at")
                artifact.yield_to_deletes()  # a cache is never why a delete is refused
                files, spans = _plan_spans(artifact, mode, self.work_dir)
                if not files:
                    raise RekindleError("it holds no bulk pages: a restore of it does not use the node cache")
                need = nodecache.entry_bytes(artifact, files, spans, nodecache.stored_sums(artifact, files))
                if need > self.cache.max_bytes:
                    raise RekindleError(f"its entry needs {need / 2**20:.1f} MiB, more than the cache's bound "
                                        f"of {self.cache.max_bytes / 2**20:.1f} MiB")
                status.total = sum(f.bytes for f in files)
                pacer = Pacer(status, self.gate, self.stop, self._publish)
                log.info("pre-warm: writing %s/%s %s into this node's cache (%.1f MiB)", ns, name, version,
                         need / 2**20)
                t0 = time.monotonic()
                rec = self.cache.write(artifact, files, spans, mode, threads=self.threads, pace=pacer)
                if rec is None:
                    if self.cache.has(manifest_id, mode):
                        self._set(ns, name, State.WARM, version=version,
                                  entry_bytes=self._entry_bytes(manifest_id, mode))
                        return
                    why = self.cache.refused.get(nodecache.entry_key(manifest_id, mode), "it does not fit")
                    raise RekindleError(why)
                log.info("pre-warm: %s/%s %s warm on this node: %.1f MiB in %.2fs (%d pause(s) for restores%s)",
                         ns, name, version, rec.bytes / 2**20, time.monotonic() - t0, pacer.pauses,
                         "" if pacer.first_pause is None else
                         f", the first {pacer.first_pause:.2f}s in, {pacer.paused_for:.2f}s paused in all")
                self._set(ns, name, State.WARM, version=version, total=status.total, bytes=status.bytes,
                          rate=status.rate, entry_bytes=rec.bytes)
        except (OSError, RekindleError) as exc:
            log.warning("pre-warm: %s/%s %s refused: %s", ns, name, version, exc)
            self._set(ns, name, State.REFUSED, version=version, reason=str(exc))
        finally:
            self._publish()

    # --- state --------------------------------------------------------------------------------

    def _set(self, ns: str, name: str, state: State, **fields: object) -> Status:
        with self._lock:
            old = self._status.get((ns, name))
            new = Status(f"{ns}/{name}", state, **{"version": old.version if old else "", **fields})  # type: ignore[arg-type]
            self._status[(ns, name)] = new
        return new

    def _refresh(self) -> None:
        """A warm one whose entry went (evicted, dropped) is absent again, and written again
        once its entry fits without evicting another (the cache let it go to make room)."""
        with self._lock:
            warm = [(k, s) for k, s in self._status.items() if s.state is State.WARM]
        for (ns, name), s in warm:
            try:
                with self.store.open(ns, name, self.key, version=s.version) as artifact:
                    there = self.cache.has(artifact.manifest_id, self._mode_of(artifact))
            except RekindleError:
                there = False
            if not there:
                self._evicted[(ns, name)] = (s.version, s.entry_bytes)
                self._set(ns, name, State.ABSENT, version=s.version,
                          reason="evicted from the cache; warmed again once it fits beside the others")
        # One at a time, and none while a warm-up is queued or under way: the room each saw
        # would be the same room.
        with self._lock:
            busy = any(s.state is State.WARMING for s in self._status.values())
        for key, (version, need) in list(self._evicted.items()):
            if self._seen.get(key) != version:  # deleted, or a new version: the look handles it
                del self._evicted[key]
            elif not busy and self.cache.has_room(need):
                del self._evicted[key]
                del self._seen[key]  # the next look opens it again and queues it
                busy = True

    def states(self) -> list[Status]:
        with self._lock:
            return [dataclasses.replace(s) for _k, s in sorted(self._status.items())]

    def _publish(self) -> None:
        states = self.states()
        if self.on_change is not None:
            self.on_change(states)
        if self.state_path is None:
            return
        tmp = f"{self.state_path}.tmp"
        try:
            with self._file_lock:
                with open(tmp, "w") as f:
                    json.dump({"updated": time.time(), "artifacts": [s.to_obj() for s in states]}, f)
                os.replace(tmp, self.state_path)
        except OSError as exc:
            log.warning("pre-warm: cannot record its state: %s", exc)

    def run(self, interval: float) -> None:
        """Look every ``interval`` seconds until :meth:`shutdown` (on a thread of its own)."""
        while not self.stop.is_set():
            self.look()
            self.stop.wait(interval)

    def shutdown(self) -> None:
        self.stop.set()


def read_states(state_dir: str) -> list[dict[str, object]]:
    """What the plugin recorded (``rekindle status``, ``rekindle artifacts list``); [] without a file."""
    try:
        with open(os.path.join(state_dir, STATE_FILE)) as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return []
    arts = obj.get("artifacts") if isinstance(obj, dict) else None
    return [a for a in arts if isinstance(a, dict)] if isinstance(arts, list) else []


def start_prewarm(settings: Settings, store: ArtifactStore, key: bytes, engine: PrewarmEngine,
                  metrics: Metrics | None) -> Prewarmer | None:
    """The plugin's pre-warmer, looking on a thread of its own; None when off (no cache, no
    interval, or a restore path that does not use the cache)."""
    if engine.cache is None or engine.cache_writer is None or not settings.cache.prewarm_interval:
        if settings.cache.prewarm:
            log.warning("pre-warm: %s listed, but %s", ", ".join(settings.cache.prewarm),
                        "the node cache is off" if engine.cache_writer is None else "--prewarm-interval is 0")
        return None
    if settings.restore.path is RestorePath.STOCK:
        log.warning("pre-warm: off (--restore-path stock restores never use the node cache)")
        return None
    prewarmer = Prewarmer(store, key, engine.cache, engine.cache_writer.warm,
                          bulk_map.MapMode(settings.cache.map_ranges.value),
                          engine.disk, os.path.join(settings.state_dir, "logs"),
                          named=parse_names(settings.cache.prewarm),
                          state_path=os.path.join(settings.state_dir, STATE_FILE),
                          on_change=metrics.prewarm if metrics is not None else None)
    threading.Thread(target=prewarmer.run, args=(settings.cache.prewarm_interval,), name="rekindle-prewarm",
                     daemon=True).start()
    log.info("pre-warm: looking at the store every %.0fs (%d listed)", settings.cache.prewarm_interval,
             len(prewarmer.named))
    return prewarmer


def _printable(value: object) -> str:
    return "".join(c if c.isprintable() else "?" for c in str(value))  # the reason quotes store content


def describe(state: dict[str, object]) -> str:
    """One recorded state as a line's tail: ``warming 48.0 of 96.0 MiB at 310.2 MiB/s``, ``warm``,
    ``refused: <reason>``, ``absent (<reason>)``."""
    st = _printable(state.get("state", "?"))
    reason = _printable(state.get("reason") or "")
    done, total, rate = (state.get(k, 0) for k in ("bytes", "total", "rate"))
    if st == State.WARMING.value and isinstance(done, int) and isinstance(total, int) \
            and isinstance(rate, (int, float)):
        paused = " (paused: a restore runs)" if state.get("paused") else ""
        return f"warming {done / 2**20:.1f} of {total / 2**20:.1f} MiB at {rate / 2**20:.1f} MiB/s{paused}"
    if st == State.REFUSED.value:
        return f"refused: {reason}"
    return f"{st} ({reason})" if reason else st
