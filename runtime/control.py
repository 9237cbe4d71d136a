"""The control-dir protocol between the node agent, the in-container init and the workload.

One directory per annotated container, on the host at
``<state>/control/<pod-uid>/<container-name>/`` and inside the container at ``/rekindle`` and
at Dynamo's default ``/snapshot-control`` (the same directory twice), so hooks written for
Dynamo find it whether they read the environment or use the default path. The init runs in
front of the workload's command (:data:`INIT_IN_CONTAINER`); the command it replaced is kept in
the spec annotation :data:`ORIGINAL_ARGS_ANNOTATION` (JSON), read back by :func:`original_args`.
File names are in docs/design.md. The directory is writable by the workload, so everything in
it is untrusted: reads never follow symlinks and are size-capped, writes go to a fresh temp
file (O_EXCL|O_NOFOLLOW) renamed over the target (a planted symlink is replaced, never
followed).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from runtime import names
from runtime.container import oci
from runtime.errors import AnnotationError

CONTAINER_PATH = "/rekindle"
DYNAMO_CONTAINER_PATH = "/snapshot-control"  # Dynamo's default control dir
CONTAINER_PATHS = (CONTAINER_PATH, DYNAMO_CONTAINER_PATH)
ENV_NAMES = ("REKINDLE_CONTROL_DIR", "SNAPSHOT_CONTROL_DIR", "DYN_SNAPSHOT_CONTROL_DIR")
INIT_DIR_IN_CONTAINER = "/.rekindle/bin"
INIT_IN_CONTAINER = INIT_DIR_IN_CONTAINER + "/rekindle-init"
ORIGINAL_ARGS_ANNOTATION = "rekindle.dev/original-args"

READY_FILES = ("ready-for-checkpoint", "ready-for-snapshot")  # ours, then Dynamo's
SNAPSHOT_COMPLETE = "snapshot-complete"
CHECKPOINT_FAILED = "checkpoint-failed"
RESTORE_PID = "restore-pid"
RESTORE_COMPLETE = "restore-complete"
RESTORE_FAILED = "restore-failed"
COLD_START = "cold-start"
# A restore's rootfs changes are not final yet (runtime.overlay.pending): the init must not start
# the original command on that rootfs.
ROOTFS_PENDING = "rootfs-pending"
TIMINGS = "timings.json"
# Everything the agent or init writes; cleared when a container is (re)created.
PROTOCOL_FILES = (*READY_FILES, SNAPSHOT_COMPLETE, CHECKPOINT_FAILED, RESTORE_PID,
                  RESTORE_COMPLETE, RESTORE_FAILED, COLD_START, ROOTFS_PENDING, TIMINGS)
MAX_READ = 64 * 1024




def original_args(spec: oci.Spec) -> list[str]:
    """The container's command before the entrypoint swap (the annotation), else its args."""
    raw = (spec.get("annotations") or {}).get(ORIGINAL_ARGS_ANNOTATION)
    if raw:
        try:
            args = json.loads(raw)
            if isinstance(args, list) and all(isinstance(a, str) for a in args):
                return args
        except ValueError:
            pass
    return [str(a) for a in (spec.get("process") or {}).get("args") or []]


def pod_control_root(state_dir: str | os.PathLike[str], pod_uid: str) -> Path:
    """The parent of a pod's control dirs (validated uid)."""
    if not names.is_pod_uid(pod_uid):
        raise AnnotationError("pod.uid", f"unusable pod uid {pod_uid!r}")
    return Path(state_dir) / "control" / pod_uid


def control_dir_for(state_dir: str | os.PathLike[str], pod_uid: str, container: str) -> ControlDir:
    """The control dir of one container; both components validated (they come from the pod)."""
    root = pod_control_root(state_dir, pod_uid)
    if not names.is_dns_label(container):
        raise AnnotationError("container.name", f"unusable container name {container!r}")
    return ControlDir(root / container)


class ControlDir:
    def __init__(self, path: Path) -> None:
        self.path = path

    def prepare(self) -> None:
        """Create the dir (writable by any uid the workload runs as) and clear stale files."""
        self.path.mkdir(parents=True, exist_ok=True)
        os.chmod(self.path, 0o1777)  # sticky: the workload cannot delete the agent's files
        for name in PROTOCOL_FILES:
            try:
                os.unlink(self.path / name)
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                pass

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path / name)

    def ready(self) -> str | None:
        """Which ready file the workload wrote, if any."""
        return next((n for n in READY_FILES if self.exists(n)), None)

    def read(self, name: str) -> str | None:
        try:
            fd = os.open(self.path / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, OSError):
            return None
        try:
            return os.read(fd, MAX_READ).decode("utf-8", "replace")
        finally:
            os.close(fd)

    def write(self, name: str, content: str) -> None:
        tmp = self.path / f".{name}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, content.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.path / name)

    def write_json(self, name: str, obj: object) -> None:
        self.write(name, json.dumps(obj, indent=2, sort_keys=True) + "\n")

    def remove(self) -> None:
        for entry in self.path.iterdir() if self.path.is_dir() else []:
            if entry.is_dir() and not entry.is_symlink():
                continue
            entry.unlink(missing_ok=True)
        try:
            self.path.rmdir()
            self.path.parent.rmdir()
        except OSError:
            pass
