"""An artifact always carries its image's id: the engine refuses a checkpoint without it, and the
plugin's engine asks containerd again while it does not answer (a restart takes seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nri_plugin.agent import NodeEngine
from runtime.checkpoint import CheckpointRequest, checkpoint
from runtime.errors import ImageUnknown
from runtime.store.volume import ArtifactStore


def test_a_checkpoint_naming_an_image_without_its_id_is_refused_before_anything(tmp_path: Path) -> None:
    req = CheckpointRequest(containerd_state=str(tmp_path / "no-containerd"), container_id="c1", namespace="default",
                            name="m", pod="p", pod_uid="u", container="app", image="app:1", image_ref="",
                            exit_after=False, log_dir=str(tmp_path / "logs"))
    with pytest.raises(ImageUnknown, match="app:1"):
        checkpoint(req, ArtifactStore(str(tmp_path / "store")), b"k" * 32)
    assert not os.path.exists(tmp_path / "store" / "default") and not os.path.exists(tmp_path / "logs")


def _engine(answers: list[str]) -> tuple[NodeEngine, list[str]]:
    asked: list[str] = []

    def lookup(image: str) -> str:
        asked.append(image)
        return answers.pop(0) if answers else ""

    engine = NodeEngine.__new__(NodeEngine)  # only the image lookup is exercised
    engine.image_ref = lookup
    engine.image_id_wait, engine.image_id_every = 2.0, 0.01
    return engine, asked


def test_the_image_id_is_asked_again_until_containerd_answers() -> None:
    engine, asked = _engine(["", "", "sha256:aa"])
    assert engine._image_id("app:1") == "sha256:aa" and len(asked) == 3


def test_the_image_id_wait_has_a_deadline_and_no_image_asks_nothing() -> None:
    engine, asked = _engine([])
    engine.image_id_wait = 0.05
    assert engine._image_id("app:1") == "" and len(asked) >= 2
    assert engine._image_id("") == "" and asked.count("") == 0
