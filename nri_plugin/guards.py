"""The rules that narrow down what Rekindle acts on, beyond what the annotations say.

- A checkpoint source whose artifact is already published is skipped, unless the pod asks
  ``rekindle.dev/overwrite: "true"``: a restarted source container (a Deployment's, or a Job's
  retry) must not checkpoint again, and again. "Published" means a valid, signed artifact of
  that name: an entry someone planted in the shared store cannot block a checkpoint.
- A pod that names no container (``rekindle.dev/container``, kubectl's default-container) is
  checkpointed only if it runs no other container at checkpoint time (its sidecars are all
  started by then; init containers have exited), and restored only into the container named
  like the artifact's source container. NRI does not tell a plugin the pod's containers at
  create time, so these are the moments where the answer is certain.
- A container whose pid namespace is not its own (``hostPID``: no pid namespace of its own in the
  OCI spec; ``shareProcessNamespace``: the pod sandbox's, joined by path) is neither
  checkpointed nor restored: a failed restore's clean-up must reach the restored tree only, and
  a dump would take the pod's or the node's other tasks' pids. Decided here from the spec, and
  again from /proc when the job runs (``runtime.container.namespaces.pid_namespace_shared``).
Each rule returns the reason to skip (its wording is what ``outcomes.classify`` recognises),
or None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from runtime.errors import ArtifactRejected, StoreError
from runtime.manifest import Manifest
from runtime.store import ArtifactStore

from .policy import CONTAINER, DEFAULT_CONTAINER, OVERWRITE, Intent


def published(store: ArtifactStore, key: bytes, namespace: str, name: str) -> Manifest | None:
    """The manifest of the valid artifact ``namespace/name``, if there is one (reads the manifest only)."""
    try:
        with store.open(namespace, name, key) as artifact:
            return artifact.manifest
    except (StoreError, ArtifactRejected):
        return None  # absent, or not a valid artifact: nothing worth keeping


def existing_artifact(store: ArtifactStore, key: bytes, namespace: str, intent: Intent) -> str | None:
    if intent.overwrite:
        return None
    manifest = published(store, key, namespace, intent.artifact)
    if manifest is None:
        return None
    return (f"artifact {namespace}/{intent.artifact} is already published (created {manifest.created_at}); "
            f"not checkpointing again: set {OVERWRITE}: \"true\" to replace it")


def other_containers(intent: Intent, me: str, running: Iterable[tuple[str, str]]) -> str | None:
    """``running``: (container id, name) of the pod's running or created containers."""
    if intent.named:
        return None
    others = sorted({name for cid, name in running if cid != me})
    if not others:
        return None
    return (f"the pod runs several containers ({', '.join(others)} besides this one) and names none: "
            f"set {CONTAINER} or {DEFAULT_CONTAINER}; no checkpoint taken")


def source_container_mismatch(intent: Intent, container: str, manifest: Manifest) -> str | None:
    source = manifest.source.container
    if intent.named or not source or source == container:
        return None
    return (f"not the artifact's source container ({source!r}); left alone: set {CONTAINER}: {container} "
            f"to restore into this one")


RunningContainers = Callable[[str], list[tuple[str, str]]]


def shared_pid_namespace(namespaces: Iterable[tuple[str, str]]) -> str | None:
    """Why a container with these OCI linux namespaces ((type, path)) has no pid namespace of
    its own, or None."""
    listed = list(namespaces)
    if not listed:
        return None  # not told (no linux section): the job looks in /proc
    pid = [path for kind, path in listed if kind == "pid"]
    if not pid:
        return "the container's pid namespace is not its own (none made for it: hostPID)"
    if pid[0]:  # containerd names the sandbox's (shareProcessNamespace) or the node's (hostPID)
        return (f"the container's pid namespace is not its own (it joins {pid[0]}: shareProcessNamespace "
                "or hostPID)")
    return None
