"""The GPU side of the flows: which GPUs and driver a node or a container has, their device nodes,
and bringing a restored tree's CUDA processes back.

Contract:
- :func:`node_cuda` asks the agent's CUDA checkpointer for the driver version and every GPU of
  the node (None without one, or when the driver does not answer).
- :func:`target_facts` narrows the node's facts to the GPUs a container was given (its
  ``/dev/nvidiaN`` devices, ``runtime.gpu.devices``); a container given none (privileged, or an OCI spec
  that lists no GPU) keeps the node's.
- :func:`source_gpus` is the same question for a checkpoint source: the GPUs it was given, else
  every GPU CUDA sees.
- :func:`ensure_device_nodes` creates the target's NVIDIA device nodes inside a restored
  process's /dev, from the host (``runtime.gpu.devnodes``: no container binary runs).
- :func:`hold_cuda` seizes every thread of a stopped tree's CUDA processes (``runtime.proc.hold``)
  before the rest of the tree is continued; :func:`cuda_restore` restores and unlocks every CUDA
  process of a restored tree, only the driver's restore threads running meanwhile where it holds
  them (then continues them); on any failure the whole tree is killed before the error is re-raised.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Collection, Iterable

from runtime.compat import NodeFacts
from runtime.container import oci
from runtime.container.containers import process_tree
from runtime.errors import RekindleError
from runtime.gpu.cuda import Checkpointer
from runtime.gpu.devices import NVIDIA_MAJOR, spec_devices, visible_gpus
from runtime.gpu.devnodes import CharDevice, ensure_char_devices
from runtime.manifest import CudaInfo, Gpu
from runtime.proc import tasks
from runtime.proc.hold import Hold, HoldError

log = logging.getLogger(__name__)


def node_cuda(cuda: Checkpointer | None) -> CudaInfo | None:
    """Driver version and every GPU of the node, from the agent's CUDA checkpointer."""
    if cuda is None:
        return None
    try:
        return CudaInfo(cuda.driver_version(), tuple(cuda.gpus()))
    except RekindleError as exc:
        log.warning("CUDA facts unavailable: %s", exc)
        return None


def target_facts(facts: NodeFacts, target_spec: oci.Spec) -> NodeFacts:
    """The node's facts with the GPU list narrowed to what the target container can see."""
    return facts_for_devices(facts, spec_devices(target_spec))


def facts_for_devices(facts: NodeFacts, devices: Iterable[tuple[str, int, int]]) -> NodeFacts:
    """The node's facts with the GPU list narrowed to what a container given these device
    entries (path, major, minor) can see."""
    if facts.cuda is None:
        return facts
    visible = visible_gpus(devices)
    by_uuid = {g.uuid: g for g in facts.cuda.gpus}
    gpus = tuple(by_uuid.get(g.uuid, g) for g in visible)  # CUDA's model name where it has one
    return dataclasses.replace(facts, cuda=CudaInfo(facts.cuda.driver_version, gpus or facts.cuda.gpus))


def source_gpus(cuda: Checkpointer, source_spec: oci.Spec) -> tuple[Gpu, ...]:
    """The GPUs a checkpoint source was given; all that CUDA sees when its spec lists none."""
    return tuple(visible_gpus(spec_devices(source_spec)) or cuda.gpus())


def gpu_device_nodes(target_spec: oci.Spec) -> list[CharDevice]:
    """The target's NVIDIA device nodes, as its OCI spec lists them."""
    out = []
    for d in (target_spec.get("linux") or {}).get("devices") or []:
        try:
            path, major, minor = str(d["path"]), int(d["major"]), int(d["minor"])
        except (KeyError, TypeError, ValueError):
            continue
        if major == NVIDIA_MAJOR or path.startswith("/dev/nvidia"):
            out.append(CharDevice(path, major, minor, int(d.get("fileMode", 0o666)) & 0o777))
    return out


def ensure_device_nodes(host_pid: int, target_spec: oci.Spec) -> list[str]:
    """The target's NVIDIA device nodes in the restored process's /dev (created from the host)."""
    return ensure_char_devices(host_pid, gpu_device_nodes(target_spec))


def hold_cuda(host_pids: Iterable[int]) -> Hold | None:
    """Every thread of the (stopped) CUDA processes seized, so that continuing the tree leaves
    them stopped until :func:`cuda_restore`; None, logged, where they cannot be (the restore then
    runs with the whole process running, as the driver alone allows)."""
    try:
        return Hold.seize(host_pids)
    except (HoldError, OSError) as exc:
        log.warning("cannot hold the CUDA processes %s while the driver restores them: %s", list(host_pids), exc)
        return None


def cuda_restore(cuda: Checkpointer, host_pids: list[int], gpu_map: dict[str, str] | None, root_host: int,
                 restored: tuple[int, ...], hold: Hold | None = None, stopped: Collection[int] = (),
                 kill: bool = True) -> None:
    """Restore and unlock every CUDA process of a restored tree; on any failure kill the tree
    (unless not ``kill``: a source's resume tries again) and re-raise. Some processes may be back on the GPU and others stuck locked: none may go on (a
    rank would wait for its peer forever); the caller's restore-failed makes the init start cold.

    With ``hold``, only each process's restore thread runs while the driver restores it (another
    thread touching device-mapped memory before it is back crashes the process); then every held
    thread is let go and its process continued, but those in ``stopped`` (stopped when dumped)."""
    try:
        if hold is not None:
            try:
                for pid in host_pids:
                    tid = restore_thread(cuda, pid)
                    hold.let_run(tid)
                    log.info("pid %d: only its restore thread %d runs while the driver restores it", pid, tid)
            except Exception as exc:  # noqa: BLE001 - the hold is an aid: without it, as the driver alone allows
                log.warning("the CUDA processes run whole while the driver restores them: %s", exc)
                _let_go(hold, stopped)
                hold = None
        cuda.restore_all(host_pids, gpu_map)
    except BaseException:
        if kill:
            tasks.kill_all(_tree_now(root_host, restored))
        raise
    finally:
        if hold is not None:
            _let_go(hold, stopped)


def _let_go(hold: Hold, stopped: Collection[int]) -> None:
    hold.release()
    tasks.signal_all([p for p in hold.pids if p not in stopped], signal.SIGCONT)


def restore_thread(cuda: Checkpointer, pid: int) -> int:
    """The host tid of ``pid``'s CUDA restore thread (the driver may name it as the process's
    own namespace sees it)."""
    tid = int(cuda.restore_tid(pid))
    if os.path.exists(f"/proc/{pid}/task/{tid}"):
        return tid
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                nspid = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if nspid and int(nspid[-1]) == tid:
            return int(task)
    raise HoldError(3, f"pid {pid}: the driver's restore thread {tid} is not one of its threads")


def _tree_now(root_host: int, restored: tuple[int, ...]) -> list[int]:
    """The restored tree as it is now (it ran since CRIU, and may have forked), and as it was."""
    try:
        now = process_tree(root_host)
    except Exception:  # noqa: BLE001 - the root is gone: kill what is known
        now = []
    return list(dict.fromkeys([*now, *restored]))
