"""The security fingerprint of a container, and whether a checkpoint may run in another one.

CRIU restores a process with what it was dumped with: credentials, capabilities, seccomp
filters, LSM label, rlimits, oom_score_adj and its mount tree (CRIU 4.2: ``cr-restore.c``
``prepare_creds``/``prepare_rlimits``/``prepare_proc_misc``, ``pie/restorer.c``). A restore is
allowed only where the TARGET's value can be forced on the restored process or the source's
value never exceeds the target's. What is recorded here (the ``security`` record of the signed
manifest) and refused by :func:`check_privilege`; what is forced lives in ``runtime.container.confine``
(oom_score_adj, rlimits, mount flags) and in the CRIU options of :func:`lsm_options`.

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
- LSM: ``apparmor_profile`` (``process.apparmorProfile``; ``""`` for none or ``unconfined``),
  ``selinux_label`` (``process.selinuxLabel``), ``selinux_mount_label`` (``linux.mountLabel``).
  When the node's kernel has the LSM (as CRIU detects it: AppArmor when
  ``/sys/kernel/security/apparmor`` exists, else SELinux when selinuxfs is mounted), the target's
  label is forced with ``--lsm-profile`` / ``--lsm-mount-context``. Refused: any difference when
  the kernel lacks that LSM (neither label means anything there, and pretending would hide a
  changed policy); a source without an AppArmor profile into a confined target (CRIU applies
  ``--lsm-profile`` only to tasks dumped with a profile, so the task would keep CRIU's own,
  unconfined, label); a different SELinux label or mount label where the target has none to
  force; a target mount label where the source's mounts had none (CRIU only rewrites an existing
  ``context=`` option). A confined source into an unconfined AppArmor target keeps its stricter
  profile.
- ``user_namespace``, ``uid_mappings``, ``gid_mappings`` (``linux.namespaces`` of type ``user``,
  ``linux.uidMappings``/``gidMappings``): any difference is refused.
- ``masked_paths`` / ``readonly_paths`` (``linux.maskedPaths``/``readonlyPaths``, normalised,
  sorted): runc makes them mounts, and CRIU restores the source's mount tree, so a path the target
  masks must be masked in the source, and a path the target makes read-only must be read-only or
  masked in the source; otherwise refused. (``runtime.container.confine`` also checks the restored mount
  tree against the target's mounts after CRIU.)
- ``devices``: the device cgroup rules as ``runtime.container.devrules`` parses them (NVIDIA nodes left to
  the GPU compatibility check). Refused when the source allows a device/access the target denies.
  The restored tree runs in the target's cgroups from CRIU's first step, so the kernel applies the
  target's rules to every open, the restore's included.
- ``sysctls`` (``linux.sysctl``, sorted by name): refused on any difference. Pod sysctls are
  namespaced (net, ipc): the restored process joins the TARGET's namespaces and sees the target's
  values, while it may hold what the source's allowed (a socket bound below
  ``ip_unprivileged_port_start``, a ``ping_group_range`` ICMP socket) or rely on a value.
  Kubernetes sets sysctls per pod, so pods of one workload have identical sets.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from runtime.container import oci
from runtime.container.devrules import DeviceRule, excess, parse_rules
from runtime.errors import ArtifactRejected

_CAP_RE = re.compile(r"CAP_[A-Z0-9_]+")
_SECCOMP_RE = re.compile(r"unconfined|sha256:[0-9a-f]{64}")
_LABEL_RE = re.compile(r"[^\x00-\x1f\x7f]*")  # passed to CRIU as one argv word
_SYSCTL_RE = re.compile(r"[a-z0-9_][a-z0-9_.\-/]*", re.IGNORECASE)
_PERMISSIVE_SECCOMP = {"SCMP_ACT_ALLOW", "SCMP_ACT_LOG"}
APPARMOR_SECURITYFS = "/sys/kernel/security/apparmor"
SELINUXFS = "/sys/fs/selinux"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class IdMapping:
    container_id: int
    host_id: int
    size: int

    def __post_init__(self) -> None:
        _check(all(0 <= v < 2**32 for v in (self.container_id, self.host_id, self.size)),
               "id mapping out of range")


@dataclass(frozen=True, slots=True)
class Sysctl:
    name: str
    value: str

    def __post_init__(self) -> None:
        _check(bool(_SYSCTL_RE.fullmatch(self.name)), f"bad sysctl name {self.name!r}")


@dataclass(frozen=True, slots=True)
class SecurityProfile:
    uid: int
    gid: int
    additional_gids: tuple[int, ...]
    capabilities: tuple[str, ...]
    privileged: bool
    seccomp: str
    no_new_privileges: bool
    apparmor_profile: str = ""
    selinux_label: str = ""
    selinux_mount_label: str = ""
    user_namespace: bool = False
    uid_mappings: tuple[IdMapping, ...] = ()
    gid_mappings: tuple[IdMapping, ...] = ()
    masked_paths: tuple[str, ...] = ()
    readonly_paths: tuple[str, ...] = ()
    devices: tuple[DeviceRule, ...] = ()
    sysctls: tuple[Sysctl, ...] = ()

    def __post_init__(self) -> None:
        ids = (self.uid, self.gid, *self.additional_gids)
        _check(all(0 <= i < 2**32 for i in ids), "uid/gid out of range")
        caps = self.capabilities
        _check(all(_CAP_RE.fullmatch(c) for c in caps), "capability names must be CAP_*")
        _check(list(caps) == sorted(set(caps)), "capabilities must be sorted and unique")
        _check(bool(_SECCOMP_RE.fullmatch(self.seccomp)), f"bad seccomp value {self.seccomp!r}")
        for label in (self.apparmor_profile, self.selinux_label, self.selinux_mount_label):
            _check(bool(_LABEL_RE.fullmatch(label)), f"control character in LSM label {label!r}")
        _check(self.apparmor_profile != "unconfined", "an unconfined AppArmor profile is recorded as ''")
        for paths in (self.masked_paths, self.readonly_paths):
            _check(all(p.startswith("/") and os.path.normpath(p) == p for p in paths),
                   "masked/readonly paths must be normalised absolute paths")
            _check(list(paths) == sorted(set(paths)), "masked/readonly paths must be sorted and unique")
        names = [s.name for s in self.sysctls]
        _check(names == sorted(set(names)), "sysctls must be sorted by name and unique")
        _check(self.user_namespace or not (self.uid_mappings or self.gid_mappings),
               "id mappings without a user namespace")

    @classmethod
    def from_oci_spec(cls, spec: oci.Spec, *, label: str = "oci-spec") -> SecurityProfile:
        """Derive the profile from an OCI runtime spec; a malformed spec raises ArtifactRejected."""
        try:
            return _profile_from_spec(spec)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ArtifactRejected(label, f"malformed OCI spec: {exc}") from exc


@dataclass(frozen=True, slots=True)
class LsmSupport:
    """Which LSM the node's kernel enforces, as CRIU sees it (it checks AppArmor first)."""

    apparmor: bool = False
    selinux: bool = False

    @classmethod
    def detect(cls) -> LsmSupport:
        if os.path.exists(APPARMOR_SECURITYFS):
            return cls(apparmor=True)
        return cls(selinux=os.path.exists(os.path.join(SELINUXFS, "enforce")))


@dataclass(frozen=True, slots=True)
class LsmOptions:
    """What CRIU restore is told so that the restored tree carries the TARGET's labels."""

    profile: str | None = None  # --lsm-profile value, "apparmor:<p>" or "selinux:<label>"
    mount_context: str | None = None  # --lsm-mount-context value


def lsm_options(target: SecurityProfile, lsm: LsmSupport) -> LsmOptions:
    """Force the target's labels wherever the kernel has the LSM and the target names one."""
    if lsm.apparmor:
        return LsmOptions(profile=f"apparmor:{target.apparmor_profile}" if target.apparmor_profile else None)
    if lsm.selinux:
        return LsmOptions(profile=f"selinux:{target.selinux_label}" if target.selinux_label else None,
                          mount_context=target.selinux_mount_label or None)
    return LsmOptions()


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise TypeError(f"{where} must be a list of integers")
    return value


def _str(value: Any, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a string")
    return value


def _paths(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) and p.startswith("/") for p in value):
        raise TypeError(f"{where} must be a list of absolute paths")
    return tuple(sorted({os.path.normpath(p) for p in value}))


def _mappings(value: Any, where: str) -> tuple[IdMapping, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise TypeError(f"{where} must be a list of objects")
    out = []
    for m in value:
        ids = (m.get("containerID"), m.get("hostID"), m.get("size"))
        if not all(type(v) is int for v in ids):
            raise TypeError(f"{where}: containerID, hostID and size must be integers")
        out.append(IdMapping(*ids))
    return tuple(out)


def _sysctls(value: Any) -> tuple[Sysctl, ...]:
    if value is None:
        return ()
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise TypeError("linux.sysctl must map strings to strings")
    return tuple(Sysctl(k, v) for k, v in sorted(value.items()))


def _user_namespace(namespaces: Any) -> bool:
    if namespaces is None:
        return False
    if not isinstance(namespaces, list) or not all(isinstance(n, dict) for n in namespaces):
        raise TypeError("linux.namespaces must be a list of objects")
    return any(n.get("type") == "user" for n in namespaces)


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


def _profile_from_spec(spec: oci.Spec) -> SecurityProfile:
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
    resources = linux.get("resources") or {}
    devices = resources.get("devices")
    privileged = ("CAP_SYS_ADMIN" in bounding and seccomp == "unconfined"
                  and _allows_all_devices(devices))
    apparmor = _str(process.get("apparmorProfile"), "process.apparmorProfile")
    userns = _user_namespace(linux.get("namespaces"))
    return SecurityProfile(
        uid=uid, gid=gid, additional_gids=tuple(sorted(set(gids))),
        capabilities=tuple(sorted(caps)), privileged=privileged, seccomp=seccomp,
        no_new_privileges=nnp,
        apparmor_profile="" if apparmor == "unconfined" else apparmor,
        selinux_label=_str(process.get("selinuxLabel"), "process.selinuxLabel"),
        selinux_mount_label=_str(linux.get("mountLabel"), "linux.mountLabel"),
        user_namespace=userns,
        uid_mappings=_mappings(linux.get("uidMappings"), "linux.uidMappings") if userns else (),
        gid_mappings=_mappings(linux.get("gidMappings"), "linux.gidMappings") if userns else (),
        masked_paths=_paths(linux.get("maskedPaths"), "linux.maskedPaths"),
        readonly_paths=_paths(linux.get("readonlyPaths"), "linux.readonlyPaths"),
        devices=parse_rules(devices, linux.get("devices")),
        sysctls=_sysctls(linux.get("sysctl")))


def check_privilege(source: SecurityProfile, target: SecurityProfile, *, lsm: LsmSupport) -> list[str]:
    """Every way a process checkpointed under ``source`` would exceed ``target``'s privilege
    once restored on a node whose kernel enforces ``lsm``."""
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
    reasons += _lsm_reasons(source, target, lsm)
    if (source.user_namespace, source.uid_mappings, source.gid_mappings) != (
            target.user_namespace, target.uid_mappings, target.gid_mappings):
        reasons.append("user namespaces differ (source {}, target {})".format(
            _userns_text(source), _userns_text(target)))
    unmasked = sorted(set(target.masked_paths) - set(source.masked_paths))
    if unmasked:
        reasons.append(f"target masks paths the source did not: {', '.join(unmasked)}")
    writable = sorted(set(target.readonly_paths) - set(source.readonly_paths) - set(source.masked_paths))
    if writable:
        reasons.append(f"target makes paths read-only that the source did not: {', '.join(writable)}")
    devices = excess(source.devices, target.devices)
    if devices:
        reasons.append(f"source's device cgroup allows what the target's denies: {', '.join(devices)}")
    if source.sysctls != target.sysctls:
        src, tgt = dict((s.name, s.value) for s in source.sysctls), dict((s.name, s.value) for s in target.sysctls)
        names = sorted(k for k in set(src) | set(tgt) if src.get(k) != tgt.get(k))
        reasons.append(f"sysctls differ: {', '.join(names)}")
    return reasons


def _userns_text(p: SecurityProfile) -> str:
    if not p.user_namespace:
        return "none"
    return "uid " + ",".join(f"{m.container_id}:{m.host_id}:{m.size}" for m in p.uid_mappings) + \
        " gid " + ",".join(f"{m.container_id}:{m.host_id}:{m.size}" for m in p.gid_mappings)


def _lsm_reasons(source: SecurityProfile, target: SecurityProfile, lsm: LsmSupport) -> list[str]:
    reasons = []
    aa_src, aa_tgt = source.apparmor_profile, target.apparmor_profile
    if aa_src != aa_tgt:
        named = f"AppArmor profiles differ (source {aa_src or 'unconfined'!r}, target {aa_tgt or 'unconfined'!r})"
        if not lsm.apparmor:
            reasons.append(f"{named} and this node's kernel has no AppArmor to enforce them")
        elif not aa_src:
            reasons.append(f"{named}: CRIU cannot confine a task dumped unconfined")
        # else: a confined target is forced with --lsm-profile; an unconfined target keeps
        # the source's (stricter) profile.
    for what, src, tgt in (("SELinux labels", source.selinux_label, target.selinux_label),
                           ("SELinux mount labels", source.selinux_mount_label, target.selinux_mount_label)):
        if src == tgt:
            continue
        named = f"{what} differ (source {src or 'none'!r}, target {tgt or 'none'!r})"
        if not lsm.selinux:
            reasons.append(f"{named} and this node's kernel has no SELinux (as CRIU sees it) to enforce them")
        elif not tgt:
            reasons.append(f"{named}: the target has no label to force")
        elif not src and what == "SELinux mount labels":
            reasons.append(f"{named}: CRIU only rewrites a context= option the source's mounts have")
    return reasons
