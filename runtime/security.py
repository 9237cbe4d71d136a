"""The security fingerprint of a container, and whether a checkpoint may run in another one.

CRIU restores a process with the credentials, capabilities and seccomp filters it was dumped
with, so a restore is only allowed into a container at least as privileged as the source.

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

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import ArtifactRejected

_CAP_RE = re.compile(r"CAP_[A-Z0-9_]+")
_SECCOMP_RE = re.compile(r"unconfined|sha256:[0-9a-f]{64}")
_PERMISSIVE_SECCOMP = {"SCMP_ACT_ALLOW", "SCMP_ACT_LOG"}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


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
    return "sha256:" + hashlib.sha256(json.dumps(seccomp, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
