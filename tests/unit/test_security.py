"""The privilege check beyond credentials: what CRIU restores from the source (LSM labels, user
namespace, mount tree, device cgroup, sysctls) is refused unless the target's value is forced."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from runtime import security
from runtime.container.devrules import DeviceRule
from runtime.errors import ArtifactRejected
from runtime.manifest import CriuInfo, FileEntry, Manifest, NodeInfo, ProcessInfo, Source
from runtime.security import IdMapping, LsmOptions, LsmSupport, SecurityProfile, Sysctl, check_privilege, lsm_options

NO_LSM, APPARMOR, SELINUX = LsmSupport(), LsmSupport(apparmor=True), LsmSupport(selinux=True)
SPC = "system_u:system_r:spc_t:s0"
CONTAINER = "system_u:system_r:container_t:s0:c1,c2"
MOUNT = "system_u:object_r:container_file_t:s0:c1,c2"
USERNS = dict(user_namespace=True, uid_mappings=(IdMapping(0, 100000, 65536),),
              gid_mappings=(IdMapping(0, 100000, 65536),))
DEFAULT_DEVICES = (DeviceRule(False, "a", -1, -1, "rwm"), DeviceRule(True, "c", 1, 3, "rwm"),
                   DeviceRule(True, "c", 136, -1, "rwm"))
FUSE = DeviceRule(True, "c", 10, 229, "rwm")


def profile(**changes: Any) -> SecurityProfile:
    base = SecurityProfile(uid=1000, gid=1000, additional_gids=(), capabilities=("CAP_CHOWN",),
                           privileged=False, seccomp="sha256:" + "0" * 64, no_new_privileges=True,
                           devices=DEFAULT_DEVICES)
    return dataclasses.replace(base, **changes)


REFUSED = [
    ("apparmor-unconfined-into-confined", profile(), profile(apparmor_profile="cri-containerd.apparmor.d"),
     APPARMOR, ["CRIU cannot confine a task dumped unconfined"]),
    ("apparmor-differs-no-apparmor", profile(apparmor_profile="a"), profile(apparmor_profile="b"), NO_LSM,
     ["AppArmor profiles differ (source 'a', target 'b') and this node's kernel has no AppArmor"]),
    ("apparmor-unconfined-into-confined-no-apparmor", profile(), profile(apparmor_profile="b"), NO_LSM,
     ["no AppArmor"]),
    ("selinux-spc-into-container-no-selinux", profile(selinux_label=SPC), profile(selinux_label=CONTAINER),
     NO_LSM, ["SELinux labels differ", "no SELinux"]),
    ("selinux-spc-under-apparmor-kernel", profile(selinux_label=SPC), profile(selinux_label=CONTAINER),
     APPARMOR, ["no SELinux"]),
    ("selinux-spc-into-unlabelled", profile(selinux_label=SPC), profile(), SELINUX, ["no label to force"]),
    ("selinux-mount-label-source-lacks", profile(selinux_label=CONTAINER),
     profile(selinux_label=CONTAINER, selinux_mount_label=MOUNT), SELINUX, ["context="]),
    ("selinux-mount-label-no-selinux", profile(selinux_mount_label=MOUNT), profile(), NO_LSM,
     ["SELinux mount labels differ"]),
    ("userns-in-target-only", profile(), profile(**USERNS), NO_LSM,
     ["user namespaces differ (source none, target uid 0:100000:65536 gid 0:100000:65536)"]),
    ("userns-in-source-only", profile(**USERNS), profile(), NO_LSM, ["user namespaces differ"]),
    ("userns-other-mapping", profile(**USERNS),
     profile(**{**USERNS, "uid_mappings": (IdMapping(0, 200000, 65536),)}), NO_LSM, ["user namespaces differ"]),
    ("masked-path-missing", profile(masked_paths=("/proc/keys",)),
     profile(masked_paths=("/proc/kcore", "/proc/keys")), NO_LSM,
     ["target masks paths the source did not: /proc/kcore"]),
    ("readonly-path-missing", profile(), profile(readonly_paths=("/proc/sys",)), NO_LSM,
     ["target makes paths read-only that the source did not: /proc/sys"]),
    ("extra-device", profile(devices=DEFAULT_DEVICES + (FUSE,)), profile(), NO_LSM,
     ["device cgroup allows what the target's denies: c 10:229 rwm"]),
    ("device-write-bit", profile(devices=DEFAULT_DEVICES + (DeviceRule(True, "c", 10, 200, "rw"),)),
     profile(devices=DEFAULT_DEVICES + (DeviceRule(True, "c", 10, 200, "r"),)), NO_LSM, ["c 10:200 w"]),
    ("sysctl-in-source-only", profile(sysctls=(Sysctl("net.ipv4.ip_unprivileged_port_start", "0"),)),
     profile(), NO_LSM, ["sysctls differ: net.ipv4.ip_unprivileged_port_start"]),
    ("sysctl-other-value", profile(sysctls=(Sysctl("net.ipv4.ping_group_range", "0 2147483647"),)),
     profile(sysctls=(Sysctl("net.ipv4.ping_group_range", "1 0"),)), NO_LSM, ["net.ipv4.ping_group_range"]),
    ("sysctl-in-target-only", profile(), profile(sysctls=(Sysctl("kernel.shm_rmid_forced", "1"),)), NO_LSM,
     ["sysctls differ: kernel.shm_rmid_forced"]),
]


@pytest.mark.parametrize("source, target, lsm, needles", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_check_privilege_refuses_what_criu_would_restore_beyond_the_target(
        source: SecurityProfile, target: SecurityProfile, lsm: LsmSupport, needles: list[str]) -> None:
    reasons = check_privilege(source, target, lsm=lsm)
    assert len(reasons) == 1, reasons
    for needle in needles:
        assert needle in reasons[0]


ACCEPTED = [
    ("apparmor-confined-forced", profile(apparmor_profile="a"), profile(apparmor_profile="b"), APPARMOR,
     LsmOptions(profile="apparmor:b")),
    ("apparmor-stricter-source-kept", profile(apparmor_profile="a"), profile(), APPARMOR, LsmOptions()),
    ("apparmor-same-forced", profile(apparmor_profile="a"), profile(apparmor_profile="a"), APPARMOR,
     LsmOptions(profile="apparmor:a")),
    ("selinux-spc-forced-to-container", profile(selinux_label=SPC, selinux_mount_label="x:y:z:s0"),
     profile(selinux_label=CONTAINER, selinux_mount_label=MOUNT), SELINUX,
     LsmOptions(profile=f"selinux:{CONTAINER}", mount_context=MOUNT)),
    ("no-lsm-equal-labels", profile(apparmor_profile="a", selinux_label=SPC),
     profile(apparmor_profile="a", selinux_label=SPC), NO_LSM, LsmOptions()),
    ("same-userns", profile(**USERNS), profile(**USERNS), NO_LSM, LsmOptions()),
    ("source-masks-more", profile(masked_paths=("/proc/kcore", "/proc/keys")),
     profile(masked_paths=("/proc/kcore",)), NO_LSM, LsmOptions()),
    ("readonly-path-masked-in-source", profile(masked_paths=("/proc/sys",)),
     profile(readonly_paths=("/proc/sys",)), NO_LSM, LsmOptions()),
    ("target-allows-more-devices", profile(), profile(devices=DEFAULT_DEVICES + (FUSE,)), NO_LSM, LsmOptions()),
    ("same-sysctls", profile(sysctls=(Sysctl("net.core.somaxconn", "1024"),)),
     profile(sysctls=(Sysctl("net.core.somaxconn", "1024"),)), NO_LSM, LsmOptions()),
]


@pytest.mark.parametrize("source, target, lsm, options", [r[1:] for r in ACCEPTED], ids=[r[0] for r in ACCEPTED])
def test_check_privilege_accepts_what_is_forced_or_stricter(
        source: SecurityProfile, target: SecurityProfile, lsm: LsmSupport, options: LsmOptions) -> None:
    assert check_privilege(source, target, lsm=lsm) == []
    assert lsm_options(target, lsm) == options


def full_spec() -> dict[str, Any]:
    return {
        "process": {"user": {"uid": 1000, "gid": 1000}, "apparmorProfile": "cri-containerd.apparmor.d",
                    "selinuxLabel": CONTAINER},
        "linux": {
            "mountLabel": MOUNT,
            "namespaces": [{"type": "pid"}, {"type": "user"}],
            "uidMappings": [{"containerID": 0, "hostID": 100000, "size": 65536}],
            "gidMappings": [{"containerID": 0, "hostID": 200000, "size": 65536}],
            "maskedPaths": ["/proc/kcore", "/proc//keys/", "/proc/kcore"],
            "readonlyPaths": ["/proc/sys", "/proc/bus"],
            "sysctl": {"net.ipv4.ping_group_range": "0 0", "kernel.shm_rmid_forced": "1"},
            "devices": [{"path": "/dev/nvidia-uvm", "type": "c", "major": 509, "minor": 0},
                        {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}],
            "resources": {"devices": [
                {"allow": False, "access": "rwm"},
                {"allow": True, "type": "c", "major": 10, "minor": 229, "access": "wr"},
                {"allow": True, "type": "c", "major": 195, "minor": 0, "access": "rw"},
                {"allow": True, "type": "c", "major": 509, "minor": 0, "access": "rw"},
            ]},
        },
    }


def test_profile_records_lsm_userns_paths_devices_and_sysctls_from_the_spec() -> None:
    p = SecurityProfile.from_oci_spec(full_spec())
    assert (p.apparmor_profile, p.selinux_label, p.selinux_mount_label) == (
        "cri-containerd.apparmor.d", CONTAINER, MOUNT)
    assert p.user_namespace and p.uid_mappings == (IdMapping(0, 100000, 65536),)
    assert p.gid_mappings == (IdMapping(0, 200000, 65536),)
    assert p.masked_paths == ("/proc/kcore", "/proc/keys")
    assert p.readonly_paths == ("/proc/bus", "/proc/sys")
    assert p.sysctls == (Sysctl("kernel.shm_rmid_forced", "1"), Sysctl("net.ipv4.ping_group_range", "0 0"))
    # NVIDIA nodes (fixed major 195, and nvidia-uvm by its path) are left to the GPU check.
    assert p.devices == (DeviceRule(False, "a", -1, -1, "rwm"), DeviceRule(True, "c", 10, 229, "rw"))


def test_profile_defaults_and_unconfined_apparmor() -> None:
    p = SecurityProfile.from_oci_spec({"process": {"apparmorProfile": "unconfined"}})
    assert (p.apparmor_profile, p.selinux_label, p.user_namespace, p.masked_paths, p.devices, p.sysctls) == (
        "", "", False, (), (), ())


@pytest.mark.parametrize("linux, process", [
    ({}, {"apparmorProfile": 7}),
    ({}, {"selinuxLabel": ["x"]}),
    ({"maskedPaths": ["proc/kcore"]}, {}),
    ({"readonlyPaths": "/proc/sys"}, {}),
    ({"sysctl": {"net.core.somaxconn": 1024}}, {}),
    ({"sysctl": {"bad name!": "1"}}, {}),
    ({"namespaces": [{"type": "user"}], "uidMappings": [{"containerID": 0, "hostID": 1}]}, {}),
    ({"namespaces": "user"}, {}),
    ({"resources": {"devices": [{"allow": "yes"}]}}, {}),
    ({"resources": {"devices": [{"allow": True, "access": "rwx"}]}}, {}),
    ({"resources": {"devices": [{"allow": True, "major": "10"}]}}, {}),
    ({}, {"apparmorProfile": "evil\nprofile"}),
], ids=["apparmor-int", "selinux-list", "masked-relative", "readonly-string", "sysctl-int",
        "sysctl-name", "mapping-no-size", "namespaces-string", "device-allow-string", "device-access-x",
        "device-major-string", "apparmor-newline"])
def test_profile_from_malformed_spec_fields_is_rejected(linux: dict[str, Any], process: dict[str, Any]) -> None:
    with pytest.raises(ArtifactRejected, match="malformed OCI spec"):
        SecurityProfile.from_oci_spec({"process": process, "linux": linux}, label="target")


def test_new_fields_round_trip_through_the_signed_manifest() -> None:
    sec = SecurityProfile.from_oci_spec(full_spec())
    m = Manifest(name="m", namespace="ns", created_at="2025-01-02T03:04:05+00:00",
                 source=Source("p", "u", "c", "cid", "img", "sha256:" + "1" * 64),
                 node=NodeInfo("n", "6.8", "x86_64"), criu=CriuInfo("4.2.1"), cuda=None, security=sec,
                 process=ProcessInfo(1, ("x",)), mounts=(), files=(FileEntry("a", 1, "ab" * 32),), timings={})
    assert Manifest.from_json(m.to_json()).security == sec


@pytest.mark.parametrize("key, value, message", [
    ("apparmor_profile", "unconfined", "recorded as ''"),
    ("masked_paths", ["/b", "/a"], "sorted and unique"),
    ("masked_paths", ["/a/../etc"], "normalised absolute"),
    ("sysctls", [{"name": "b", "value": "1"}, {"name": "a", "value": "1"}], "sorted by name"),
    ("uid_mappings", [{"container_id": 0, "host_id": 1, "size": 1}], "without a user namespace"),
    ("devices", [{"allow": True, "type": "x", "major": 1, "minor": 1, "access": "r"}], "device rule type"),
    ("devices", [{"allow": True, "type": "c", "major": 1, "minor": 1, "access": "wr"}], "access"),
], ids=["apparmor-unconfined-word", "masked-unsorted", "masked-dotdot", "sysctls-unsorted",
        "mappings-without-userns", "device-type", "device-access-order"])
def test_manifest_refuses_malformed_new_security_fields(key: str, value: Any, message: str) -> None:
    sec = SecurityProfile.from_oci_spec({"process": {}})
    m = Manifest(name="m", namespace="ns", created_at="2025-01-02T03:04:05+00:00",
                 source=Source("p", "u", "c", "cid", "img", "sha256:" + "1" * 64),
                 node=NodeInfo("n", "6.8", "x86_64"), criu=CriuInfo("4.2.1"), cuda=None, security=sec,
                 process=ProcessInfo(1, ("x",)), mounts=(), files=(), timings={})
    obj = json.loads(m.to_json())
    obj["security"][key] = value
    with pytest.raises(ArtifactRejected, match=message):
        Manifest.from_json(json.dumps(obj).encode())


@pytest.mark.parametrize("apparmor, selinux_enforce, expected", [
    (False, False, NO_LSM), (True, False, APPARMOR), (False, True, SELINUX), (True, True, APPARMOR),
], ids=["none", "apparmor", "selinux", "both-apparmor-first-like-criu"])
def test_lsm_support_detects_what_criu_would(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                             apparmor: bool, selinux_enforce: bool, expected: LsmSupport) -> None:
    (tmp_path / "selinux").mkdir()
    if apparmor:
        (tmp_path / "apparmor").mkdir()
    if selinux_enforce:
        (tmp_path / "selinux" / "enforce").write_text("1")
    monkeypatch.setattr(security, "APPARMOR_SECURITYFS", str(tmp_path / "apparmor"))
    monkeypatch.setattr(security, "SELINUXFS", str(tmp_path / "selinux"))
    assert LsmSupport.detect() == expected
