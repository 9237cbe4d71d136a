"""Composition root: builds the plugin, the engine and their clients from ``Settings``.

``run_plugin`` is the DaemonSet's long-lived process: the stub and the Rekindle plugin, the jobs,
and what tells the outside what happened: the status files (``rekindle status``), an outcome
``Reporter`` observing them that feeds the Prometheus metrics and, with ``--events``, the
Kubernetes Events and pod condition (``events_k8s``), and the HTTP endpoint with ``/metrics``,
``/readyz`` (registered and synchronized with the runtime) and ``/healthz`` (the event loop
beats). ``checkpoint_once`` / ``restore_once`` run the same engine for one container from the
CLI (a node operator's manual path).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from runtime import checkpoint as checkpoint_flow
from runtime import control, hostfiles, housekeeping
from runtime import restore as restore_flow
from runtime.compat import NodeFacts
from runtime.container.containers import ContainerInfo, resolve_container
from runtime.containerd.cri_lookup import CRIError
from runtime.gpu import Checkpointer, node_cuda
from runtime.overlay import pending as overlay_pending
from runtime.pages.mapping import for_artifact
from runtime.pages.nodecache import NodeCache
from runtime.pod import hooks
from runtime.pod.probe import probe as run_probe
from runtime.proc import thp
from runtime.proc.thp import ThpSwitch
from runtime.rollback import GenerationBook
from runtime.route import RestorePath
from runtime.status import StatusBook
from runtime.store import ArtifactStore, load_key
from runtime.store import gc as store_gc

from . import guards
from .cache import CacheWriter, cache_bytes, cache_dir, map_mode, open_cache
from .config import CheckpointThp, Settings
from .disk_gate import DiskGate
from .handlers import IMAGE_NAME_ANNOTATION, ImageRef, RekindlePlugin
from .health import HEARTBEAT, Health
from .imageids import ImageIds
from .jobs import Jobs, Skipped, Work
from .metrics import BuildInfo, Metrics
from .outcomes import COLD_START, Reporter
from .policy import AfterCheckpoint, ReadyProbe
from .polling import ask_until
from .prefetch import Prefetcher
from .prewarm import start_prewarm
from .probes import ProbeSlots
from .stub import Identity, Stub
from .swap import SpecAccess

if TYPE_CHECKING:  # imported where used: the Kubernetes client only with --events
    from .events_k8s import KubeReporter
    from .httpd import HttpEndpoint

log = logging.getLogger(__name__)
T = TypeVar("T")
HOST_DIGESTS = "hostfile-digests.json"  # in the state dir: runtime.hostfiles.DigestCache.persist
ExitCode = Callable[[str], "int | None"]  # container id -> its exit code once exited


def install_init(settings: Settings) -> None:
    """Copy rekindle-init to ``<state>/bin`` (a host path that containers bind-mount)."""
    src = settings.init_source()
    if src is None:
        raise FileNotFoundError("rekindle-init not found")
    settings.bin_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.bin_dir, 0o755)
    fd, tmp = tempfile.mkstemp(dir=settings.bin_dir, prefix=".rekindle-init.")
    os.close(fd)
    shutil.copyfile(src, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, settings.installed_init)  # running containers keep the old inode
    log.info("installed %s -> %s", src, settings.installed_init)


def _cuda(parallel: int = 1) -> Checkpointer | None:
    """The long-lived CUDA checkpointer, or None on nodes without a usable driver."""
    try:
        from runtime.gpu import CudaCheckpointer
        cp = CudaCheckpointer(parallel=parallel)
        cp.gpus()
        return cp
    except Exception as exc:  # noqa: BLE001 - CPU nodes are fine
        log.info("CUDA checkpointing unavailable on this node: %s", exc)
        return None


class NodeEngine:
    """Adapts the runtime flows to the jobs' ``Engine`` protocol.

    The image id of a checkpoint or restore is asked of containerd again for up to
    ``image_id_wait`` seconds when it does not answer (it may be restarting): a checkpoint
    without it would publish an artifact no restore accepts, a restore would start cold."""

    image_id_wait = 30.0
    image_id_every = 0.5

    def __init__(self, settings: Settings, store: ArtifactStore, key: bytes, cuda: Checkpointer | None,
                 facts: NodeFacts, image_ref: ImageRef | None,
                 running: guards.RunningContainers | None = None) -> None:
        self.settings = settings
        self.store = store
        self.key = key
        self.cuda = cuda
        self.facts = facts
        self.image_ref = image_ref
        self.running = running  # pod sandbox id -> [(container id, name)] running or created
        self.generations = GenerationBook(settings.state_dir)
        self.prefetcher: Prefetcher | None = None  # set by run_plugin
        self.cache: NodeCache | None = None  # the node cache, and its writer (run_plugin)
        self.cache_writer: CacheWriter | None = None
        self.disk = DiskGate()  # restores running: a pre-warm waits for them (nri_plugin.prewarm)
        self.exit_code: ExitCode | None = None      # set by _engine when containerd answers
        # THP switched to always around CUDA checkpoints, where asked (runtime.proc.thp)
        self.thp = ThpSwitch(settings.thp_record) if settings.checkpoint.thp is CheckpointThp.ALWAYS else None
        self._restores = 0  # restores running now: each is told how many others run (runtime.route)
        self._restores_lock = threading.Lock()

    def _source_rules(self, work: Work) -> None:
        """Right before a checkpoint: the rules of ``guards`` that only now have an answer."""
        skip = guards.existing_artifact(self.store, self.key, work.namespace, work.intent)
        if skip is None and not work.intent.named:
            if self.running is None:
                skip = ("the pod names no container and this plugin has no containerd API to list its other "
                        "containers; no checkpoint taken")
            else:
                running = self.running
                skip = guards.other_containers(work.intent, work.container_id,
                                               self._patiently(lambda: running(work.pod_id), "the pod's containers"))
        if skip:
            raise Skipped(skip)

    def checkpoint(self, work: Work) -> dict[str, float]:
        self._source_rules(work)
        before = work.intent.before_checkpoint
        if before is None:
            return self._checkpoint(work)
        # The release path: the engine sleeps for the checkpoint, and is woken whatever happens
        # unless it is to exit (its timings go straight to the record: a failure keeps them too).
        try:
            work.timings["before_checkpoint"] = hooks.run(work.netns, before, "before-checkpoint")
        except hooks.HookFailed as exc:
            woke = self._wake_source(work)
            raise hooks.HookFailed(f"{exc}; no checkpoint taken{woke}") from None
        done = False
        try:
            timings = self._checkpoint(work)
            done = True
        finally:
            if not (done and work.intent.after_checkpoint is AfterCheckpoint.EXIT):
                self._wake_source(work)
        return timings

    def _wake_source(self, work: Work) -> str:
        """Wake a source put to sleep for its checkpoint (rekindle.dev/after-restore, if set);
        what became of it, for a reason."""
        wake = work.intent.after_restore
        if wake is None:
            return "; the source was not woken (no rekindle.dev/after-restore)"
        try:
            work.timings["wake_source"] = hooks.run(work.netns, wake, "after-restore")
        except hooks.HookFailed as exc:
            log.warning("%s: waking the source after its checkpoint failed: %s", work.who, exc)
            return f"; waking the source failed too: {exc}"
        return "; the source was woken"

    def _checkpoint(self, work: Work) -> dict[str, float]:
        req = checkpoint_request(
            self.settings, work.container_id, work.namespace, work.artifact, pod=work.pod, pod_uid=work.pod_uid,
            container=work.container, image=work.image, image_ref=self._image_id(work.image),
            exit_after=work.intent.after_checkpoint is AfterCheckpoint.EXIT,
            max_layer_bytes=min(work.intent.max_layer_bytes, self.settings.max_layer_bytes),
            prewarm=work.intent.prewarm, map_ranges=work.intent.map_ranges,
            cold_start=work.timings.get(COLD_START, 0.0))
        return checkpoint_flow.checkpoint(req, self.store, self.key, control=work.control, cuda=self.cuda,
                                          progress=work.progress, thp=self.thp)

    def restore(self, work: Work) -> dict[str, float]:
        with self._restores_lock:
            others = self._restores
            self._restores += 1
        try:
            req = dataclasses.replace(
                restore_request(self.settings, work.container_id, work.namespace, work.artifact, image=work.image,
                                image_ref=self._image_id(work.image), version=work.version),
                concurrent=others)
            prefetcher = self.prefetcher
            staged = (lambda art: prefetcher.take(work.pod_uid, art)) if prefetcher is not None else None
            writer = self.cache_writer
            with self.disk.restore():  # a pre-warm's reads wait meanwhile (nri_plugin.prewarm)
                return restore_flow.restore(req, self.store, self.key, self.facts, control=work.control,
                                            cuda=self.cuda, generations=self.generations, progress=work.progress,
                                            staged=staged, cache=self.cache, map_mode=map_mode(self.settings),
                                            on_cold=writer.submit if writer is not None else None,
                                            after_restore=self._after_restore(work))
        finally:
            with self._restores_lock:
                self._restores -= 1

    @staticmethod
    def _after_restore(work: Work) -> Callable[[], object] | None:
        """The restored engine's wake-up (rekindle.dev/after-restore): failing, the restore fails."""
        wake = work.intent.after_restore
        if wake is None:
            return None
        return lambda: hooks.run(work.netns, wake, "after-restore")

    def recover(self, work: Work) -> list[str] | None:
        return restore_flow.recover_rootfs(undo_dir(self.settings), work.container_id, work.pid, work.control)

    def _patiently(self, ask: Callable[[], T], what: str) -> T:
        """``ask()``, asked again for up to ``image_id_wait`` seconds while containerd does not
        answer (it may be restarting: a checkpoint must not fail or go wrong for that)."""
        def missed(_n: int, exc: T | Exception) -> None:
            log.info("containerd did not answer for %s (%s); asking again", what, exc)

        return ask_until(ask, self.image_id_wait, self.image_id_every, retry=(CRIError,), missed=missed)

    def _image_id(self, image: str) -> str:
        """The id containerd resolves ``image`` to ("" when there is no image or no answer)."""
        if not self.image_ref or not image:
            return ""
        image_ref = self.image_ref

        def missed(n: int, _answer: str | Exception) -> None:
            if n == 1:
                log.info("the id of image %s is unknown (is containerd restarting?); asking again for up to %.0fs",
                         image, self.image_id_wait)

        found = ask_until(lambda: image_ref(image), self.image_id_wait, self.image_id_every, done=bool, missed=missed)
        return found or ""

    exit_wait = 5.0  # how long containerd may take to report an exit it has seen

    def exit_status(self, work: Work) -> int | None:
        """The exit code of a container whose process is gone, as containerd reports it (None if
        it does not say in time)."""
        ask = self.exit_code
        if ask is None:
            return None
        def code() -> int | None:
            try:
                return ask(work.container_id)
            except CRIError as exc:
                log.debug("exit code of %s unavailable: %s", work.container_id[:12], exc)
                return None

        return ask_until(code, self.exit_wait, 0.1, done=lambda c: c is not None)

    async def probe(self, netns: str, probe: ReadyProbe) -> bool:
        return await run_probe(netns, probe.kind.value, probe.host, probe.port, probe.path)


def _clients(settings: Settings) -> tuple[SpecAccess | None, ImageRef | None, guards.RunningContainers | None,
                                          ExitCode | None]:
    """containerd spec access, an image-digest lookup, a pod's live containers and a
    container's exit code, when the socket is there."""
    if not os.path.exists(settings.containerd_socket):
        log.warning("no containerd socket at %s: entrypoint swap on NRI < 0.10 disabled",
                    settings.containerd_socket)
        return None, None, None, None
    from runtime.containerd.client import ContainerdClient
    from runtime.containerd.cri_lookup import CriLookup
    specs = ContainerdClient(settings.containerd_socket, namespace=settings.containerd_namespace)
    cri = CriLookup(settings.containerd_socket, timeout=1.0)

    def image_ref(image: str) -> str:
        try:
            return cri.image_ref(image) or ""
        except Exception as exc:  # noqa: BLE001 - a missing digest is reported by the check
            log.debug("image digest of %s unavailable: %s", image, exc)
            return ""

    return specs, image_ref, cri.live_containers, cri.exit_code


class Node(NamedTuple):
    """What the plugin and the CLI's one-shot flows work with on this node."""

    store: ArtifactStore
    key: bytes
    facts: NodeFacts
    engine: NodeEngine
    specs: SpecAccess | None
    image_ref: ImageRef | None


def checkpoint_request(settings: Settings, container_id: str, namespace: str, name: str, *, pod: str = "",
                       pod_uid: str = "", container: str = "", image: str = "", image_ref: str = "",
                       exit_after: bool = False, max_layer_bytes: int | None = None, prewarm: bool = False,
                       map_ranges: str = "", cold_start: float = 0.0
                       ) -> checkpoint_flow.CheckpointRequest:
    """The one place a checkpoint request is built from the settings (the plugin's and the CLI's)."""
    return checkpoint_flow.CheckpointRequest(
        containerd_state=settings.containerd_state, container_id=container_id, namespace=namespace, name=name,
        pod=pod, pod_uid=pod_uid, container=container, image=image, image_ref=image_ref, exit_after=exit_after,
        log_dir=os.path.join(settings.state_dir, "logs"),
        max_layer_bytes=settings.max_layer_bytes if max_layer_bytes is None else max_layer_bytes,
        capture_timeout=settings.checkpoint.capture_timeout, bulk_min_run=settings.checkpoint.bulk_min_run,
        prewarm=prewarm, map_ranges=map_ranges,
        cold_start=cold_start)


def restore_request(settings: Settings, container_id: str, namespace: str, name: str, *, image: str,
                    image_ref: str, version: str = "") -> restore_flow.RestoreRequest:
    """The one place a restore request is built from the settings (the plugin's and the CLI's)."""
    return restore_flow.RestoreRequest(
        containerd_state=settings.containerd_state, container_id=container_id, namespace=namespace, name=name,
        image=image, image_ref=image_ref, log_dir=os.path.join(settings.state_dir, "logs"),
        path=settings.restore.path, max_layer_bytes=settings.max_layer_bytes,
        threads=settings.restore.fill_threads, serve_threads=settings.restore.serve_threads,
        warm_rest=settings.restore.warm_rest, undo_dir=undo_dir(settings), version=version)


def _engine(settings: Settings) -> Node:
    # Only the plugin, and only when told (--create-key), may make a key; everything else reads it.
    key = load_key(settings.key_path, create=settings.create_key)
    store = ArtifactStore(settings.store)
    cuda = _cuda(settings.cuda_parallel)
    facts = NodeFacts.detect(cuda=node_cuda(cuda))
    specs, image_ref, running, exit_code = _clients(settings)
    engine = NodeEngine(settings, store, key, cuda, facts, image_ref, running)
    engine.exit_code = exit_code
    return Node(store, key, facts, engine, specs, image_ref)


def _reporting(settings: Settings, status: StatusBook, facts: NodeFacts | None = None
               ) -> tuple[Metrics, Health, HttpEndpoint | None, KubeReporter | None]:
    """Metrics, health, the HTTP endpoint (bound now: a port in use stops the plugin) and the
    Kubernetes reporter (configured now: no service account with --events stops it too)."""
    build = BuildInfo(criu=(facts.criu_version or "") if facts else "",
                      driver=facts.cuda.driver_version if facts and facts.cuda else "")
    metrics = Metrics(store_path=settings.store, build=build)
    health = Health()
    reporter = Reporter([metrics])
    kube = None
    missing = None
    if settings.report.events:
        from .events_k8s import client_missing
        missing = client_missing()
    if missing is not None:
        # The client is an optional extra: without it the plugin runs, with Events off.
        from .events_k8s import INSTALL_HINT
        log.warning("--events is on but the Kubernetes client cannot be imported (%s): no Events and no "
                    "rekindle.dev/Restored condition will be reported; %s", missing, INSTALL_HINT)
    elif settings.report.events:
        from .events_k8s import KubeReporter, connect
        kube = KubeReporter(connect(settings.report.kubeconfig), settings.report.node_name, on_sent=metrics.report_sent,
                            on_drop=metrics.report_dropped).start()
        reporter.add(kube)
        log.info("reporting outcomes to Kubernetes as node %s", settings.report.node_name)
    status.observe(reporter)
    endpoint = None
    if settings.report.metrics_port:
        from .httpd import HttpEndpoint
        endpoint = HttpEndpoint(settings.report.metrics_address, settings.report.metrics_port, metrics.registry, health)
        try:
            endpoint.start()
        except OSError as exc:
            from runtime.errors import ConfigError
            raise ConfigError(f"cannot serve metrics on {settings.report.metrics_address}:{settings.report.metrics_port}: "
                              f"{exc} (--metrics-port 0 turns the endpoint off)") from exc
    return metrics, health, endpoint, kube


async def _heartbeat(health: Health) -> None:
    while True:
        health.beat()
        await asyncio.sleep(HEARTBEAT)


def _say_if_streams() -> None:
    from runtime.pages import stream
    why = stream.unsupported()
    if why is None:
        log.info("restores stream: this kernel's userfaultfd and CRIU's lazy-pages hand-off are there")
    else:
        log.warning("restores take the bulk path, not the streamed one: %s", why)


def run_plugin(settings: Settings, max_parallel: int = 2) -> int:
    os.makedirs(settings.state_dir, exist_ok=True)
    store, key, facts, engine, specs, image_ref = _engine(settings)  # a key problem stops us here
    install_init(settings)
    os.makedirs(settings.store, exist_ok=True)
    status = StatusBook(settings.state_dir)
    # A THP mode a killed checkpoint left switched goes back first, whatever the setting now, and
    # one a checkpoint holds switched when the plugin stops (an uninstall) goes back as it exits.
    thp.put_back(settings.thp_record)
    # The host files' digests outlive a restart: the first restore after it need not read them all.
    hostfiles.CACHE.persist(os.path.join(settings.state_dir, HOST_DIGESTS))
    log.info("node %s: kernel %s, CRIU %s, CUDA %s", facts.hostname, facts.kernel, facts.criu_version,
             facts.cuda.driver_version if facts.cuda else "none")
    metrics, health, endpoint, kube = _reporting(settings, status, facts)
    if settings.idx < "50":  # two digits: compared as the runtime sorts them
        log.warning("NRI index %s: plugins at a higher index (the GPU Operator's CDI plugin, say) adjust "
                    "containers after Rekindle has seen them; use 50-99 (the chart refuses less)", settings.idx)
    # asked once now, not in the first restore's time
    if settings.restore.path in (RestorePath.AUTO, RestorePath.STREAM):
        threading.Thread(target=_say_if_streams, name="rekindle-stream-check", daemon=True).start()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # Handlers, engine work and probes have their own pools; this bounds anything else.
        loop.set_default_executor(ThreadPoolExecutor(2, thread_name_prefix="rekindle-default"))
        jobs = Jobs(engine, status, max_parallel=max_parallel,
                    probes=ProbeSlots(settings.probes.per_pod, settings.probes.per_node))
        jobs.bind_loop(loop)
        cache = engine.cache = open_cache(settings)
        engine.cache_writer = CacheWriter(cache, store, key) if cache.enabled else None
        mode = map_mode(settings)
        engine.prefetcher = (Prefetcher(store, key, staging_dir=os.path.join(settings.state_dir, "logs"),
                                        cached=lambda art: cache.has(art.manifest_id, for_artifact(
                                            art.manifest.map_ranges, mode)),
                                        reading=engine.disk.restore)
                             if settings.restore.prefetch else None)
        prewarmer = start_prewarm(settings, store, key, engine, metrics)
        plugin = RekindlePlugin(settings, store=store, key=key, status=status, jobs=jobs,
                                specs=specs, facts=facts, image_ref=ImageIds(image_ref) if image_ref else None,
                                generations=engine.generations,
                                prefetcher=engine.prefetcher)
        # Leftovers of dead publishes, old logs and status records: now and every few minutes.
        stop_housekeeping = threading.Event()
        threading.Thread(target=_housekeeping, args=(settings, store, stop_housekeeping, metrics),
                         name="rekindle-housekeeping", daemon=True).start()
        fd = os.environ.get("NRI_PLUGIN_SOCKET")
        stub = Stub(plugin, Identity(os.environ.get("NRI_PLUGIN_NAME", settings.name),
                                     os.environ.get("NRI_PLUGIN_IDX", settings.idx)),
                    socket_path=settings.socket_path, preconnected_fd=int(fd) if fd else None,
                    observers=(health, metrics))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stub.stop)
        beat = loop.create_task(_heartbeat(health), name="rekindle-heartbeat")
        log.info("rekindle plugin %s-%s starting on %s", settings.idx, settings.name, settings.socket_path)
        await stub.run()
        stop_housekeeping.set()
        beat.cancel()
        await jobs.shutdown()
        if prewarmer is not None:
            prewarmer.shutdown()
        if engine.cache_writer is not None:
            engine.cache_writer.shutdown()
        log.info("rekindle plugin stopped")

    try:
        asyncio.run(main())
    finally:
        thp.put_back(settings.thp_record)
        if kube is not None:
            kube.close()
        if endpoint is not None:
            endpoint.stop()
    return 0


HOUSEKEEPING_EVERY = 600.0


def undo_dir(settings: Settings) -> str:
    """Where restores keep their rootfs undo journals (runtime.overlay.pending)."""
    return os.path.join(settings.state_dir, "rootfs-undo")


def _housekeep_once(settings: Settings, store: ArtifactStore, metrics: Metrics | None = None) -> list[str]:
    """One round; each step on its own (one that fails skips no other). The failed steps' names."""
    logs = os.path.join(settings.state_dir, "logs")

    def sweep_store() -> None:
        bad: list[store_gc.Leftover] = []
        removed = store_gc.sweep(store, on_bad=bad.append)
        if metrics is not None:
            metrics.store_bad_leftovers.set(len(bad))
        if removed:
            log.info("store sweep removed %d leftovers (%d bytes)", len(removed), sum(r.bytes for r in removed))

    steps = [housekeeping.Step("store_sweep", sweep_store),
             housekeeping.Step("restore_copies", lambda: housekeeping.sweep_restore_copies(logs)),
             housekeeping.Step("rootfs_journals", lambda: overlay_pending.sweep(undo_dir(settings))),
             housekeeping.Step("logs", lambda: housekeeping.rotate_logs(logs)),
             housekeeping.Step("status", lambda: housekeeping.expire_status(settings.state_dir))]
    return housekeeping.run_steps(steps, metrics.housekeeping_failed if metrics is not None else None)


def _housekeeping(settings: Settings, store: ArtifactStore, stop: threading.Event,
                  metrics: Metrics | None = None) -> None:
    """Its own thread: a slow shared store stalls neither handlers nor engine work."""
    while not stop.is_set():
        _housekeep_once(settings, store, metrics)
        stop.wait(HOUSEKEEPING_EVERY)


def _control_of(info: ContainerInfo) -> control.ControlDir | None:
    """The control dir of a container, found through its bundle's mounts."""
    for m in info.spec_mounts:
        if m.get("destination") == control.CONTAINER_PATH and m.get("source"):
            return control.ControlDir(Path(m["source"]))
    return None


CRI_POD_NAME = "io.kubernetes.cri.sandbox-name"
CRI_POD_UID = "io.kubernetes.cri.sandbox-uid"
CRI_CONTAINER_NAME = "io.kubernetes.cri.container-name"


def checkpoint_once(settings: Settings, container_id: str, namespace: str, name: str,
                    exit_after: bool = False,
                    progress: Callable[[str, int, int], None] | None = None) -> dict[str, float]:
    node = _engine(settings)
    info = resolve_container(settings.containerd_state, container_id)
    # What the plugin takes from NRI, the CLI reads from the spec containerd's CRI wrote: the
    # image (a restore checks it), the pod and the container. A container made without CRI has none.
    notes = info.annotations
    image = notes.get(IMAGE_NAME_ANNOTATION, "")
    req = checkpoint_request(settings, container_id, namespace, name, exit_after=exit_after, image=image,
                             image_ref=node.engine._image_id(image), pod=notes.get(CRI_POD_NAME, ""),
                             pod_uid=notes.get(CRI_POD_UID, ""), container=notes.get(CRI_CONTAINER_NAME, ""))
    return checkpoint_flow.checkpoint(req, node.store, node.key, control=_control_of(info),
                                      cuda=node.engine.cuda, progress=progress, thp=node.engine.thp)


def restore_once(settings: Settings, container_id: str, namespace: str, name: str,
                 image: str, progress: Callable[[str, int, int], None] | None = None) -> dict[str, float]:
    """The CLI's restore into a target the caller checked (``restore_target``): the same checks
    as the plugin's, the image and its digest included."""
    node = _engine(settings)
    req = restore_request(settings, container_id, namespace, name, image=image,
                          image_ref=node.engine._image_id(image))
    cache = NodeCache(cache_dir(settings), cache_bytes(settings), settings.cache.entries)  # read only
    ctl = _control_of(resolve_container(settings.containerd_state, container_id))
    return restore_flow.restore(req, node.store, node.key, node.facts, control=ctl,
                                cuda=node.engine.cuda, generations=node.engine.generations, progress=progress,
                                cache=cache, map_mode=map_mode(settings))
