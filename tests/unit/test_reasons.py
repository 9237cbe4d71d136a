"""Failure reasons are types: each error class the engine raises says what kind of failure it is,
and that kind (not a guess from its words) is what the status, the Event and the metric label
carry. Words are guessed only for what carries no kind."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import nri_plugin
import runtime
from nri_plugin.outcomes import Outcome, OutcomeKind, classify, outcome_of
from runtime.errors import ConfinementError, Reason, RekindleError, reason_of
from runtime.status import ContainerStatus, Phase, StatusBook

# Every error class of the engine and the plugin, and its kind. A new class must be added here:
# the test below fails until it is (a failure must say what it is).
EXPECTED = {
    "runtime.errors.RekindleError": Reason.OTHER, "runtime.errors.ConfigError": Reason.OTHER,
    "runtime.errors.ManagedContainerd": Reason.OTHER, "runtime.errors.KeyMissing": Reason.OTHER,
    "runtime.errors.AnnotationError": Reason.ANNOTATION, "runtime.errors.StoreError": Reason.STORE,
    "runtime.errors.ArtifactRejected": Reason.INTEGRITY, "runtime.errors.TreeTooLarge": Reason.STORE,
    "runtime.errors.ArtifactNotFound": Reason.NOT_FOUND, "runtime.errors.OverlayError": Reason.RUNTIME,
    "runtime.errors.ContainerNotFound": Reason.RUNTIME, "runtime.errors.ImageUnknown": Reason.RUNTIME,
    "runtime.errors.NamespaceError": Reason.RUNTIME, "runtime.errors.ConfinementError": Reason.PRIVILEGE,
    "runtime.errors.CriuError": Reason.CRIU, "runtime.errors.CudaError": Reason.CUDA,
    "runtime.errors.CudaStuck": Reason.CUDA, "runtime.errors.SourceResumeFailed": Reason.CUDA,
    "runtime.errors.CheckpointRefused": Reason.INCOMPATIBLE,
    "runtime.errors.CudaUnavailable": Reason.CUDA, "runtime.errors.AlreadyAttempted": Reason.ALREADY_ATTEMPTED,
    "runtime.errors.Incompatible": Reason.INCOMPATIBLE, "runtime.errors.LessPrivileged": Reason.PRIVILEGE,
    "runtime.errors.SharedPidNamespace": Reason.INCOMPATIBLE,
    "runtime.containerd.client.ContainerdError": Reason.RUNTIME,
    "runtime.pod.hooks.HookFailed": Reason.RUNTIME,  # the workload did not answer its release-path call
    "runtime.containerd.cri_lookup.CRIError": Reason.RUNTIME,
    "runtime.pages.serve.StreamError": Reason.CRIU, "runtime.pages.serve.StreamIntegrityError": Reason.INTEGRITY,
    "runtime.restore.RestoreRolledBackBadly": Reason.RUNTIME, "runtime.pages.bulk.FillError": Reason.INTEGRITY,
    "runtime.pages.chunks.IntegrityError": Reason.INTEGRITY, "runtime.criu.lazy_pages.LazyPagesError": Reason.CRIU,
    "runtime.overlay.tar._Invalid": Reason.RUNTIME, "runtime.hostfiles.HostFilesError": Reason.INCOMPATIBLE,
    "runtime.pages.mapping.MapError": Reason.INTEGRITY, "runtime.pages.nodecache.CacheError": Reason.STORE,
    "runtime.gpu.cuda.CudaTimeout": Reason.CUDA, "runtime.gpu.cuda.GpuMapError": Reason.INCOMPATIBLE,
    "nri_plugin.restore_target.TargetRefused": Reason.RUNTIME,
    "nri_plugin.jobs.Skipped": Reason.OTHER,  # the guards' own texts: classed by their words
}


def _all_errors() -> dict[str, type[RekindleError]]:
    for pkg in (runtime, nri_plugin):
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if ".criu_proto" in mod.name or mod.name.endswith("__main__") or ".proto" in mod.name:
                continue
            try:
                importlib.import_module(mod.name)
            except ImportError:  # optional dependencies (kubernetes, prometheus): not the engine's
                continue
    found: dict[str, type[RekindleError]] = {}
    todo: list[type[RekindleError]] = [RekindleError]
    while todo:
        cls = todo.pop()
        found[f"{cls.__module__}.{cls.__qualname__}"] = cls
        todo += cls.__subclasses__()
    return {k: v for k, v in found.items() if k.startswith(("runtime.", "nri_plugin."))}


def test_every_error_type_says_its_reason() -> None:
    found = _all_errors()
    assert sorted(set(found) - set(EXPECTED)) == [], "error classes without a decided reason"
    for name, cls in found.items():
        assert cls.reason_class is EXPECTED[name], name


def test_a_rejection_says_whether_privilege_or_compatibility() -> None:
    from runtime.errors import ArtifactRejected
    assert ArtifactRejected("a/b", "source runs as uid 0", Reason.PRIVILEGE).reason_class is Reason.PRIVILEGE
    assert ArtifactRejected("a/b", "bad signature").reason_class is Reason.INTEGRITY


CONFINE = [  # runtime/container/confine.py's own messages: "restored" holds "store"
    "the restored mount tree lacks the target's mounts at /data",
    "restored mounts still lack the target's flags: /data ro",
    "cannot set limits of restored process 4242: [Errno 1] Operation not permitted",
    "restored process 4242 kept oom_score_adj 0 (want 1000)",
]


@pytest.mark.parametrize("message", CONFINE)
def test_confine_failures_are_counted_as_privilege_not_store(tmp_path, message: str) -> None:
    exc = ConfinementError(message)
    book = StatusBook(tmp_path)
    book.record(ContainerStatus(namespace="ns", pod="p", container="c", role="restore", artifact="a",
                                phase=Phase.COLD_START, reason=str(exc), container_id="x", pod_uid="u",
                                reason_class=reason_of(exc).value))  # type: ignore[union-attr]
    got = outcome_of(book.read("ns", "p", "c"))  # type: ignore[arg-type]
    assert got is not None and got.reason_class is Reason.PRIVILEGE
    assert classify(message) is Reason.STORE  # what guessing from the words said


def test_words_are_guessed_only_without_a_recorded_reason() -> None:
    plain = Outcome(OutcomeKind.COLD_START, "restore", "ns", "p", "u", "c", "x", "a", reason="criu restore failed: x")
    assert plain.reason_class is Reason.CRIU
    said = Outcome(OutcomeKind.COLD_START, "restore", "ns", "p", "u", "c", "x", "a", reason="criu restore failed: x",
                   reason_kind="integrity")
    assert said.reason_class is Reason.INTEGRITY
    assert reason_of(ValueError("x")) is None and reason_of(RekindleError("x")) is None
