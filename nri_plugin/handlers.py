"""The Rekindle NRI plugin: each handler is parse -> decide -> adjust, within the 2 s budget.

CreateContainer    annotations -> Intent; give the container its control dir and the init
                   (mounts + env); for a restore, a cheap pre-check of the artifact (manifest
                   signature, compatibility, fail-once); the entrypoint swap where the runtime
                   takes ``args`` (NRI >= 0.10).
PostCreateContainer the entrypoint swap through containerd's API on NRI 0.6/0.8, after checking
                   that a restore would not give the process more privilege than the container.
PostStartContainer hand the container to ``Jobs`` (wait-ready + checkpoint, or restore), which
                   run outside the handler.
Stop/Remove        cancel jobs, clean up.
Synchronize        pick up containers whose jobs were lost when the plugin restarted.

Which container (``guards``): a restore into a pod that names no container goes only into the
container named like the artifact's source container; a source whose artifact is already
published is left alone unless ``rekindle.dev/overwrite: "true"``. Both are recorded as
``skipped`` with the reason.

Failure policy: anything wrong -> the container is left (or put back) on its cold start, the
reason is logged with the pod and container, and recorded in its status file. Handlers never
return an error to containerd: that would fail the pod instead of starting it cold. What a
handler does not catch itself, the stub's fail-open boundary answers empty and hands to
``on_handler_error``, which records the cold start and undoes what was prepared.

Failing closed (``rekindle.dev/on-restore-failure: fail``): a failed restore must never start the
original command. The init gets ``--on-failure fail`` and exits with the reason (status 75) where
it would start cold; a pre-check that fails still puts the init in place, with ``restore-failed``
already written, so the container exits at once. Each new container of such a pod (kubelet's
restarts) tries the restore again: no fail-once check, the artifact may have been fixed. Only
where the init cannot be put in place at all (CreateContainer overran and was answered empty, no
control dir, no way to swap the entrypoint) does the container still run unadjusted.

Late results: CreateContainer registers a container (``_pending``, read by PostCreate and
PostStart) and records its status only in the ``commit`` of its ``Reply``, which the stub runs
when it sends that reply. A create that overran its budget was answered empty (no mounts, no
init), so it must leave no trace that would make PostCreate swap the entrypoint.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from runtime import control
from runtime.compat import NodeFacts, check_compatibility
from runtime.errors import (
    AlreadyAttempted,
    AnnotationError,
    Incompatible,
    LessPrivileged,
    RekindleError,
    SharedPidNamespace,
    reason_of,
)
from runtime.gpu import facts_for_devices
from runtime.manifest import Manifest
from runtime.rollback import GenerationBook
from runtime.security import LsmSupport, SecurityProfile, check_privilege
from runtime.status import ContainerStatus, Phase, StatusBook
from runtime.store import ArtifactStore

from . import guards, logs
from .config import Settings
from .events import RuntimeInfo
from .handler_types import (
    ConfigureHandler,
    CreateContainerHandler,
    HandlerErrorHandler,
    PostCreateContainerHandler,
    PostStartContainerHandler,
    RemoveContainerHandler,
    RemovePodSandboxHandler,
    RunPodSandboxHandler,
    StopContainerHandler,
    StopPodSandboxHandler,
    SynchronizeHandler,
)
from .jobs import Jobs, Skipped, Work, restore_failure_phase
from .policy import Intent, Role, decide, role_hint
from .prefetch import Prefetcher
from .proto import nri_api_pb2 as api
from .stub import HandlerOverrun, Reply
from .swap import SpecAccess, Strategy, choose, init_command, is_swapped, swap_by_spec_update

log = logging.getLogger(__name__)

IMAGE_NAME_ANNOTATION = "io.kubernetes.cri.image-name"
# An image name -> the digest containerd resolves it to ("" when unknown).
ImageRef = Callable[[str], str]


@dataclass
class Pending:
    """A container we adjusted at create time and will act on once it runs."""

    work: Work
    manifest: Manifest | None = None
    swapped: bool = False
    failed: str = ""  # fails closed: the pre-check failed for this reason (restore-failed is written)


# Handlers that run before the container's process does: an error there means a cold start.
_START_HANDLERS = ("create_container", "post_create_container", "start_container", "post_start_container")


def who(pod: api.PodSandbox, ctr: api.Container) -> str:
    return f"{pod.namespace}/{pod.name}:{ctr.name}"


class RekindlePlugin(ConfigureHandler, SynchronizeHandler, RunPodSandboxHandler, StopPodSandboxHandler,
                     RemovePodSandboxHandler, CreateContainerHandler, PostCreateContainerHandler,
                     PostStartContainerHandler, StopContainerHandler, RemoveContainerHandler, HandlerErrorHandler):
    def __init__(self, settings: Settings, *, store: ArtifactStore, key: bytes, status: StatusBook,
                 jobs: Jobs, specs: SpecAccess | None, facts: NodeFacts,
                 image_ref: ImageRef | None = None, generations: GenerationBook | None = None,
                 prefetcher: Prefetcher | None = None) -> None:
        self.settings = settings
        self.store = store
        self.key = key
        self.status = status
        self.jobs = jobs
        self.specs = specs
        self.facts = facts
        self.image_ref = image_ref  # None: no containerd API here
        self.generations = generations  # rollback check (runtime.rollback)
        self.prefetcher = prefetcher  # reads a restore's artifact ahead (RunPodSandbox)
        self.runtime: RuntimeInfo | None = None
        self.strategy = Strategy.SPEC_UPDATE
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle
    def configure(self, config: str, runtime: RuntimeInfo) -> None:
        self.runtime = runtime
        self.strategy = choose(runtime)
        log.info("entrypoint swap: %s", self.strategy.value)

    def synchronize(self, pods: list[api.PodSandbox], containers: list[api.Container]) -> list[api.ContainerUpdate]:
        by_id = {p.id: p for p in pods}
        for ctr in containers:
            pod = by_id.get(ctr.pod_sandbox_id)
            if pod is None or ctr.state != api.CONTAINER_RUNNING or not is_swapped(list(ctr.args)):
                continue
            try:
                intent = decide(dict(pod.annotations), ctr.name, self.settings.restore.timeout,
                           self.settings.max_layer_bytes)
                if intent is None:
                    continue
                ctl = control.control_dir_for(self.settings.state_dir, pod.uid, ctr.name)
            except AnnotationError:
                continue
            self.jobs.resume(self._work(pod, ctr, intent, ctl))
        return []

    # ------------------------------------------------------------------ create
    def create_container(self, pod: api.PodSandbox,
                         ctr: api.Container) -> api.CreateContainerResponse | Reply[api.CreateContainerResponse]:
        empty = api.CreateContainerResponse()
        try:
            intent = decide(dict(pod.annotations), ctr.name, self.settings.restore.timeout,
                           self.settings.max_layer_bytes)
        except AnnotationError as exc:
            log.warning("%s: %s; container starts unadjusted", who(pod, ctr), exc)
            self._record(pod, ctr, None, Phase.IGNORED, str(exc), exc)
            return empty
        if intent is None:
            return empty
        logs.bind(artifact=intent.artifact)
        failed = version = ""
        failed_cause: BaseException | None = None
        try:
            ctl = control.control_dir_for(self.settings.state_dir, pod.uid, ctr.name)
            # Decided before anything else: a failed restore's clean-up must reach its own tree only.
            shared = guards.shared_pid_namespace((n.type, n.path) for n in ctr.linux.namespaces)
            if intent.role is Role.RESTORE:
                try:
                    manifest: Manifest | None
                    if shared:
                        raise SharedPidNamespace(f"restore refused: {shared}")
                    manifest, version = self._precheck_restore(pod, ctr, intent)
                except RekindleError as exc:
                    if not intent.fails_closed or isinstance(exc, Skipped):
                        raise
                    manifest, failed, failed_cause = None, str(exc), exc  # the init is put in place to fail the container
            else:
                manifest = None
                if shared:
                    raise SharedPidNamespace(f"checkpoint refused: {shared}")
                skip = guards.existing_artifact(self.store, self.key, pod.namespace, intent)
                if skip:
                    raise Skipped(skip)
            ctl.prepare()
            if failed:
                ctl.write(control.RESTORE_FAILED, failed + "\n")
        except Skipped as exc:
            log.info("%s: %s %s: %s", who(pod, ctr), intent.role.value, intent.artifact, exc)
            self._record(pod, ctr, intent, Phase.SKIPPED, str(exc))
            return empty
        except RekindleError as exc:
            phase = Phase.COLD_START if intent.role is Role.RESTORE else Phase.CHECKPOINT_FAILED
            log.warning("%s: %s %s: %s; %s", who(pod, ctr), intent.role.value, intent.artifact, exc, phase.value)
            self._record(pod, ctr, intent, phase, str(exc), exc)
            return empty

        adjust = api.ContainerAdjustment()
        for path in control.CONTAINER_PATHS:
            adjust.mounts.add(destination=path, type="bind", source=str(ctl.path),
                              options=["rbind", "rw", "nosuid", "nodev"])
        adjust.mounts.add(destination=control.INIT_DIR_IN_CONTAINER, type="bind",
                          source=str(self.settings.bin_dir), options=["rbind", "ro", "nosuid", "nodev"])
        for name in control.ENV_NAMES:
            adjust.env.add(key=name, value=control.CONTAINER_PATH)
        work = self._work(pod, ctr, intent, ctl)
        work.version = version  # the job restores the version checked here, or none
        pending = Pending(work, manifest, failed=failed)
        if self.strategy is Strategy.ARGS_ADJUSTMENT and ctr.args:
            adjust.args.extend(init_command(work.mode, intent.restore_timeout, list(ctr.args), intent.fails_closed))
            pending.swapped = True
        phase = Phase.RESTORE_PENDING if intent.role is Role.RESTORE else Phase.WAITING_READY
        if failed:
            phase = Phase.RESTORE_FAILED
            log.warning("%s: restore %s: %s; failing the container (on-restore-failure: fail)", who(pod, ctr),
                        intent.artifact, failed)

        def commit() -> None:  # run by the stub as it sends this reply, never for a late one
            with self._lock:
                self._pending[ctr.id] = pending
            self._record(pod, ctr, intent, phase, failed, failed_cause)
            log.info("%s: %s %s: control dir %s", who(pod, ctr), intent.role.value, intent.artifact, ctl.path)
        return Reply(api.CreateContainerResponse(adjust=adjust), commit)

    def _precheck_restore(self, pod: api.PodSandbox, ctr: api.Container, intent: Intent) -> tuple[Manifest, str]:
        """Cheap checks only (reads the manifest, not the images): this runs inside the handler.
        Returns the manifest and the version it is of: the artifact is opened once here, and the
        restore job opens that version, not whatever the name points to by then."""
        prev = self.status.read(pod.namespace, pod.name, ctr.name)
        # A pod that fails closed tries again in each new container: never a cold start instead.
        attempted = (Phase.COLD_START, Phase.RESTORED, Phase.RESTORING, Phase.RESTORE_EXITED)
        if not intent.fails_closed and prev and prev.pod_uid == pod.uid and prev.phase in attempted:
            raise AlreadyAttempted(f"a restore was already attempted for this pod ({prev.phase.value}"
                                f"{': ' + prev.reason if prev.reason else ''}); not retrying")
        with self.store.open(pod.namespace, intent.artifact, self.key) as artifact:
            manifest, version = artifact.manifest, artifact.version
        skip = guards.source_container_mismatch(intent, ctr.name, manifest)
        if skip:
            raise Skipped(skip)
        if self.generations is not None:
            self.generations.check(pod.namespace, intent.artifact, manifest.generation)
        image = ctr.annotations.get(IMAGE_NAME_ANNOTATION, "")
        image_ref = self.image_ref(image) if (self.image_ref and image) else ""
        # GPUs: those this container was given (its /dev/nvidiaN devices), not all of the node's.
        facts = facts_for_devices(self.facts, [(d.path, d.major, d.minor) for d in ctr.linux.devices])
        reasons = check_compatibility(manifest, facts, image=image, image_ref=image_ref or "")
        if reasons:
            raise Incompatible("incompatible: " + "; ".join(reasons))
        return manifest, version

    # ------------------------------------------------------------------ post-create
    def post_create_container(self, pod: api.PodSandbox, ctr: api.Container) -> None:
        with self._lock:
            pending = self._pending.get(ctr.id)
        if pending is None:
            return
        work = pending.work
        spec = None
        try:
            if pending.manifest is not None and self.specs is not None:
                spec = self.specs.get_spec(ctr.id)
                target = SecurityProfile.from_oci_spec(spec, label=work.artifact)
                reasons = check_privilege(pending.manifest.security, target, lsm=LsmSupport.detect())
                if reasons:
                    raise LessPrivileged("target container is less privileged than the source: "
                                        + "; ".join(reasons))
            if not pending.swapped:
                if self.specs is None:
                    raise RekindleError("no containerd API to swap the entrypoint with")
                swap_by_spec_update(self.specs, ctr.id, work.mode, work.intent.restore_timeout, spec,
                                    fail_closed=work.intent.fails_closed)
                pending.swapped = True
        except Exception as exc:  # noqa: BLE001 - fail open: the container runs its own command
            if work.intent.fails_closed and not pending.swapped and self.specs is not None:
                try:  # the init must still be there to fail the container, not start it cold
                    swap_by_spec_update(self.specs, ctr.id, work.mode, work.intent.restore_timeout, spec,
                                        fail_closed=True)
                    pending.swapped = True
                except Exception as swap_exc:  # noqa: BLE001
                    log.error("%s: cannot put the init in place to fail closed: %s", who(pod, ctr), swap_exc)
            if pending.swapped:
                # args were set at create (NRI >= 0.10): tell the init to start cold (or fail) right away.
                work.control.write(control.RESTORE_FAILED, str(exc))
            with self._lock:
                self._pending.pop(ctr.id, None)
            phase = (restore_failure_phase(work.intent) if pending.swapped else Phase.COLD_START) \
                if work.intent.role is Role.RESTORE else Phase.CHECKPOINT_FAILED
            log.warning("%s: %s; %s", who(pod, ctr), exc, phase.value)
            self._record(pod, ctr, work.intent, phase, str(exc), exc)
            return
        log.info("%s: entrypoint swapped to rekindle-init (%s mode)", who(pod, ctr), work.mode)

    # ------------------------------------------------------------------ start/stop/remove
    async def post_start_container(self, pod: api.PodSandbox, ctr: api.Container) -> None:
        with self._lock:
            pending = self._pending.pop(ctr.id, None)
        if pending is None or not pending.swapped or pending.failed:
            return  # failed: its init reads restore-failed and exits
        pending.work.container_id = ctr.id
        pending.work.pid = ctr.pid
        self.jobs.start(pending.work)

    async def stop_container(self, pod: api.PodSandbox, ctr: api.Container) -> list[api.ContainerUpdate]:
        self.jobs.cancel(ctr.id, "container stopping")
        return []

    async def remove_container(self, pod: api.PodSandbox, ctr: api.Container) -> None:
        self.jobs.cancel(ctr.id, "container removed")
        with self._lock:
            self._pending.pop(ctr.id, None)

    def run_pod_sandbox(self, pod: api.PodSandbox) -> None:
        # Only queued here: the artifact is read ahead on the prefetcher's own threads.
        if self.prefetcher is not None and self.prefetcher.start(pod.uid, pod.namespace, dict(pod.annotations)):
            log.info("%s/%s: prefetching its artifact", pod.namespace, pod.name)

    def stop_pod_sandbox(self, pod: api.PodSandbox) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cancel(pod.uid)

    def remove_pod_sandbox(self, pod: api.PodSandbox) -> None:
        if self.prefetcher is not None:
            self.prefetcher.cancel(pod.uid)
        try:
            root = control.pod_control_root(self.settings.state_dir, pod.uid)
        except AnnotationError:
            return
        if root.is_dir():
            for sub in root.iterdir():
                control.ControlDir(sub).remove()

    # ------------------------------------------------------------------ fail-open
    def on_handler_error(self, handler: str, pod: api.PodSandbox | None, ctr: api.Container | None,
                         exc: Exception) -> None:
        """The stub answered ``handler`` empty because it raised or overran: undo and record.

        Until the container starts, an error means it starts cold: whatever was registered for
        it is dropped, a restore init that may already be in place is told to start the
        original command at once, and the status says why. Later events change nothing.
        """
        if pod is None or ctr is None or handler not in _START_HANDLERS:
            return
        with self._lock:
            self._pending.pop(ctr.id, None)
        reason = str(exc) if isinstance(exc, (RekindleError, HandlerOverrun)) \
            else f"{handler} failed: {type(exc).__name__}: {exc}"
        try:
            intent = decide(dict(pod.annotations), ctr.name, self.settings.restore.timeout,
                           self.settings.max_layer_bytes)
        except AnnotationError as bad:
            self._record(pod, ctr, None, Phase.IGNORED, str(bad))
            return
        if intent is None:
            return
        if handler != "create_container":
            self.jobs.cancel(ctr.id, reason)
            try:  # the entrypoint may be swapped already (args at create, or a late spec update)
                ctl = control.control_dir_for(self.settings.state_dir, pod.uid, ctr.name)
                if ctl.path.is_dir() and intent.role is Role.RESTORE:
                    ctl.write(control.RESTORE_FAILED, reason + "\n")
            except (OSError, RekindleError) as failed:
                log.error("%s: cannot tell the init to start cold: %s", who(pod, ctr), failed)
        if handler == "create_container":
            phase = Phase.COLD_START  # answered empty: no init, the container runs unadjusted
        elif intent.role is Role.RESTORE:
            phase = restore_failure_phase(intent)
        else:
            phase = Phase.CHECKPOINT_FAILED
        self._record(pod, ctr, intent, phase, reason)

    # ------------------------------------------------------------------ helpers
    def _work(self, pod: api.PodSandbox, ctr: api.Container, intent: Intent,
              ctl: control.ControlDir) -> Work:
        return Work(
            intent=intent, control=ctl, container_id=ctr.id, pid=ctr.pid,
            namespace=pod.namespace, pod=pod.name, pod_uid=pod.uid, container=ctr.name,
            image=ctr.annotations.get(IMAGE_NAME_ANNOTATION, ""),
            netns=next((ns.path for ns in pod.linux.namespaces if ns.type == "network"), ""),
            pod_id=pod.id or ctr.pod_sandbox_id,
        )

    def _record(self, pod: api.PodSandbox, ctr: api.Container, intent: Intent | None,
                phase: Phase, reason: str, cause: BaseException | None = None) -> None:
        # A malformed pod still says what it wanted (for its Event): the role, if recognisable.
        hint = role_hint(dict(pod.annotations)) if intent is None else None
        self.status.record(ContainerStatus(
            namespace=pod.namespace, pod=pod.name, container=ctr.name,
            role=intent.role.value if intent else (hint.value if hint else ""),
            artifact=intent.artifact if intent else "",
            phase=phase, reason=reason, container_id=ctr.id, pod_uid=pod.uid,
            reason_class=kind.value if cause is not None and (kind := reason_of(cause)) is not None else ""))
