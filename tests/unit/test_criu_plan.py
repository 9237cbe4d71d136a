"""Pure parts of the CRIU mechanics: mountinfo/cgroup parsing, the mount plan, argv, pstree.img."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.container import mount_plan
from runtime.container.containers import ContainerInfo, NsRef, overlay_upperdir, parse_cgroup_paths, parse_mountinfo
from runtime.criu import command as criu_mod
from runtime.criu import image_files
from runtime.criu import log as criu_log
from runtime.criu.command import DumpOptions, RestoreOptions
from runtime.errors import CriuError, NamespaceError
from runtime.layout import MountPlanEntry

HOST_V1 = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""

HOST_V2 = """\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
31 23 0:28 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate
"""

WORKLOAD = """\
600 500 0:90 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/b/upper,workdir=/b/work
601 600 0:91 / /proc rw - proc proc rw
602 600 254:0 /srv/vol\\040a /data rw - ext4 /dev/vda rw
603 600 254:0 /srv/hosts /etc/hosts rw - ext4 /dev/vda rw
604 600 0:92 / /sys/fs/cgroup ro - tmpfs tmpfs ro
605 604 0:29 /pods/c1 /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct
606 604 0:32 /pods/c1 /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory
607 600 254:0 /srv/secret /run/secrets rw - ext4 /dev/vda rw
"""

SPEC = {
    "mounts": [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/data/", "type": "bind", "source": "/srv/vol a", "options": ["rbind", "rw"]},
        {"destination": "/etc/hosts", "type": "bind", "source": "/srv/hosts", "options": ["rbind", "ro"]},
        {"destination": "/var/run/secrets", "source": "/srv/secret", "options": ["bind"]},
        {"destination": "/missing", "type": "bind", "source": "/srv/x", "options": ["bind"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
    ]
}


def test_parse_mountinfo_unescapes_and_splits() -> None:
    mi = parse_mountinfo(WORKLOAD)
    data = next(m for m in mi if m.mount_point == "/data")
    assert data.root == "/srv/vol a" and data.dev == "254:0" and data.fstype == "ext4"
    assert overlay_upperdir(mi) == "/b/upper"
    with pytest.raises(NamespaceError, match="not overlay"):
        overlay_upperdir(parse_mountinfo(HOST_V1))


def test_cgroup_paths_v1_hybrid_and_v2() -> None:
    text = "9:name=systemd:/pods/c1\n4:memory:/pods/c1\n2:cpu,cpuacct:/pods/c1\n0::/pods/c1\n"
    v, paths = parse_cgroup_paths(text, parse_mountinfo(HOST_V1))
    assert v == 1
    assert paths == {
        "name=systemd": "/sys/fs/cgroup/systemd/pods/c1",
        "memory": "/sys/fs/cgroup/memory/pods/c1",
        "cpu,cpuacct": "/sys/fs/cgroup/cpu,cpuacct/pods/c1",
        "": "/sys/fs/cgroup/unified/pods/c1",
    }
    v, paths = parse_cgroup_paths("0::/kubepods/pod1/c1\n", parse_mountinfo(HOST_V2))
    assert (v, paths) == (2, {"": "/sys/fs/cgroup/kubepods/pod1/c1"})


def test_plan_external_mounts(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "var").mkdir()
    os.symlink("/run", tmp_path / "var/run")  # like many images: /var/run -> /run
    plan = mount_plan.plan_external_mounts(parse_mountinfo(WORKLOAD), SPEC, str(tmp_path))
    assert [(e.key, e.destination, e.type, e.mount_point) for e in plan] == [
        ("m0", "/data", "bind", ""),
        ("m1", "/etc/hosts", "bind", ""),
        ("m2", "/sys/fs/cgroup/cpu,cpuacct", "cgroup", ""),
        ("m3", "/sys/fs/cgroup/memory", "cgroup", ""),
        ("m4", "/var/run/secrets", "bind", "/run/secrets"),
    ]
    argv = criu_mod.criu_argv(DumpOptions(images_dir="/img", pid=7, netns_inode=42, external_mounts=plan))
    assert argv[:4] == [criu_mod.CRIU, "dump", "-t", "7"]
    for frag in ("net[42]:extnet", "mnt[/run/secrets]:m4", "mnt[/data]:m0"):
        assert frag in argv
    for flag in ("--leave-running", "--tcp-close", "--file-locks", "--manage-cgroups=ignore", "-v4", "--skip-in-flight"):
        assert flag in argv
    assert argv[argv.index("--network-lock") + 1] == "skip"
    assert argv[argv.index("-o") + 1] == "/img/dump.log"


def _target(spec: dict) -> ContainerInfo:
    return ContainerInfo(id="c2", bundle="/b2", spec=spec, init_pid=1, rootfs="/b2/rootfs", upperdir="/b2/upper",
                         namespaces={"net": NsRef("/proc/1/ns/net", 1)}, cgroup_version=1, cgroups={},
                         stdio=("", "", ""), hostname="h")


def test_map_mounts_binds_and_missing_counterpart() -> None:
    plan = [MountPlanEntry("m0", "/data", "bind"), MountPlanEntry("m1", "/etc/hosts", "bind")]
    spec = {"mounts": [{"destination": "/data", "type": "bind", "source": "/other/vol", "options": ["rbind"]},
                       {"destination": "/etc/hosts", "source": "/other/hosts", "options": ["bind", "ro"]}]}
    assert mount_plan.map_mounts(plan, _target(spec)) == ["mnt[m0]:/other/vol", "mnt[m1]:/other/hosts"]
    with pytest.raises(CriuError, match=r"m1 \(/etc/hosts, bind\) has no counterpart in container c2"):
        mount_plan.map_mounts(plan, _target({"mounts": spec["mounts"][:1]}))


def test_host_path_of_mount_longest_root_prefix() -> None:
    host = parse_mountinfo(HOST_V1 + "50 27 0:29 /pods /mnt/pods rw - cgroup cgroup rw,cpu,cpuacct\n")
    mi = {m.mount_point: m for m in parse_mountinfo(WORKLOAD)}
    assert mount_plan.host_path_of_mount(mi["/sys/fs/cgroup/cpu,cpuacct"], host) == "/mnt/pods/c1"
    assert mount_plan.host_path_of_mount(mi["/sys/fs/cgroup/memory"], host) == "/sys/fs/cgroup/memory/pods/c1"
    with pytest.raises(CriuError, match="no host mount of device 0:92"):
        mount_plan.host_path_of_mount(mi["/sys/fs/cgroup"], host)


def test_restore_argv() -> None:
    argv = criu_mod.criu_argv(RestoreOptions(
        images_dir="/img", root="/b2/rootfs", pidfile="/w/p", work_dir="/w",
        inherit_fds=[(5, "extnet"), (6, "pipe:[9]")], join_ns=[("ipc", "/proc/1/ns/ipc")],
        external_mounts=["mnt[m0]:/x"], shell_job=True))
    assert argv[1] == "restore" and "-d" in argv and "--shell-job" in argv
    assert argv[argv.index("--root") + 1] == "/b2/rootfs"
    assert argv[argv.index("-o") + 1] == "/w/restore.log"
    assert "fd[6]:pipe:[9]" in argv and "ipc:/proc/1/ns/ipc" in argv and "mnt[m0]:/x" in argv
    assert "--leave-running" not in argv and "--network-lock" not in argv
    assert "--leave-stopped" in argv  # resumed only after the log check, the bulk fill and confine
    assert "--lsm-profile" not in argv


def test_restore_argv_leaves_stopped_and_forces_the_targets_lsm_labels() -> None:
    from runtime.security import LsmSupport, SecurityProfile, lsm_options
    target = SecurityProfile.from_oci_spec({"process": {"selinuxLabel": "u:r:container_t:s0:c1,c2"},
                                            "linux": {"mountLabel": "u:object_r:container_file_t:s0:c1,c2"}})
    lsm = lsm_options(target, LsmSupport(selinux=True))
    argv = criu_mod.criu_argv(RestoreOptions(images_dir="/img", root="/r", pidfile="/p", leave_stopped=True,
                                             lsm_profile=lsm.profile, lsm_mount_context=lsm.mount_context))
    assert "--leave-stopped" in argv
    assert argv[argv.index("--lsm-profile") + 1] == "selinux:u:r:container_t:s0:c1,c2"
    assert argv[argv.index("--lsm-mount-context") + 1] == "u:object_r:container_file_t:s0:c1,c2"


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _entry(pid: int, ppid: int, pgid: int, sid: int, threads: list[int], packed: bool) -> bytes:
    msg = b"".join(_varint(n << 3) + _varint(v) for n, v in ((1, pid), (2, ppid), (3, pgid), (4, sid)))
    if packed:
        body = b"".join(_varint(t) for t in threads)
        msg += _varint(5 << 3 | 2) + _varint(len(body)) + body
    else:
        msg += b"".join(_varint(5 << 3) + _varint(t) for t in threads)
    return len(msg).to_bytes(4, "little") + msg


def test_pstree_image(tmp_path: Path) -> None:
    magic = (0x54564319).to_bytes(4, "little") + (0x50273030).to_bytes(4, "little")
    (tmp_path / "pstree.img").write_bytes(
        magic + _entry(6, 1, 1, 1, [6, 8, 300], packed=False) + _entry(7, 6, 1, 1, [7], packed=True))
    assert image_files.image_pids(str(tmp_path)) == {6, 7, 8, 300}
    assert image_files.image_is_shell_job(str(tmp_path))
    (tmp_path / "pstree.img").write_bytes(magic + _entry(6, 0, 6, 6, [6], packed=True))
    assert not image_files.image_is_shell_job(str(tmp_path))
    (tmp_path / "pstree.img").write_bytes(magic + b"\x05\x00\x00\x00\xff")
    with pytest.raises(CriuError, match="pstree.img: entry of 5 bytes"):
        image_files.read_pstree(str(tmp_path))
    (tmp_path / "pstree.img").write_bytes(magic + b"\x02\x00\x00\x00\x08\xff")
    with pytest.raises(CriuError, match="bad pstree_entry"):
        image_files.read_pstree(str(tmp_path))


def test_log_errors(tmp_path: Path) -> None:
    log = tmp_path / "r.log"
    log.write_text("(0.1) ok\n(0.2) Error (mount.c:1): mnt: No mapping for 94\n(0.3) bye\n")
    assert "No mapping for 94" in criu_log.log_errors(str(log))
    assert "no log" in criu_log.log_errors(str(tmp_path / "none"))


@pytest.mark.parametrize("output, version, parts", [
    ("Version: 4.2.1\n", "4.2.1", (4, 2, 1)),
    ("Version: 4.3\nGitID: v4.3\n", "4.3", (4, 3)),
    ("criu: Version: 9\n", None, None),  # only a line that starts with it
    ("nothing here", None, None),
], ids=["three-parts", "gitid-line", "not-at-line-start", "no-version"])
def test_one_parser_reads_criu_version_output(output, version, parts):
    assert criu_mod.parse_version(output) == version
    if version is not None:
        assert criu_mod.version_tuple(version) == parts


def test_version_tuple_reads_kernel_releases_and_refuses_words():
    assert criu_mod.version_tuple("6.8.0-45-generic") == (6, 8, 0)
    assert criu_mod.version_tuple("unknown") is None


def test_log_errors_leave_out_the_harmless_rlimit_line(tmp_path: Path) -> None:
    log = tmp_path / "d.log"
    log.write_text("(0.05) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not "
                   "permitted\n(0.95) Error (criu/page-xfer.c:263): page-xfer: Unable to spice data: No space left "
                   "on device\n(0.96) Error (criu/cr-dump.c:1975): Dumping FAILED.\n")
    assert criu_log.log_errors(str(log)).startswith("(0.95) Error (criu/page-xfer.c:263)")
