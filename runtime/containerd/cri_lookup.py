"""The read-only CRI calls the plugin makes on a node: runtime version, image digest, a pod's containers.

Contract:
- :class:`CriLookup` wraps one gRPC channel to containerd's CRI socket (``runtime.v1``); each
  method is one call and returns plain values. Every gRPC failure becomes :class:`CRIError`
  naming the operation (and carrying the gRPC status code).
- Nothing here creates, starts or stops anything: the plugin only looks. The kubelet stand-in
  used by the tests and the demo (``devtools.cri``) builds on this class.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from runtime.containerd import RECONNECT_OPTIONS
from runtime.containerd.proto import cri_api_pb2 as pb
from runtime.containerd.proto import cri_api_pb2_grpc as pb_grpc
from runtime.errors import Reason, RekindleError


class CRIError(RekindleError):
    """A CRI call failed; ``code`` is the gRPC status code (or None)."""

    reason_class = Reason.RUNTIME

    def __init__(self, op: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"CRI {op}: {message}")
        self.op = op
        self.code = code


class ContainerState(enum.Enum):
    CREATED = pb.CONTAINER_CREATED
    RUNNING = pb.CONTAINER_RUNNING
    EXITED = pb.CONTAINER_EXITED
    UNKNOWN = pb.CONTAINER_UNKNOWN


LIVE = (ContainerState.RUNNING, ContainerState.CREATED)


@dataclass(frozen=True)
class ContainerSummary:
    id: str
    pod_id: str
    name: str
    state: ContainerState
    image: str


@dataclass(frozen=True)
class RuntimeVersion:
    runtime_name: str
    runtime_version: str
    runtime_api_version: str


class CriLookup:
    """Read-only CRI client over a unix socket; use as a context manager or call close()."""

    def __init__(self, address: str, timeout: float = 30.0) -> None:
        target = address if address.startswith("unix:") else f"unix://{address}"
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 16 << 20),
                                                               *RECONNECT_OPTIONS])
        self._rt = pb_grpc.RuntimeServiceStub(self._channel)
        self._img = pb_grpc.ImageServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> CriLookup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, fn: Callable[..., Any], request: Any, timeout: float | None = None) -> Any:
        try:
            return fn(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise CRIError(op, f"{e.code().name}: {e.details()}", e.code()) from None

    def version(self) -> RuntimeVersion:
        v = self._call("Version", self._rt.Version, pb.VersionRequest(version="v1"))
        return RuntimeVersion(v.runtime_name, v.runtime_version, v.runtime_api_version)

    def list_containers(self, pod_id: str = "", labels: Mapping[str, str] | None = None) -> list[ContainerSummary]:
        flt = pb.ContainerFilter(pod_sandbox_id=pod_id, label_selector=dict(labels or {}))
        resp = self._call("ListContainers", self._rt.ListContainers, pb.ListContainersRequest(filter=flt))
        return [ContainerSummary(c.id, c.pod_sandbox_id, c.metadata.name, ContainerState(c.state), c.image.image)
                for c in resp.containers]

    def live_containers(self, pod_id: str) -> list[tuple[str, str]]:
        """(id, name) of the pod's running and created containers."""
        return [(c.id, c.name) for c in self.list_containers(pod_id=pod_id) if c.state in LIVE]

    def exit_code(self, container_id: str) -> int | None:
        """The container's exit code once CRI reports it exited, else None."""
        resp = self._call("ContainerStatus", self._rt.ContainerStatus,
                          pb.ContainerStatusRequest(container_id=container_id))
        return int(resp.status.exit_code) if ContainerState(resp.status.state) is ContainerState.EXITED else None

    def image_ref(self, image: str) -> str | None:
        """The image id containerd resolves ``image`` to, or None when absent."""
        resp = self._call("ImageStatus", self._img.ImageStatus,
                          pb.ImageStatusRequest(image=pb.ImageSpec(image=image)))
        return resp.image.id or None
