"""Artifact store: names, atomic publish, defensive open, file verification, list and delete."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import threading
from pathlib import Path

import pytest

from runtime.errors import ArtifactNotFound, ArtifactRejected, StoreError
from runtime.manifest import (
    CriuInfo, FileEntry, Manifest, NodeInfo, ProcessInfo, SecurityProfile, Source, sign,
)
from runtime.store import ArtifactStore, validate_name, validate_namespace

KEY = b"s" * 32


def make_manifest(**changes: object) -> Manifest:
    base = Manifest(
        name="qwen-7b", namespace="team-a", created_at="2025-01-02T03:04:05+00:00",
        source=Source(pod="p", pod_uid="u", container="c", container_id="cid", image="img:1",
                      image_ref="sha256:" + "1" * 64),
        node=NodeInfo(hostname="node-1", kernel="6.8.0", arch="x86_64"),
        criu=CriuInfo(version="4.1"), cuda=None,
        security=SecurityProfile(uid=1000, gid=1000, additional_gids=(), capabilities=(),
                                 privileged=False, seccomp="unconfined", no_new_privileges=True),
        process=ProcessInfo(root_pid=7, args=("serve",)), mounts=(), files=(), timings={})
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def publish(store: ArtifactStore, namespace: str = "team-a", name: str = "qwen-7b",
            files: dict[str, bytes] | None = None, **changes: object) -> Path:
    manifest = make_manifest(namespace=namespace, name=name, **changes)
    with store.stage(namespace, name) as staging:
        for rel, data in (files if files is not None else {"criu/core-1.img": b"core",
                                                            "rootfs-diff.tar": b"tar"}).items():
            path = Path(staging.path, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        staging.publish(manifest, KEY)
    return Path(store.root, namespace, name)


def resign(artifact_dir: Path, manifest: Manifest) -> None:
    data = manifest.to_json()
    (artifact_dir / "manifest.json").write_bytes(data)
    (artifact_dir / "manifest.json.sig").write_text(sign(data, KEY))


@pytest.mark.parametrize("value", ["a", "team-a", "0", "a" * 63],
                         ids=["one-char", "dashed", "digit", "63-chars"])
def test_validate_namespace_accepts_dns_labels(value: str) -> None:
    assert validate_namespace(value) == value


@pytest.mark.parametrize("value", ["", "A", "-a", "a-", "a.b", "a/b", "..", "a\n", "a" * 64,
                                   "a_b", "é"],
                         ids=["empty", "upper", "leading-dash", "trailing-dash", "dot", "slash",
                              "dotdot", "newline", "64-chars", "underscore", "non-ascii"])
def test_validate_namespace_rejects_non_labels(value: str) -> None:
    with pytest.raises(StoreError, match="invalid namespace"):
        validate_namespace(value)


@pytest.mark.parametrize("value", ["qwen-7b", "llama.3.1-8b", "a", "a" * 63],
                         ids=["dashed", "dotted", "one-char", "63-chars"])
def test_validate_name_accepts_artifact_names(value: str) -> None:
    assert validate_name(value) == value


@pytest.mark.parametrize("value", ["", ".", "..", ".hidden", "a.", "-a", "a/b", "../a", "A",
                                   "a\x00", "a\n", "a" * 64, "a b"],
                         ids=["empty", "dot", "dotdot", "leading-dot", "trailing-dot",
                              "leading-dash", "slash", "traversal", "upper", "nul", "newline",
                              "64-chars", "space"])
def test_validate_name_rejects_unsafe_names(value: str) -> None:
    with pytest.raises(StoreError, match="invalid artifact name"):
        validate_name(value)


def test_stage_refuses_invalid_names_before_touching_disk(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(StoreError):
        store.stage("..", "x")
    with pytest.raises(StoreError):
        store.stage("ns", "../../etc")
    assert list(tmp_path.iterdir()) == []


def test_publish_then_open_returns_the_signed_manifest_with_file_digests(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    assert sorted(p.name for p in final.iterdir()) == [
        "criu", "manifest.json", "manifest.json.sig", "rootfs-diff.tar"]
    assert os.listdir(tmp_path / "team-a") == ["qwen-7b"]
    artifact = store.open("team-a", "qwen-7b", KEY)
    assert artifact.path == str(final)
    assert [(f.path, f.size) for f in artifact.manifest.files] == [
        ("criu/core-1.img", 4), ("rootfs-diff.tar", 3)]
    assert artifact.manifest.files[1].sha256 == hashlib.sha256(b"tar").hexdigest()
    artifact.verify_files()


def test_stage_is_removed_when_the_body_raises(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(RuntimeError):
        with store.stage("team-a", "x") as staging:
            Path(staging.path, "f").write_bytes(b"1")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path / "team-a") == []


def test_stage_left_unpublished_is_removed(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    with store.stage("team-a", "x") as staging:
        assert os.path.basename(staging.path).startswith(".staging-x-")
    assert os.listdir(tmp_path / "team-a") == []


def test_publish_refuses_a_manifest_for_another_artifact(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(StoreError, match="staging is for team-a/other"):
        with store.stage("team-a", "other") as staging:
            staging.publish(make_manifest(), KEY)
    assert os.listdir(tmp_path / "team-a") == []


def test_publish_refuses_a_symlink_in_staging(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    (tmp_path / "secret").write_bytes(b"s")
    with pytest.raises(StoreError):
        with store.stage("team-a", "qwen-7b") as staging:
            os.symlink(tmp_path / "secret", os.path.join(staging.path, "link"))
            staging.publish(make_manifest(), KEY)
    assert os.listdir(tmp_path / "team-a") == []


def test_publish_replaces_an_existing_artifact_and_leaves_no_trash(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"old": b"1"})
    publish(store, files={"new": b"2"})
    artifact = store.open("team-a", "qwen-7b", KEY)
    assert [f.path for f in artifact.manifest.files] == ["new"]
    assert os.listdir(tmp_path / "team-a") == ["qwen-7b"]
    artifact.verify_files()


def test_concurrent_reader_never_sees_a_half_written_artifact(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"gen": b"0"}, timings={"gen": 0.0})
    problems: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                m = store.open("team-a", "qwen-7b", KEY).manifest
            except ArtifactNotFound:
                continue  # between the two renames of a replace
            except Exception as exc:  # noqa: BLE001 - any other failure is the bug we look for
                problems.append(repr(exc))
                continue
            if [f.size for f in m.files] != [len(str(int(m.timings["gen"])))]:
                problems.append(f"inconsistent manifest {m}")

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for gen in range(1, 40):
            publish(store, files={"gen": str(gen).encode()}, timings={"gen": float(gen)})
    finally:
        done.set()
        thread.join()
    assert problems == []


def test_open_rejects_a_tampered_manifest_as_bad_signature(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    data = (final / "manifest.json").read_bytes().replace(b'"uid":1000', b'"uid":0')
    (final / "manifest.json").write_bytes(data)
    with pytest.raises(ArtifactRejected, match="bad signature"):
        store.open("team-a", "qwen-7b", KEY)


def test_open_rejects_a_manifest_signed_with_another_key(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    with pytest.raises(ArtifactRejected, match="bad signature"):
        store.open("team-a", "qwen-7b", b"x" * 32)


def test_open_checks_the_signature_before_parsing(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    (final / "manifest.json").write_bytes(b"not json")
    with pytest.raises(ArtifactRejected, match="bad signature"):
        store.open("team-a", "qwen-7b", KEY)


def test_open_rejects_manifest_copied_into_another_namespace(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    (tmp_path / "team-b").mkdir()
    shutil.copytree(final, tmp_path / "team-b" / "qwen-7b")
    with pytest.raises(ArtifactRejected, match="manifest names team-a/qwen-7b, found at team-b"):
        store.open("team-b", "qwen-7b", KEY)


def test_open_rejects_manifest_copied_under_another_name(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    shutil.copytree(final, tmp_path / "team-a" / "other")
    with pytest.raises(ArtifactRejected, match="found at team-a/other"):
        store.open("team-a", "other", KEY)


@pytest.mark.parametrize("where", ["namespace", "artifact", "manifest", "signature"],
                         ids=["symlinked-namespace", "symlinked-artifact", "symlinked-manifest",
                              "symlinked-signature"])
def test_open_rejects_symlinks_in_the_artifact_path(tmp_path: Path, where: str) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    real = publish(ArtifactStore(str(tmp_path / "elsewhere")))
    ns = tmp_path / "store" / "team-a"
    if where == "namespace":
        (tmp_path / "store").mkdir()
        ns.symlink_to(real.parent)
    elif where == "artifact":
        ns.mkdir(parents=True)
        (ns / "qwen-7b").symlink_to(real)
    else:
        shutil.copytree(real, ns / "qwen-7b")
        target = ns / "qwen-7b" / ("manifest.json" if where == "manifest" else "manifest.json.sig")
        target.unlink()
        target.symlink_to(real / target.name)
    with pytest.raises(ArtifactRejected, match="symlink"):
        store.open("team-a", "qwen-7b", KEY)


def test_open_of_a_missing_artifact_raises_not_found(tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotFound):
        ArtifactStore(str(tmp_path)).open("team-a", "nothing", KEY)


def test_open_of_a_dir_without_manifest_is_rejected_as_incomplete(tmp_path: Path) -> None:
    (tmp_path / "team-a" / "qwen-7b").mkdir(parents=True)
    with pytest.raises(ArtifactRejected, match="incomplete: no manifest.json.sig"):
        ArtifactStore(str(tmp_path)).open("team-a", "qwen-7b", KEY)


@pytest.mark.parametrize("change, needle", [
    (lambda d: (d / "rootfs-diff.tar").write_bytes(b"TAR"), "file rootfs-diff.tar: content changed"),
    (lambda d: (d / "rootfs-diff.tar").write_bytes(b"tarx"), "file rootfs-diff.tar: content changed"),
    (lambda d: (d / "criu" / "core-1.img").unlink(), "file criu/core-1.img: missing"),
    (lambda d: (d / "criu" / "extra.img").write_bytes(b""), "file criu/extra.img: not in the manifest"),
    (lambda d: ((d / "rootfs-diff.tar").unlink(), (d / "rootfs-diff.tar").symlink_to("/etc/hostname")),
     "file rootfs-diff.tar: is a symlink"),
    (lambda d: (shutil.rmtree(d / "criu"), (d / "criu").symlink_to(d.parent)),
     "file criu/core-1.img: is a symlink"),
], ids=["changed-same-size", "changed-size", "missing", "extra", "file-symlink", "dir-symlink"])
def test_verify_files_reports_the_first_bad_file(tmp_path: Path, change: object,
                                                 needle: str) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    artifact = store.open("team-a", "qwen-7b", KEY)
    change(final)  # type: ignore[operator]
    with pytest.raises(ArtifactRejected, match=needle):
        artifact.verify_files()


@pytest.mark.parametrize("path", ["/etc/shadow", "../team-b/x", "criu/../../x", "./a", "a//b",
                                  "manifest.json", "criu/"],
                         ids=["absolute", "dotdot", "inner-dotdot", "dot", "empty-component",
                              "manifest-itself", "trailing-slash"])
def test_verify_files_rejects_unsafe_paths_in_a_signed_manifest(tmp_path: Path, path: str) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store, files={})
    manifest = store.open("team-a", "qwen-7b", KEY).manifest
    resign(final, dataclasses.replace(manifest, files=(FileEntry(path, 0, "e3" * 32),)))
    with pytest.raises(ArtifactRejected, match="unsafe path"):
        store.open("team-a", "qwen-7b", KEY).verify_files()


def test_list_skips_dot_dirs_and_reports_broken_entries(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    publish(store, namespace="team-b", name="good")
    (tmp_path / "team-a" / ".staging-x-123").mkdir()
    (tmp_path / "team-a" / ".trash-x-123").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "team-a" / "empty").mkdir()
    (tmp_path / "team-a" / "Bad_Name").mkdir()
    (tmp_path / "team-a" / "file").write_bytes(b"")
    (tmp_path / "team-b" / "good" / "manifest.json").write_bytes(b"{")
    rows = {(r.namespace, r.name): r for r in store.list()}
    assert sorted(rows) == [("team-a", "Bad_Name"), ("team-a", "empty"), ("team-a", "file"),
                            ("team-a", "qwen-7b"), ("team-b", "good")]
    assert rows["team-a", "qwen-7b"].manifest is not None and rows["team-a", "qwen-7b"].problem is None
    assert "invalid artifact name" in (rows["team-a", "Bad_Name"].problem or "")
    assert "incomplete" in (rows["team-a", "empty"].problem or "")
    assert "not a directory" in (rows["team-a", "file"].problem or "")
    assert "not valid JSON" in (rows["team-b", "good"].problem or "")
    assert "bad signature" in (store.list("team-b", key=KEY)[0].problem or "")
    assert [r.name for r in store.list("team-a", key=KEY) if r.problem is None] == ["qwen-7b"]


def test_list_of_an_empty_store_is_empty(tmp_path: Path) -> None:
    assert ArtifactStore(str(tmp_path / "missing")).list() == []


def test_delete_removes_the_artifact_and_leaves_no_trash(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    store.delete("team-a", "qwen-7b")
    assert os.listdir(tmp_path / "team-a") == []
    with pytest.raises(ArtifactNotFound):
        store.delete("team-a", "qwen-7b")


def test_delete_of_a_symlinked_artifact_removes_the_link_only(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    real = publish(ArtifactStore(str(tmp_path / "elsewhere")))
    (tmp_path / "store" / "team-a").mkdir(parents=True)
    (tmp_path / "store" / "team-a" / "qwen-7b").symlink_to(real)
    store.delete("team-a", "qwen-7b")
    assert (real / "manifest.json").exists()
    assert os.listdir(tmp_path / "store" / "team-a") == []


def test_large_file_digest_is_by_pieces_and_catches_one_flipped_byte(tmp_path):
    """Files over one piece are hashed piecewise in parallel; a change anywhere is still caught."""
    import hashlib

    from runtime import store as store_mod
    big = tmp_path / "big.img"
    with open(big, "wb") as f:
        f.truncate(2 * store_mod.PIECE + 12345)
        f.seek(store_mod.PIECE + 7)
        f.write(b"payload")
    fd = os.open(big, os.O_RDONLY)
    try:
        size, digest = store_mod._hash_fd(fd)
    finally:
        os.close(fd)
    assert size == 2 * store_mod.PIECE + 12345
    assert digest != hashlib.sha256(big.read_bytes()).hexdigest()  # the two-level form
    with open(big, "r+b") as f:
        f.seek(2 * store_mod.PIECE + 100)
        f.write(b"\x01")
    fd = os.open(big, os.O_RDONLY)
    try:
        assert store_mod._hash_fd(fd)[1] != digest
    finally:
        os.close(fd)
