"""Manifest schema, canonical JSON, signatures, privilege and compatibility checks (keys: test_keys.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pytest

from runtime.compat import NodeFacts, check_compatibility
from runtime.errors import ArtifactRejected
from runtime.manifest import (
    CriuInfo,
    CudaInfo,
    FileEntry,
    Gpu,
    HostFile,
    Manifest,
    MountInfo,
    NodeInfo,
    ProcessInfo,
    Source,
    sign,
    verify,
)
from runtime.security import LsmSupport, SecurityProfile, check_privilege

KEY = b"k" * 32
SHA = "ab" * 32


def profile(**changes: Any) -> SecurityProfile:
    base = SecurityProfile(uid=1000, gid=1000, additional_gids=(), capabilities=("CAP_CHOWN",),
                           privileged=False, seccomp="sha256:" + "0" * 64,
                           no_new_privileges=True)
    return dataclasses.replace(base, **changes)


def make_manifest(**changes: Any) -> Manifest:
    base = Manifest(
        name="qwen-7b", namespace="team-a", created_at="2025-01-02T03:04:05+00:00",
        source=Source(pod="p", pod_uid="u", container="c", container_id="cid",
                      image="registry/img:1", image_ref="sha256:" + "1" * 64),
        node=NodeInfo(hostname="node-1", kernel="6.8.0-45-generic", arch="x86_64"),
        criu=CriuInfo(version="4.1"),
        cuda=CudaInfo(driver_version="580.65", gpus=(Gpu(uuid="GPU-1", name="NVIDIA H200"),),
                      pids=(12,)),
        security=profile(),
        process=ProcessInfo(root_pid=7, args=("python", "-m", "serve")),
        mounts=(MountInfo(key="shm", destination="/dev/shm", type="tmpfs"),),
        files=(FileEntry(path="criu/core-1.img", size=3, digest=SHA),),
        timings={"dump": 1.5},
        host_files=(HostFile(mount="/usr/lib/x86_64-linux-gnu/libcuda.so.1", path="", size=5, digest=SHA),
                    HostFile(mount="/models", path="qwen/tokenizer.json", size=9, digest=SHA)),
    )
    return dataclasses.replace(base, **changes)


def facts(**changes: Any) -> NodeFacts:
    base = NodeFacts(hostname="node-2", kernel="6.8.12-1", arch="x86_64", criu_version="4.1",
                     cuda=CudaInfo(driver_version="580.65",
                                    gpus=(Gpu(uuid="GPU-9", name="NVIDIA H200"),)))
    return dataclasses.replace(base, **changes)


def test_manifest_round_trips_through_canonical_json() -> None:
    m = make_manifest()
    data = m.to_json()
    assert Manifest.from_json(data) == m
    obj = json.loads(data)
    assert data == json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    assert obj["format_version"] == 5 and obj["prewarm"] is False and obj["map_ranges"] == "" and obj["cuda"]["gpus"][0]["name"] == "NVIDIA H200"
    assert obj["host_files"][1] == {"mount": "/models", "path": "qwen/tokenizer.json", "size": 9, "digest": SHA}


def _version_2() -> dict[str, Any]:
    obj = json.loads(make_manifest().to_json())
    del obj["host_files"], obj["prewarm"], obj["map_ranges"]
    obj["format_version"] = 2
    return obj


def _version_3() -> bytes:
    obj = json.loads(make_manifest().to_json())
    del obj["prewarm"], obj["map_ranges"]
    obj["format_version"] = 3
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _version_4() -> bytes:
    obj = json.loads(make_manifest(prewarm=True).to_json())
    del obj["map_ranges"]
    obj["format_version"] = 4
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def test_a_format_4_manifest_is_read_with_the_nodes_map_setting_and_keeps_its_signed_bytes() -> None:
    data = _version_4()
    verify(data, sign(data, KEY), KEY)
    m = Manifest.from_json(data)
    assert m.format_version == 4 and m.prewarm is True and m.map_ranges == ""
    assert m.to_json() == data
    with pytest.raises(ArtifactRejected, match="map_ranges in a format_version 4 manifest"):
        Manifest.from_json(data.replace(b'"process"', b'"map_ranges":"all","process"'))


def test_a_manifest_records_what_its_restores_map_in_its_signed_bytes() -> None:
    m = make_manifest(map_ranges="all")
    data = m.to_json()
    assert json.loads(data)["map_ranges"] == "all" and Manifest.from_json(data).map_ranges == "all"
    with pytest.raises(ArtifactRejected, match="bad signature"):
        verify(data.replace(b'"map_ranges":"all"', b'"map_ranges":"none"'), sign(data, KEY), KEY)
    with pytest.raises(ValueError, match="map_ranges must be one of"):
        make_manifest(map_ranges="everything")
    with pytest.raises(ValueError, match="map_ranges needs format_version 5"):
        make_manifest(map_ranges="all", format_version=4)


def test_a_format_3_manifest_is_read_unmarked_and_keeps_its_signed_bytes() -> None:
    """Artifacts published before pre-warming existed still verify and restore: their bytes
    (what the signature covers) are what to_json gives back, with no prewarm key."""
    data = _version_3()
    verify(data, sign(data, KEY), KEY)
    m = Manifest.from_json(data)
    assert m.format_version == 3 and m.prewarm is False
    assert m.to_json() == data
    with pytest.raises(ArtifactRejected, match="prewarm in a format_version 3 manifest"):
        Manifest.from_json(data.replace(b'"process"', b'"prewarm":false,"process"'))


def test_a_marked_manifest_records_prewarm_in_its_signed_bytes() -> None:
    m = make_manifest(prewarm=True)
    data = m.to_json()
    assert json.loads(data)["prewarm"] is True and Manifest.from_json(data).prewarm is True
    sig = sign(data, KEY)
    with pytest.raises(ArtifactRejected, match="bad signature"):  # unmarking it breaks the signature
        verify(data.replace(b'"prewarm":true', b'"prewarm":false'), sig, KEY)
    with pytest.raises(ValueError, match="prewarm needs format_version 4"):
        make_manifest(prewarm=True, format_version=3)


def test_a_format_2_manifest_is_read_with_its_host_files_not_recorded() -> None:
    """Artifacts written before host files were recorded still restore (runtime.hostfiles)."""
    m = Manifest.from_json(json.dumps(_version_2()).encode())
    assert m.format_version == 2 and m.host_files is None
    assert m.source == make_manifest().source


def test_manifest_without_cuda_serialises_cuda_as_null() -> None:
    m = make_manifest(cuda=None)
    assert json.loads(m.to_json())["cuda"] is None
    assert Manifest.from_json(m.to_json()).cuda is None


def _mutate(path: str, value: Any) -> bytes:
    obj = json.loads(make_manifest().to_json())
    *parents, last = path.split(".")
    node = obj
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return json.dumps(obj).encode()


@pytest.mark.parametrize("data, needle", [
    (_mutate("format_version", 6), "unsupported manifest format_version 6 (this build reads 2, 3, 4, 5)"),
    (_mutate("map_ranges", "most"), "map_ranges must be one of"),
    (_mutate("map_ranges", None), "manifest.map_ranges: expected str"),
    (_mutate("prewarm", "true"), "manifest.prewarm: expected bool"),
    (_mutate("host_files", KeyError), "missing keys ['host_files']"),
    (_mutate("host_files", None), "host_files is null exactly in a format_version 2 manifest"),
    (_mutate("host_files.1.path", "../etc/shadow"), "not a normal relative path"),
    (_mutate("host_files.1.path", "/etc/shadow"), "not a normal relative path"),
    (_mutate("host_files.0.mount", "usr/lib"), "not a normal absolute path"),
    (_mutate("host_files.0.digest", "ab"), "bad digest"),
    (json.dumps({**_version_2(), "host_files": []}).encode(), "host_files in a format_version 2 manifest"),
    (_mutate("format_version", "2"), "unsupported manifest format_version '2'"),
    (_mutate("format_version", True), "unsupported manifest format_version True"),
    (_mutate("extra", 1), "unknown keys ['extra']"),
    (_mutate("timings", KeyError), "missing keys ['timings']"),
    (_mutate("security.uid", "0"), "manifest.security.uid: expected int"),
    (_mutate("security.privileged", 0), "manifest.security.privileged: expected bool"),
    (_mutate("process.root_pid", True), "manifest.process.root_pid: expected int"),
    (_mutate("process.args", "python"), "manifest.process.args: expected a list"),
    (_mutate("files.0.digest", "xyz"), "bad digest"),
    (_mutate("files.0.size", -1), "negative size"),
    (_mutate("security.capabilities", ["CAP_SYS_ADMIN", "CAP_CHOWN"]), "sorted and unique"),
    (_mutate("security.seccomp", "whatever"), "bad seccomp value"),
    (_mutate("timings.dump", -1), "non-negative"),
    (_mutate("created_at", "yesterday"), "not an ISO 8601 time"),
    (b'{"format_version": 2, "format_version": 2}', "duplicate key"),
    (b'{"format_version": 2, "x": NaN}', "NaN is not allowed"),
    (b"[1]", "not a JSON object"),
    (b"\xff\xfe", "not valid JSON"),
    (b"x" * (16 * 1024 * 1024 + 1), "larger than"),
], ids=["future-version", "map-ranges-unknown", "map-ranges-null", "prewarm-as-string", "host-files-missing", "host-files-null", "host-file-dotdot", "host-file-absolute",
        "host-mount-relative", "host-file-bad-digest", "version-2-with-host-files", "version-as-string", "version-as-bool", "unknown-key", "missing-key",
        "uid-as-string", "bool-as-int", "int-as-bool", "string-for-list", "bad-digest",
        "negative-size", "unsorted-caps", "unknown-seccomp", "negative-timing", "bad-time",
        "duplicate-key", "nan", "not-object", "not-utf8", "too-large"])
def test_from_json_rejects_malformed_manifest(data: bytes, needle: str) -> None:
    with pytest.raises(ArtifactRejected) as info:
        Manifest.from_json(data, artifact="team-a/qwen-7b")
    assert needle in str(info.value)
    assert info.value.name == "team-a/qwen-7b"


def test_sign_and_verify_accept_the_exact_bytes_only() -> None:
    data = make_manifest().to_json()
    sig = sign(data, KEY)
    assert sig.startswith("hmac-sha256:") and len(sig) == len("hmac-sha256:") + 64
    verify(data, sig, KEY)
    verify(data, sig + "\n", KEY)
    for bad_data, bad_sig, key in [(data + b" ", sig, KEY), (data, sig, b"j" * 32),
                                   (data, sig.replace("hmac-sha256", "sha256"), KEY), (data, "", KEY)]:
        with pytest.raises(ArtifactRejected, match="bad signature"):
            verify(bad_data, bad_sig, key)


RUNTIME_DEFAULT = {"defaultAction": "SCMP_ACT_ERRNO",
                   "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]}
ALL_CAPS = ["CAP_CHOWN", "CAP_NET_ADMIN", "CAP_SYS_ADMIN"]


def spec(**linux: Any) -> dict[str, Any]:
    return {"process": {"user": {"uid": 1000, "gid": 2000, "additionalGids": [3000, 10, 3000]},
                        "capabilities": {"bounding": ["CAP_NET_BIND_SERVICE", "CAP_CHOWN"],
                                         "effective": ["CAP_CHOWN"], "permitted": ["CAP_KILL"],
                                         "inheritable": ["CAP_SYS_ADMIN"]},
                        "noNewPrivileges": True},
            "linux": {"seccomp": RUNTIME_DEFAULT, **linux}}


def test_profile_from_oci_spec_reads_user_caps_seccomp_and_nnp() -> None:
    p = SecurityProfile.from_oci_spec(spec())
    assert (p.uid, p.gid, p.additional_gids) == (1000, 2000, (10, 3000))
    assert p.capabilities == ("CAP_CHOWN", "CAP_KILL", "CAP_NET_BIND_SERVICE")
    assert p.seccomp.startswith("sha256:") and not p.privileged and p.no_new_privileges


def test_profile_from_oci_spec_defaults_to_root_unconfined() -> None:
    p = SecurityProfile.from_oci_spec({"process": {}})
    assert (p.uid, p.gid, p.capabilities, p.seccomp, p.no_new_privileges) == (
        0, 0, (), "unconfined", False)


@pytest.mark.parametrize("seccomp, expected", [
    (None, "unconfined"),
    ({"defaultAction": "SCMP_ACT_ALLOW"}, "unconfined"),
    ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["x"], "action": "SCMP_ACT_LOG"}]},
     "unconfined"),
    ({"defaultAction": "SCMP_ACT_ALLOW",
      "syscalls": [{"names": ["ptrace"], "action": "SCMP_ACT_ERRNO"}]}, "confined"),
    (RUNTIME_DEFAULT, "confined"),
], ids=["absent", "allow-all", "allow-and-log", "one-denied", "runtime-default"])
def test_profile_seccomp_rule(seccomp: Any, expected: str) -> None:
    s = {"process": {}, "linux": {} if seccomp is None else {"seccomp": seccomp}}
    value = SecurityProfile.from_oci_spec(s).seccomp
    assert (value == "unconfined") == (expected == "unconfined")


def test_profile_seccomp_hash_depends_on_the_profile() -> None:
    other = {**RUNTIME_DEFAULT, "syscalls": [{"names": ["write"], "action": "SCMP_ACT_ALLOW"}]}
    a = SecurityProfile.from_oci_spec(spec()).seccomp
    b = SecurityProfile.from_oci_spec({**spec(), "linux": {"seccomp": other}}).seccomp
    assert a != b


def privileged_spec(devices: Any, bounding: list[str] = ALL_CAPS, seccomp: Any = None) -> Any:
    linux: dict[str, Any] = {"resources": {"devices": devices}}
    if seccomp is not None:
        linux["seccomp"] = seccomp
    return {"process": {"capabilities": {"bounding": bounding}}, "linux": linux}


@pytest.mark.parametrize("s, expected", [
    (privileged_spec([{"allow": True, "access": "rwm"}]), True),
    (privileged_spec([{"allow": False, "access": "rwm"}, {"allow": True, "type": "a"}]), True),
    (privileged_spec([{"allow": False, "access": "rwm"}]), False),
    (privileged_spec([{"allow": True, "access": "rwm"},
                      {"allow": False, "type": "c", "major": 1, "minor": 3, "access": "rwm"}]),
     False),
    (privileged_spec([{"allow": True, "access": "r"}]), False),
    (privileged_spec([{"allow": True}], bounding=["CAP_CHOWN"]), False),
    (privileged_spec([{"allow": True}], seccomp=RUNTIME_DEFAULT), False),
], ids=["allow-all", "deny-then-allow-all", "deny-all", "allow-all-then-deny-one", "read-only",
        "no-sys-admin", "seccomp-confined"])
def test_profile_privileged_rule(s: Any, expected: bool) -> None:
    assert SecurityProfile.from_oci_spec(s).privileged is expected


@pytest.mark.parametrize("s", [
    {"process": {"user": {"uid": "0"}}},
    {"process": {"user": {"additionalGids": ["1"]}}},
    {"process": {"capabilities": {"bounding": "CAP_SYS_ADMIN"}}},
    {"process": {"capabilities": {"bounding": ["cap_sys_admin"]}}},
    {"process": {"noNewPrivileges": "true"}},
    {"process": {}, "linux": {"seccomp": "unconfined"}},
    {"process": {}, "linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": ["x"]}}},
    ["not", "an", "object"],
], ids=["uid-string", "gid-string", "caps-string", "caps-lowercase", "nnp-string", "seccomp-string",
        "seccomp-rule-string", "spec-not-object"])
def test_profile_from_malformed_oci_spec_is_rejected(s: Any) -> None:
    with pytest.raises(ArtifactRejected, match="malformed OCI spec"):
        SecurityProfile.from_oci_spec(s, label="target")


@pytest.mark.parametrize("source, target, needles", [
    (profile(), profile(), []),
    (profile(uid=0), profile(), ["source runs as root (uid 0), target as uid 1000"]),
    (profile(uid=1001), profile(), ["source runs as uid 1001, target as uid 1000"]),
    (profile(gid=0), profile(), ["source gid 0 differs from target gid 1000"]),
    (profile(additional_gids=(5, 1000, 7)), profile(additional_gids=(7,)),
     ["groups the target lacks: [5]"]),
    (profile(capabilities=("CAP_CHOWN", "CAP_SYS_ADMIN")), profile(),
     ["capabilities the target lacks: CAP_SYS_ADMIN"]),
    (profile(privileged=True), profile(), ["source is privileged"]),
    (profile(seccomp="unconfined"), profile(), ["source has no seccomp filter"]),
    (profile(seccomp="sha256:" + "1" * 64), profile(), ["seccomp profiles differ"]),
    (profile(), profile(seccomp="unconfined"), []),
    (profile(no_new_privileges=False), profile(), ["target sets no_new_privileges"]),
    (profile(), profile(capabilities=("CAP_CHOWN", "CAP_KILL"), no_new_privileges=False), []),
    (profile(uid=0, gid=0, capabilities=("CAP_SYS_ADMIN",), privileged=True, seccomp="unconfined",
             no_new_privileges=False), profile(),
     ["uid 0", "gid 0", "CAP_SYS_ADMIN", "privileged", "seccomp", "no_new_privileges"]),
], ids=["equal", "root-to-user", "other-uid", "other-gid", "extra-group", "extra-cap",
        "privileged", "unconfined-to-confined", "other-seccomp", "confined-to-unconfined",
        "nnp-lost", "target-has-more", "every-reason-at-once"])
def test_check_privilege_lists_every_excess(source: SecurityProfile, target: SecurityProfile,
                                            needles: list[str]) -> None:
    reasons = check_privilege(source, target, lsm=LsmSupport())
    assert len(reasons) == len(needles), reasons
    for reason, needle in zip(reasons, needles):
        assert needle in reason


IMG, REF = "registry/img:1", "sha256:" + "1" * 64


@pytest.mark.parametrize("m, f, image, ref, needles", [
    (make_manifest(), facts(), IMG, REF, []),
    (make_manifest(), facts(arch="aarch64"), IMG, REF, ["architecture differs"]),
    (make_manifest(), facts(criu_version="4.0"), IMG, REF, ["CRIU 4.0 is older"]),
    (make_manifest(), facts(criu_version="4.2"), IMG, REF, []),
    (make_manifest(), facts(criu_version=None), IMG, REF, ["CRIU version unknown"]),
    (make_manifest(), facts(cuda=None), IMG, REF, ["node has no CUDA driver"]),
    (make_manifest(), facts(cuda=CudaInfo("570.1", (Gpu("G", "NVIDIA H200"),))), IMG, REF,
     ["CUDA driver differs"]),
    (make_manifest(), facts(cuda=CudaInfo("580.65", (Gpu("G", "NVIDIA A100"),))), IMG, REF,
     ["GPU 0 model differs"]),
    (make_manifest(), facts(cuda=CudaInfo("580.65", (Gpu("G", "NVIDIA H200"),) * 2)), IMG, REF,
     ["GPU count differs"]),
    (make_manifest(cuda=None), facts(cuda=None), IMG, REF, []),
    (make_manifest(), facts(), "registry/img:2", REF, ["image differs"]),
    (make_manifest(), facts(), IMG, "", ["image digest differs"]),
    (make_manifest(source=dataclasses.replace(make_manifest().source, image_ref="")), facts(), IMG, "",
     ["image digest unknown on both sides"]),
    (make_manifest(source=dataclasses.replace(make_manifest().source, image="", image_ref="")), facts(), "", "",
     []),
    (make_manifest(), facts(kernel="6.1.0"), IMG, REF, []),
    (make_manifest(), facts(arch="arm64", criu_version="3.19", cuda=None), "other", "x",
     ["architecture", "CRIU", "image differs", "digest", "CUDA"]),
], ids=["compatible", "arch", "old-criu", "newer-criu", "unknown-criu", "no-cuda",
        "driver", "gpu-model", "gpu-count", "cpu-only", "image-name", "image-digest", "digest-unknown-both",
        "no-image-named",
        "kernel-is-only-a-warning", "every-problem-at-once"])
def test_check_compatibility_lists_every_problem(m: Manifest, f: NodeFacts, image: str, ref: str,
                                                 needles: list[str]) -> None:
    reasons = check_compatibility(m, f, image=image, image_ref=ref)
    assert len(reasons) == len(needles), reasons
    for reason, needle in zip(reasons, needles):
        assert needle in reason


def test_check_compatibility_strict_kernel_rejects_other_major_minor() -> None:
    reasons = check_compatibility(make_manifest(), facts(kernel="6.1.0"), image=IMG,
                                  image_ref=REF, strict_kernel=True)
    assert reasons == ["kernel differs: artifact 6.8.0-45-generic, node 6.1.0"]


def test_node_facts_detect_reads_uname() -> None:
    f = NodeFacts.detect(criu_version="4.1")
    assert f.arch == os.uname().machine and f.kernel == os.uname().release
    assert f.criu_version == "4.1" and f.cuda is None
