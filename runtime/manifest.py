"""The artifact manifest: schema, canonical bytes, signature, privilege and compatibility checks.

Contract:

- :class:`Manifest` (``format_version`` 1) mirrors docs/design.md "Artifact". Every record is a
  frozen dataclass validated on construction. :meth:`Manifest.to_json` gives canonical bytes
  (sorted keys, compact separators, UTF-8); :meth:`Manifest.from_json` treats its input as
  untrusted: exact key sets, strict JSON types (a bool is not an int), no duplicate keys, no
  NaN, a size cap, and an unknown ``format_version`` is refused by name. Every parse problem
  raises :class:`ArtifactRejected`.
- :func:`sign` / :func:`verify`: ``"hmac-sha256:<hex>"`` over the exact manifest bytes.
- The key itself (reading, creating) lives in ``runtime.keys``.
- The security fingerprint and the privilege check live in ``runtime.security``; the
  compatibility check in ``runtime.compat``.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import ArtifactRejected
from runtime.security import SecurityProfile

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
SIG_PREFIX = "hmac-sha256:"

_SHA_RE = re.compile(r"[0-9a-f]{64}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


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
class Gpu:
    uuid: str
    name: str


@dataclass(frozen=True, slots=True)
class CudaInfo:
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
    sha256: str

    def __post_init__(self) -> None:
        _check(self.size >= 0, f"file {self.path!r}: negative size")
        _check(bool(_SHA_RE.fullmatch(self.sha256)), f"file {self.path!r}: bad sha256")


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
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        _check(self.format_version == FORMAT_VERSION, "format_version must be 1")
        try:
            datetime.datetime.fromisoformat(self.created_at)
        except ValueError:
            raise ValueError(f"created_at {self.created_at!r} is not an ISO 8601 time") from None
        _check(all(math.isfinite(v) and v >= 0 for v in self.timings.values()),
               "timings must be finite, non-negative seconds")
        paths = [f.path for f in self.files]
        _check(len(paths) == len(set(paths)), "duplicate path in files")

    def to_json(self) -> bytes:
        """Canonical bytes: sorted keys, compact separators, UTF-8, no NaN."""
        return canonical_json(_to_obj(self))

    @classmethod
    def from_json(cls, data: bytes, *, artifact: str = "manifest") -> Manifest:
        """Parse untrusted bytes; any problem raises ArtifactRejected(artifact, reason)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ArtifactRejected(artifact, f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            obj = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                             parse_constant=_no_constants)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ArtifactRejected(artifact, f"manifest is not valid JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise ArtifactRejected(artifact, "manifest is not a JSON object")
        version = obj.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            raise ArtifactRejected(
                artifact, f"unsupported manifest format_version {version!r} (this build reads "
                f"{FORMAT_VERSION})")
        try:
            return typing.cast(Manifest, _from_obj(cls, obj, "manifest"))
        except (TypeError, ValueError) as exc:
            raise ArtifactRejected(artifact, f"invalid manifest: {exc}") from exc


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _to_obj(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_obj(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_to_obj(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _to_obj(v) for k, v in value.items()}
    return value


def _from_obj(tp: Any, value: Any, where: str) -> Any:
    """Convert JSON to ``tp`` with strict types; raise TypeError/ValueError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _from_obj(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        if set(value) != names:
            extra, missing = sorted(set(value) - names), sorted(names - set(value))
            raise ValueError(f"{where}: unknown keys {extra}, missing keys {missing}")
        return tp(**{n: _from_obj(hints[n], value[n], f"{where}.{n}") for n in names})
    if origin is tuple:
        if not isinstance(value, list):
            raise TypeError(f"{where}: expected a list")
        inner = typing.get_args(tp)[0]
        return tuple(_from_obj(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict):
        if not isinstance(value, dict):
            raise TypeError(f"{where}: expected an object")
        inner = typing.get_args(tp)[1]
        return {k: _from_obj(inner, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if type(value) not in (int, float):
            raise TypeError(f"{where}: expected a number")
        return float(value)
    if tp in (str, int, bool):
        if type(value) is not tp:
            raise TypeError(f"{where}: expected {tp.__name__}")
        return value
    raise TypeError(f"{where}: unsupported type {tp!r}")  # pragma: no cover


# --- signature ---------------------------------------------------------------------------------------

def sign(data: bytes, key: bytes) -> str:
    return SIG_PREFIX + hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(data: bytes, sig: str, key: bytes, *, artifact: str = "manifest") -> None:
    """Raise ArtifactRejected(artifact, "bad signature") unless ``sig`` signs ``data``."""
    if not hmac.compare_digest(sign(data, key).encode(), sig.strip().encode("utf-8", "replace")):
        raise ArtifactRejected(artifact, "bad signature")
