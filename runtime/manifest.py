"""The artifact manifest: schema, canonical bytes, signature, privilege and compatibility checks.

Contract:

- :class:`Manifest` (``format_version`` 5) mirrors docs/design.md "Artifact". Every record is a
  frozen dataclass validated on construction. :meth:`Manifest.to_json` gives canonical bytes
  (sorted keys, compact separators, UTF-8); :meth:`Manifest.from_json` treats its input as
  untrusted: exact key sets, strict JSON types (a bool is not an int), no duplicate keys, no
  NaN, a size cap, and an unknown ``format_version`` is refused by name. Every parse problem
  raises :class:`ArtifactRejected`. Version 2 (before ``host_files``) is still read: its
  ``host_files`` is None, "not recorded" (``runtime.hostfiles`` says what a restore does then);
  versions 2 and 3 (before ``prewarm``) are read with ``prewarm`` false, versions before 5 (before
  ``map_ranges``) with ``map_ranges`` empty, and their bytes (the ones signed) are never
  rewritten.
- :func:`sign` / :func:`verify`: ``"hmac-sha256:<hex>"`` over the exact manifest bytes.
- The key itself (reading, creating) lives in ``runtime.store.keys``.
- The security fingerprint and the privilege check live in ``runtime.security``; the
  compatibility check in ``runtime.compat``.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import math
import posixpath
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from runtime import strict_json
from runtime.errors import ArtifactRejected
from runtime.security import SecurityProfile

__all__ = ["CriuInfo", "CudaInfo", "FileEntry", "Gpu", "HostFile", "Manifest", "MountInfo", "NodeInfo", "ProcessInfo",
           "Source", "sign", "verify"]

FORMAT_VERSION = 5
READS_VERSIONS = (2, 3, 4, 5)  # 2: written before host_files existed; 3: before prewarm; 4: before map_ranges
MAP_RANGES = ("", "driver", "all", "none")  # runtime.pages.mapping.MapMode's values; "": the node's
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
SIG_PREFIX = "hmac-sha256:"

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU as every part of Rekindle names it: its UUID (``GPU-xxxxxxxx-...``, as the driver
    and nvidia-smi print it) and its model name (``runtime.gpu.devices`` lists a node's)."""

    uuid: str
    name: str


@dataclass(frozen=True, slots=True)
class Source:
    pod: str
    pod_uid: str
    container: str
    container_id: str
    image: str
    image_ref: str


@dataclass(frozen=True, slots=True)
class NodeInfo:
    hostname: str
    kernel: str
    arch: str


@dataclass(frozen=True, slots=True)
class CriuInfo:
    version: str


@dataclass(frozen=True, slots=True)
class CudaInfo:
    """The CUDA driver and GPUs of a checkpoint (``pids``: its CUDA processes), or of a node or a
    target container (no pids) when an artifact is checked against them."""

    driver_version: str
    gpus: tuple[Gpu, ...]
    pids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(all(p > 0 for p in self.pids), "cuda.pids must be positive")


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    root_pid: int
    args: tuple[str, ...]

    def __post_init__(self) -> None:
        _check(self.root_pid > 0, "process.root_pid must be positive")


@dataclass(frozen=True, slots=True)
class MountInfo:
    key: str
    destination: str
    type: str


@dataclass(frozen=True, slots=True)
class FileEntry:
    path: str
    size: int
    digest: str  # BLAKE3, hex (runtime.store.volume)

    def __post_init__(self) -> None:
        _check(self.size >= 0, f"file {self.path!r}: negative size")
        _check(bool(_DIGEST_RE.fullmatch(self.digest)), f"file {self.path!r}: bad digest")


@dataclass(frozen=True, slots=True)
class HostFile:
    """A file the tree maps or holds open from a bind mount (host content, not the image's):
    ``mount`` is the mount's destination in the spec, ``path`` the file beneath it ("" when the
    mount is the file itself); hashed from the host side at checkpoint (``runtime.hostfiles``)."""

    mount: str
    path: str
    size: int
    digest: str  # BLAKE3, hex (runtime.digests)

    @property
    def in_container(self) -> str:
        return posixpath.join(self.mount, self.path) if self.path else self.mount

    def __post_init__(self) -> None:
        _check(self.mount.startswith("/") and posixpath.normpath(self.mount) == self.mount,
               f"host file mount {self.mount!r}: not a normal absolute path")
        _check(self.path == "" or (not self.path.startswith("/") and posixpath.normpath(self.path) == self.path
                                   and self.path.split("/")[0] != ".."),
               f"host file {self.path!r}: not a normal relative path")
        _check(self.size >= 0, f"host file {self.in_container!r}: negative size")
        _check(bool(_DIGEST_RE.fullmatch(self.digest)), f"host file {self.in_container!r}: bad digest")


@dataclass(frozen=True, slots=True)
class Manifest:
    name: str
    namespace: str
    created_at: str
    source: Source
    node: NodeInfo
    criu: CriuInfo
    cuda: CudaInfo | None
    security: SecurityProfile
    process: ProcessInfo
    mounts: tuple[MountInfo, ...]
    files: tuple[FileEntry, ...]
    timings: Mapping[str, float]
    # Set by the store at publish: increases with every publish of a name (microseconds since
    # the epoch, or the previous version's + 1), so a node can refuse a rollback.
    generation: int = 0
    # Files from bind mounts the tree maps or holds open, with their digests; None only in a
    # version 2 manifest (recorded by no one).
    host_files: tuple[HostFile, ...] | None = ()
    # Nodes write their cache entry of each version as it is published (the source pod's
    # rekindle.dev/prewarm); false in a manifest before format_version 4.
    prewarm: bool = False
    # What a restore from a node's cache maps (the source pod's rekindle.dev/map-ranges); "": the
    # node's setting; "" in a manifest before format_version 5.
    map_ranges: str = ""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        _check(self.format_version in READS_VERSIONS, f"format_version must be one of {READS_VERSIONS}")
        _check((self.host_files is None) == (self.format_version == 2),
               "host_files is null exactly in a format_version 2 manifest")
        _check(self.generation >= 0, "generation must not be negative")
        _check(self.format_version >= 4 or not self.prewarm, "prewarm needs format_version 4")
        _check(self.map_ranges in MAP_RANGES, f"map_ranges must be one of {MAP_RANGES}")
        _check(self.format_version >= 5 or not self.map_ranges, "map_ranges needs format_version 5")
        try:
            datetime.datetime.fromisoformat(self.created_at)
        except ValueError:
            raise ValueError(f"created_at {self.created_at!r} is not an ISO 8601 time") from None
        _check(all(math.isfinite(v) and v >= 0 for v in self.timings.values()),
               "timings must be finite, non-negative seconds")
        paths = [f.path for f in self.files]
        _check(len(paths) == len(set(paths)), "duplicate path in files")
        hosts = [(h.mount, h.path) for h in self.host_files or ()]
        _check(len(hosts) == len(set(hosts)), "duplicate file in host_files")

    def to_json(self) -> bytes:
        """Canonical bytes: sorted keys, compact separators, UTF-8, no NaN."""
        obj = strict_json.to_obj(self)
        if self.format_version < 4:  # the bytes an older version had: no prewarm key
            del obj["prewarm"]
        if self.format_version < 5:  # nor map_ranges
            del obj["map_ranges"]
        return strict_json.canonical_json(obj)

    @classmethod
    def from_json(cls, data: bytes, *, artifact: str = "manifest") -> Manifest:
        """Parse untrusted bytes; any problem raises ArtifactRejected(artifact, reason)."""
        try:
            obj = strict_json.loads(data, max_bytes=MAX_MANIFEST_BYTES)
        except ValueError as exc:
            raise ArtifactRejected(artifact, f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ArtifactRejected(artifact, "manifest is not a JSON object")
        version = obj.get("format_version")
        if type(version) is not int or version not in READS_VERSIONS:
            raise ArtifactRejected(
                artifact, f"unsupported manifest format_version {version!r} (this build reads "
                f"{', '.join(map(str, READS_VERSIONS))})")
        if version == 2:
            if "host_files" in obj:
                raise ArtifactRejected(artifact, "invalid manifest: host_files in a format_version 2 manifest")
            obj["host_files"] = None
        if version < 4:
            if "prewarm" in obj:
                raise ArtifactRejected(artifact, f"invalid manifest: prewarm in a format_version {version} manifest")
            obj["prewarm"] = False
        if version < 5:
            if "map_ranges" in obj:
                raise ArtifactRejected(artifact, f"invalid manifest: map_ranges in a format_version {version} manifest")
            obj["map_ranges"] = ""
        try:
            return typing.cast(Manifest, strict_json.from_obj(cls, obj, "manifest"))
        except (TypeError, ValueError) as exc:
            raise ArtifactRejected(artifact, f"invalid manifest: {exc}") from exc


# --- signature ---------------------------------------------------------------------------------------

def sign(data: bytes, key: bytes) -> str:
    return SIG_PREFIX + hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(data: bytes, sig: str, key: bytes, *, artifact: str = "manifest") -> None:
    """Raise ArtifactRejected(artifact, "bad signature") unless ``sig`` signs ``data``."""
    if not hmac.compare_digest(sign(data, key).encode(), sig.strip().encode("utf-8", "replace")):
        raise ArtifactRejected(artifact, "bad signature")
