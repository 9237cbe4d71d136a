"""The runtime's view of paths: where a container's bind sources and rootfs are, and how CRIU gets there.

A container's bind sources and rootfs are paths the runtime resolved: runc, started by the
container's shim, in the shim's mount namespace (the host's). The plugin on the host shares it.
The plugin under the chart has a mount namespace of its own, where only what the chart mounts
is at its host path: the host's driver libraries under ``/usr/lib`` (bound into GPU containers
by the NVIDIA toolkit) or a hostPath volume the chart does not list are not there.

Contract:

- :func:`runtime_pid` ``(init_pid)``: the process that started a container, the parent of its
  init (the shim), checked to be outside the container's pid namespace; None when that cannot
  be told (gone, unreadable): the callers then keep the plugin's own view, as before.
- :func:`open_in_root` opens a path resolved as that process resolves it (openat2
  ``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`` from ``/proc/<pid>/root``: an absolute symlink on
  the host stays on the host); :func:`host_root` is that root as an ``O_PATH`` fd.
- :func:`criu_launch` ``(init_pid)`` is how CRIU runs for a container: in the plugin's own mount
  namespace when the runtime's is the same (``Launch.same``: as before), else through
  ``rekindle-hostexec`` (runtime/hostexec/rekindle-hostexec.c): a private copy of the
  runtime's mount namespace with the plugin's whole tree attached at :data:`AT`, CRIU started
  by the plugin's own loader and libraries (found by ``ld.so --list`` in the plugin's view),
  PATH reaching only the plugin's tar and gzip (which CRIU runs for tmpfs contents), CRIU's
  plugin dir pointed at one without plugins, the host's ``/etc/ld.so.preload`` covered. No
  binary or library of the host runs with the plugin's privileges. ``Launch.path`` turns a
  path of the plugin's into one CRIU can open there; ``Launch.mounts_pid`` is the process whose
  mountinfo shows CRIU's view (host paths of cgroup mounts).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import CriuError
from runtime.fs.openat2 import RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, openat2

AT = "/run/rekindle-criu"  # where the plugin's tree is, in CRIU's copy of the runtime's namespace
SHIMMED = ("tar", "gzip")  # what CRIU runs by name (tmpfs contents), and what tar runs
_EAGAIN_RETRIES = 8


def _hostexec_candidates() -> list[str]:
    here = Path(__file__).resolve().parent.parent
    return [os.environ.get("REKINDLE_HOSTEXEC", ""), "/usr/local/lib/rekindle/hostexec/rekindle-hostexec",
            str(here / "build" / "hostexec" / "rekindle-hostexec")]


def _status_field(pid: int | str, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(None, 1)[1].strip()
    except OSError:
        return None
    return None


def runtime_pid(init_pid: int) -> int | None:
    """The shim of the container whose init is ``init_pid`` (its parent, outside its pid ns)."""
    ppid = _status_field(init_pid, "PPid")
    if ppid is None or not ppid.isdigit() or int(ppid) <= 0:
        return None
    try:
        if os.stat(f"/proc/{ppid}/ns/pid").st_ino == os.stat(f"/proc/{init_pid}/ns/pid").st_ino:
            return None  # not the runtime: a process inside the container
        os.stat(f"/proc/{ppid}/ns/mnt")
    except OSError:
        return None
    return int(ppid)


def same_mount_ns(pid: int | str) -> bool:
    a, b = os.stat("/proc/self/ns/mnt"), os.stat(f"/proc/{pid}/ns/mnt")
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def host_root(init_pid: int | None) -> int:
    """An O_PATH fd of the root the runtime of that container resolves paths from (the
    plugin's own root when it cannot be told, or for None)."""
    pid = runtime_pid(init_pid) if init_pid is not None else None
    return os.open(f"/proc/{pid}/root" if pid is not None else "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def open_in_root(root_fd: int, path: str, flags: int) -> int:
    """``path`` resolved with ``root_fd`` as / (symlinks included), no /proc magic links."""
    for _ in range(_EAGAIN_RETRIES):
        try:
            return openat2(root_fd, path, flags, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                raise
    raise OSError(errno.EAGAIN, "path kept changing while being resolved", path)


# --- CRIU in the runtime's view -------------------------------------------------------------

@dataclass(frozen=True)
class Userland:
    """The plugin's own files that run CRIU in another view (paths in the plugin's view)."""

    helper: str
    shims: str
    loader: str
    library_path: tuple[str, ...]
    criu: str
    progs: tuple[tuple[str, str], ...]


@dataclass
class Launch:
    same: bool
    argv: list[str] = field(default_factory=list)   # goes right before criu's own argv
    pass_fds: list[int] = field(default_factory=list)
    root: str = ""                                   # the plugin's tree, in CRIU's view
    mounts_pid: int | str = "self"
    extra: list[str] = field(default_factory=list)   # CRIU options this view needs

    def path(self, p: str) -> str:
        return self.root + p if self.root else p


def elf_interpreter(path: str) -> str:
    """PT_INTERP of a 64-bit little-endian ELF file (the dynamic loader it names)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
        phoff, = struct.unpack_from("<Q", head, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack("<IIQQQQ", f.read(40))
            if p_type == 3:  # PT_INTERP
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    raise ValueError(f"{path}: statically linked (no PT_INTERP)")


_LIB = re.compile(r"^\s*(\S+)\s*=>\s*(.*?)\s*(?:\(0x[0-9a-f]+\))?\s*$")


def library_dirs(listing: str) -> list[str]:
    """Directories of the libraries ``ld.so --list`` resolved; ValueError naming a missing one."""
    dirs: list[str] = []
    for line in listing.splitlines():
        m = _LIB.match(line)
        if not m:
            continue
        name, where = m.groups()
        if where in ("", "not found"):
            raise ValueError(f"library {name} not found")
        d = os.path.dirname(os.path.realpath(where))
        if d not in dirs:
            dirs.append(d)
    return dirs


@functools.lru_cache(maxsize=4)
def userland(criu: str) -> Userland:
    """What :func:`criu_launch` needs of the plugin's files; CriuError naming what is missing."""
    helper = next((p for p in _hostexec_candidates() if p and os.access(p, os.X_OK)), None)
    if helper is None:
        raise CriuError("restore", "rekindle-hostexec is missing (make builds it; the image has it in "
                        "/usr/local/lib/rekindle/hostexec): CRIU cannot reach the host's paths")
    resolved = shutil.which(criu)
    if resolved is None:
        raise CriuError("restore", f"no CRIU at {criu}")
    criu_path = os.path.realpath(resolved)
    progs = [(name, os.path.realpath(p)) for name in SHIMMED if (p := shutil.which(name))]
    try:
        loader = os.path.realpath(elf_interpreter(criu_path))
        dirs: list[str] = []
        for prog in (criu_path, *(p for _, p in progs)):
            out = subprocess.run([loader, "--list", prog], capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                raise ValueError(f"{loader} --list {prog}: exit {out.returncode}: {out.stderr.strip()}")
            dirs += [d for d in library_dirs(out.stdout) if d not in dirs]
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise CriuError("restore", f"cannot tell how to run {criu_path} in the host's view: {exc}") from exc
    return Userland(helper=helper, shims=os.path.join(os.path.dirname(helper), "bin"), loader=loader,
                    library_path=tuple(dirs), criu=criu_path, progs=tuple(progs))


def launcher_argv(u: Userland, mntns_fd: int, mount_proc: bool = True) -> list[str]:
    argv = [u.helper, "--mntns-fd", str(mntns_fd), "--at", AT, "--loader", u.loader,
            "--library-path", ":".join(u.library_path), "--shims", u.shims]
    if mount_proc:
        argv.append("--mount-proc")
    for name, path in u.progs:
        argv += ["--prog", f"{name}={path}"]
    return argv + ["--"]


@contextlib.contextmanager
def criu_launch(init_pid: int, criu: str) -> Iterator[Launch]:
    """How CRIU must run to see the paths of the container whose init is ``init_pid``."""
    pid = runtime_pid(init_pid)
    if pid is None or same_mount_ns(pid):
        yield Launch(same=True)
        return
    u = userland(criu)
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        # CRIU's plugin dir: the shims' dir holds no *.so, so no CRIU plugin of the host is loaded.
        yield Launch(same=False, argv=launcher_argv(u, fd), pass_fds=[fd], root=AT, mounts_pid=pid,
                     extra=["--libdir", AT + u.shims])
    finally:
        os.close(fd)


def criu_binary(launch: Launch, criu: str) -> str:
    """The CRIU path to put in argv: the resolved one when the helper maps it into its view."""
    return criu if launch.same else userland(criu).criu
