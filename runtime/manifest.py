"""The artifact manifest: schema, canonical bytes, signature, privilege and compatibility checks.

Contract:

- :class:`Manifest` (``format_version`` 1) mirrors docs/design.md "Artifact". Every record is a
  frozen dataclass validated on construction. :meth:`Manifest.to_json` gives canonical bytes
  (sorted keys, compact separators, UTF-8); :meth:`Manifest.from_json` treats its input as
  untrusted: exact key sets, strict JSON types (a bool is not an int), no duplicate keys, no
  NaN, a size cap, and an unknown ``format_version`` is refused by name. Every parse problem
  raises :class:`ArtifactRejected`.
- :func:`sign` / :func:`verify`: ``"hmac-sha256:<hex>"`` over the exact manifest bytes.
- :func:`load_or_create_key`: 32 random bytes, mode 0600, created atomically (link of a fully
  written temp file), refused when group/world accessible, not ours, or of the wrong length.
- :meth:`SecurityProfile.from_oci_spec` derives the security fingerprint of a container;
  :func:`check_privilege` lists every way a source exceeds a target.
- :func:`check_compatibility` lists every reason an artifact cannot run on a node.

Security rules (documented here because the checks depend on them):

- ``capabilities`` is the sorted union of the bounding, effective and permitted sets (ambient
  capabilities are a subset of permitted by kernel rule).
- ``seccomp`` is ``"unconfined"`` when ``linux.seccomp`` is absent or restricts nothing (default
  action and every rule's action is ALLOW or LOG); otherwise ``"sha256:<hex>"`` of the canonical
  JSON of ``linux.seccomp``. The OCI spec does not say which Kubernetes profile produced a filter,
  so profiles are compared by content. CRIU restores the source's filters, so a confined target
  accepts only the identical profile.
- ``privileged`` is true when the bounding set holds CAP_SYS_ADMIN, there is no effective seccomp
  filter, and the devices cgroup allows every device (the last rule matching all devices is an
  ``allow`` of ``rwm``), which is what containerd sets for a privileged container.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import stat
import subprocess
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import ArtifactRejected, ConfigError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
KEY_BYTES = 32
SIG_PREFIX = "hmac-sha256:"

_CAP_RE = re.compile(r"CAP_[A-Z0-9_]+")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_SECCOMP_RE = re.compile(r"unconfined|sha256:[0-9a-f]{64}")
_PERMISSIVE_SECCOMP = {"SCMP_ACT_ALLOW", "SCMP_ACT_LOG"}


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
class SecurityProfile:
    uid: int
    gid: int
    additional_gids: tuple[int, ...]
    capabilities: tuple[str, ...]
    privileged: bool
    seccomp: str
    no_new_privileges: bool

    def __post_init__(self) -> None:
        ids = (self.uid, self.gid, *self.additional_gids)
        _check(all(0 <= i < 2**32 for i in ids), "uid/gid out of range")
        caps = self.capabilities
        _check(all(_CAP_RE.fullmatch(c) for c in caps), "capability names must be CAP_*")
        _check(list(caps) == sorted(set(caps)), "capabilities must be sorted and unique")
        _check(bool(_SECCOMP_RE.fullmatch(self.seccomp)), f"bad seccomp value {self.seccomp!r}")

    @classmethod
    def from_oci_spec(cls, spec: Mapping[str, Any], *, label: str = "oci-spec") -> SecurityProfile:
        """Derive the profile from an OCI runtime spec; a malformed spec raises ArtifactRejected."""
        try:
            return _profile_from_spec(spec)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ArtifactRejected(label, f"malformed OCI spec: {exc}") from exc


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


# --- signature and key -------------------------------------------------------------------------

def sign(data: bytes, key: bytes) -> str:
    return SIG_PREFIX + hmac.new(key, data, hashlib.sha256).hexdigest()


def verify(data: bytes, sig: str, key: bytes, *, artifact: str = "manifest") -> None:
    """Raise ArtifactRejected(artifact, "bad signature") unless ``sig`` signs ``data``."""
    if not hmac.compare_digest(sign(data, key).encode(), sig.strip().encode("utf-8", "replace")):
        raise ArtifactRejected(artifact, "bad signature")


def load_or_create_key(path: str) -> bytes:
    """Return the HMAC key at ``path``, creating it (0600, 32 random bytes) when absent."""
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, secrets.token_bytes(KEY_BYTES))
        os.fsync(fd)
        os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a key another process created meanwhile
            log.info("created HMAC key %s", path)
        except FileExistsError:
            pass
    finally:
        os.unlink(tmp)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return _read_key(path)


def _read_key(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ConfigError(f"HMAC key {path}: cannot open: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"HMAC key {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"HMAC key {path}: mode {stat.S_IMODE(st.st_mode):o} is group/"
                              "world accessible (want 0600)")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"HMAC key {path}: owned by uid {st.st_uid}, not {os.geteuid()}")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise ConfigError(f"HMAC key {path}: {len(data)} bytes, want {KEY_BYTES}")
    return data


# --- security profile --------------------------------------------------------------------------

def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise TypeError(f"{where} must be a list of integers")
    return value


def _seccomp_value(seccomp: Any) -> str:
    if seccomp is None:
        return "unconfined"
    if not isinstance(seccomp, dict):
        raise TypeError("linux.seccomp must be an object")
    rules = seccomp.get("syscalls") or []
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise TypeError("linux.seccomp.syscalls must be a list of objects")
    actions = {seccomp.get("defaultAction")} | {rule.get("action") for rule in rules}
    if actions <= _PERMISSIVE_SECCOMP:
        return "unconfined"
    return "sha256:" + hashlib.sha256(canonical_json(seccomp)).hexdigest()


def _allows_all_devices(rules: Any) -> bool:
    """True when, after every rule in order, all devices are allowed for rwm."""
    if not isinstance(rules, list):
        return False
    verdict = False
    for rule in rules:
        if not isinstance(rule, dict):
            raise TypeError("linux.resources.devices entries must be objects")
        every = (rule.get("type") in (None, "a") and rule.get("major") in (None, -1)
                 and rule.get("minor") in (None, -1))
        allow = rule.get("allow") is True
        if every:
            verdict = allow and set("rwm") <= set(rule.get("access") or "rwm")
        elif not allow:
            verdict = False  # some devices denied after an allow-all
    return verdict


def _profile_from_spec(spec: Mapping[str, Any]) -> SecurityProfile:
    process = spec.get("process") or {}
    user = process.get("user") or {}
    uid, gid = user.get("uid", 0), user.get("gid", 0)
    if type(uid) is not int or type(gid) is not int:
        raise TypeError("process.user.uid/gid must be integers")
    gids = _int_list(user.get("additionalGids") or [], "process.user.additionalGids")
    caps_obj = process.get("capabilities") or {}
    caps: set[str] = set()
    for key in ("bounding", "effective", "permitted"):
        names = caps_obj.get(key) or []
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"process.capabilities.{key} must be a list of strings")
        caps.update(names)
    bounding = set(caps_obj.get("bounding") or [])
    nnp = process.get("noNewPrivileges", False)
    if type(nnp) is not bool:
        raise TypeError("process.noNewPrivileges must be a boolean")
    linux = spec.get("linux") or {}
    seccomp = _seccomp_value(linux.get("seccomp"))
    devices = (linux.get("resources") or {}).get("devices")
    privileged = ("CAP_SYS_ADMIN" in bounding and seccomp == "unconfined"
                  and _allows_all_devices(devices))
    return SecurityProfile(uid=uid, gid=gid, additional_gids=tuple(sorted(set(gids))),
                           capabilities=tuple(sorted(caps)), privileged=privileged,
                           seccomp=seccomp, no_new_privileges=nnp)


def check_privilege(source: SecurityProfile, target: SecurityProfile) -> list[str]:
    """Every way a process checkpointed under ``source`` would exceed ``target``'s privilege."""
    reasons: list[str] = []
    if source.uid != target.uid:
        who = "root (uid 0)" if source.uid == 0 else f"uid {source.uid}"
        reasons.append(f"source runs as {who}, target as uid {target.uid}")
    if source.gid != target.gid:
        reasons.append(f"source gid {source.gid} differs from target gid {target.gid}")
    extra_groups = sorted(set(source.additional_gids) - set(target.additional_gids) - {target.gid})
    if extra_groups:
        reasons.append(f"source has groups the target lacks: {extra_groups}")
    extra_caps = sorted(set(source.capabilities) - set(target.capabilities))
    if extra_caps:
        reasons.append(f"source has capabilities the target lacks: {', '.join(extra_caps)}")
    if source.privileged and not target.privileged:
        reasons.append("source is privileged, target is not")
    if target.seccomp != "unconfined" and source.seccomp != target.seccomp:
        reasons.append("source has no seccomp filter, target is confined"
                       if source.seccomp == "unconfined" else "seccomp profiles differ")
    if target.no_new_privileges and not source.no_new_privileges:
        reasons.append("target sets no_new_privileges, source does not")
    return reasons


# --- node facts and compatibility --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CudaFacts:
    """The CUDA driver and the GPUs visible to the target container, in device order."""

    driver_version: str
    gpus: tuple[Gpu, ...]


@dataclass(frozen=True, slots=True)
class NodeFacts:
    hostname: str
    kernel: str
    arch: str
    criu_version: str | None
    cuda: CudaFacts | None

    @classmethod
    def detect(cls, criu_version: str | None = None, cuda: CudaFacts | None = None) -> NodeFacts:
        """Facts of this node. ``criu_version`` None runs ``criu --version`` (None on failure);
        ``cuda`` is passed in by the caller (the cuda module owns libcuda)."""
        uts = os.uname()
        return cls(hostname=uts.nodename, kernel=uts.release, arch=uts.machine,
                   criu_version=criu_version or _criu_version(), cuda=cuda)


def _criu_version() -> str | None:
    try:
        out = subprocess.run(["criu", "--version"], capture_output=True, text=True, timeout=5,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("criu --version failed: %s", exc)
        return None
    match = re.search(r"Version:\s*(\S+)", out)
    return match.group(1) if match else None


def _version_tuple(text: str) -> tuple[int, ...] | None:
    match = re.match(r"(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def _major_minor(kernel: str) -> tuple[int, ...] | str:
    version = _version_tuple(kernel)
    return version[:2] if version else kernel


def check_compatibility(manifest: Manifest, facts: NodeFacts, *, image: str, image_ref: str,
                        strict_kernel: bool = False) -> list[str]:
    """Every reason ``manifest`` cannot be restored on ``facts`` into a container of
    ``image``/``image_ref``. A kernel major.minor difference is logged as a warning and listed
    only with ``strict_kernel``; every other difference is listed."""
    reasons: list[str] = []
    src = manifest.node
    if src.arch != facts.arch:
        reasons.append(f"architecture differs: artifact {src.arch}, node {facts.arch}")
    if _major_minor(src.kernel) != _major_minor(facts.kernel):
        message = f"kernel differs: artifact {src.kernel}, node {facts.kernel}"
        if strict_kernel:
            reasons.append(message)
        else:
            log.warning("artifact %s/%s: %s", manifest.namespace, manifest.name, message)
    want = _version_tuple(manifest.criu.version)
    have = _version_tuple(facts.criu_version or "")
    if have is None or want is None:
        reasons.append(f"CRIU version unknown: artifact {manifest.criu.version!r}, "
                       f"node {facts.criu_version!r}")
    elif have < want:
        reasons.append(f"CRIU {facts.criu_version} is older than the artifact's "
                       f"{manifest.criu.version}")
    if manifest.source.image != image:
        reasons.append(f"image differs: artifact {manifest.source.image}, target {image}")
    if manifest.source.image_ref != image_ref:
        reasons.append(f"image digest differs: artifact {manifest.source.image_ref}, "
                       f"target {image_ref or 'unknown'}")
    cuda = manifest.cuda
    if cuda is not None:
        if facts.cuda is None:
            reasons.append("artifact uses CUDA, node has no CUDA driver")
        else:
            if cuda.driver_version != facts.cuda.driver_version:
                reasons.append(f"CUDA driver differs: artifact {cuda.driver_version}, "
                               f"node {facts.cuda.driver_version}")
            if len(cuda.gpus) != len(facts.cuda.gpus):
                reasons.append(f"GPU count differs: artifact {len(cuda.gpus)}, "
                               f"target {len(facts.cuda.gpus)}")
            for i, (a, b) in enumerate(zip(cuda.gpus, facts.cuda.gpus)):
                if a.name != b.name:
                    reasons.append(f"GPU {i} model differs: artifact {a.name}, target {b.name}")
    return reasons
