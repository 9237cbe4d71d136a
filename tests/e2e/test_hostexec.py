"""rekindle-hostexec, run as the plugin runs it under the chart, without containerd.

Two mount namespaces stand in for the node: "host" (a private copy of this machine's, with an
/etc/ld.so.preload naming a library that does not exist) and "plugin" (a copy of the host's in
which a host dir is hidden under a tmpfs and /etc is the real one again). From the plugin's,
the launcher must run the plugin's own programs where the host's paths are: the hidden file is
read, the host's preload list is not applied, PATH reaches the plugin's tar and gzip and nothing
else, and no mount of it is left in the plugin's namespace.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from runtime.container import hostview

REPO = Path(__file__).resolve().parents[2]
HELPER = REPO / "build" / "hostexec" / "rekindle-hostexec"
HOST_ONLY = Path("/var/lib/rekindle-test-hostlib")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespaces)")


@pytest.fixture
def host_only_dir():
    d = HOST_ONLY / f"hostexec-{uuid.uuid4().hex[:8]}"
    (d / "lib").mkdir(parents=True)
    (d / "lib" / "libdriver.so").write_text("seen from the host view\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_launcher_runs_the_plugins_programs_in_the_hosts_view(host_only_dir, tmp_path):
    if not HELPER.exists():
        pytest.fail(f"{HELPER} is missing: run make")
    sh = os.path.realpath(shutil.which("sh") or "/bin/sh")
    tar = os.path.realpath(shutil.which("tar") or "")
    u = hostview.Userland(helper=str(HELPER), shims=str(HELPER.parent / "bin"),
                          loader=os.path.realpath(hostview.elf_interpreter(sh)),
                          library_path=("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu"), criu=sh,
                          progs=(("tar", tar), ("gzip", os.path.realpath(shutil.which("gzip") or ""))))
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    (data / "a" / "b").write_text("packed\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # What runs in the host's view, as CRIU would: builtins, plus what PATH offers (tar, gzip).
    errors = tmp_path / "launched.err"
    script = (f"exec 2>{errors}; read l < {host_only_dir}/lib/libdriver.so && echo \"file: $l\"; echo \"PATH=$PATH\"; "
              f"tar --create --gzip --directory {data} . > {tmp_path}/t.tgz && "
              f"tar --extract --gzip --directory {out_dir} < {tmp_path}/t.tgz && echo tar-ok; "
              "cat /dev/null && echo cat-ran; true")
    argv = hostview.launcher_argv(u, 7, mount_proc=False) + [sh, "-c", script]
    plugin = (f"mount -t tmpfs none {host_only_dir} && umount -l /etc && "
              f"test ! -e {host_only_dir}/lib/libdriver.so && exec 7</proc/$1/ns/mnt && "
              f"{shlex.join(argv)}; echo \"helper-exit=$?\"; grep -c rekindle-criu /proc/self/mountinfo || true")
    host = ("mount -t tmpfs none /etc && echo /nonexistent-rekindle-preload.so > /etc/ld.so.preload && "
            f"{sh} -c true; unshare -m --propagation private {sh} -c {shlex.quote(plugin)} plugin $$")
    res = subprocess.run(["unshare", "-m", "--propagation", "private", sh, "-c", host],
                         capture_output=True, text=True, timeout=60)
    out, err = res.stdout, res.stderr
    # The control: in the host's view, the preload list is in effect for the host's programs.
    assert "nonexistent-rekindle-preload.so" in err.splitlines()[0], (out, err)
    launched = errors.read_text().splitlines()
    assert "file: seen from the host view" in out, (out, launched)
    assert f"PATH={hostview.AT}{HELPER.parent}/bin" in out, (out, err)
    assert "tar-ok" in out and (out_dir / "a" / "b").read_text() == "packed\n", (out, err)
    assert "cat-ran" not in out and any("cat: not found" in ln for ln in launched), (out, err)
    assert not any("preload" in ln for ln in launched), launched  # covered for the plugin's loader
    assert "helper-exit=0" in out, (out, err)
    assert out.strip().splitlines()[-1] == "0", out  # its mounts stayed in its own namespace
