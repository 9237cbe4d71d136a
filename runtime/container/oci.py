"""The parts of an OCI runtime spec (config.json) the engine reads, as typed mappings.

containerd writes the spec from the pod's CRI request; the engine reads a container's devices,
mounts, process and security settings from it. The types say what the runtime-spec schema says
a field holds; a reader still checks each value it uses (``runtime.security`` refuses a spec
whose uid is not an integer), since a spec is JSON whose every field is optional.
"""

from __future__ import annotations

from typing import Any, TypedDict


class User(TypedDict, total=False):
    uid: int
    gid: int
    additionalGids: list[int]


class Capabilities(TypedDict, total=False):
    bounding: list[str]
    effective: list[str]
    permitted: list[str]
    inheritable: list[str]
    ambient: list[str]


class Process(TypedDict, total=False):
    args: list[str]
    env: list[str]
    cwd: str
    user: User
    capabilities: Capabilities
    noNewPrivileges: bool
    apparmorProfile: str
    selinuxLabel: str


class Device(TypedDict, total=False):
    """A device node the runtime creates in the container (``linux.devices``)."""

    path: str
    type: str
    major: int
    minor: int
    fileMode: int
    uid: int
    gid: int


class DeviceRule(TypedDict, total=False):
    """A device cgroup rule (``linux.resources.devices``)."""

    allow: bool
    type: str
    major: int
    minor: int
    access: str


class Resources(TypedDict, total=False):
    devices: list[DeviceRule]


class Namespace(TypedDict, total=False):
    type: str
    path: str


class IdMapping(TypedDict, total=False):
    containerID: int
    hostID: int
    size: int


class Linux(TypedDict, total=False):
    devices: list[Device]
    resources: Resources
    namespaces: list[Namespace]
    uidMappings: list[IdMapping]
    gidMappings: list[IdMapping]
    seccomp: dict[str, Any]
    maskedPaths: list[str]
    readonlyPaths: list[str]
    mountLabel: str
    sysctl: dict[str, str]


class Mount(TypedDict, total=False):
    destination: str
    type: str
    source: str
    options: list[str]


class Root(TypedDict, total=False):
    path: str
    readonly: bool


class Spec(TypedDict, total=False):
    ociVersion: str
    process: Process
    root: Root
    hostname: str
    mounts: list[Mount]
    linux: Linux
    annotations: dict[str, str]
