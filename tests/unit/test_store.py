"""Artifact store: names, versioned atomic publish, reads through one fd, verified copies,
locks against removal while read, list, delete, prune and sweep of leftovers."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import threading
from pathlib import Path

import blake3
import pytest

from runtime import digests
from runtime.errors import ArtifactNotFound, ArtifactRejected, StoreError
from runtime.fs import holes
from runtime.manifest import (
    CriuInfo,
    FileEntry,
    Manifest,
    NodeInfo,
    ProcessInfo,
    SecurityProfile,
    Source,
    sign,
)
from runtime.proc.owner import Owner
from runtime.rollback import GenerationBook
from runtime.store import gc as store_gc
from runtime.store.volume import ArtifactStore, validate_name, validate_namespace

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
    """Publish and return the version directory the name now points to."""
    manifest = make_manifest(namespace=namespace, name=name, **changes)
    with store.stage(namespace, name) as staging:
        for rel, data in (files if files is not None else {"criu/core-1.img": b"core",
                                                            "rootfs-diff.tar": b"tar"}).items():
            path = Path(staging.path, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        staging.publish(manifest, KEY)
    link = Path(store.root, namespace, name)
    return link.parent / os.readlink(link)


def resign(version_dir: Path, manifest: Manifest) -> None:
    data = manifest.to_json()
    (version_dir / "manifest.json").write_bytes(data)
    (version_dir / "manifest.json.sig").write_text(sign(data, KEY))


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
    version = publish(store)
    assert sorted(p.name for p in version.iterdir()) == [
        "criu", "manifest.json", "manifest.json.sig", "rootfs-diff.tar"]
    assert sorted(os.listdir(tmp_path / "team-a")) == [version.name, "qwen-7b"]
    assert version.name.startswith(".version-qwen-7b-")
    with store.open("team-a", "qwen-7b", KEY) as artifact:
        assert artifact.version == version.name
        assert [(f.path, f.size) for f in artifact.manifest.files] == [
            ("criu/core-1.img", 4), ("rootfs-diff.tar", 3)]
        assert artifact.manifest.files[1].digest == blake3.blake3(b"tar").hexdigest()
        assert artifact.manifest.generation > 0
        artifact.verify_files()


def test_stage_is_removed_when_the_body_raises(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(RuntimeError):
        with store.stage("team-a", "x") as staging:
            Path(staging.path, "f").write_bytes(b"1")
            raise RuntimeError("boom")
    assert not (tmp_path / "team-a").exists()  # nothing reaches the store before publish
    assert not os.path.exists(staging.path)


def test_publish_whose_owner_record_cannot_be_written_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def full(path: str, data: bytes, dir_fd: int | None = None, *, exclusive: bool = False) -> None:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=dir_fd))  # created, then the disk is full
        raise OSError(28, "No space left on device")
    from runtime.proc import owner
    monkeypatch.setattr(owner, "write_file", full)
    with pytest.raises(StoreError, match="No space left"):
        with ArtifactStore(str(tmp_path)).stage("team-a", "x") as staging:
            staging.publish(make_manifest(namespace="team-a", name="x"), KEY)
    assert os.listdir(tmp_path / "team-a") == []


def test_stage_left_unpublished_is_removed(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    (tmp_path / "private").mkdir(mode=0o700)
    with store.stage("team-a", "x", private_root=str(tmp_path / "private")) as staging:
        assert os.path.dirname(staging.path) == str(tmp_path / "private")
        assert stat.S_IMODE(os.stat(staging.path).st_mode) == 0o700
    assert os.listdir(tmp_path / "private") == []
    assert not (tmp_path / "team-a").exists()


def test_publish_refuses_a_manifest_for_another_artifact(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    with pytest.raises(StoreError, match="staging is for team-a/other"):
        with store.stage("team-a", "other") as staging:
            staging.publish(make_manifest(), KEY)
    assert not (tmp_path / "team-a").exists()


def test_publish_refuses_a_symlink_in_staging(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    (tmp_path / "secret").write_bytes(b"s")
    with pytest.raises(StoreError):
        with store.stage("team-a", "qwen-7b") as staging:
            os.symlink(tmp_path / "secret", os.path.join(staging.path, "link"))
            staging.publish(make_manifest(), KEY)
    assert os.listdir(tmp_path / "team-a") == []


def test_publish_replaces_an_existing_artifact_with_a_newer_generation(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"old": b"1"})
    with store.open("team-a", "qwen-7b", KEY) as first:
        gen1 = first.manifest.generation
    version = publish(store, files={"new": b"2"})
    with store.open("team-a", "qwen-7b", KEY) as artifact:
        assert [f.path for f in artifact.manifest.files] == ["new"]
        assert artifact.manifest.generation > gen1
    assert sorted(os.listdir(tmp_path / "team-a")) == [version.name, "qwen-7b"]  # old one removed


def test_concurrent_reader_never_sees_a_half_written_artifact(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"gen": b"0"}, timings={"gen": 0.0})
    problems: list[str] = []
    done = threading.Event()

    def reader() -> None:
        while not done.is_set():
            try:
                with store.open("team-a", "qwen-7b", KEY) as art:
                    m = art.manifest
                    got = os.pread(art.open_file("gen"), 64, 0)
            except Exception as exc:  # noqa: BLE001 - any other failure is the bug we look for
                problems.append(repr(exc))
                continue
            if [f.size for f in m.files] != [len(str(int(m.timings["gen"])))] or got != str(int(m.timings["gen"])).encode():
                problems.append(f"inconsistent version {m} {got!r}")

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
    shutil.copytree(final, tmp_path / "team-b" / final.name)
    (tmp_path / "team-b" / "qwen-7b").symlink_to(final.name)
    with pytest.raises(ArtifactRejected, match="manifest names team-a/qwen-7b, found at team-b"):
        store.open("team-b", "qwen-7b", KEY)


def test_open_rejects_a_name_pointing_at_another_names_version(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    (tmp_path / "team-a" / "other").symlink_to(final.name)
    with pytest.raises(ArtifactRejected, match="not to a version of other"):
        store.open("team-a", "other", KEY)


@pytest.mark.parametrize("target", ["/etc", "../team-b/.version-qwen-7b-1-0123456789abcdef",
                                    ".version-qwen-7b-1-0123456789abcdef/../x", "qwen-7b"],
                         ids=["absolute", "other-namespace", "dotdot", "loop"])
def test_open_refuses_a_pointer_that_is_not_a_plain_version_name(tmp_path: Path, target: str) -> None:
    publish(ArtifactStore(str(tmp_path)))
    link = tmp_path / "team-a" / "qwen-7b"
    link.unlink()
    link.symlink_to(target)
    with pytest.raises(ArtifactRejected, match="not to a version of qwen-7b"):
        ArtifactStore(str(tmp_path)).open("team-a", "qwen-7b", KEY)


@pytest.mark.parametrize("where", ["namespace", "version", "manifest", "signature"],
                         ids=["symlinked-namespace", "symlinked-version", "symlinked-manifest",
                              "symlinked-signature"])
def test_open_rejects_symlinks_in_the_artifact_path(tmp_path: Path, where: str) -> None:
    store = ArtifactStore(str(tmp_path / "store"))
    real = publish(ArtifactStore(str(tmp_path / "elsewhere")))
    ns = tmp_path / "store" / "team-a"
    if where == "namespace":
        (tmp_path / "store").mkdir()
        ns.symlink_to(real.parent)
    elif where == "version":
        ns.mkdir(parents=True)
        (ns / real.name).symlink_to(real)
        (ns / "qwen-7b").symlink_to(real.name)
    else:
        shutil.copytree(real, ns / real.name)
        (ns / "qwen-7b").symlink_to(real.name)
        target = ns / real.name / ("manifest.json" if where == "manifest" else "manifest.json.sig")
        target.unlink()
        target.symlink_to(real / target.name)
    with pytest.raises(ArtifactRejected, match="symlink"):
        store.open("team-a", "qwen-7b", KEY)


def test_open_of_a_missing_artifact_raises_not_found(tmp_path: Path) -> None:
    with pytest.raises(ArtifactNotFound):
        ArtifactStore(str(tmp_path)).open("team-a", "nothing", KEY)


def test_open_of_a_plain_directory_at_the_name_is_refused(tmp_path: Path) -> None:
    (tmp_path / "team-a" / "qwen-7b").mkdir(parents=True)
    with pytest.raises(ArtifactRejected, match="not a published name"):
        ArtifactStore(str(tmp_path)).open("team-a", "qwen-7b", KEY)


def test_open_of_a_version_without_manifest_is_rejected_as_incomplete(tmp_path: Path) -> None:
    version = ".version-qwen-7b-5-0123456789abcdef"
    (tmp_path / "team-a" / version).mkdir(parents=True)
    (tmp_path / "team-a" / "qwen-7b").symlink_to(version)
    with pytest.raises(ArtifactRejected, match="incomplete: no manifest.json"):
        ArtifactStore(str(tmp_path)).open("team-a", "qwen-7b", KEY)


def test_a_manifest_in_a_version_dir_of_another_generation_is_refused(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    renamed = final.with_name(".version-qwen-7b-99999999999999999-0123456789abcdef")
    final.rename(renamed)
    link = tmp_path / "team-a" / "qwen-7b"
    link.unlink()
    link.symlink_to(renamed.name)
    with pytest.raises(ArtifactRejected, match="does not match its version"):
        store.open("team-a", "qwen-7b", KEY)


@pytest.mark.parametrize("change, needle", [
    (lambda d: (d / "rootfs-diff.tar").write_bytes(b"TAR"), "file rootfs-diff.tar: content changed"),
    (lambda d: (d / "rootfs-diff.tar").write_bytes(b"tarx"), "file rootfs-diff.tar: content changed"),
    (lambda d: (d / "criu" / "core-1.img").unlink(), "file criu/core-1.img: missing"),
    (lambda d: ((d / "rootfs-diff.tar").unlink(), (d / "rootfs-diff.tar").symlink_to("/etc/hostname")),
     "file rootfs-diff.tar: is a symlink"),
    (lambda d: (shutil.rmtree(d / "criu"), (d / "criu").symlink_to(d.parent)),
     "file criu/core-1.img: is a symlink"),
], ids=["changed-same-size", "changed-size", "missing", "file-symlink", "dir-symlink"])
def test_verify_files_reports_the_first_bad_file(tmp_path: Path, change: object,
                                                 needle: str) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    with store.open("team-a", "qwen-7b", KEY) as artifact:
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
    with store.open("team-a", "qwen-7b", KEY) as art:
        manifest = art.manifest
    resign(final, dataclasses.replace(manifest, files=(FileEntry(path, 0, "e3" * 32),)))
    with store.open("team-a", "qwen-7b", KEY) as art, pytest.raises(ArtifactRejected, match="unsafe path"):
        art.verify_files()


def test_list_checks_signatures_and_reports_bad_entries(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    good_b = publish(store, namespace="team-b", name="good")
    (tmp_path / "team-a" / ".staging-x-123").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "team-a" / "plain-dir").mkdir()
    (tmp_path / "team-a" / "Bad_Name").symlink_to(".version-Bad_Name-1-0123456789abcdef")
    (good_b / "manifest.json").write_bytes(b"{")
    rows = {(r.namespace, r.name): r for r in store.list(key=KEY)}
    assert sorted(rows) == [("team-a", "Bad_Name"), ("team-a", "plain-dir"), ("team-a", "qwen-7b"),
                            ("team-b", "good")]
    assert rows["team-a", "qwen-7b"].manifest is not None and rows["team-a", "qwen-7b"].problem is None
    assert "invalid artifact name" in (rows["team-a", "Bad_Name"].problem or "")
    assert "not a published name" in (rows["team-a", "plain-dir"].problem or "")
    assert "bad signature" in (rows["team-b", "good"].problem or "")


def test_list_survives_a_deeply_nested_manifest(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    final = publish(store)
    deep = b"[" * 100000 + b"]" * 100000
    (final / "manifest.json").write_bytes(deep)
    (final / "manifest.json.sig").write_text(sign(deep, KEY))
    [row] = store.list(key=KEY)
    assert row.manifest is None and "nested deeper" in (row.problem or "")


def test_list_of_an_empty_store_is_empty(tmp_path: Path) -> None:
    assert ArtifactStore(str(tmp_path / "missing")).list() == []


def test_delete_removes_the_name_and_its_version(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    store.delete("team-a", "qwen-7b")
    assert os.listdir(tmp_path / "team-a") == []
    with pytest.raises(ArtifactNotFound):
        store.delete("team-a", "qwen-7b")


def test_delete_refuses_while_a_restore_reads_the_artifact(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    version = publish(store)
    reading = store.open("team-a", "qwen-7b", KEY)
    with pytest.raises(StoreError, match="a restore is reading it"):
        store.delete("team-a", "qwen-7b")
    assert (tmp_path / "team-a" / "qwen-7b").is_symlink() and version.is_dir()
    threading.Timer(0.3, reading.close).start()
    store.delete("team-a", "qwen-7b", wait=10)  # waits for the reader, then removes
    assert os.listdir(tmp_path / "team-a") == []


def test_a_republish_leaves_a_version_being_read_for_the_sweep(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    old = publish(store, files={"f": b"old"})
    with store.open("team-a", "qwen-7b", KEY) as reading:
        new = publish(store, files={"f": b"new"})
        assert old.is_dir()  # still read: not removed
        fd = reading.open_file("f")
        assert os.pread(fd, 16, 0) == b"old"  # the reader keeps its version
        os.close(fd)
        assert [x.kind for x in store_gc.leftovers(store)] == ["unreferenced-version"]
        assert store_gc.sweep(store, grace=0) == []  # locked: kept
    assert [x.entry for x in store_gc.sweep(store, grace=0)] == [old.name]
    assert sorted(os.listdir(tmp_path / "team-a")) == [new.name, "qwen-7b"]


def test_reader_reads_only_the_version_it_opened_across_rename_and_republish(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    v1 = publish(store, files={"criu/pages-1.img": b"A" * 5000, "plan": b"uid 1000"})
    with store.open("team-a", "qwen-7b", KEY) as art:
        # Another tenant: the version dir renamed away and a new one in its place, then a
        # same-name re-publish (the name now points at a different signed version).
        v1.rename(v1.with_name(".moved"))
        shutil.copytree(v1.with_name(".moved"), v1)
        (v1 / "plan").write_bytes(b"uid 0000")
        publish(store, files={"criu/pages-1.img": b"B" * 5000, "plan": b"uid 0 admin"})
        dest = tmp_path / "private"
        dest.mkdir()
        art.copy_verified("plan", str(dest / "plan"))
        art.copy_verified("criu/pages-1.img", str(dest / "pages"))
        assert (dest / "plan").read_bytes() == b"uid 1000"
        assert (dest / "pages").read_bytes() == b"A" * 5000


def test_a_listed_file_rewritten_through_a_hard_link_is_refused_on_copy(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    v1 = publish(store, files={"rootfs-diff.tar": b"T" * 4096})
    os.link(v1 / "rootfs-diff.tar", tmp_path / "elsewhere")
    with store.open("team-a", "qwen-7b", KEY) as art:
        (tmp_path / "elsewhere").write_bytes(b"X" * 4096)  # same inode, new bytes
        with pytest.raises(ArtifactRejected, match="content changed"):
            art.copy_verified("rootfs-diff.tar", str(tmp_path / "copy"))
    assert not (tmp_path / "copy").exists()  # nothing unverified is left to be used


def test_materialize_copies_all_but_skipped_files_and_verifies_them(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path / "s"))
    publish(store, files={"criu/core-1.img": b"core", "bulk/pages-1.bulk": b"P" * 8192, "plan": b"p"})
    with store.open("team-a", "qwen-7b", KEY) as art:
        copied = art.materialize(str(tmp_path / "priv"), skip=lambda p: p.startswith("bulk/"))
    assert copied == 5
    assert sorted(str(p.relative_to(tmp_path / "priv")) for p in (tmp_path / "priv").rglob("*")
                  if p.is_file()) == ["criu/core-1.img", "plan"]
    assert oct((tmp_path / "priv").stat().st_mode & 0o777) == "0o700"


def test_sweep_removes_dead_owners_staging_and_keeps_live_and_foreign_ones(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    ns = tmp_path / "team-a"

    def staging(name: str, owner: dict[str, object]) -> None:
        (ns / name).mkdir()
        (ns / name / "pages.img").write_bytes(b"x" * 4096)
        (ns / name / ".owner.json").write_text(json.dumps(owner))

    me = dataclasses.asdict(Owner.me())
    staging(".staging-live-1", me)
    staging(".staging-dead-pid-1", {**me, "pid": 999999999, "start_time": 1})
    staging(".staging-old-boot-1", {**me, "boot_id": "another-boot"})
    staging(".staging-other-node-1", {**me, "node": "another-node"})
    staging(".staging-other-node-old-1", {**me, "node": "another-node", "created": me["created"] - 2 * 86400})
    (ns / ".link-qwen-7b-0123456789abcdef").symlink_to("nowhere")
    kinds = {x.entry: x.kind for x in store_gc.leftovers(store)}
    assert kinds[".staging-live-1"] == "staging" and kinds[".link-qwen-7b-0123456789abcdef"] == "link"
    removed = sorted(x.entry for x in store_gc.sweep(store, grace=0))
    assert removed == [".link-qwen-7b-0123456789abcdef", ".staging-dead-pid-1", ".staging-old-boot-1",
                       ".staging-other-node-old-1"]
    assert (ns / ".staging-live-1").is_dir() and (ns / ".staging-other-node-1").is_dir()


def test_a_killed_publisher_leaves_a_staging_dir_the_next_sweep_removes(tmp_path: Path) -> None:
    import subprocess
    import sys
    # Killed while the publish copies into the store (the only time the store holds a staging dir).
    code = ("import sys, os, signal; from runtime.store import volume as st; from tests.unit.test_store import make_manifest; "
            "s = st.ArtifactStore(sys.argv[1]).stage('team-a', 'x'); "
            "open(os.path.join(s.path, 'pages.img'), 'wb').write(b'p' * 65536); "
            "real = st._transfer; "
            "st._transfer = lambda *a: (real(*a), os.kill(os.getpid(), signal.SIGKILL)); "
            "s.publish(make_manifest(namespace='team-a', name='x'), b'k' * 32)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=Path(__file__).parents[2])
    store = ArtifactStore(str(tmp_path))
    [left] = store_gc.leftovers(store)
    assert left.kind == "staging" and left.owner is not None and left.bytes >= 65536
    assert [x.entry for x in store_gc.sweep(store)] == [left.entry]
    assert os.listdir(tmp_path / "team-a") == []


def test_prune_keeps_the_newest_versions_and_removes_old_artifacts(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    old1 = publish(store, name="a")
    with store.open("team-a", "a", KEY):  # held: the re-publish keeps it around
        publish(store, name="a")
    newest = publish(store, name="a")
    assert old1.is_dir()
    assert store_gc.prune(store, keep_last=1) == [f"team-a/{old1.name}"]
    assert sorted(os.listdir(tmp_path / "team-a")) == [newest.name, "a"]
    assert store_gc.prune(store, older_than=3600) == []
    assert store_gc.prune(store, older_than=0) == ["team-a/a"]
    assert os.listdir(tmp_path / "team-a") == []


def test_generation_book_refuses_a_rollback(tmp_path: Path) -> None:
    book = GenerationBook(tmp_path)
    book.check("team-a", "m", 5)
    book.record("team-a", "m", 5)
    book.record("team-a", "m", 3)  # never lowers
    book.check("team-a", "m", 5)
    book.check("team-a", "m", 6)
    with pytest.raises(ArtifactRejected, match="rollback"):
        book.check("team-a", "m", 4)


def test_large_file_digest_is_by_pieces_and_catches_one_flipped_byte(tmp_path):
    """Files over one piece are hashed piecewise in parallel; a change anywhere is still caught."""
    big = tmp_path / "big.img"
    with open(big, "wb") as f:
        f.truncate(2 * digests.PIECE + 12345)
        f.seek(digests.PIECE + 7)
        f.write(b"payload")
    fd = os.open(big, os.O_RDONLY)
    try:
        size, digest = digests.hash_fd(fd)
    finally:
        os.close(fd)
    assert size == 2 * digests.PIECE + 12345
    assert digest != blake3.blake3(big.read_bytes()).hexdigest()  # the two-level form
    with open(big, "r+b") as f:
        f.seek(2 * digests.PIECE + 100)
        f.write(b"\x01")
    fd = os.open(big, os.O_RDONLY)
    try:
        assert digests.hash_fd(fd)[1] != digest
    finally:
        os.close(fd)


@pytest.mark.parametrize("moved", [True, False], ids=["renamed-in", "copied-in"])
def test_publish_moves_or_copies_the_private_tree_and_records_its_bytes(tmp_path: Path, monkeypatch, moved) -> None:
    from runtime.store import volume as store_mod
    if not moved:  # the store on another file system than the private dir
        monkeypatch.setattr(store_mod, "_move", lambda *a: False)
    store = ArtifactStore(str(tmp_path / "store"))
    data = {"criu/core-1.img": b"core", "bulk/pages-1.bulk": os.urandom(3 << 20), "restore-plan.json": b"{}"}
    version = publish(store, files=data)
    for rel, content in data.items():
        assert (version / rel).read_bytes() == content
    with store.open("team-a", "qwen-7b", KEY) as artifact:
        artifact.verify_files()
    assert not list(version.parent.glob(".staging-*"))


def test_publish_never_writes_through_a_name_planted_in_the_store(tmp_path: Path, monkeypatch) -> None:
    """Another writer of the store plants a symlink to a host file in the staging dir while the
    publish copies into it: the publish fails, the host file is untouched."""
    from runtime.store import volume as store_mod
    victim = tmp_path / "authorized_keys"
    victim.write_text("victim\n")
    real = store_mod._transfer

    def planted(src_root: str, dst_fd: int, label: str, known=None):  # type: ignore[no-untyped-def]
        os.mkdir("criu", dir_fd=dst_fd)
        os.symlink(victim, "criu/core-1.img", dir_fd=dst_fd)
        return real(src_root, dst_fd, label, known)

    monkeypatch.setattr(store_mod, "_transfer", planted)
    monkeypatch.setattr(store_mod, "_move", lambda *a: False)
    store = ArtifactStore(str(tmp_path / "store"))
    with pytest.raises(StoreError, match="File exists"):
        publish(store)
    assert victim.read_text() == "victim\n"
    assert os.listdir(tmp_path / "store" / "team-a") == []


def test_deleting_an_artifact_with_a_deep_tree_planted_in_its_version_does_not_recurse(tmp_path: Path) -> None:
    """Another writer nests 1500 directories inside a published version: delete (and the
    removal of the version a re-publish replaces) removes it without RecursionError."""
    store = ArtifactStore(str(tmp_path))
    for _ in range(2):
        version = publish(store)
        fd = os.open(version, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for _ in range(1500):
                os.mkdir("d", dir_fd=fd)
                sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = sub
        finally:
            os.close(fd)
    store.delete("team-a", "qwen-7b")
    assert os.listdir(tmp_path / "team-a") == []


def test_open_of_a_version_opens_that_one_and_no_other(tmp_path: Path) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store, files={"old": b"1"})
    with store.open("team-a", "qwen-7b", KEY) as first:
        old = first.version
        # held (as a restore holds it): the next publish leaves this version in place
        publish(store, files={"new": b"2"})
        with store.open("team-a", "qwen-7b", KEY, version=old) as pinned:
            assert pinned.version == old and [f.path for f in pinned.manifest.files] == ["old"]
    with store.open("team-a", "qwen-7b", KEY) as now:
        assert now.version != old
    store_gc.sweep(store, grace=0)  # nothing holds it now: swept
    with pytest.raises(ArtifactNotFound, match="is gone"):
        store.open("team-a", "qwen-7b", KEY, version=old)


@pytest.mark.parametrize("version", [".version-other-1-0123456789abcdef", "../x", ".version-qwen-7b", "qwen-7b"])
def test_open_of_a_version_refuses_what_is_not_a_version_of_the_name(tmp_path: Path, version: str) -> None:
    store = ArtifactStore(str(tmp_path))
    publish(store)
    with pytest.raises(ArtifactRejected, match="is not a version of qwen-7b"):
        store.open("team-a", "qwen-7b", KEY, version=version)


def test_a_store_writer_racing_a_same_mount_publish_never_gets_its_bytes_signed(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The store on the private dir's file system (files renamed in): another writer of the store
    rewrites each file the moment it becomes reachable there. The signed digests are the private
    bytes', so a reader finds the rewritten file corrupt instead of trusting it."""
    from runtime.store import volume as store_mod
    real = store_mod._move
    rewritten: list[str] = []

    def racing(src_dir: str, base: str, dst_fd: int) -> bool:
        moved = real(src_dir, base, dst_fd)
        assert moved, "the store is on the private dir's file system: a rename"
        fd = os.open(base, os.O_WRONLY | os.O_TRUNC, dir_fd=dst_fd)  # the writer, by its path
        try:
            os.write(fd, b"the writer's bytes")
        finally:
            os.close(fd)
        rewritten.append(base)
        return moved

    monkeypatch.setattr(store_mod, "_move", racing)
    store = ArtifactStore(str(tmp_path / "store"))
    data = {"rootfs.tar": b"the layer" * 1000, "criu/core-1.img": b"core", "restore-plan.json": b"{}"}
    publish(store, files=data)
    assert sorted(rewritten) == sorted(os.path.basename(r) for r in data)
    def digest_of(content: bytes) -> str:
        (tmp_path / "probe").write_bytes(content)
        fd = os.open(tmp_path / "probe", os.O_RDONLY)
        try:
            return digests.hash_fd(fd)[1]
        finally:
            os.close(fd)
    with store.open("team-a", "qwen-7b", KEY) as artifact:
        signed = {f.path: f for f in artifact.manifest.files}
        for rel, content in data.items():
            assert (signed[rel].size, signed[rel].digest) == (len(content), digest_of(content)), rel
        with pytest.raises(ArtifactRejected):
            artifact.verify_files()


def test_racing_same_name_publishes_leave_no_unreferenced_version(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Publish B reads the name, then publish A runs start to end, then B makes its version and
    switches: the version A pointed the name at is removed at once (it was left for the sweep's
    grace), and only B's stays."""
    from runtime.store import volume as store_mod
    store = ArtifactStore(str(tmp_path / "store"))
    publish(store)  # a first version: both racers read it as the previous one
    from runtime.fs.fdfs import rename_noreplace as real
    raced: list[str] = []

    def a_first(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
        if src.startswith(".staging-") and not raced:  # B's staging dir becoming its version
            raced.append(dst)
            publish(store)  # A
        real(src_fd, src, dst_fd, dst)

    monkeypatch.setattr(store_mod, "rename_noreplace", a_first)
    b = publish(store)
    assert b.name == raced[0]
    versions = [p.name for p in (tmp_path / "store" / "team-a").iterdir() if p.name.startswith(".version-")]
    assert versions == [b.name], versions
    with store.open("team-a", "qwen-7b", KEY) as artifact:
        artifact.verify_files()


def test_a_copy_while_hashed_keeps_the_holes_of_its_source(tmp_path):
    """A bulk file holds only the runs moved out of CRIU's images, at their offsets: a copy into
    the store (another file system) or into a private dir must not fill its holes with zeros."""
    src, dst = tmp_path / "src.bulk", tmp_path / "dst.bulk"
    size = digests.PIECE + (8 << 20)
    with open(src, "wb") as f:
        f.truncate(size)
        for at in (0, digests.PIECE - 4096, size - 4096):  # one run across the pieces' edge
            f.seek(at)
            f.write(os.urandom(8192 if at < size - 4096 else 4096))
    fd, out = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        assert digests.hash_fd(fd, out) == digests.hash_fd(fd)
    finally:
        os.close(fd)
        os.close(out)
    assert dst.read_bytes() == src.read_bytes()
    assert os.stat(dst).st_blocks * 512 <= 20 * 4096 + (1 << 20)


def test_a_listing_counts_the_bytes_a_version_takes_not_its_holes(tmp_path):
    store = ArtifactStore(str(tmp_path))
    version = publish(store, files={"bulk/pages-1.bulk": os.urandom(8 << 20), "plan": b"x"})
    bulk = version / "bulk/pages-1.bulk"
    bulk.chmod(0o600)
    fd = os.open(bulk, os.O_RDWR)
    try:
        holes.punch(fd, [(1 << 20, 6 << 20)])  # as the split leaves what CRIU keeps
    finally:
        os.close(fd)
    (row,) = store.list("team-a", key=KEY)
    assert (2 << 20) <= row.stored_bytes <= (2 << 20) + (256 << 10)
