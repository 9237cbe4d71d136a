"""Pod annotations -> what Rekindle should do with one container. Pure: no I/O.

``decide(annotations, container_name)`` returns ``None`` (not ours), an ``Intent``, or raises
``AnnotationError`` naming the key and the reason. A bad annotation affects only its own pod:
the caller logs it and leaves the container alone (cold start).

Keys (pod annotations, documented in the README):
  rekindle.dev/checkpoint       NAME   this container is a checkpoint source
  rekindle.dev/restore          NAME   start this container from artifact NAME
  rekindle.dev/container        CTR    which container the keys apply to
  rekindle.dev/ready-probe      file | http://[host]:PORT[/path] | tcp://[host]:PORT
                                (host: an IP address or localhost; default 127.0.0.1)
  rekindle.dev/after-checkpoint keep-running | exit
  rekindle.dev/restore-timeout  seconds (1..86400)
  rekindle.dev/max-layer-size   bytes (or N Ki/Mi/Gi/Ti), at most the node's --max-layer-bytes:
                                the cap on this source's captured writable layer
  rekindle.dev/overwrite        true | false (default): checkpoint even when the artifact exists
  rekindle.dev/prewarm          true | false (default): every node writes its cache entry of each
                                version as it is published (recorded in the signed manifest)
  rekindle.dev/map-ranges       driver | all | none (default: the node's cache.mapRanges): what a
                                restore from a node's cache maps of this source's memory
                                (recorded in the signed manifest; all: its large private ranges
                                read cached bytes back after MADV_DONTNEED, not zeros)
  rekindle.dev/on-restore-failure cold-start (default) | fail: what a failed restore does; fail:
                                the container exits with the reason (the init's status 75) and
                                its original command never runs; a restarted container tries the
                                restore again (restore pods only)
  rekindle.dev/before-checkpoint http://[host]:PORT[/path][?query]: POSTed in the pod before the
                                checkpoint (an engine's sleep); not 2xx in time: no checkpoint
  rekindle.dev/after-restore    http://[host]:PORT[/path][?query]: POSTed in the pod once the
                                restored process runs (its wake-up; not 2xx in time: a failed
                                restore), and in a source put to sleep once its checkpoint ends
  rekindle.dev/before-checkpoint-timeout, rekindle.dev/after-restore-timeout
                                seconds (1..3600, default 120) for each call, all of it
Unknown ``rekindle.dev/`` keys are errors (typos must not silently disable a restore).

Which container: ``rekindle.dev/container``, else kubectl's ``kubectl.kubernetes.io/default-container``
(which Istio's injector sets to the application container), names the one container the keys
apply to. When neither does, every container gets an ``Intent`` with ``named=False`` and the
caller narrows it down with what NRI cannot tell a pure function: a restore goes only into the
container named like the artifact's source container, a checkpoint is taken only when the pod
runs no other container (``jobs``/``agent``).
Numbers are ASCII decimal digits only: ``str.isdigit`` and ``int`` also take '²', '١٢', ' 12',
'1_0' and raise ValueError past 4300 digits, none of which may reach a handler uncaught.
Probe hosts are addresses, never names: resolving a name could block without a deadline.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

from runtime import manifest, names
from runtime.errors import AnnotationError
from runtime.pod import hooks

PREFIX = "rekindle.dev/"
CHECKPOINT = PREFIX + "checkpoint"
RESTORE = PREFIX + "restore"
CONTAINER = PREFIX + "container"
READY_PROBE = PREFIX + "ready-probe"
AFTER_CHECKPOINT = PREFIX + "after-checkpoint"
RESTORE_TIMEOUT = PREFIX + "restore-timeout"
OVERWRITE = PREFIX + "overwrite"
MAX_LAYER_SIZE = PREFIX + "max-layer-size"
ON_RESTORE_FAILURE = PREFIX + "on-restore-failure"
PREWARM = PREFIX + "prewarm"
MAP_RANGES = PREFIX + "map-ranges"
MAP_RANGES_VALUES = tuple(v for v in manifest.MAP_RANGES if v)  # what the manifest records; "" is the default
BEFORE_CHECKPOINT = PREFIX + "before-checkpoint"
AFTER_RESTORE = PREFIX + "after-restore"
HOOK_TIMEOUT = "-timeout"  # BEFORE_CHECKPOINT or AFTER_RESTORE + this: that call's deadline
KNOWN_KEYS = {CHECKPOINT, RESTORE, CONTAINER, READY_PROBE, AFTER_CHECKPOINT, RESTORE_TIMEOUT, OVERWRITE,
              MAX_LAYER_SIZE, ON_RESTORE_FAILURE, PREWARM, MAP_RANGES, BEFORE_CHECKPOINT, BEFORE_CHECKPOINT + HOOK_TIMEOUT,
              AFTER_RESTORE, AFTER_RESTORE + HOOK_TIMEOUT}
SOURCE_ONLY_KEYS = (READY_PROBE, AFTER_CHECKPOINT, OVERWRITE, MAX_LAYER_SIZE, PREWARM, MAP_RANGES, BEFORE_CHECKPOINT,
                    BEFORE_CHECKPOINT + HOOK_TIMEOUT)
DEFAULT_LAYER_CAP = 8 << 30  # the node's cap on a writable layer in an artifact (--max-layer-bytes)
_UNITS = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
# kubectl's default container of a pod (kubectl logs/exec); Istio's injector sets it too.
DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"

DEFAULT_RESTORE_TIMEOUT = 1800
MAX_RESTORE_TIMEOUT = 86400



class Role(Enum):
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"


class AfterCheckpoint(Enum):
    KEEP_RUNNING = "keep-running"
    EXIT = "exit"


class OnRestoreFailure(Enum):
    COLD_START = "cold-start"  # the init runs the original command (fail open, once)
    FAIL = "fail"              # the init exits with the reason; the original command never runs


class ProbeKind(Enum):
    FILE = "file"
    HTTP = "http"
    TCP = "tcp"


@dataclass(frozen=True, slots=True)
class ReadyProbe:
    kind: ProbeKind
    host: str = "127.0.0.1"
    port: int = 0
    path: str = "/"

    def __str__(self) -> str:
        if self.kind is ProbeKind.FILE:
            return "file"
        suffix = self.path if self.kind is ProbeKind.HTTP else ""
        return f"{self.kind.value}://{self.host}:{self.port}{suffix}"


@dataclass(frozen=True, slots=True)
class Intent:
    role: Role
    artifact: str
    ready_probe: ReadyProbe = ReadyProbe(ProbeKind.FILE)
    after_checkpoint: AfterCheckpoint = AfterCheckpoint.KEEP_RUNNING
    restore_timeout: int = DEFAULT_RESTORE_TIMEOUT
    overwrite: bool = False  # checkpoint even if the artifact exists (rekindle.dev/overwrite)
    max_layer_bytes: int = DEFAULT_LAYER_CAP  # the writable layer's cap for this source
    named: bool = False      # an annotation named this container (else: one of possibly many)
    on_failure: OnRestoreFailure = OnRestoreFailure.COLD_START  # rekindle.dev/on-restore-failure
    prewarm: bool = False  # nodes warm their cache with each published version (rekindle.dev/prewarm)
    map_ranges: str = ""  # what restores from a node's cache map (rekindle.dev/map-ranges); "": the node's
    before_checkpoint: hooks.Call | None = None  # rekindle.dev/before-checkpoint (an engine's sleep)
    after_restore: hooks.Call | None = None      # rekindle.dev/after-restore (its wake-up)

    @property
    def fails_closed(self) -> bool:
        return self.role is Role.RESTORE and self.on_failure is OnRestoreFailure.FAIL


MAX_DECIMAL_DIGITS = 18


def parse_decimal(value: str) -> int | None:
    """The value of a plain ASCII decimal number (no sign, space, '_' or other digits), or None."""
    if not 0 < len(value) <= MAX_DECIMAL_DIGITS or not value.isascii() or not value.isdigit():
        return None
    return int(value)


def parse_size(value: str) -> int | None:
    """Bytes from ``N`` or ``N`` + Ki/Mi/Gi/Ti (ASCII digits only), or None."""
    unit = value[-2:] if value[-2:] in _UNITS else ""
    number = parse_decimal(value[:len(value) - len(unit)])
    return None if number is None else number * _UNITS[unit]


def valid_artifact_name(name: str) -> bool:
    return names.is_artifact_name(name)


def valid_dns_label(value: str) -> bool:
    return names.is_dns_label(value)


def parse_probe(value: str) -> ReadyProbe:
    if value == "file":
        return ReadyProbe(ProbeKind.FILE)
    try:
        parts = urlsplit(value)
    except ValueError as exc:  # e.g. an unclosed '[' in the host
        raise AnnotationError(READY_PROBE, f"not a URL: {exc}") from None
    if parts.scheme not in ("http", "tcp"):
        raise AnnotationError(READY_PROBE, f"scheme must be file, http or tcp, got {value!r}")
    hostport = parts.netloc.rpartition("@")[2]
    raw_port = hostport.rpartition(":")[2] if ":" in hostport and not hostport.endswith("]") else ""
    port = parse_decimal(raw_port)
    if port is None or not 1 <= port <= 65535:
        raise AnnotationError(READY_PROBE, f"needs a port in 1..65535: {value!r}")
    host = _probe_host(hostport[: -len(raw_port) - 1])
    if parts.scheme == "tcp" and parts.path not in ("", "/"):
        raise AnnotationError(READY_PROBE, "a tcp probe takes no path")
    if parts.query or parts.fragment or parts.username:
        raise AnnotationError(READY_PROBE, "no query, fragment or credentials allowed")
    return ReadyProbe(ProbeKind(parts.scheme), host, port, parts.path or "/")


def parse_hook(key: str, value: str, timeout_raw: str | None) -> hooks.Call:
    """``http://[host]:PORT[/path][?query]`` with the ready probe's rules for the host (an
    address, never a name), and its deadline in whole seconds."""
    try:
        parts = urlsplit(value)
    except ValueError as exc:
        raise AnnotationError(key, f"not a URL: {exc}") from None
    if parts.scheme != "http":
        raise AnnotationError(key, f"must be an http:// URL, got {value!r}")
    hostport = parts.netloc
    raw_port = hostport.rpartition(":")[2] if ":" in hostport and not hostport.endswith("]") else ""
    port = parse_decimal(raw_port)
    if port is None or not 1 <= port <= 65535:
        raise AnnotationError(key, f"needs a port in 1..65535: {value!r}")
    if parts.fragment or "@" in hostport:
        raise AnnotationError(key, "no fragment or credentials allowed")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not target.isascii() or any(c.isspace() or not c.isprintable() for c in target):
        raise AnnotationError(key, f"the path and query must be printable ASCII without spaces: {value!r}")
    timeout = hooks.DEFAULT_TIMEOUT
    if timeout_raw is not None:
        parsed = parse_decimal(timeout_raw)
        if parsed is None or not 1 <= parsed <= hooks.MAX_TIMEOUT:
            raise AnnotationError(key + HOOK_TIMEOUT,
                                  f"must be whole seconds in 1..{hooks.MAX_TIMEOUT}, got {timeout_raw!r}")
        timeout = parsed
    return hooks.Call(_probe_host(hostport[: -len(raw_port) - 1], key), port, target, timeout)


def _hook(ours: dict[str, str], key: str) -> hooks.Call | None:
    if key not in ours:
        if key + HOOK_TIMEOUT in ours:
            raise AnnotationError(key + HOOK_TIMEOUT, f"needs {key} beside it")
        return None
    return parse_hook(key, ours[key], ours.get(key + HOOK_TIMEOUT))


def _probe_host(raw: str, key: str = READY_PROBE) -> str:
    """An IP address (IPv6 without its brackets); empty and ``localhost`` mean 127.0.0.1."""
    if raw.lower() in ("", "localhost"):
        return "127.0.0.1"
    literal = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    try:
        if not literal.isascii():
            raise ValueError(literal)
        return str(ipaddress.ip_address(literal))
    except ValueError:
        raise AnnotationError(key, f"host must be an IP address or localhost, got {raw!r}") from None


def decide(annotations: dict[str, str], container_name: str,
           default_timeout: int = DEFAULT_RESTORE_TIMEOUT, layer_cap: int = DEFAULT_LAYER_CAP) -> Intent | None:
    """The intent for ``container_name`` from its pod's annotations, if any."""
    ours = {k: v for k, v in annotations.items() if k.startswith(PREFIX)}
    if not ours:
        return None
    unknown = sorted(set(ours) - KNOWN_KEYS)
    if unknown:
        raise AnnotationError(unknown[0], f"unknown key (known: {', '.join(sorted(KNOWN_KEYS))})")
    target_key = CONTAINER if CONTAINER in ours else DEFAULT_CONTAINER if DEFAULT_CONTAINER in annotations else None
    if target_key is not None:
        target = annotations[target_key]
        if not valid_dns_label(target):
            raise AnnotationError(target_key, f"not a container name: {target!r}")
        if target != container_name:
            return None
    if CHECKPOINT in ours and RESTORE in ours:
        raise AnnotationError(RESTORE, f"a pod cannot be both {CHECKPOINT} and {RESTORE}")
    if CHECKPOINT in ours:
        role, key = Role.CHECKPOINT, CHECKPOINT
    elif RESTORE in ours:
        role, key = Role.RESTORE, RESTORE
    else:
        raise AnnotationError(sorted(ours)[0], f"needs {CHECKPOINT} or {RESTORE} beside it")
    name = ours[key]
    if not valid_artifact_name(name):
        raise AnnotationError(key, f"artifact name must be 1-63 of [a-z0-9.-], got {name!r}")

    probe = parse_probe(ours.get(READY_PROBE, "file"))
    after_raw = ours.get(AFTER_CHECKPOINT, AfterCheckpoint.KEEP_RUNNING.value)
    try:
        after = AfterCheckpoint(after_raw)
    except ValueError:
        raise AnnotationError(AFTER_CHECKPOINT, f"must be keep-running or exit, got {after_raw!r}") from None
    timeout_raw = ours.get(RESTORE_TIMEOUT, str(default_timeout))
    timeout = parse_decimal(timeout_raw)
    if timeout is None or not 1 <= timeout <= MAX_RESTORE_TIMEOUT:
        raise AnnotationError(RESTORE_TIMEOUT, f"must be whole seconds in 1..{MAX_RESTORE_TIMEOUT}, got {timeout_raw!r}")
    overwrite_raw = ours.get(OVERWRITE, "false")
    if overwrite_raw not in ("true", "false"):
        raise AnnotationError(OVERWRITE, f"must be true or false, got {overwrite_raw!r}")
    prewarm_raw = ours.get(PREWARM, "false")
    if prewarm_raw not in ("true", "false"):
        raise AnnotationError(PREWARM, f"must be true or false, got {prewarm_raw!r}")
    map_ranges = ours.get(MAP_RANGES, "")
    if MAP_RANGES in ours and map_ranges not in MAP_RANGES_VALUES:
        raise AnnotationError(MAP_RANGES, f"must be one of {', '.join(MAP_RANGES_VALUES)}, got {map_ranges!r}")
    layer = layer_cap
    if MAX_LAYER_SIZE in ours:
        asked = parse_size(ours[MAX_LAYER_SIZE])
        if asked is None or asked < 1:
            raise AnnotationError(MAX_LAYER_SIZE, f"must be bytes, or a number with Ki, Mi, Gi or Ti, got "
                                  f"{ours[MAX_LAYER_SIZE]!r}")
        if asked > layer_cap:
            raise AnnotationError(MAX_LAYER_SIZE, f"{asked} bytes exceeds this node's cap of {layer_cap}")
        layer = asked
    on_failure_raw = ours.get(ON_RESTORE_FAILURE, OnRestoreFailure.COLD_START.value)
    try:
        on_failure = OnRestoreFailure(on_failure_raw)
    except ValueError:
        raise AnnotationError(ON_RESTORE_FAILURE, f"must be cold-start or fail, got {on_failure_raw!r}") from None
    before = _hook(ours, BEFORE_CHECKPOINT)
    after_restore = _hook(ours, AFTER_RESTORE)
    if role is Role.RESTORE:
        for source_key in SOURCE_ONLY_KEYS:
            if source_key in ours:
                raise AnnotationError(source_key, "applies to checkpoint sources only")
    elif ON_RESTORE_FAILURE in ours:
        raise AnnotationError(ON_RESTORE_FAILURE, "applies to restore pods only")
    return Intent(role, name, probe, after, timeout, overwrite=overwrite_raw == "true",
                  named=target_key is not None, max_layer_bytes=layer, on_failure=on_failure,
                  prewarm=prewarm_raw == "true", map_ranges=map_ranges, before_checkpoint=before,
                  after_restore=after_restore)


def role_hint(annotations: dict[str, str]) -> Role | None:
    """The role a pod's annotations ask for, even when they are malformed (for reporting)."""
    if CHECKPOINT in annotations:
        return Role.CHECKPOINT
    if RESTORE in annotations:
        return Role.RESTORE
    return None
