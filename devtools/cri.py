"""A small CRI (runtime.v1) client that plays kubelet against containerd's CRI socket (tests, demo, bench).

Contract:
- :class:`CRIClient` extends the plugin's read-only :class:`runtime.containerd.cri_lookup.CriLookup`
  (one gRPC channel; version, image digest, container list) with pod and container lifecycle
  calls (plus the small amount of kubelet behaviour a test needs: log dirs, kubelet's namespace
  modes); each method is one CRI call and returns plain dataclasses. Every gRPC failure becomes
  :class:`CRIError` naming the operation.
- Pods default to kubelet's layout: pid namespace per container (``NamespaceMode.CONTAINER``),
  network and ipc per pod; logs at ``<log_root>/<ns>_<name>_<uid>/<container>/<attempt>.log``.
- :meth:`CRIClient.create_container` needs the :class:`Pod` returned by
  :meth:`CRIClient.run_pod_sandbox` (CRI wants the pod's config again).
- :meth:`CRIClient.container_status` with ``verbose=True`` parses containerd's ``info`` JSON:
  ``pid`` and ``runtime_spec`` (the OCI spec) are filled in.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.containerd.cri_lookup import ContainerState, ContainerSummary, CRIError, CriLookup
from runtime.containerd.proto import cri_api_pb2 as pb

__all__ = ["CRIClient", "CRIError", "ContainerState", "ContainerStatus", "ContainerSummary", "Device",
           "ExecResult", "Mount", "NamespaceMode", "Pod", "PodState", "PodSummary", "SecurityContext",
           "parse_cri_log"]

log = logging.getLogger(__name__)

DEFAULT_LOG_ROOT = Path("/var/log/pods")


class PodState(enum.Enum):
    READY = pb.SANDBOX_READY
    NOTREADY = pb.SANDBOX_NOTREADY


class NamespaceMode(enum.Enum):
    POD = pb.POD
    CONTAINER = pb.CONTAINER
    NODE = pb.NODE


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    readonly: bool = False
    propagation: int = pb.PROPAGATION_PRIVATE


@dataclass(frozen=True)
class Device:
    container_path: str
    host_path: str
    permissions: str = "rwm"


@dataclass(frozen=True)
class SecurityContext:
    run_as_user: int | None = None
    run_as_group: int | None = None
    privileged: bool = False
    add_capabilities: tuple[str, ...] = ()
    drop_capabilities: tuple[str, ...] = ()
    readonly_rootfs: bool = False
    no_new_privs: bool = False
    supplemental_groups: tuple[int, ...] = ()
    seccomp_runtime_default: bool = False  # seccompProfile: RuntimeDefault, as kubelet sends it


@dataclass(frozen=True)
class Pod:
    id: str
    name: str
    namespace: str
    uid: str
    log_directory: Path
    config: Any = field(repr=False)  # pb.PodSandboxConfig, needed again by CreateContainer
    pid_mode: NamespaceMode = NamespaceMode.CONTAINER


@dataclass(frozen=True)
class PodSummary:
    id: str
    name: str
    namespace: str
    uid: str
    state: PodState
    labels: dict[str, str]
    annotations: dict[str, str]


@dataclass(frozen=True)
class ContainerStatus:
    id: str
    name: str
    state: ContainerState
    exit_code: int
    reason: str
    message: str
    log_path: str
    image: str
    image_ref: str
    started_at: int
    finished_at: int
    labels: dict[str, str]
    annotations: dict[str, str]
    pid: int | None = None  # verbose only
    runtime_spec: dict | None = None  # verbose only: the OCI spec containerd holds
    info: dict = field(default_factory=dict, repr=False)  # verbose only: the whole info JSON


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes

    @property
    def out(self) -> str:
        return self.stdout.decode(errors="replace")

    @property
    def err(self) -> str:
        return self.stderr.decode(errors="replace")


def parse_cri_log(raw: str) -> tuple[list[str], list[str]]:
    """Split a CRI log file (``<time> <stream> <P|F> <text>``) into (stdout, stderr) lines."""
    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    partial: dict[str, str] = {"stdout": "", "stderr": ""}
    for line in raw.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[1] not in out:
            continue
        text = parts[3] if len(parts) == 4 else ""
        if parts[2] == "P":  # partial line: continued by the next record of the stream
            partial[parts[1]] += text
        else:
            out[parts[1]].append(partial[parts[1]] + text)
            partial[parts[1]] = ""
    return out["stdout"], out["stderr"]


class CRIClient(CriLookup):
    """Kubelet-like CRI client over a unix socket; use as a context manager or call close()."""

    def __init__(self, address: str, timeout: float = 30.0, log_root: Path | str = DEFAULT_LOG_ROOT) -> None:
        super().__init__(address, timeout)
        self.log_root = Path(log_root)

    def __enter__(self) -> CRIClient:
        return self

    # -- pods --

    def run_pod_sandbox(self, name: str, namespace: str = "default", uid: str | None = None, *,
                        annotations: Mapping[str, str] | None = None,
                        labels: Mapping[str, str] | None = None,
                        hostname: str | None = None,
                        pid_mode: NamespaceMode = NamespaceMode.CONTAINER,
                        cgroup_parent: str = "",
                        port_mappings: Sequence[tuple[int, int]] = (),
                        attempt: int = 0, timeout: float | None = None) -> Pod:
        """Start a pod sandbox; pid namespace per container unless pid_mode says otherwise."""
        import uuid
        uid = uid or str(uuid.uuid4())
        log_dir = self.log_root / f"{namespace}_{name}_{uid}"
        log_dir.mkdir(parents=True, exist_ok=True)
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=attempt),
            hostname=hostname or name,
            log_directory=str(log_dir),
            labels=dict(labels or {}),
            annotations=dict(annotations or {}),
            port_mappings=[pb.PortMapping(protocol=pb.TCP, container_port=c, host_port=h) for c, h in port_mappings],
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=cgroup_parent,
                security_context=pb.LinuxSandboxSecurityContext(
                    namespace_options=pb.NamespaceOption(network=pb.POD, pid=pid_mode.value, ipc=pb.POD))),
        )
        resp = self._call("RunPodSandbox", self._rt.RunPodSandbox,
                          pb.RunPodSandboxRequest(config=config), timeout or max(self.timeout, 60))
        log.debug("pod %s/%s running: %s", namespace, name, resp.pod_sandbox_id)
        return Pod(resp.pod_sandbox_id, name, namespace, uid, log_dir, config, pid_mode)

    def stop_pod(self, pod_id: str, timeout: float | None = None) -> None:
        self._call("StopPodSandbox", self._rt.StopPodSandbox,
                   pb.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout or max(self.timeout, 60))

    def remove_pod(self, pod_id: str) -> None:
        self._call("RemovePodSandbox", self._rt.RemovePodSandbox, pb.RemovePodSandboxRequest(pod_sandbox_id=pod_id))

    def pod_status(self, pod_id: str, verbose: bool = False) -> pb.PodSandboxStatusResponse:
        return self._call("PodSandboxStatus", self._rt.PodSandboxStatus,
                          pb.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose))

    def pod_ip(self, pod_id: str) -> str:
        """The pod's primary IP ('' when it has no network)."""
        return self.pod_status(pod_id).status.network.ip

    def list_pods(self, labels: Mapping[str, str] | None = None) -> list[PodSummary]:
        flt = pb.PodSandboxFilter(label_selector=dict(labels or {}))
        resp = self._call("ListPodSandbox", self._rt.ListPodSandbox, pb.ListPodSandboxRequest(filter=flt))
        return [PodSummary(p.id, p.metadata.name, p.metadata.namespace, p.metadata.uid, PodState(p.state),
                           dict(p.labels), dict(p.annotations)) for p in resp.items]

    # -- containers --

    def create_container(self, pod: Pod, name: str, image: str, *,
                         command: Sequence[str] = (), args: Sequence[str] = (),
                         env: Mapping[str, str] | None = None,
                         mounts: Sequence[Mount] = (), devices: Sequence[Device] = (),
                         security: SecurityContext | None = None,
                         labels: Mapping[str, str] | None = None,
                         annotations: Mapping[str, str] | None = None,
                         working_dir: str = "", attempt: int = 0,
                         oom_score_adj: int = 0,
                         timeout: float | None = None) -> str:
        """Create (not start) a container in pod; returns its id. Log: <pod log dir>/<name>/<attempt>.log.

        ``oom_score_adj`` is what kubelet derives from the pod's QoS class (-997 Guaranteed,
        1000 BestEffort).
        """
        sc = security or SecurityContext()
        (pod.log_directory / name).mkdir(parents=True, exist_ok=True)
        lsc = pb.LinuxContainerSecurityContext(
            capabilities=pb.Capability(add_capabilities=list(sc.add_capabilities),
                                       drop_capabilities=list(sc.drop_capabilities)),
            privileged=sc.privileged,
            namespace_options=pb.NamespaceOption(network=pb.POD, pid=pod.pid_mode.value, ipc=pb.POD),
            readonly_rootfs=sc.readonly_rootfs,
            no_new_privs=sc.no_new_privs,
            supplemental_groups=list(sc.supplemental_groups),
        )
        if sc.run_as_user is not None:
            lsc.run_as_user.value = sc.run_as_user
        if sc.run_as_group is not None:
            lsc.run_as_group.value = sc.run_as_group
        if sc.seccomp_runtime_default:
            lsc.seccomp.CopyFrom(pb.SecurityProfile(profile_type=pb.SecurityProfile.RuntimeDefault))
        config = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=name, attempt=attempt),
            image=pb.ImageSpec(image=image),
            command=list(command), args=list(args), working_dir=working_dir,
            envs=[pb.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
            mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path, readonly=m.readonly,
                             propagation=m.propagation) for m in mounts],
            devices=[pb.Device(container_path=d.container_path, host_path=d.host_path, permissions=d.permissions)
                     for d in devices],
            labels=dict(labels or {}), annotations=dict(annotations or {}),
            log_path=f"{name}/{attempt}.log",
            linux=pb.LinuxContainerConfig(security_context=lsc,
                                          resources=pb.LinuxContainerResources(oom_score_adj=oom_score_adj)),
        )
        resp = self._call("CreateContainer", self._rt.CreateContainer,
                          pb.CreateContainerRequest(pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config),
                          timeout or max(self.timeout, 60))
        return resp.container_id

    def start_container(self, container_id: str, timeout: float | None = None) -> None:
        self._call("StartContainer", self._rt.StartContainer,
                   pb.StartContainerRequest(container_id=container_id), timeout or max(self.timeout, 60))

    def stop_container(self, container_id: str, grace_seconds: int = 10) -> None:
        self._call("StopContainer", self._rt.StopContainer,
                   pb.StopContainerRequest(container_id=container_id, timeout=grace_seconds),
                   self.timeout + grace_seconds)

    def remove_container(self, container_id: str) -> None:
        self._call("RemoveContainer", self._rt.RemoveContainer, pb.RemoveContainerRequest(container_id=container_id))

    def container_status(self, container_id: str, verbose: bool = False) -> ContainerStatus:
        resp = self._call("ContainerStatus", self._rt.ContainerStatus,
                          pb.ContainerStatusRequest(container_id=container_id, verbose=verbose))
        s = resp.status
        info: dict = {}
        if verbose and "info" in resp.info:
            try:
                info = json.loads(resp.info["info"])
            except ValueError as e:
                raise CRIError("ContainerStatus", f"unparsable info JSON for {container_id}: {e}") from None
        return ContainerStatus(
            id=s.id, name=s.metadata.name, state=ContainerState(s.state), exit_code=s.exit_code,
            reason=s.reason, message=s.message, log_path=s.log_path, image=s.image.image,
            image_ref=s.image_ref, started_at=s.started_at, finished_at=s.finished_at,
            labels=dict(s.labels), annotations=dict(s.annotations),
            pid=info.get("pid") or None, runtime_spec=info.get("runtimeSpec"), info=info)

    def wait_container(self, container_id: str, states: Sequence[ContainerState] = (ContainerState.EXITED,),
                       timeout: float = 30.0, interval: float = 0.1) -> ContainerStatus:
        """Poll until the container is in one of states; CRIError on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.container_status(container_id)
            if st.state in states:
                return st
            if time.monotonic() >= deadline:
                raise CRIError("wait", f"container {container_id} is {st.state.name} after {timeout:.0f}s, "
                                       f"wanted {[s.name for s in states]}")
            time.sleep(interval)

    def exec_sync(self, container_id: str, cmd: Sequence[str], timeout: int = 10) -> ExecResult:
        """Run cmd in the container and wait (timeout in whole seconds; 0 = none)."""
        resp = self._call("ExecSync", self._rt.ExecSync,
                          pb.ExecSyncRequest(container_id=container_id, cmd=list(cmd), timeout=timeout),
                          (timeout or self.timeout) + 10)
        return ExecResult(resp.exit_code, resp.stdout, resp.stderr)

    def log_path(self, container_id: str) -> Path:
        """The container's CRI log file on the host."""
        return Path(self.container_status(container_id).log_path)

    def logs(self, container_id: str, stream: str = "stdout") -> list[str]:
        """The container's log lines for stream ('stdout', 'stderr' or 'both')."""
        try:
            raw = self.log_path(container_id).read_text(errors="replace")
        except FileNotFoundError:
            return []
        out, err = parse_cri_log(raw)
        return {"stdout": out, "stderr": err}.get(stream, out + err)

    # -- images --

    def list_images(self) -> list[str]:
        resp = self._call("ListImages", self._img.ListImages, pb.ListImagesRequest())
        return sorted(t for i in resp.images for t in i.repo_tags)
