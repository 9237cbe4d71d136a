"""The checkpoint flow: one running container -> one published artifact.

Steps, each timed (the timings go into the manifest and the container's status):
  1. inspect: resolve the container (bundle, init pid, overlay upperdir) and its workload tree;
  2. preflight: find the tree's CUDA processes; refuse (``CheckpointRefused``, nothing locked,
     the source untouched) what the restore could not bring back (``runtime.checkpointable``: live
     NCCL communicators on transports the driver cannot restore, io_uring, fds CRIU cannot dump);
  3. cuda_checkpoint: lock all, checkpoint all (device memory -> host); a process without CUDA
     is skipped; the driver's new host staging mappings are noted (huge pages on restore); with
     ``thp``, the node's THP mode is ``always`` meanwhile (runtime.proc.thp);
  4. criu_dump: CRIU dumps the tree and leaves it stopped (netns and mounts external); TCP
     connections are kept when all are loopback ones inside the tree (``runtime.proc.tcpmode``), else
     closed, and the restore plan records which; its pages images are hashed while it writes
     them (``runtime.pages.tailhash``), so the split and the publish read none of them again;
  5. rootfs_capture / shm_capture: the writable layer and /dev/shm, while the tree is still
     stopped, so files and memory are one instant;
  6. resume: SIGCONT, then CUDA restore + unlock (unless the source is to exit), on a thread of
     its own beside step 7 (``source_stopped``: from the CUDA lock, or the dump, to here);
  7. host_files: digests of the files the tree uses from bind mounts (runtime.hostfiles);
     layer_sums: the digest of each 1 MiB of the layer archives, so a restore applies them from
     the store without staging a copy (runtime.overlay.verified);
     split: the large private anonymous page runs move beside CRIU's images (runtime.pages.bulk);
  8. publish: manifest (identity, node, CRIU, CUDA, security fingerprint, digests, timings with
     the source's ``cold_start`` when the caller measured it), signed,
     published as a new version of the name;
  9. tell the source (``snapshot-complete``) and stop it if asked.
Progress: ``progress(phase, 0, 0)`` at each phase start and ``("complete", n, n)`` once published,
n the bytes the artifact stores (its holes take nothing).
Any failure raises; the source is resumed (never left stopped or CUDA-locked), the staging dir is
removed, nothing appears under the artifact's name. When the source's CUDA state cannot be
brought back (a rollback or the resume fails: the processes would stay locked for good), the
source tree is killed, so its container exits and restarts cold instead of hanging.
A request naming an image but not its id is refused before anything else (ImageUnknown): every
restore compares the two ids, so such an artifact could never be restored.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from runtime import checkpointable as preflight
from runtime import control as control_mod
from runtime import hostfiles, layout, overlay
from runtime.container.containers import ContainerInfo, ns_pids, process_tree, resolve_container, workload_root
from runtime.container.namespaces import pid_namespace_shared
from runtime.criu import DumpResult, dump_workload
from runtime.digests import Hashed
from runtime.errors import (
    CheckpointRefused,
    CriuError,
    CudaStuck,
    ImageUnknown,
    RekindleError,
    SharedPidNamespace,
    SourceResumeFailed,
)
from runtime.fs.fdfs import tree_bytes
from runtime.gpu import Checkpointer, cuda_restore, hold_cuda, source_gpus
from runtime.gpu.cuda import ProcessState
from runtime.manifest import CriuInfo, CudaInfo, Manifest, MountInfo, NodeInfo, ProcessInfo, Source
from runtime.overlay.verified import write_sums as write_layer_sums
from runtime.pages import bulk
from runtime.pages.tailhash import TailHasher
from runtime.proc import frozen, procfs, tasks, tcpmode
from runtime.proc.owner import write_owner
from runtime.proc.procfs import anon_mappings
from runtime.proc.thp import ThpSwitch
from runtime.security import SecurityProfile
from runtime.store import ArtifactStore
from runtime.timings import Timings

log = logging.getLogger(__name__)

CUDA_LOCK_TIMEOUT_MS = 30_000
HOLD_WAIT_S = 10.0  # for the resume to seize the source's CUDA threads before the tree goes on
HUGE_MIN = 2 << 20  # staging mappings smaller than this gain nothing from huge pages


@dataclass(frozen=True)
class CheckpointRequest:
    containerd_state: str
    container_id: str
    namespace: str
    name: str
    pod: str
    pod_uid: str
    container: str
    image: str
    image_ref: str
    exit_after: bool
    log_dir: str
    split: bool = True  # move bulk pages beside CRIU (runtime.pages.bulk)
    bulk_min_run: int = bulk.MIN_RUN  # shorter page runs stay with CRIU
    max_layer_bytes: int = overlay.DEFAULT_MAX_LAYER_BYTES  # cap on the captured layer (and /dev/shm)
    capture_timeout: float = 600.0  # seconds for the capture, while the tree is stopped
    prewarm: bool = False  # recorded in the manifest: nodes warm their cache with it (nri_plugin.prewarm)
    map_ranges: str = ""  # recorded in the manifest: what restores from a node's cache map; "": the node's
    # Seconds from the source's start to ready, as its caller saw them (0: unknown): kept in the
    # manifest's timings as ``cold_start``, what a restore of it is compared with.
    cold_start: float = 0.0


def capture_excludes(info: ContainerInfo) -> list[str]:
    """Paths never captured: every mount destination (their content is not the container's)."""
    dests = [m.get("destination", "") for m in info.spec_mounts]
    return sorted({*overlay.DEFAULT_EXCLUDES, *(d for d in dests if d),
                   *control_mod.CONTAINER_PATHS, os.path.dirname(control_mod.INIT_DIR_IN_CONTAINER)})


Progress = Callable[[str, int, int], None]  # (phase, bytes done, bytes total)


def checkpoint(req: CheckpointRequest, store: ArtifactStore, key: bytes, *,
               control: control_mod.ControlDir | None = None, cuda: Checkpointer | None = None,
               progress: Progress | None = None, thp: ThpSwitch | None = None) -> dict[str, float]:
    """``thp``: the node's THP mode is ``always`` during the CUDA checkpoint (runtime.proc.thp)."""
    if req.image and not req.image_ref:
        raise ImageUnknown(f"checkpoint {req.namespace}/{req.name}: the id of image {req.image} is unknown "
                           "(containerd did not say); an artifact without it could never be restored")
    t = Timings()
    if progress is not None:
        t.on_phase = lambda phase: progress(phase, 0, 0)
    with t.phase("inspect"):
        info = resolve_container(req.containerd_state, req.container_id)
        shared = pid_namespace_shared(info.init_pid)
        if shared:  # its restore would be refused: never dump the pod's or the node's tasks
            raise SharedPidNamespace(f"checkpoint refused: {shared}")
        root = workload_root(info)
        tree = process_tree(root.host)
    # What an agent that died mid-checkpoint left stopped runs again first.
    if frozen.thaw_left_over(req.log_dir, req.container_id):
        tree = process_tree(root.host)
    log.info("checkpoint %s/%s: container %s, workload %s (%d processes)",
             req.namespace, req.name, req.container_id[:12], root, len(tree))
    work_dir = os.path.join(req.log_dir, f"checkpoint-{req.namespace}-{req.name}-{int(time.time())}")
    os.makedirs(work_dir, mode=0o700, exist_ok=True)
    write_owner(work_dir)  # the sweep removes the private staging of a checkpoint that died

    cuda_host: list[int] = []
    stopped_at: float | None = None  # the source's GPU work or whole tree stopped from then on
    cuda_info: CudaInfo | None = None
    huge: dict[int, list[tuple[int, int]]] = {}
    if cuda is not None:
        with t.phase("cuda_find"):
            cuda_host = cuda.find_cuda_pids(tree)
    with t.phase("preflight"):  # before anything is locked: a refusal leaves the source untouched
        report = preflight.inspect(tree, cuda_host)
    for note in report.notes:
        log.info("checkpoint %s/%s: pid %d (%s): %s", req.namespace, req.name, note.pid, note.comm, note.summary)
    if report.blocking:
        raise CheckpointRefused(report.reasons())
    # CRIU dumps and the capture writes into a private node-local dir: the store is written
    # only by the publish, through directory fds (runtime.store.volume.Staging).
    with store.stage(req.namespace, req.name, private_root=work_dir) as staging, contextlib.ExitStack() as held_open:
        images = os.path.join(staging.path, layout.CRIU_DIR)
        if cuda is not None and cuda_host:
            gpus = source_gpus(cuda, info.spec)
            driver = cuda.driver_version()
            stale = cuda.release(cuda_host)
            if stale:
                log.warning("CUDA processes %s were left locked or checkpointed (an earlier agent died "
                            "mid-checkpoint); resumed them first", stale)
            before = {h: anon_mappings(h) for h in cuda_host}
            stopped_at = time.monotonic()
            with t.phase("cuda_checkpoint"), _ends_source_on(CudaStuck, root.host), \
                    (thp.always() if thp is not None else contextlib.nullcontext()):
                cuda_host = cuda.checkpoint_all(cuda_host, lock_timeout_ms=CUDA_LOCK_TIMEOUT_MS)
            ns_of = {h: ns_pids(h)[-1] for h in cuda_host}
            if cuda_host:
                cuda_info = CudaInfo(driver, gpus, tuple(sorted(ns_of.values())))
            for h in cuda_host:  # the driver's host copy of device memory: new mappings
                new = sorted(r for r in anon_mappings(h) - before[h] if r[1] - r[0] >= HUGE_MIN)
                huge[ns_of[h]] = new  # empty: split marks the process's largest bulk run instead
                log.info("CUDA process %d: %d new staging mapping(s) after the checkpoint: %s", h, len(new),
                         ", ".join(f"{a:#x}+{(b - a) >> 20}MiB" for a, b in new))
        tcp = tcpmode.TcpPlan(False, "not looked at")
        # Processes the workload itself keeps stopped stay stopped after the dump (runtime.proc.frozen).
        held = tasks.stopped(tree)
        frozen.record(req.log_dir, req.container_id, [p for p in tree if p not in held])
        resume = _SourceResume(cuda, cuda_host, root.host) \
            if cuda is not None and cuda_host and not req.exit_after else None
        stopped_at = stopped_at or time.monotonic()
        released_at = 0.0
        hashed: dict[str, Hashed] = {}
        try:
            try:
                with t.phase("criu_dump"):
                    tcp = tcpmode.plan(_tree(root.host))
                    log.info("checkpoint %s/%s: TCP connections %s: %s", req.namespace, req.name,
                             "kept" if tcp.established else "closed", tcp.reason)
                    os.makedirs(images, mode=0o700, exist_ok=True)
                    # CRIU's pages hashed while it writes them; their files held until published
                    ahead = held_open.enter_context(TailHasher(images, write_back=_same_fs(work_dir, store.root)))
                    dump = dump_workload(info, images, leave_running=True, leave_stopped=True,
                                         work_dir=work_dir, tcp_established=tcp.established)
                    if resume is not None:
                        resume.criu_log = dump.log_path
                    hashed = ahead.finish()
                    if tcp.established:
                        _check_tcp_kept(dump)
                # One instant: the files and /dev/shm are read while the tree is still stopped.
                deadline = time.monotonic() + req.capture_timeout  # the tree waits, stopped
                with t.phase("rootfs_capture"):
                    overlay.capture(info.upperdir, os.path.join(staging.path, layout.ROOTFS_TAR),
                                    os.path.join(staging.path, layout.ROOTFS_DELETIONS),
                                    exclude=capture_excludes(info), max_bytes=req.max_layer_bytes,
                                    deadline=deadline)
                if dump.shm_source:
                    with t.phase("shm_capture"):
                        overlay.capture(dump.shm_source, os.path.join(staging.path, layout.SHM_TAR),
                                        os.path.join(staging.path, layout.SHM_DELETIONS), exclude=(),
                                        max_bytes=req.max_layer_bytes, deadline=deadline)
            finally:
                try:
                    # CRIU leaves kept connections in repair mode when it leaves the tree stopped.
                    unrepaired = tcpmode.repair_off(tcp.holders) if tcp.established else []
                    if resume is not None:  # its CUDA processes held first: they go on once resumed
                        resume.start(held)
                    tasks.signal_all([p for p in _tree(root.host) if p not in held and p not in holding(resume)],
                                     signal.SIGCONT)  # what CRIU left stopped
                    frozen.clear(req.log_dir, req.container_id)
                finally:  # whatever failed above, the source's CUDA state comes back
                    released_at = time.monotonic()
                    if resume is not None:
                        resume.start(held)  # the driver copies back while the artifact is finished
            if unrepaired:
                raise CriuError("dump", "TCP connections of the source were left in repair mode: "
                                + "; ".join(unrepaired), dump.log_path)
            with t.phase("host_files"):
                host_files = hostfiles.record(images, dump.mount_plan, info.spec_mounts, view_of=info.init_pid)
            with t.phase("layer_sums"):  # the source runs again: its restore reads the layer unstaged
                for tar in [layout.ROOTFS_TAR] + ([layout.SHM_TAR] if dump.shm_source else []):
                    write_layer_sums(os.path.join(staging.path, tar),
                                     os.path.join(staging.path, layout.layer_sums(tar)))
            moved: bulk.Split | None = None
            if req.split:
                with t.phase("split"):
                    moved = bulk.split(staging.path, huge, min_run=req.bulk_min_run, hashed=hashed)
        finally:
            # Nothing is published, and no failure is raised, before the source runs again.
            if resume is not None:
                resume.join(t)
        t["source_stopped"] = round((resume.done_at if resume is not None else released_at) - stopped_at, 3)
        plan = layout.RestorePlan(
            stdio=tuple(dump.stdio), shell_job=dump.shell_job,
            mounts=tuple(dump.mount_plan), shm=bool(dump.shm_source), bulk=moved.files if moved else (),
            tcp_established=tcp.established, shared=moved.shared if moved else ())
        with open(os.path.join(staging.path, layout.RESTORE_PLAN), "wb") as f:
            f.write(plan.to_json())
        uts = os.uname()
        manifest = Manifest(
            name=req.name, namespace=req.namespace,
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            source=Source(pod=req.pod, pod_uid=req.pod_uid, container=req.container,
                          container_id=req.container_id, image=req.image, image_ref=req.image_ref),
            node=NodeInfo(hostname=uts.nodename, kernel=uts.release, arch=uts.machine),
            criu=CriuInfo(dump.criu_version),
            cuda=cuda_info,
            security=SecurityProfile.from_oci_spec(info.spec, label=req.name),
            process=ProcessInfo(root_pid=dump.root_ns_pid, args=tuple(control_mod.original_args(info.spec))),
            mounts=tuple(MountInfo(m.key, m.destination, m.type) for m in dump.mount_plan),
            files=(),
            host_files=host_files,
            timings={**t, **({"cold_start": round(req.cold_start, 3)} if req.cold_start > 0 else {})},
            prewarm=req.prewarm, map_ranges=req.map_ranges,
        )
        stored = _stored_bytes(staging.path)  # after the split's holes: what the store will hold
        with t.phase("publish"):
            staging.publish(manifest, key, known=hashed.values())

    if control is not None:
        # the bytes beside the phases: what the artifact holds, and what of it is stored as nothing
        control.write_json(control_mod.TIMINGS, {"checkpoint": dict(t), "stored_bytes": stored,
                                                 **({"pages": moved.stats.as_record()} if moved is not None else {})})
        control.write(control_mod.SNAPSHOT_COMPLETE, req.name + "\n")
    if req.exit_after:
        log.info("stopping the source workload %s as annotated", root)
        try:
            os.kill(root.host, signal.SIGTERM)
        except ProcessLookupError:
            pass
    if progress is not None:  # the bytes stored, not the files' sizes: a zero pool takes none
        progress("complete", stored, stored)
    return dict(t)


def _stored_bytes(staging: str) -> int:
    """The allocated bytes of a (private) staging dir."""
    fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return tree_bytes(fd)
    finally:
        os.close(fd)


def holding(resume: _SourceResume | None) -> frozenset[int]:
    """The processes a source's resume holds and continues itself."""
    return resume.held if resume is not None else frozenset()


class _SourceResume:
    """The source's CUDA restore and unlock on a thread of its own, while the artifact is finished
    (host files, split); ``join`` records its time and raises what it raised. A failed resume is
    tried once more from what the driver says of each process; failing again, the tree is ended
    and the error (:class:`SourceResumeFailed`) says why."""

    def __init__(self, cuda: Checkpointer, pids: list[int], root_host: int) -> None:
        self._cuda, self._pids, self._root = cuda, pids, root_host
        self._thread = threading.Thread(target=self._run, name="rekindle-resume-source", daemon=True)
        self._error: BaseException | None = None
        self._holding = threading.Event()  # set once the thread holds the processes, or cannot
        self._stopped: frozenset[int] = frozenset()
        self.held: frozenset[int] = frozenset()  # the processes it continues itself
        self.started_at = self.done_at = 0.0
        self.criu_log: str | None = None  # the dump's log, quoted when the resume fails

    def start(self, stopped: Iterable[int] = ()) -> None:
        """Start the resume (once), and wait until it holds the CUDA processes' threads: the
        caller continues the rest of the tree, ``stopped`` (stopped before the dump) excepted."""
        if self.started_at:
            return
        self.started_at = time.monotonic()
        self._stopped = frozenset(stopped)
        try:
            self._thread.start()
        except RuntimeError:  # no thread to be had: resumed here and now instead
            self._run()
        self._holding.wait(HOLD_WAIT_S)

    def _run(self) -> None:
        hold = None
        try:
            # ptrace binds the threads to this thread: seized, let run and let go from here
            hold = hold_cuda(self._pids)
            self.held = frozenset(hold.pids) if hold is not None else frozenset()
            self._holding.set()
            try:
                cuda_restore(self._cuda, self._pids, None, self._root, (), hold=hold, kill=False,
                             stopped=self._stopped)
            except RekindleError as exc:
                self._second_try(exc)
        except BaseException as exc:  # noqa: BLE001 - handed to join
            self._error = exc
        finally:
            self._holding.set()
            self.done_at = time.monotonic()

    def _second_try(self, cause: RekindleError) -> None:
        """Before the source is given up: what the driver says of each process, and one more
        try to bring back what it can (a checkpointed process restored, a locked one unlocked);
        where that fails too, the tree is ended with a reason the user can act on."""
        log.error("the source's CUDA resume failed (%s); asking the driver what became of %s", cause, self._pids)
        try:
            self._cuda.release([p for p in self._pids if _alive(p)])
        except RekindleError as exc:
            log.error("the second try failed too: %s", exc)
        states = {p: _driver_state(self._cuda, p) for p in self._pids}
        if all(s == str(ProcessState.RUNNING) for s in states.values()):
            log.warning("the source's CUDA state came back on the second try (%s)", cause)
            return
        log.error("the source's CUDA state cannot be brought back (%s); ending the workload %d", states, self._root)
        tasks.kill_all(_tree(self._root))
        raise SourceResumeFailed(cause, states, _criu_said(self.criu_log)) from cause

    def join(self, t: Timings) -> None:
        if not self.started_at:
            return  # never started: nothing to wait for
        if self._thread.ident is not None:
            self._thread.join()
        t["cuda_resume_source"] = round(self.done_at - self.started_at, 3)
        log.info("phase cuda_resume_source: %.3fs (beside the split)", t["cuda_resume_source"])
        if self._error is not None:
            raise self._error


@contextlib.contextmanager
def _ends_source_on(kind: type[BaseException], root_host: int) -> Iterator[None]:
    """On ``kind``, kill the source tree before re-raising: its CUDA processes are stuck locked or
    checkpointed and would never run again; ended, the container exits and restarts cold."""
    try:
        yield
    except kind as exc:
        log.error("the source's CUDA state cannot be brought back (%s); ending the workload %d", exc, root_host)
        tasks.kill_all(_tree(root_host))
        raise


def _alive(pid: int) -> bool:
    st = procfs.read_stat(pid)
    return st is not None and st.state not in ("Z", "X")


def _driver_state(cuda: Checkpointer, pid: int) -> str:
    """What the driver says of ``pid`` (or that the process is gone, or the call's own error)."""
    if not _alive(pid):
        return "gone (the process died after its CUDA checkpoint)"
    try:
        return str(cuda.state(pid))
    except RekindleError as exc:
        return f"no state ({exc})"


CRIU_LINES = 3  # of CRIU's warnings and errors quoted in a failed resume's reason


def _criu_said(log_path: str | None) -> list[str]:
    """CRIU's last warnings and errors on the dump: where it touched the tree (e.g. threads it
    resumed with EINTR: "Will restore N with interrupted system call")."""
    if not log_path:
        return []
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f if "Error" in ln or "Warn" in ln]
    except OSError:
        return []
    return [ln[:160] for ln in lines[-CRIU_LINES:]]


def _same_fs(a: str, b: str) -> bool:
    """Whether the publish will move files from ``a`` into ``b`` (else it copies them)."""
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def _check_tcp_kept(dump: DumpResult) -> None:
    """The dump kept TCP connections: the stopped tree must still hold only loopback ones between
    its own processes (one opened between the decision and the freeze would not restore)."""
    now = tcpmode.plan(dump.tree)
    if now.connections and not now.established:
        raise CriuError("dump", f"a TCP connection changed while the tree was dumped: {now.reason}", dump.log_path)


def _tree(host_pid: int) -> list[int]:
    try:
        return process_tree(host_pid)
    except Exception:  # noqa: BLE001 - the source died: nothing to resume
        return []
