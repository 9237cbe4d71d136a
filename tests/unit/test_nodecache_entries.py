"""runtime.pages.nodecache on a tmp dir: entries written, held, dropped when changed, evicted
within the bounds, swept; and the entry streamed restores make as they run (begun, joined,
handed to the writer, sealed or abandoned), with their serves' writes stood in for here."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nri_plugin.cache import CacheWriter
from runtime import layout
from runtime.layout import SUM_CHUNK, BulkFile, BulkRange, bulk_file, bulk_sums
from runtime.pages import bulk, nodecache
from runtime.pages.entry import EntryBuild, Left, Share, State
from runtime.pages.mapping import MapMode, Span
from runtime.pages.source import PIECE
from runtime.restore import CacheWork
from runtime.store import Artifact
from runtime.store.volume import ArtifactStore
from tests.unit.test_store import KEY, publish

SIZE = 4 << 20
PID = 1
VADDR = 0x7F0000000000
FILES = (BulkFile(PID, bulk_file(PID), 1, (BulkRange(VADDR, SIZE, 0),)),)
# 2 MiB of the bulk file from 1 MiB on, at an address 1 MiB into its 2 MiB page: its map file
# holds it from 1 MiB on (3 MiB, two pieces)
SPAN = Span(PID, VADDR + (1 << 20), 2 << 20, 1 << 20)
MODE = MapMode.DRIVER


class _Node:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.store = ArtifactStore(str(tmp_path / "store"))
        self.data: dict[str, bytes] = {}

    def publish(self, name: str, seed: int = 0) -> None:
        data = bytes((i * 7 + seed + len(name)) % 251 for i in range(256)) * (SIZE // 256)
        src, sums = self.tmp / f"{name}.bulk", self.tmp / f"{name}.sums"
        src.write_bytes(data)
        bulk.write_sums(str(src), str(sums))
        publish(self.store, name=name, files={bulk_file(PID): data, bulk_sums(PID): sums.read_bytes(),
                                              "criu/core-1.img": b"core", "rootfs-diff.tar": b"tar"})
        self.data[name] = data

    def open(self, name: str) -> Artifact:
        return self.store.open("team-a", name, KEY)


@pytest.fixture
def node(tmp_path: Path) -> _Node:
    n = _Node(tmp_path)
    n.publish("llm")
    return n


def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_bytes: int = 1 << 30,
           max_entries: int = nodecache.MAX_ENTRIES) -> nodecache.NodeCache:
    cache = nodecache.NodeCache(str(tmp_path / "cache"), max_bytes, max_entries)
    monkeypatch.setattr(cache, "_fits", lambda need: None)  # the guards of the host's memory and disk: test_nodecache
    monkeypatch.setattr(cache, "streams_into", lambda: None)  # a tmpfs taking minor faults
    cache.prepare()
    return cache


def _write(cache: nodecache.NodeCache, node: _Node, name: str, **kw: object) -> nodecache.Record | None:
    with node.open(name) as art:
        return cache.write(art, FILES, [SPAN], MODE, threads=2, **kw)  # type: ignore[arg-type]


def _key(node: _Node, name: str) -> str:
    with node.open(name) as art:
        return nodecache.entry_key(art.manifest_id, MODE)


def _listing(cache: nodecache.NodeCache) -> list[str]:
    return sorted(os.listdir(cache.dir))


# --- written, held, dropped ------------------------------------------------------------------


def test_an_entry_holds_the_bulk_file_with_its_mapped_range_apart_sealed(node: _Node, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch)
    rec = _write(cache, node, "llm")
    assert rec is not None and rec.span_list() == [SPAN] and set(rec.files) == {"fill-1.bin", SPAN.name}
    key, data = _key(node, "llm"), node.data["llm"]
    assert _listing(cache) == [key] and cache.has(_manifest(node, "llm"), MODE)
    with node.open("llm") as art:
        held = cache.hold(art, MODE)
    assert held is not None
    try:
        fill, mapped = os.pread(held.fd("fill-1.bin"), SIZE, 0), os.pread(held.fd(SPAN.name), SPAN.file_size, 0)
        # the chunks wholly inside the mapped range are a hole in the fill file
        assert fill[:1 << 20] == data[:1 << 20] and fill[3 << 20:] == data[3 << 20:]
        assert fill[1 << 20:3 << 20] == bytes(2 << 20)
        assert mapped[SPAN.file_offset:] == data[SPAN.offset:SPAN.offset + SPAN.length]
        assert all(held.stat(n).st_mode & 0o777 == 0o444 for n in rec.files)
        fd = held.open_copy("criu/core-1.img")
        try:
            assert os.read(fd, 16) == b"core"
        finally:
            os.close(fd)
        [info] = cache.entries()
        assert (info.key, info.label, info.in_use) == (key, "team-a/llm", True)  # held: locked shared
    finally:
        held.close()
    assert not cache.entries()[0].in_use


def test_an_entry_is_written_once(node: _Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch)
    assert _write(cache, node, "llm") is not None
    assert _write(cache, node, "llm") is None
    assert cache.refused[_key(node, "llm")] == "being written, or written already"


def test_an_entry_changed_since_it_was_sealed_is_dropped(node: _Node, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch)
    _write(cache, node, "llm")
    fill = Path(cache.dir, _key(node, "llm"), "fill-1.bin")
    fill.chmod(0o644)
    with fill.open("r+b") as f:
        f.write(b"x")
    fill.chmod(0o444)  # its mode back: its ctime still tells
    with node.open("llm") as art:
        assert cache.hold(art, MODE) is None
    assert _listing(cache) == []


def test_a_write_that_fails_leaves_nothing_and_frees_its_key(node: _Node, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch)
    with node.open("llm") as art, pytest.raises(nodecache.CacheError, match="does not match its digest"):
        monkeypatch.setattr(bulk, "read_sums", lambda a, f: bytes(32) * (SIZE // SUM_CHUNK))
        cache.write(art, FILES, [SPAN], MODE)
    monkeypatch.undo()
    assert _listing(cache) == [] and cache._writing == {}


# --- bounds ---------------------------------------------------------------------------------


def _age(cache: nodecache.NodeCache, key: str, when: float) -> None:
    os.utime(os.path.join(cache.dir, key), (when, when))  # its last use, as hold() records it


def test_the_least_recently_used_entry_goes_for_one_past_the_entry_bound(node: _Node, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch, max_entries=2)
    for name in ("asr", "tts"):
        node.publish(name)
    _write(cache, node, "llm")
    _write(cache, node, "asr")
    _age(cache, _key(node, "llm"), 2000)
    _age(cache, _key(node, "asr"), 1000)
    assert _write(cache, node, "tts") is not None
    assert _listing(cache) == sorted([_key(node, "llm"), _key(node, "tts")])


def test_entries_go_until_one_more_fits_the_byte_bound(node: _Node, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch, max_bytes=6 << 20)
    node.publish("asr")
    assert _write(cache, node, "llm") is not None
    assert _write(cache, node, "asr") is not None
    assert _listing(cache) == [_key(node, "asr")]
    assert cache.used_bytes() <= 6 << 20


def test_has_room_counts_the_entries_and_both_bounds_and_evicts_nothing(node: _Node, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch, max_bytes=6 << 20, max_entries=2)
    assert cache.has_room(6 << 20) and not cache.has_room((6 << 20) + 1)
    rec = _write(cache, node, "llm")
    assert rec is not None and rec.bytes > 0
    left = (6 << 20) - rec.bytes
    assert cache.has_room(left) and not cache.has_room(left + 1)
    node.publish("asr")
    monkeypatch.setattr(cache, "max_bytes", 1 << 30)
    assert _write(cache, node, "asr") is not None
    assert not cache.has_room(0)  # two entries: the entry bound
    assert _listing(cache) == sorted([_key(node, "llm"), _key(node, "asr")])  # nothing evicted by asking
    monkeypatch.setattr(cache, "max_entries", 3)
    assert cache.has_room(0)
    monkeypatch.setattr(cache, "_fits", lambda need: "the disk guard")
    assert not cache.has_room(0)


def test_an_entry_in_use_is_not_evicted(node: _Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch, max_entries=2)
    for name in ("asr", "tts"):
        node.publish(name)
    _write(cache, node, "llm")
    _write(cache, node, "asr")
    _age(cache, _key(node, "llm"), 1000)  # the older, but a restore holds it
    _age(cache, _key(node, "asr"), 2000)
    with node.open("llm") as art:
        held = cache.hold(art, MODE)
    assert held is not None
    try:
        assert _write(cache, node, "tts") is not None
        assert _listing(cache) == sorted([_key(node, "llm"), _key(node, "tts")])
        with node.open("tts") as art:
            held_too = cache.hold(art, MODE)
        assert held_too is not None
        try:
            node.publish("ocr")
            assert _write(cache, node, "ocr") is None  # both in use: no room
            assert "past the cache's bounds" in cache.refused[_key(node, "ocr")]
        finally:
            held_too.close()
    finally:
        held.close()


def test_another_version_of_the_same_artifact_goes_first(node: _Node, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch, max_entries=2)
    node.publish("asr")
    _write(cache, node, "asr")
    _write(cache, node, "llm")
    old = _key(node, "llm")
    _age(cache, _key(node, "asr"), 1000)  # the least recently used
    _age(cache, old, 2000)
    node.publish("llm", seed=1)  # a new version of it
    assert _key(node, "llm") != old
    assert _write(cache, node, "llm") is not None
    assert _listing(cache) == sorted([_key(node, "asr"), _key(node, "llm")])


def test_a_sweep_removes_evicted_entries_and_dead_writers_leftovers_only(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache(tmp_path, monkeypatch)
    root = Path(cache.dir)
    (root / ".evict-k-1-2").mkdir()
    (root / ".tmp-dead-1").mkdir()
    me = {"node": socket.gethostname(), "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
          "pid": os.getpid(), "start_time": -1, "created": 0.0}  # this pid, but another process
    (root / ".tmp-dead-1" / ".owner.json").write_text(json.dumps(me))
    (root / ".tmp-nobody-1").mkdir()
    (root / ".tmp-mine-1").mkdir()
    fd = os.open(root / ".tmp-mine-1", os.O_RDONLY | os.O_DIRECTORY)
    try:
        nodecache.write_owner_at(fd)
    finally:
        os.close(fd)
    assert cache.sweep() == 3
    assert _listing(cache) == [".tmp-mine-1"]


# --- made by streamed restores as they run -------------------------------------------------


def _manifest(node: _Node, name: str) -> str:
    with node.open(name) as art:
        return art.manifest_id


def _begin(cache: nodecache.NodeCache, node: _Node, name: str = "llm") -> Share | None:
    with node.open(name) as art:
        return cache.begin(art, FILES, [SPAN], MODE)


def _join(cache: nodecache.NodeCache, node: _Node, spans: tuple[Span, ...] = (SPAN,)) -> Share | None:
    with node.open("llm") as art:
        return cache.join(art, spans, MODE)


def _serve(share: Share, data: bytes, pieces: range | None = None) -> None:
    """What the streamed restore's serve does: each piece of the map file written (verified),
    and marked in the book the entry's restores share."""
    book = share.build.book
    for index in pieces if pieces is not None else range(-(-SPAN.file_size // PIECE)):
        lo, hi = max(index * PIECE, SPAN.file_offset), min((index + 1) * PIECE, SPAN.file_size)
        at = SPAN.offset + lo - SPAN.file_offset
        os.pwrite(share.out(SPAN.name), data[at:at + hi - lo], lo)
        book.mark(SPAN.name, index)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[nodecache.NodeCache]:
    yield _cache(tmp_path, monkeypatch)


def test_a_begun_entry_is_an_unfinished_dir_of_empty_map_files_its_restores_share(
        node: _Node, cache: nodecache.NodeCache) -> None:
    first = _begin(cache, node)
    assert first is not None and first.first and first.build.state is State.BUILDING
    tmp = Path(cache.dir, first.build.tmp)
    assert sorted(p.name for p in tmp.iterdir()) == [".owner.json", SPAN.name]
    assert (tmp / SPAN.name).stat().st_size == SPAN.file_size
    assert _begin(cache, node) is None  # one writer of a key
    assert not cache.has(_manifest(node, "llm"), MODE)
    later = _join(cache, node)
    assert later is not None and later.build is first.build and not later.first
    assert _join(cache, node, (Span(PID, VADDR, 1 << 20, 0),)) is None  # other ranges: not this entry
    assert later.leave(False) is Left.STAYS and first.leave(False) is Left.ABANDONED


def test_an_entry_its_restores_leave_unfinished_is_removed_and_its_key_free(
        node: _Node, cache: nodecache.NodeCache) -> None:
    first = _begin(cache, node)
    assert first is not None
    _serve(first, node.data["llm"], range(1))  # one piece of two
    assert first.leave(first.build.book.whole()) is Left.ABANDONED
    assert _listing(cache) == [] and cache._writing == {} and _join(cache, node) is None
    again = _begin(cache, node)
    assert again is not None and again.build is not first.build
    again.leave(False)


def test_an_entry_handed_over_whole_is_sealed_by_the_writer_with_no_mapped_byte_read_again(
        node: _Node, cache: nodecache.NodeCache) -> None:
    first = _begin(cache, node)
    later = _join(cache, node)
    assert first is not None and later is not None
    _serve(first, node.data["llm"], range(1))
    _serve(later, node.data["llm"], range(1, 2))  # restores of one version write the pieces between them
    assert later.leave(True) is Left.HANDED and first.leave(True) is Left.STAYS
    build = later.build
    assert _join(cache, node) is None and build.claim()
    read: list[int] = []
    rec = _write(cache, node, "llm", premade=build, pace=read.append)
    assert rec is not None and build.state is State.SEALED
    assert sum(read) == SIZE - SPAN.length  # the mapped range is not read from the store again
    assert _listing(cache) == [build.key] and cache._writing == {} and cache._building == {}
    with node.open("llm") as art:
        held = cache.hold(art, MODE)
    assert held is not None
    try:
        data = node.data["llm"]
        assert os.pread(held.fd(SPAN.name), SPAN.length, SPAN.file_offset) == data[SPAN.offset:SPAN.offset + SPAN.length]
    finally:
        held.close()
    assert not build.abandon()  # the writer's last word: a no-op


@pytest.mark.parametrize("whole_book", [False, True], ids=["not-whole", "a-hole-in-its-file"])
def test_a_handed_entry_the_writer_cannot_finish_is_abandoned(node: _Node, cache: nodecache.NodeCache,
                                                              whole_book: bool) -> None:
    first = _begin(cache, node)
    assert first is not None
    _serve(first, node.data["llm"], range(1))
    if whole_book:  # marked, but never written: a hole
        first.build.book.mark(SPAN.name, 1)
    assert first.leave(True) is Left.HANDED  # (a restore that said so wrongly)
    build = first.build
    assert build.claim()
    with pytest.raises(nodecache.CacheError, match="not whole" if not whole_book else "did not write it all"):
        _write(cache, node, "llm", premade=build)
    assert build.state is State.ABANDONED
    assert _listing(cache) == [] and cache._writing == {} and cache._building == {}


def test_an_entry_not_claimed_by_the_writer_is_refused_by_its_write(node: _Node, cache: nodecache.NodeCache) -> None:
    first = _begin(cache, node)
    assert first is not None
    _serve(first, node.data["llm"])
    assert first.leave(True) is Left.HANDED
    with pytest.raises(nodecache.CacheError, match="not this one, or not whole"):
        _write(cache, node, "llm", premade=first.build)
    assert first.build.state is State.ABANDONED and _listing(cache) == []


# --- the plugin's writer takes it --------------------------------------------------------


def _handed(cache: nodecache.NodeCache, node: _Node) -> EntryBuild:
    share = _begin(cache, node)
    assert share is not None
    _serve(share, node.data["llm"])
    assert share.leave(True) is Left.HANDED
    return share.build


def _work(node: _Node, build: EntryBuild | None) -> CacheWork:
    return CacheWork("team-a", "llm", _manifest(node, "llm"), FILES, (SPAN,), MODE, premade=build)


def test_the_writer_claims_a_handed_entry_as_it_queues_it_and_seals_it(node: _Node,
                                                                       cache: nodecache.NodeCache) -> None:
    build = _handed(cache, node)
    writer = CacheWriter(cache, node.store, KEY)
    try:
        assert writer.submit(_work(node, build))
        assert build.state in (State.WRITING, State.SEALED)  # the writer's from here on
        assert not build.abandon_unclaimed()  # what the restore does last: nothing now
        assert writer.idle(30)
        assert build.state is State.SEALED and cache.has(_manifest(node, "llm"), MODE)
    finally:
        writer.shutdown()


def test_a_writer_shut_down_abandons_the_entry_it_claimed(node: _Node, cache: nodecache.NodeCache) -> None:
    build = _handed(cache, node)
    writer = CacheWriter(cache, node.store, KEY)
    writer.shutdown()
    assert not writer.submit(_work(node, build))
    assert build.state is State.ABANDONED and _listing(cache) == []


def test_the_writer_does_not_take_an_entry_abandoned_already(node: _Node, cache: nodecache.NodeCache) -> None:
    build = _handed(cache, node)
    build.abandon()
    writer = CacheWriter(cache, node.store, KEY)
    try:
        assert not writer.submit(_work(node, build))
    finally:
        writer.shutdown()


def test_an_entry_copies_only_the_chunks_that_hold_a_range(node: _Node, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What CRIU keeps is punched out of a bulk file (in an older artifact it is there, read by
    no restore): the entry leaves a hole there and its bound counts only the chunks it copies."""
    cache = _cache(tmp_path, monkeypatch)
    ranges = (BulkRange(VADDR, 1 << 20, 0), BulkRange(VADDR + (3 << 20), 4096, 3 << 20))
    files = (BulkFile(PID, bulk_file(PID), 1, ranges),)
    with node.open("llm") as art:
        others = sum(f.size for f in art.manifest.files if not layout.is_bulk_pages(f.path))
        assert nodecache.entry_bytes(art, files) == (2 << 20) + others
        rec = cache.write(art, files, [], MODE, threads=2)
    assert rec is not None
    fill = Path(cache.dir, _key(node, "llm"), "fill-1.bin")
    data, got = node.data["llm"], fill.read_bytes()
    assert len(got) == SIZE
    assert got[:1 << 20] == data[:1 << 20] and got[3 << 20:] == data[3 << 20:]
    assert got[1 << 20:3 << 20] == bytes(2 << 20)  # a hole
    assert os.stat(fill).st_blocks * 512 <= (2 << 20) + (64 << 10)
    assert rec.bytes <= (2 << 20) + (64 << 10) + others


def test_a_zero_chunk_the_store_holds_as_a_hole_stays_a_hole_in_the_entry(node: _Node, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint punches a bulk file's zero chunks out: the entry copies nothing of them."""
    from runtime.fs import holes
    zero = bytearray(node.data["llm"])
    zero[2 << 20:3 << 20] = bytes(1 << 20)
    src, sums = tmp_path / "zero.bulk", tmp_path / "zero.sums"
    src.write_bytes(zero)
    bulk.write_sums(str(src), str(sums))
    publish(node.store, name="zero", files={bulk_file(PID): bytes(zero), bulk_sums(PID): sums.read_bytes(),
                                            "criu/core-1.img": b"core", "rootfs-diff.tar": b"tar"})
    stored = [p for p in Path(node.store.root).rglob(f"pages-{PID}.bulk") if "version-zero-" in str(p)]
    assert len(stored) == 1
    fd = os.open(stored[0], os.O_RDWR)
    try:
        assert holes.punch(fd, [(2 << 20, 1 << 20)])  # as the checkpoint leaves it
    finally:
        os.close(fd)
    cache = _cache(tmp_path, monkeypatch)
    with node.store.open("team-a", "zero", KEY) as art:
        rec = cache.write(art, FILES, [], MODE, threads=2)
    assert rec is not None
    with node.store.open("team-a", "zero", KEY) as art:
        fill = Path(cache.dir, nodecache.entry_key(art.manifest_id, MODE), "fill-1.bin")
    assert fill.read_bytes() == bytes(zero)
    fd = os.open(fill, os.O_RDONLY)
    try:
        assert holes.data_spans(fd) == [(0, 2 << 20), (3 << 20, 1 << 20)]
    finally:
        os.close(fd)


def test_the_byte_bound_counts_no_zero_chunk(node: _Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's KV pool is zero chunks the entry leaves as holes (here held as data in the
    store, as on a file system that cannot punch): its bound counts only the chunks with data,
    so an entry that fits by its data is written though its size does not."""
    zero = bytearray(SIZE)
    zero[:1 << 20] = node.data["llm"][:1 << 20]  # one chunk of data, three of zeros
    src, sums = tmp_path / "kv.bulk", tmp_path / "kv.sums"
    src.write_bytes(zero)
    bulk.write_sums(str(src), str(sums))
    publish(node.store, name="kv", files={bulk_file(PID): bytes(zero), bulk_sums(PID): sums.read_bytes(),
                                          "criu/core-1.img": b"core", "rootfs-diff.tar": b"tar"})
    with node.store.open("team-a", "kv", KEY) as art:
        others = sum(f.size for f in art.manifest.files if not layout.is_bulk_pages(f.path))
        assert nodecache.entry_bytes(art, FILES) == SIZE + others  # without the digests: every chunk
        read = nodecache.stored_sums(art, FILES)
        assert nodecache.entry_bytes(art, FILES, sums=read) == (1 << 20) + others
    cache = _cache(tmp_path, monkeypatch, max_bytes=(2 << 20))
    with node.store.open("team-a", "kv", KEY) as art:
        rec = cache.write(art, FILES, [], MODE, threads=2)
    assert rec is not None, cache.refused
    assert rec.bytes <= (1 << 20) + (64 << 10) + others
    with node.store.open("team-a", "kv", KEY) as art:
        fill = Path(cache.dir, nodecache.entry_key(art.manifest_id, MODE), "fill-1.bin")
    assert fill.read_bytes() == bytes(zero)


def test_digests_that_do_not_verify_leave_the_bound_counting_every_chunk(node: _Node) -> None:
    with node.open("llm") as art:
        real = art.open_file

        def tampered(path: str) -> int:
            fd = real(path)
            if path == bulk_sums(PID):
                os.close(fd)
                r, w = os.pipe()
                os.write(w, bytes(SIZE // SUM_CHUNK * 32))
                os.close(w)
                return r
            return fd
        art.open_file = tampered  # type: ignore[method-assign]
        assert nodecache.stored_sums(art, FILES) == {}


def test_an_entry_forgotten_is_removed_unless_a_restore_holds_it(node: _Node, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry that maps other ranges than this plugin would (made by another version of it) is
    removed, so that the writer can make it again; never from under a restore that holds it."""
    cache = _cache(tmp_path, monkeypatch)
    _write(cache, node, "llm")
    key = _key(node, "llm")
    with node.open("llm") as art:
        held = cache.hold(art, MODE)
    assert held is not None
    try:
        assert not cache.forget(key) and _listing(cache) == [key]
    finally:
        held.close()
    assert cache.forget(key) and _listing(cache) == []
    assert not cache.forget(key)
    assert _write(cache, node, "llm") is not None  # made again
