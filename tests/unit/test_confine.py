"""What confinement forces on a restored tree: rlimits clamped to the target's, and the target's
mount flags on every mount point the target has (computed from mountinfo)."""

from __future__ import annotations

import resource

import pytest

from runtime.container.confine import clamp, exceeds, mount_attrs, mount_fixes, visible_mounts
from runtime.container.containers import parse_mountinfo
from runtime.container.mountattr import MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY

INF = resource.RLIM_INFINITY


@pytest.mark.parametrize("current, target, expected", [
    ((1024, 1024), (1024, 1024), (1024, 1024)),
    ((20000, 20000), (512, 512), (512, 512)),
    ((INF, INF), (512, 4096), (4096, 4096)),
    ((100, 20000), (512, 4096), (100, 4096)),
    ((3000, 20000), (512, 4096), (3000, 4096)),
    ((256, 256), (512, 4096), (256, 256)),
    ((INF, INF), (INF, INF), (INF, INF)),
    ((8192, INF), (1024, 4096), (4096, 4096)),
], ids=["equal", "higher-lowered", "unlimited-lowered", "own-lower-soft-kept", "soft-within-target-hard-kept",
        "own-lower-kept", "both-unlimited", "soft-above-new-hard"])
def test_clamp_never_leaves_a_hard_limit_above_the_targets(current: tuple[int, int], target: tuple[int, int],
                                                           expected: tuple[int, int]) -> None:
    got = clamp(current, target)
    assert got == expected
    assert not exceeds(got, target)


def mi(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def line(mount_id: int, parent: int, point: str, options: str, fstype: str = "ext4") -> str:
    return f"{mount_id} {parent} 254:0 / {point} {options} - {fstype} /dev/vda rw"


TARGET = mi(line(10, 1, "/", "ro,relatime", "overlay"),
            line(11, 10, "/data", "ro,nosuid,nodev,relatime"),
            line(12, 10, "/proc", "rw,nosuid,nodev,noexec,relatime", "proc"),
            line(13, 12, "/proc/kcore", "ro,nosuid", "tmpfs"),
            line(14, 10, "/etc/hosts", "ro,relatime"))
RESTORED_RW = mi(line(20, 2, "/", "rw,relatime", "overlay"),
                 line(21, 20, "/data", "rw,relatime"),
                 line(22, 20, "/proc", "rw,nosuid,nodev,noexec,relatime", "proc"),
                 line(23, 22, "/proc/kcore", "ro,nosuid", "tmpfs"),
                 line(24, 20, "/etc/hosts", "rw,relatime"))


@pytest.mark.parametrize("target, restored, fixes, missing", [
    (TARGET, TARGET, {}, []),
    (TARGET, RESTORED_RW, {"/": MOUNT_ATTR_RDONLY, "/data": MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
                           "/etc/hosts": MOUNT_ATTR_RDONLY}, []),
    (TARGET, mi(*[ln for ln in RESTORED_RW.splitlines() if "kcore" not in ln]),
     {"/": MOUNT_ATTR_RDONLY, "/data": MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
      "/etc/hosts": MOUNT_ATTR_RDONLY}, ["/proc/kcore"]),
    (mi(line(10, 1, "/", "rw,relatime")), mi(line(20, 2, "/", "ro,nosuid,nodev,noexec")), {}, []),
    (mi(line(10, 1, "/", "rw")), mi(line(20, 2, "/", "ro"), line(25, 20, "/extra", "rw")), {}, []),
    (mi(line(10, 1, "/", "rw"), line(11, 10, "/sys", "ro,noexec", "sysfs")),
     mi(line(20, 2, "/", "rw"), line(21, 20, "/sys", "rw", "sysfs")), {"/sys": MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOEXEC}, []),
], ids=["same", "writable-rootfs-volume-and-hosts", "masked-path-missing", "restored-stricter",
        "extra-restored-mount", "sysfs-rw"])
def test_mount_fixes_add_the_targets_flags_and_name_missing_mount_points(
        target: str, restored: str, fixes: dict[str, int], missing: list[str]) -> None:
    assert mount_fixes(parse_mountinfo(target), parse_mountinfo(restored)) == (fixes, missing)


def test_visible_mount_is_the_top_of_a_stack() -> None:
    stacked = parse_mountinfo(mi(line(20, 2, "/", "rw"), line(21, 20, "/data", "rw"),
                                 line(22, 21, "/data", "ro,nosuid")))
    assert visible_mounts(stacked)["/data"].mount_id == 22
    reordered = parse_mountinfo(mi(line(22, 21, "/data", "ro,nosuid"), line(21, 20, "/data", "rw")))
    assert visible_mounts(reordered)["/data"].mount_id == 22
    assert mount_attrs("ro,nosuid,nodev,noexec,relatime") == 15 and mount_attrs("rw,relatime") == 0
