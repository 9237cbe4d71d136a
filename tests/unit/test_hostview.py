"""Pure parts of runtime.container.hostview, and CRIU's argv in another view (runtime.criu.command)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import hostfiles
from runtime.container import hostview
from runtime.criu import command as criu_mod
from runtime.criu.command import RestoreOptions

REPO = Path(__file__).resolve().parents[2]

LISTING = """\
\tlinux-vdso.so.1 (0x00007ffc8a1f2000)
\tlibprotobuf-c.so.1 => /lib/x86_64-linux-gnu/libprotobuf-c.so.1 (0x00007f2c1c2b0000)
\tlibnl-3.so.200 => /usr/lib/x86_64-linux-gnu/libnl-3.so.200 (0x00007f2c1c28c000)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2c1c0ab000)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f2c1c3c8000)
"""


def test_library_dirs_are_where_the_plugins_loader_found_each_library() -> None:
    dirs = hostview.library_dirs(LISTING)
    # real paths, each once, in the loader's order (merged /usr: /lib is /usr/lib here)
    assert dirs == list(dict.fromkeys(os.path.dirname(os.path.realpath(p)) for p in (
        "/lib/x86_64-linux-gnu/libprotobuf-c.so.1", "/usr/lib/x86_64-linux-gnu/libnl-3.so.200",
        "/lib/x86_64-linux-gnu/libc.so.6")))


def test_a_library_the_plugin_lacks_is_refused_rather_than_left_to_the_hosts_loader_paths() -> None:
    with pytest.raises(ValueError, match="libnet.so.1 not found"):
        hostview.library_dirs(LISTING + "\tlibnet.so.1 => not found\n")


def test_the_loader_is_the_one_the_binary_names() -> None:
    sh = os.path.realpath(shutil.which("sh") or "/bin/sh")
    assert os.path.basename(hostview.elf_interpreter(sh)).startswith("ld-linux")
    with pytest.raises(ValueError):
        hostview.elf_interpreter(__file__)


def test_the_launcher_is_static_so_it_runs_where_none_of_its_libraries_are() -> None:
    helper = REPO / "build" / "hostexec" / "rekindle-hostexec"
    if not helper.exists():
        pytest.fail("build/hostexec/rekindle-hostexec is missing: run make")
    with pytest.raises(ValueError, match="statically linked"):
        hostview.elf_interpreter(str(helper))
    assert os.readlink(helper.parent / "bin" / "tar") == "../rekindle-hostexec"
    # started under a name, without its environment: it refuses, it runs nothing
    res = subprocess.run([str(helper.parent / "bin" / "tar"), "--version"], capture_output=True, text=True,
                         env={}, timeout=10)
    assert res.returncode == 126 and "no program of the plugin's named tar" in res.stderr


def test_launcher_argv_names_every_plugin_path_and_ends_before_the_program() -> None:
    u = hostview.Userland(helper="/h/rekindle-hostexec", shims="/h/bin", loader="/usr/lib/ld.so",
                          library_path=("/usr/lib/a", "/usr/lib/b"), criu="/usr/sbin/criu",
                          progs=(("tar", "/usr/bin/tar"),))
    assert hostview.launcher_argv(u, 9) == [
        "/h/rekindle-hostexec", "--mntns-fd", "9", "--at", hostview.AT, "--loader", "/usr/lib/ld.so",
        "--library-path", "/usr/lib/a:/usr/lib/b", "--shims", "/h/bin", "--mount-proc",
        "--prog", "tar=/usr/bin/tar", "--"]


def test_criu_in_another_view_opens_the_plugins_files_under_its_root_and_the_runtimes_as_they_are() -> None:
    opts = RestoreOptions(images_dir="/state/r/private/criu", root="/run/containerd/x/rootfs",
                          pidfile="/state/r/restore.pid", work_dir="/state/r",
                          external_mounts=["mnt[m0]:/usr/lib/x86_64-linux-gnu/libcuda.so.1"],
                          view_root="/run/rekindle-criu")
    argv = criu_mod.criu_argv(opts, "/usr/sbin/criu")
    at = {flag: argv[argv.index(flag) + 1] for flag in ("-D", "-W", "-o", "--pidfile", "--root", "--external")}
    assert at == {"-D": "/run/rekindle-criu/state/r/private/criu", "-W": "/run/rekindle-criu/state/r",
                  "-o": "/run/rekindle-criu/state/r/restore.log", "--pidfile": "/run/rekindle-criu/state/r/restore.pid",
                  "--root": "/run/containerd/x/rootfs", "--external": "mnt[m0]:/usr/lib/x86_64-linux-gnu/libcuda.so.1"}
    assert criu_mod.log_path(opts) == "/state/r/restore.log"  # read back by the plugin, in its own view


def test_a_container_whose_parent_is_in_its_own_pid_namespace_keeps_the_plugins_view() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert hostview.runtime_pid(child.pid) is None  # its parent (this test) is no runtime
        with hostview.criu_launch(child.pid, criu_mod.CRIU) as launch:
            assert launch.same and launch.argv == [] and launch.path("/x") == "/x"
    finally:
        child.kill()
        child.wait()


def _host_tree(root: Path) -> None:
    (root / "usr" / "lib" / "nvidia").mkdir(parents=True)
    (root / "usr" / "lib" / "nvidia" / "libcuda.so.1").write_bytes(b"the host's driver")
    os.symlink("/usr/lib", root / "lib")  # absolute: resolved against the host's root, not ours


def test_a_bind_source_is_resolved_in_the_runtimes_root_absolute_symlinks_included(tmp_path: Path) -> None:
    _host_tree(tmp_path)
    root = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        fd = hostfiles._open_regular(root, "/lib/nvidia", "libcuda.so.1")
        try:
            assert os.read(fd, 100) == b"the host's driver"
        finally:
            os.close(fd)
        with pytest.raises(OSError):  # ".." stops at that root
            os.close(hostview.open_in_root(root, "/../../../../etc/passwd", os.O_RDONLY))
    finally:
        os.close(root)
