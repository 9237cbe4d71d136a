"""containerd's Containers service (the stored container records), over gRPC.

Contract:
- :class:`ContainerdClient` talks to containerd's gRPC socket with the
  ``containerd-namespace`` metadata (default ``k8s.io``, the CRI namespace).
- :meth:`ContainerdClient.get` returns a :class:`ContainerRecord` whose ``spec`` is the stored
  OCI runtime spec, decoded from JSON, and ``spec_type_url`` the Any's type URL.
- :meth:`ContainerdClient.update_spec` replaces the stored spec with ``update_mask: ["spec"]``,
  keeping the original Any type URL (containerd decodes the spec by it). It changes what the
  runtime will use for a container that has not been started yet (the entrypoint swap on
  NRI < 0.10); a running task is not affected.
- Every gRPC failure becomes :class:`ContainerdError` (``not_found`` set for NOT_FOUND).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from google.protobuf import any_pb2, field_mask_pb2

from runtime.container import oci
from runtime.containerd import RECONNECT_OPTIONS
from runtime.containerd.proto import containers_pb2 as pb
from runtime.containerd.proto import containers_pb2_grpc as pb_grpc
from runtime.errors import Reason, RekindleError

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "/run/containerd/containerd.sock"
CRI_NAMESPACE = "k8s.io"
# What containerd writes for an OCI spec when nothing else is known.
OCI_SPEC_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/Spec"


class ContainerdError(RekindleError):
    """A containerd API call failed."""

    reason_class = Reason.RUNTIME

    def __init__(self, op: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"containerd {op}: {message}")
        self.op = op
        self.code = code

    @property
    def not_found(self) -> bool:
        return self.code == grpc.StatusCode.NOT_FOUND


@dataclass(frozen=True)
class ContainerRecord:
    id: str
    image: str
    labels: dict[str, str]
    runtime: str
    snapshotter: str
    snapshot_key: str
    spec: oci.Spec
    spec_type_url: str
    raw: Any = field(repr=False)  # the containers_pb2.Container


class ContainerdClient:
    """Containers service client; use as a context manager or call close()."""

    def __init__(self, address: str = DEFAULT_ADDRESS, namespace: str = CRI_NAMESPACE, timeout: float = 10.0) -> None:
        target = address if address.startswith("unix:") else f"unix://{address}"
        self.address = address
        self.namespace = namespace
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=RECONNECT_OPTIONS)
        self._containers = pb_grpc.ContainersStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ContainerdClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, fn: Any, request: Any) -> Any:
        try:
            return fn(request, timeout=self.timeout, metadata=(("containerd-namespace", self.namespace),))
        except grpc.RpcError as e:
            raise ContainerdError(op, f"{e.code().name}: {e.details()}", e.code()) from None

    def get(self, container_id: str) -> ContainerRecord:
        c = self._call("Containers.Get", self._containers.Get, pb.GetContainerRequest(id=container_id)).container
        try:
            spec = json.loads(c.spec.value) if c.spec.value else {}
        except ValueError as e:
            raise ContainerdError("Containers.Get", f"container {container_id}: spec is not JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ContainerdError("Containers.Get", f"container {container_id}: spec is not a JSON object")
        return ContainerRecord(id=c.id, image=c.image, labels=dict(c.labels), runtime=c.runtime.name,
                               snapshotter=c.snapshotter, snapshot_key=c.snapshot_key, spec=cast(oci.Spec, spec),
                               spec_type_url=c.spec.type_url, raw=c)

    def get_spec(self, container_id: str) -> oci.Spec:
        return self.get(container_id).spec

    def update_spec(self, container_id: str, spec: oci.Spec, type_url: str | None = None) -> ContainerRecord:
        """Store spec as the container's OCI spec (only the spec field changes)."""
        if type_url is None:
            type_url = self.get(container_id).spec_type_url or OCI_SPEC_TYPE_URL
        req = pb.UpdateContainerRequest(
            container=pb.Container(id=container_id,
                                   spec=any_pb2.Any(type_url=type_url, value=json.dumps(spec).encode())),
            update_mask=field_mask_pb2.FieldMask(paths=["spec"]))
        self._call("Containers.Update", self._containers.Update, req)
        log.debug("updated spec of container %s", container_id)
        return self.get(container_id)
