"""The restore flow: one artifact -> the workload running inside a waiting container.

The target container runs ``rekindle-init --mode restore`` as PID 1 and waits. Steps, timed:
  1. open: the version the name points to now, through one directory fd (signature, location,
     generation not older than this node last restored: no rollback);
  2. inspect: compatibility (node, CRIU, image, driver, GPUs visible to *this* container) and
     that the source's privilege does not exceed the target's (``runtime.security``: uid/gid,
     capabilities, privileged, seccomp, no_new_privs, LSM, user namespace, masked and read-only
     paths, device cgroup, sysctls) — CRIU restores what the source had; the files the tree
     uses from bind mounts have the checkpoint's content (``runtime.hostfiles``);
  3. stage: every file but the bulk pages and the layer archives whose chunk digests are listed
     is copied into a private node-local directory while hashed; only those copies are used
     afterwards (CRIU reads its images from there). The
     prefetch may have done this from RunPodSandbox on: its copies are taken when they are of
     the very version opened in step 1 (version name and manifest bytes);
  4. rootfs_apply: the writable-layer diff (and /dev/shm) into the target, read from the store
     chunk by chunk, each verified before use (runtime.overlay.verified), journaled outside
     it (``<undo_dir>/<container id>``, runtime.overlay.pending) until ``restore-complete``: a
     later step that fails rolls it back, and so does the next agent (:func:`recover_rootfs`)
     when this one dies; meanwhile ``rootfs-pending`` tells the init not to start cold on it;
  5. criu_restore: CRIU inside the target's namespaces and cgroups with the target's LSM labels,
     TCP connections kept or closed as the dump decided (``RestorePlan.tcp_established``), left
     stopped; the target's oom_score_adj, rlimits and mount flags are forced on the stopped
     tree (runtime.criu.executor, runtime.container.confine);
  6. fill: the bulk pages are read, hashed and written into the stopped process on many
     threads; the process is resumed only when every digest matched (``fill_shared`` first:
     shared anonymous segments, on every route but the stock one);
  7. cuda_restore: the target's GPU device nodes (created from the host by syscalls), restore
     (remapped by UUID onto the GPUs this container was given) of every CUDA process, then
     unlock of every one; any failure kills the restored tree (a process left locked, or a rank
     whose peer failed, would never go on);
  8. after_restore (only when asked): the workload's wake-up call (``runtime.pod.hooks``), while
     the stream goes on; not answered 2xx in time, the restore fails;
  9. ``restore-pid`` + ``restore-complete`` for the init.
Progress: ``progress(phase, 0, 0)`` at each phase start, ``("fill", done, total)`` bytes during
the fill (from the fill's threads), and ``("complete", n, n)`` at the end, n the artifact's bytes.
Any failure raises: a restored tree that never ran is killed, and once the rootfs was touched
everything but the init is killed and the rootfs rolled back; the caller writes
``restore-failed`` and the init kills whatever is left in its pid namespace and starts cold.
The private copies live in ``<log_dir>/restore-*/private`` beside an owner record (this process);
they are removed at the end, or by ``housekeeping.sweep_restore_copies`` once that process is
provably dead (an agent killed mid-restore).
The stock path (``RestorePath.STOCK``) hands the bulk pages back to CRIU instead (a private
copy of them too), for comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from runtime import control as control_mod
from runtime import hostfiles, layout, overlay
from runtime.compat import NodeFacts, check_compatibility
from runtime.container.containers import ContainerInfo, resolve_container
from runtime.container.namespaces import host_pid_of, pid_namespace_shared
from runtime.criu import image_files, restore_into
from runtime.errors import ArtifactRejected, Reason, RekindleError, SharedPidNamespace
from runtime.gpu import Checkpointer, build_gpu_map, cuda_restore, ensure_device_nodes, hold_cuda, target_facts
from runtime.overlay import pending as overlay_pending
from runtime.overlay.verified import VerifiedArchive
from runtime.pages import bulk, nodecache, stream
from runtime.pages import mapping as bulk_map
from runtime.pages.entry import EntryBuild, Left, Share
from runtime.proc import tasks
from runtime.proc.owner import write_owner
from runtime.rollback import GenerationBook
from runtime.route import RestorePath, Route, RouteFacts
from runtime.route import choose as choose_route
from runtime.security import LsmSupport, SecurityProfile, check_privilege, lsm_options
from runtime.store import Artifact, ArtifactStore
from runtime.testpause import pause_for_test
from runtime.timings import Timings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreRequest:
    containerd_state: str
    container_id: str
    namespace: str
    name: str
    image: str
    image_ref: str
    log_dir: str
    path: RestorePath = RestorePath.AUTO  # as asked; the restore's route decides (runtime.route)
    threads: int = 0  # fill threads; 0: the fill's own default (bulk.fill_threads)
    # The streamed path's install threads (runtime.pages.stream.threads); None: as ``threads``
    # where set, else the serve's own default. 0 serves faults only (a measurement setting).
    serve_threads: int | None = None
    # A restore that maps ranges from a complete node cache entry serves the bulk pages it does
    # not map, as the first restore of a version does, instead of filling them before the tree
    # runs. Four LLM-worker pods mapped from one entry spent 1.06-1.26 s each in that fill (0.29 s
    # alone; bench/results/h200/scale-out-llm-warm.json) before their CUDA restores could start;
    # served, it runs beside them. Off until measured on a GPU node (a measurement setting).
    warm_rest: bool = False
    max_layer_bytes: int = overlay.DEFAULT_MAX_LAYER_BYTES  # what a layer may write, at most
    # Node-local dir of the rootfs undo journals (runtime.overlay.pending), where the next agent
    # finds them; "": in the restore's work dir (rolled back on failure, not after a kill).
    undo_dir: str = ""
    # The version the plugin checked when the container was created (its precheck): that one is
    # restored, or none ("": the version the name points to now).
    version: str = ""
    concurrent: int = 0  # other restores running on the node when this one began (runtime.route)


Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


@dataclass(frozen=True)
class CacheWork:
    """What the node cache's entry of a version is written from, after a restore found none."""

    namespace: str
    name: str
    manifest_id: str
    files: tuple[layout.BulkFile, ...]
    spans: tuple[bulk_map.Span, ...]
    mode: bulk_map.MapMode
    # The entry the restore began and whose map files its serve wrote (a streamed restore on a
    # tmpfs cache): the writer claims it and seals it, or abandons it.
    premade: EntryBuild | None = None


@dataclass(frozen=True)
class CacheUse:
    """How a restore used the node cache (``cache`` in the container's ``timings.json``)."""

    # "warm": mapped and filled from an entry; "cold": none yet; "building": none yet, and this
    # (streamed) restore made it as it ran, its ranges mapped from it; "joined": the same, with
    # another restore of the version that began it; "off": no cache
    state: str
    mapped_bytes: int = 0
    filled_bytes: int = 0
    store_bytes_read: int = 0  # of the bulk files, from the shared store
    entry: str = ""
    reason: str = ""  # why "off" for this target when the node has a cache


def _shm_dir(target: ContainerInfo) -> str | None:
    for m in target.spec_mounts:
        if os.path.normpath(m.get("destination", "")) == "/dev/shm" and m.get("type") == "bind":
            return m.get("source")
    return None


def _stage(artifact: Artifact, private: str, path: RestorePath, ahead: str | None = None,
           source: Callable[[str], int] | None = None) -> layout.RestorePlan:
    """Copy (and verify) what this restore reads into ``private``; parse the plan from there.
    ``ahead``: a work dir whose ``private`` already holds verified copies of exactly this
    version (staged from RunPodSandbox on): it is moved in instead. ``source``: where the
    copies are read from when not the store (the node cache), verified all the same."""
    taken = False
    if ahead is not None:
        try:
            os.rename(os.path.join(ahead, "private"), private)
            taken = True
            log.info("%s: staged ahead (from the pod's sandbox start on)", artifact.label)
        except OSError as exc:
            log.info("%s: the copy staged ahead cannot be used (%s); staging again", artifact.label, exc)
        shutil.rmtree(ahead, ignore_errors=True)
    if not taken:
        artifact.materialize(private, skip=layout.staged_skip({f.path for f in artifact.manifest.files}),
                             source=source)
    try:
        with open(os.path.join(private, layout.RESTORE_PLAN), "rb") as f:
            plan = layout.RestorePlan.from_json(f.read())
    except (OSError, ValueError, TypeError) as exc:
        raise ArtifactRejected(artifact.label, f"restore plan: {exc}") from exc
    if path is RestorePath.STOCK:
        images = os.path.join(private, layout.CRIU_DIR)
        for b in plan.bulk:
            _rejoin(artifact, os.path.join(images, f"pagemap-{b.pid}.img"), b.path, layout.bulk_pagemap(b.pid))
        for sh in plan.shared:
            _rejoin(artifact, os.path.join(images, f"pagemap-shmem-{sh.shmid}.img"), sh.path,
                    layout.shared_pagemap(sh.shmid))
    return plan


def _rejoin(artifact: Artifact, pagemap: str, bulk_path: str, original: str) -> None:
    """The stock path: CRIU's pagemap ``pagemap`` and its pages file made whole again from the
    bulk file and the pagemap the dump wrote (private copies, verified)."""
    kept = image_files.read_pagemap_at(pagemap)
    kept_pages = kept.pages_path + ".kept"
    os.rename(kept.pages_path, kept_pages)
    os.unlink(kept.path)
    artifact.copy_verified(bulk_path, kept.pages_path)
    artifact.copy_verified(original, kept.path)
    # The bulk file lacks what CRIU keeps (punched out): its own pages file has them.
    try:
        bulk.rejoin(kept, image_files.read_pagemap_at(pagemap), kept_pages, kept.pages_path)
    except OSError as exc:
        raise ArtifactRejected(artifact.label, f"stock pages of {bulk_path}: {exc}") from exc
    os.unlink(kept_pages)


@contextlib.contextmanager
def _layer(artifact: Artifact, private: str, tar: str,
           source: Callable[[str], int] | None) -> Iterator[str | VerifiedArchive]:
    """The layer archive to apply: its private copy when staging made one (an artifact without
    its chunk digests, or a copy staged ahead), else the store's (or the node cache's) file read
    through the chunk digests staged beside it: one read of each byte, verified before use."""
    copy = os.path.join(private, tar)
    if os.path.exists(copy):
        yield copy
        return
    with open(os.path.join(private, layout.layer_sums(tar)), "rb") as f:
        sums = f.read()
    fd = (source or artifact.open_file)(tar)
    with VerifiedArchive(fd, artifact.entry(tar).size, sums, f"{artifact.label}: {tar}") as archive:
        yield archive


@dataclass
class _Cached:
    """How one restore uses the node cache (``_use_cache``)."""

    entry: nodecache.Held | None  # held until the restore ends
    bulk_files: tuple[layout.BulkFile, ...]  # what is filled (the plan's, less what is mapped)
    use: CacheUse
    spans: list[bulk_map.Span] = dataclasses.field(default_factory=list)  # mapped from the entry
    inherit: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # their fds, for CRIU
    cold: CacheWork | None = None  # what the entry is written from, when there is none


def _use_cache(cache: nodecache.NodeCache | None, entry: nodecache.Held | None, req: RestoreRequest,
               artifact: Artifact, plan: layout.RestorePlan, images: str, mode: bulk_map.MapMode) -> _Cached:
    """With a complete ``entry`` of this version: CRIU's images rewritten to map the chosen
    ranges from it, the rest to fill; without one: what to write it from, later."""
    off = cache is None or not cache.enabled or req.path is RestorePath.STOCK
    shared = sum(sh.bytes for sh in plan.shared)  # never in an entry: read from the store
    use = CacheUse("off" if off else "cold", store_bytes_read=sum(b.bytes for b in plan.bulk) + shared)
    if off or not plan.bulk:
        return _Cached(entry, plan.bulk, use)
    cuda_pids = artifact.manifest.cuda.pids if artifact.manifest.cuda else ()
    spans = bulk_map.choose(plan.bulk, images, mode, cuda_pids, _digests(artifact, plan.bulk, entry))
    if entry is not None and entry.record.span_list() != spans:
        stale = entry.record.key
        entry.close()
        entry = None
        dropped = cache is not None and cache.forget(stale)  # another plugin version made it: made again
        log.warning("%s: node cache entry %s maps other ranges than this restore would; not used%s",
                    artifact.label, stale, ", removed" if dropped else "")
    if entry is None:
        return _Cached(None, plan.bulk, use, cold=CacheWork(req.namespace, req.name, artifact.manifest_id,
                                                            plan.bulk, tuple(spans), mode))
    key = entry.record.key
    bulk_map.rewrite_images(images, spans, key, {s.name: entry.stat(s.name).st_size for s in spans})
    rest = bulk_map.remainder(plan.bulk, spans)
    return _Cached(entry, rest, CacheUse("warm", sum(s.length for s in spans), sum(b.bytes for b in rest), shared, key),
                   spans, [(entry.fd(s.name), bulk_map.inherit_key(s, key)) for s in spans])


def _digests(artifact: Artifact, files: Sequence[layout.BulkFile], entry: nodecache.Held | None) -> dict[str, bytes]:
    """Each bulk file's chunk digests, checked, from the entry where there is one (the mapping
    leaves the zero ranges out by them); {} where they cannot be read: every range may be mapped
    then, and an entry made with them is not used."""
    try:
        return {f.path: bulk.read_sums(artifact, f, entry.open_copy if entry is not None else None) for f in files}
    except (OSError, RekindleError) as exc:
        log.info("%s: chunk digests not read to choose the mapped ranges: %s", artifact.label, exc)
        return {}


@dataclass(frozen=True)
class _Building:
    bulk_files: tuple[layout.BulkFile, ...]  # what is still copied: the plan's, less what is mapped
    inherit: list[tuple[int, str]]  # the map files, for CRIU


def _share_entry(cache: nodecache.NodeCache | None, artifact: Artifact, plan: layout.RestorePlan, cold: CacheWork,
                 mode: bulk_map.MapMode) -> Share | None:
    """No entry of this version yet, and the restore streams: a share of the entry it makes as it
    runs, or of the one another restore of the version is making now (None: it streams by copy)."""
    if cache is None or not cold.spans or stream.unsupported() is not None:
        return None
    return cache.begin(artifact, plan.bulk, cold.spans, mode) or cache.join(artifact, cold.spans, mode)


def _map_building(share: Share, images: str, plan: layout.RestorePlan) -> _Building:
    """CRIU's images rewritten to map the ranges of the entry being made from its map files."""
    spans, key = list(share.build.spans), share.build.key
    bulk_map.rewrite_images(images, spans, key, {sp.name: sp.file_size for sp in spans})
    return _Building(bulk_map.remainder(plan.bulk, spans),
                     [(share.ro(sp.name), bulk_map.inherit_key(sp, key)) for sp in spans])


def _mapped_check(share: Share | None, pidns: int) -> Callable[[], None] | None:
    """Once the mapped ranges are registered (the tree still stopped): each is a mapping of
    exactly its file, and no page of it is there yet (another restore may have written it)."""
    if share is None:
        return None
    spans = list(share.build.spans)

    def check() -> None:
        pids = {sp.pid: host_pid_of(pidns, sp.pid) for sp in spans}
        bulk_map.check_mapped(pids, spans, {sp.name: os.fstat(share.ro(sp.name)) for sp in spans})
        bulk_map.check_untouched(pids, spans)
    return check


def _open_bulk(held: contextlib.ExitStack, artifact: Artifact,
               files: Sequence[layout.AnyBulkFile]) -> tuple[list[int], list[bytes]]:
    """fds of the bulk files and their chunk digests (verified), both from staging on: whatever
    is renamed or removed in the store afterwards cannot change which bytes the fill reads (it
    checks each chunk against its digest before writing it)."""
    fds, sums = [], []
    for b in files:
        fd = artifact.open_file(b.path)
        held.callback(os.close, fd)
        fds.append(fd)
        sums.append(bulk.read_sums(artifact, b))
    return fds, sums


def _route(req: RestoreRequest, artifact: Artifact, mapped: bool,
           bulk_files: tuple[layout.BulkFile, ...]) -> Route:
    """The route of this restore, from the facts staged so far (runtime.route)."""
    asks_stream = req.path in (RestorePath.STREAM, RestorePath.AUTO)
    return choose_route(req.path, RouteFacts(
        node_cannot_stream=stream.unsupported() if asks_stream and not mapped else None,
        mapped_entry=mapped, warm_rest=req.warm_rest, cuda_host_copy=artifact.manifest.cuda is not None,
        serve_bytes=sum(b.bytes for b in bulk_files), concurrent=req.concurrent))


def restore(req: RestoreRequest, store: ArtifactStore, key: bytes, facts: NodeFacts, *,
            control: control_mod.ControlDir | None = None, cuda: Checkpointer | None = None,
            check_image: bool = True, generations: GenerationBook | None = None,
            progress: Progress | None = None,
            staged: Callable[[Artifact], str | None] | None = None,
            cache: nodecache.NodeCache | None = None, map_mode: bulk_map.MapMode = bulk_map.MapMode.DRIVER,
            on_cold: Callable[[CacheWork], object] | None = None,
            after_restore: Callable[[], object] | None = None) -> dict[str, float]:
    """Restore ``req``; ``staged(artifact)`` may hand over a work dir with this version's
    verified copies, staged ahead (``nri_plugin.prefetch``). With a ``cache`` whose entry of
    this version is complete, the chosen bulk ranges (``map_mode``, unless the artifact's manifest
    names its own: ``runtime.pages.mapping.for_artifact``) are mapped from it and the
    rest filled from it (``runtime.pages.mapping``); without one, ``on_cold`` is handed what the
    entry would be written from, once the restore succeeded (an entry this restore made as it
    streamed, ``CacheWork.premade``, is abandoned unless ``on_cold`` claimed it)."""
    t = Timings()
    if progress is not None:
        t.on_phase = lambda phase: progress(phase, 0, 0)
    os.makedirs(req.log_dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f"restore-{req.namespace}-{req.name}-{req.container_id[:12]}-",
                            dir=req.log_dir)
    private = os.path.join(work, "private")  # verified copies; removed at the end (logs stay)
    undo_root = req.undo_dir or os.path.join(work, "undo")
    pending = overlay_pending.Pending(undo_root, req.container_id, control)
    final = False  # restore-complete written: the restored rootfs stays
    target: ContainerInfo | None = None
    streamed: stream.Session | None = None
    entry: nodecache.Held | None = None
    use = CacheUse("off")
    cold_work: CacheWork | None = None
    share: Share | None = None  # of the entry this restore makes as it streams
    handed: EntryBuild | None = None  # that entry, once this restore holds it for the writer
    inherit: list[tuple[int, str]] = []  # its map files, for CRIU
    try:
        # Who made them: if this process dies mid-restore, housekeeping removes them.
        write_owner(work)
        with contextlib.ExitStack() as held:  # the artifact (its lock) and the bulk fds
            with t.phase("open"):
                artifact = held.enter_context(store.open(req.namespace, req.name, key, version=req.version or None))
            manifest = artifact.manifest
            map_mode = bulk_map.for_artifact(manifest.map_ranges, map_mode)  # its source's, else the node's
            if manifest.timings.get("cold_start", 0) > 0:  # not a phase: what this restore competes with
                t["source_cold_start"] = float(manifest.timings["cold_start"])
            if generations is not None:
                generations.check(req.namespace, req.name, manifest.generation)
            with t.phase("inspect"):
                target = resolve_container(req.containerd_state, req.container_id)
                shared = pid_namespace_shared(target.init_pid)
                if shared:  # a failed restore's clean-up must reach the restored tree only
                    raise SharedPidNamespace(f"restore refused: {shared}")
                tfacts = target_facts(facts, target.spec)
                image = req.image if check_image else manifest.source.image
                image_ref = req.image_ref if check_image else manifest.source.image_ref
                reasons = check_compatibility(manifest, tfacts, image=image, image_ref=image_ref)
                security = SecurityProfile.from_oci_spec(target.spec, label=req.name)
                lsm = LsmSupport.detect()
                if manifest.cuda is not None and cuda is None:
                    reasons.append("artifact holds CUDA state but this agent has no CUDA driver")
                privilege = check_privilege(manifest.security, security, lsm=lsm)
                kind = Reason.PRIVILEGE if privilege else Reason.INCOMPATIBLE
                reasons += privilege
                if not reasons:  # hashing is the costly check: only when nothing else refused
                    reasons += hostfiles.check(manifest.host_files, target.spec_mounts, label=artifact.label,
                                                view_of=target.init_pid)
                    kind = Reason.INTEGRITY  # the files it uses from bind mounts changed
                if reasons:
                    raise ArtifactRejected(artifact.label, "; ".join(reasons), kind)
            with t.phase("stage"):
                no_cache = nodecache.refused_for(security.capabilities) if cache is not None else None
                if no_cache is not None:
                    log.info("%s: %s", artifact.label, no_cache)
                    cache = None
                if cache is not None and req.path is not RestorePath.STOCK:
                    entry = cache.hold(artifact, map_mode)
                ahead = staged(artifact) if staged is not None else None
                plan = _stage(artifact, private, req.path, ahead, entry.open_copy if entry is not None else None)
                images = os.path.join(private, layout.CRIU_DIR)
                cached = _use_cache(cache, entry, req, artifact, plan, images, map_mode)
                entry, use, cold_work, bulk_files = cached.entry, cached.use, cached.cold, cached.bulk_files
                if no_cache is not None:
                    use = dataclasses.replace(use, reason=no_cache)
                route = _route(req, artifact, bool(cached.spans), bulk_files)
                path = route.path
                if path is RestorePath.STREAM and cold_work is not None and on_cold is not None:
                    share = _share_entry(cache, artifact, plan, cold_work, map_mode)
                    if share is not None:
                        made = _map_building(share, images, plan)
                        bulk_files, inherit = made.bulk_files, made.inherit
                        use = dataclasses.replace(use, state="building" if share.first else "joined",
                                                  entry=share.build.key,
                                                  mapped_bytes=sum(sp.length for sp in share.build.spans))
                        route = route.feeding(share.first)
                if path is RestorePath.STREAM and (bulk_files or share is not None):
                    why = stream.prepare(bulk_files, images)
                    if why is not None and share is not None:  # its ranges can only be served
                        raise stream.StreamError(f"the streamed restore cannot run: {why}")
                    if why is not None:
                        log.warning("%s: the bulk path instead of the streamed one: %s", artifact.label, why)
                        route = route.instead(RestorePath.BULK, why)
                        path = route.path
                log.info("%s: route %s, %s (%s)", artifact.label, route.kind.value, route.path.value, route.reason)
                fill_bulk = bool(bulk_files) and path in (RestorePath.BULK, RestorePath.STREAM)
                served_files = plan.bulk if share is not None else bulk_files
                sealed = False  # the fds are a node cache entry's sealed fill files
                if share is not None:
                    fds, sums = _open_bulk(held, artifact, plan.bulk)
                elif not fill_bulk:
                    fds, sums = [], []
                elif entry is not None:  # its identity checked: the fill copies it unhashed (bulk.fill)
                    fds, sealed = [entry.fd(nodecache.fill_name(b.pid)) for b in bulk_files], True
                    sums = ([bulk.read_sums(artifact, b, entry.open_copy) for b in bulk_files]
                            if path is RestorePath.STREAM else [])
                else:
                    fds, sums = _open_bulk(held, artifact, plan.bulk)
                # Shared segments are filled on every route but the stock one, from the store
                # (a node cache entry holds none), before the tree runs (runtime.pages.bulk).
                shared_files = plan.shared if path is not RestorePath.STOCK else ()
                shared_fds, shared_sums = _open_bulk(held, artifact, shared_files)
                total = sum(b.bytes for b in served_files)
                report = (lambda done: progress("fill", done, total)) if progress else None
                stream_report = (lambda done: progress("stream", done, total)) if progress else None
                if (fill_bulk or share is not None) and path is RestorePath.STREAM:  # faults served from CRIU's hand-off on
                    first = (stream.driver_spans(images, manifest.cuda.pids)  # mapped ones are no piece's
                             if manifest.cuda is not None and not cached.spans else [])
                    mapped = ([stream.Mapped(sp, share.out(sp.name)) for sp in share.build.spans]
                              if share is not None else [])
                    streamed = stream.Session.begin(work, target, control, artifact.label, served_files, fds, sums,
                                                    threads=stream.threads(req.threads, req.serve_threads),
                                                    progress=stream_report,
                                                    first=first, mapped=mapped,
                                                    book=share.build.book if share is not None else None)
            if generations is not None:
                generations.record(req.namespace, req.name, manifest.generation)

            with t.phase("rootfs_apply"):
                # Journaled outside the rootfs until the restore is final: any later failure, or
                # the next agent after this one died, rolls it back (runtime.overlay.pending).
                recover_rootfs(undo_root, req.container_id, 0, control)
                pending.begin()
                layer_from = entry.open_copy if entry is not None else None
                with _layer(artifact, private, layout.ROOTFS_TAR, layer_from) as tar:
                    overlay.apply(target.rootfs, tar, os.path.join(private, layout.ROOTFS_DELETIONS),
                                  max_bytes=req.max_layer_bytes, journal=pending.journal("rootfs"))
                shm = _shm_dir(target)
                if plan.shm and shm:
                    with _layer(artifact, private, layout.SHM_TAR, layer_from) as tar:
                        overlay.apply(shm, tar, os.path.join(private, layout.SHM_DELETIONS),
                                      max_bytes=req.max_layer_bytes, journal=pending.journal("shm"))
            pause_for_test("applied")

            with t.phase("criu_restore"):
                stdio = plan.stdio if len(plan.stdio) == 3 else None
                result = restore_into(target, os.path.join(private, layout.CRIU_DIR), list(plan.mounts),
                                      source_stdio=stdio, work_dir=work, lsm=lsm_options(security, lsm),
                                      tcp_established=plan.tcp_established, lazy_pages=streamed is not None,
                                      inherit=cached.inherit + inherit)
            pause_for_test("criu")
            pidns = target.namespaces["pid"].inode
            host_pids: list[int] = []
            gpu_map = None
            try:
                if shared_files:
                    with t.phase("fill_shared"):
                        bulk.fill(artifact, shared_files, shared_fds, lambda pid: host_pid_of(pidns, pid),
                                  sums=shared_sums, images=os.path.join(private, layout.CRIU_DIR),
                                  tree=result.tree, threads=bulk.fill_threads(req.threads))
                if streamed is not None:
                    with t.phase("stream_start"):  # installs begin; the tree runs from SIGCONT on
                        bulk.check_targets(bulk_files, os.path.join(private, layout.CRIU_DIR), result.tree,
                                           lambda pid: host_pid_of(pidns, pid))
                        streamed.start(check=_mapped_check(share, pidns))
                if entry is not None and cached.spans:
                    bulk_map.check_mapped({s.pid: host_pid_of(pidns, s.pid) for s in cached.spans}, cached.spans,
                                          {s.name: entry.stat(s.name) for s in cached.spans})
                if streamed is None and fill_bulk:
                    with t.phase("fill"):
                        bulk.fill(artifact, bulk_files, fds, lambda pid: host_pid_of(pidns, pid),
                                  sums=sums, images=os.path.join(private, layout.CRIU_DIR), tree=result.tree,
                                  threads=bulk.fill_threads(req.threads), progress=report,
                                  sealed=sealed)
                if manifest.cuda is not None:
                    host_pids = [host_pid_of(pidns, p) for p in manifest.cuda.pids]
                    gpu_map = build_gpu_map([g.uuid for g in manifest.cuda.gpus],
                                            [g.uuid for g in (tfacts.cuda.gpus if tfacts.cuda else ())])
                    if gpu_map:  # the driver reopens the target's GPU by its own node
                        for pid in host_pids:
                            ensure_device_nodes(pid, target.spec)
            except BaseException:
                tasks.kill_all(result.tree)  # stopped since CRIU: it never ran
                raise
        # Every byte is in place and verified (streamed: every byte it reads will be): let it
        # run (but what was stopped when dumped).
        kept = {host_pid_of(pidns, p) for p in image_files.stopped_pids(os.path.join(private, layout.CRIU_DIR))}
        restoring = manifest.cuda is not None and cuda is not None  # CUDA state without a driver was refused
        hold = hold_cuda(host_pids) if restoring else None  # its threads wait for the driver's restore
        on_hold = set(hold.pids) if hold is not None else set()
        tasks.signal_all([p for p in result.tree if p not in kept and p not in on_hold], signal.SIGCONT)
        if restoring and cuda is not None:
            with t.phase("cuda_restore"):
                cuda_restore(cuda, host_pids, gpu_map, result.host_pid, result.tree, hold=hold, stopped=kept)
            log.info("CUDA restored for %d process(es)%s", len(host_pids),
                     f", remapped {gpu_map}" if gpu_map else "")
        if after_restore is not None:
            # The engine's wake-up (runtime.pod.hooks), beside the stream: its failure is the
            # restore's, and the tree that ran is ended like any other after CRIU.
            with t.phase("after_restore"):
                after_restore()
        served: dict[str, object] = {}
        if streamed is not None:
            with t.phase("stream"):  # until the last piece is in: then the uffds are closed
                stats = streamed.wait()
            served = dataclasses.asdict(stats)
            if share is not None:
                if share.leave(stats.mapped_whole) is Left.HANDED:  # the first done with it whole
                    handed = share.build
                elif not stats.mapped_whole:
                    log.info("%s: not every mapped piece was written: no cache entry from this restore",
                             artifact.label)
                share = None
                cold_work = (dataclasses.replace(cold_work, premade=handed)
                             if cold_work is not None and handed is not None else None)
        if control is not None:
            control.write_json(control_mod.TIMINGS, {"restore": dict(t), **({"stream": served} if served else {}),
                                                     "cache": dataclasses.asdict(use), "route": route.record()})
            control.write(control_mod.RESTORE_PID, f"{result.ns_pid}\n")
            control.write(control_mod.RESTORE_COMPLETE, req.name + "\n")
        final = True
        pending.commit()
        log.info("restored %s/%s into %s: %d processes, %s", req.namespace, req.name, req.container_id[:12],
                 len(result.tree), ", ".join(f"{k} {v:.2f}s" for k, v in t.items()))
        if progress is not None:  # what the artifact stores (holes take nothing), not its files' sizes
            size = artifact.stored_bytes()
            progress("complete", size, size)
        if cold_work is not None and on_cold is not None:
            on_cold(cold_work)  # a premade entry is the writer's once it claimed it
        return dict(t)
    except BaseException as exc:
        if not final:
            if pending.begun and target is not None:  # nothing of a restored tree may write to it any more
                _kill_leftovers(target.init_pid)
            problems = pending.roll_back()
            if problems:
                raise RestoreRolledBackBadly(str(exc) or type(exc).__name__, problems) from exc
        raise
    finally:
        if streamed is not None:
            streamed.abort()  # a no-op once served; else the tree is killed, the holder ends
        if entry is not None:
            entry.close()  # held until here: an entry a restore maps is not evicted meanwhile
        if share is not None:
            share.leave(False)  # the restore failed: the last to leave removes an entry nobody finished
        if handed is not None:
            handed.abandon_unclaimed()  # handed over, but the writer did not claim it
        shutil.rmtree(private, ignore_errors=True)


class RestoreRolledBackBadly(RekindleError):
    """A failed restore whose rootfs changes could not all be undone: the init will not start the
    original command on that rootfs (``rootfs-pending`` stays)."""

    reason_class = Reason.RUNTIME

    def __init__(self, failure: str, problems: list[str]) -> None:
        super().__init__(f"{failure}; and the rootfs changes could not all be rolled back "
                         f"({len(problems)} problems: {'; '.join(problems[:3])})")


def recover_rootfs(undo_dir: str, container_id: str, init_pid: int,
                   control: control_mod.ControlDir | None) -> list[str] | None:
    """A restore of ``container_id`` by an agent that died: when it completed, its journals are
    dropped; otherwise what it left running in the container is killed (all but its init, host
    pid ``init_pid``; 0: none looked for) and its rootfs changes are rolled back. None: nothing was
    pending; else the problems met (none: the rootfs is the image's again)."""
    if control is not None and control.exists(control_mod.RESTORE_COMPLETE):
        overlay_pending.Pending(undo_dir, container_id, control).commit()
        return None
    if init_pid > 0:
        _kill_leftovers(init_pid)
    return overlay_pending.recover(undo_dir, container_id, control)


def _kill_leftovers(init_pid: int, wait: float = 5.0) -> None:
    """SIGKILL the restored tree: every descendant of the target's init (host pid
    ``init_pid``) in its pid namespace, by parentage, and wait (a little) until they are gone.
    Never the namespace's other tasks: with a shared pid namespace (refused, but this is the
    last line) they are the pod's or the node's."""
    try:
        pidns = os.stat(f"/proc/{init_pid}/ns/pid").st_ino
    except OSError:
        return
    tasks.kill_descendants(init_pid, pidns, wait=wait)
