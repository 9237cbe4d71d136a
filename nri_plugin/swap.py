"""Entrypoint swap: make a container run the Rekindle init in front of its original command.

Two strategies, picked once per runtime connection from its NRI version:

* ``ARGS_ADJUSTMENT`` (NRI >= 0.10, containerd >= 2.2): ``ContainerAdjustment.args`` in the
  CreateContainer reply. Atomic with the create; nothing can race it.
* ``SPEC_UPDATE`` (NRI 0.6/0.8, containerd 1.7 – 2.1, which ignore ``args``): in the
  PostCreateContainer handler, read the container's stored spec through containerd's
  Containers API and write it back with ``process.args`` replaced (``update_mask: ["spec"]``),
  *before* replying. containerd calls PostCreate inline before it answers the CRI create, and
  the task's bundle is written from the stored spec at StartContainer, so the update always
  lands first. If the plugin is absent or too slow, nothing is swapped: the container starts
  cold, which is the fail-safe outcome for Rekindle.

The original args are kept in the spec annotation ``rekindle.dev/original-args`` (JSON).
"""

from __future__ import annotations

import copy
import json
from enum import Enum
from typing import Protocol

from runtime.container import oci
from runtime.control import CONTAINER_PATH, INIT_IN_CONTAINER, ORIGINAL_ARGS_ANNOTATION

from .events import RuntimeInfo

__all__ = ["ORIGINAL_ARGS_ANNOTATION", "SpecAccess", "Strategy", "choose", "init_command", "is_swapped",
           "swap_by_spec_update", "swapped_spec"]


class Strategy(Enum):
    ARGS_ADJUSTMENT = "args-adjustment"
    SPEC_UPDATE = "spec-update"


class SpecAccess(Protocol):
    def get_spec(self, container_id: str) -> oci.Spec: ...
    def update_spec(self, container_id: str, spec: oci.Spec) -> object: ...


def choose(runtime: RuntimeInfo) -> Strategy:
    return Strategy.ARGS_ADJUSTMENT if runtime.supports_args_adjustment else Strategy.SPEC_UPDATE


def init_command(mode: str, timeout: int, original: list[str], fail_closed: bool = False) -> list[str]:
    """The init in front of ``original``; the init falls back to ``original`` on any failure,
    unless ``fail_closed`` (then it exits with the reason instead)."""
    closed = ["--on-failure", "fail"] if fail_closed else []
    return [INIT_IN_CONTAINER, "--mode", mode, "--control", CONTAINER_PATH,
            "--timeout", str(timeout), *closed, "--", *original]


def is_swapped(args: list[str]) -> bool:
    return bool(args) and args[0] == INIT_IN_CONTAINER


def swapped_spec(spec: oci.Spec, mode: str, timeout: int, fail_closed: bool = False) -> oci.Spec:
    """A copy of ``spec`` whose process runs the init; unknown fields are kept as they are."""
    new = copy.deepcopy(spec)
    process = new.get("process")
    if not isinstance(process, dict) or not isinstance(process.get("args"), list) or not process["args"]:
        raise ValueError("spec has no process.args to swap")
    original = [str(a) for a in process["args"]]
    if is_swapped(original):
        return new  # already done (e.g. a replayed PostCreate)
    process["args"] = init_command(mode, timeout, original, fail_closed)
    annotations = new.setdefault("annotations", {})
    annotations[ORIGINAL_ARGS_ANNOTATION] = json.dumps(original)
    return new


def swap_by_spec_update(access: SpecAccess, container_id: str, mode: str, timeout: int,
                        spec: oci.Spec | None = None, fail_closed: bool = False) -> list[str]:
    """Rewrite the stored spec (``spec``: the one just read in this handler, if any, saving a
    round trip to containerd); returns the new args."""
    spec = access.get_spec(container_id) if spec is None else spec
    new = swapped_spec(spec, mode, timeout, fail_closed)
    access.update_spec(container_id, new)
    return list(new["process"]["args"])
