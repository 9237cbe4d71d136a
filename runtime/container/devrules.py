"""Device cgroup rules (OCI ``linux.resources.devices``): parse them, and find what one list
allows that another does not.

Contract:

- :func:`parse_rules` turns the spec's list into :class:`DeviceRule` records (``major``/``minor``
  ``-1`` = any, ``type`` ``"a"`` = any, ``access`` a subset of ``rwm`` in that order, absent =
  ``rwm``), leaving out the rules for NVIDIA device nodes: char major 195 (GPUs, nvidiactl,
  nvidia-modeset) and the ``/dev/nvidia*`` nodes the spec lists in ``linux.devices`` (nvidia-uvm's
  major is assigned at module load). A restore remaps GPUs by UUID, so those are compared by the
  GPU compatibility check instead; the restored process is in the target's device cgroup in any
  case, so a GPU the target was not given cannot be opened.
- Semantics, as runc applies the list: every device starts denied; rules apply in order; for each
  access bit the last rule that matches the device and holds that bit decides.
- :func:`excess` lists, for representative devices, what ``source`` allows and ``target`` denies.
  The verdict only changes at majors/minors some rule names, so one device per named major/minor
  plus one unnamed ("other") covers every device exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NVIDIA_MAJOR = 195
_OTHER = -2  # a major/minor no rule names
_TYPES = ("c", "b")
_ACCESS = "rwm"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True, slots=True)
class DeviceRule:
    allow: bool
    type: str  # "a" (any), "c" or "b"
    major: int  # -1: any
    minor: int  # -1: any
    access: str  # subset of "rwm", in that order

    def __post_init__(self) -> None:
        _check(self.type in ("a", "c", "b"), f"device rule type {self.type!r}")
        _check(self.major >= -1 and self.minor >= -1, "device rule major/minor below -1")
        _check(bool(self.access) and self.access == "".join(c for c in _ACCESS if c in self.access),
               f"device rule access {self.access!r}")

    def matches(self, typ: str, major: int, minor: int) -> bool:
        return (self.type in ("a", typ) and self.major in (-1, major) and self.minor in (-1, minor))

    def __str__(self) -> str:
        return f"{self.type} {_num(self.major)}:{_num(self.minor)} {self.access}"


def _num(n: int) -> str:
    return "*" if n in (-1, _OTHER) else str(n)


def _number(value: Any, where: str) -> int:
    if value is None:
        return -1
    if type(value) is not int:
        raise TypeError(f"{where} must be an integer")
    return value


def _nvidia_nodes(devices: Any) -> set[tuple[int, int]]:
    if devices is None:
        return set()
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise TypeError("linux.devices must be a list of objects")
    return {(d.get("major"), d.get("minor")) for d in devices
            if str(d.get("path", "")).startswith("/dev/nvidia") and d.get("type", "c") == "c"}


def parse_rules(rules: Any, devices: Any = None) -> tuple[DeviceRule, ...]:
    """The spec's device cgroup rules, NVIDIA device nodes left out (see the module contract)."""
    if rules is None:
        return ()
    if not isinstance(rules, list) or not all(isinstance(r, dict) for r in rules):
        raise TypeError("linux.resources.devices must be a list of objects")
    nvidia = _nvidia_nodes(devices)
    out = []
    for i, r in enumerate(rules):
        allow = r.get("allow")
        if type(allow) is not bool:
            raise TypeError(f"linux.resources.devices[{i}].allow must be a boolean")
        typ = r.get("type") or "a"
        access = r.get("access") or _ACCESS
        if not isinstance(typ, str) or not isinstance(access, str) or set(access) - set(_ACCESS):
            raise ValueError(f"linux.resources.devices[{i}]: bad type or access")
        rule = DeviceRule(allow=allow, type=typ, major=_number(r.get("major"), "major"),
                          minor=_number(r.get("minor"), "minor"),
                          access="".join(c for c in _ACCESS if c in access))
        if rule.type == "c" and (rule.major == NVIDIA_MAJOR or (rule.major, rule.minor) in nvidia):
            continue
        out.append(rule)
    return tuple(out)


def allowed(rules: Sequence[DeviceRule], typ: str, major: int, minor: int, access: str) -> bool:
    verdict = False
    for rule in rules:
        if access in rule.access and rule.matches(typ, major, minor):
            verdict = rule.allow
    return verdict


def _named(rules: Iterable[DeviceRule]) -> tuple[set[int], set[int]]:
    majors, minors = {_OTHER}, {_OTHER}
    for r in rules:
        if r.major != -1:
            majors.add(r.major)
        if r.minor != -1:
            minors.add(r.minor)
    return majors, minors


def excess(source: Sequence[DeviceRule], target: Sequence[DeviceRule]) -> list[str]:
    """Devices (and access bits) ``source`` allows and ``target`` does not, e.g. ``c 10:229 rw``;
    ``*`` stands for every major/minor that no rule names."""
    majors, minors = _named([*source, *target])
    found = []
    for typ in _TYPES:
        for major in sorted(majors):
            for minor in sorted(minors):
                bits = "".join(a for a in _ACCESS if allowed(source, typ, major, minor, a)
                               and not allowed(target, typ, major, minor, a))
                if bits:
                    found.append(f"{typ} {_num(major)}:{_num(minor)} {bits}")
    return found
