"""runtime.store.keys: the HMAC key as kubelet mounts it, as the plugin creates it, and every way a
key path can be wrong (each one line, never a hang or a traceback)."""

from __future__ import annotations

import os
import signal
import socket
import stat
from pathlib import Path

import pytest

from runtime.errors import ConfigError, KeyMissing
from runtime.fs import openat2
from runtime.store.keys import create_key, load_key, read_key
from tests.e2e.kubelet_volumes import project

KEY = bytes(range(32))


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    """Every case runs with the kernel's openat2 and with the walk kept for older kernels."""
    if request.param == "walk":
        monkeypatch.setattr(openat2, "_have_openat2", False)
    return request.param


@pytest.fixture
def deadline():
    """Fail, instead of hanging the suite, when a read blocks (the old reader did on a FIFO)."""
    def expired(signum, frame):
        raise TimeoutError("reading the key blocked")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, 5)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _key_file(path: Path, content: bytes = KEY, mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


# --- the kubelet Secret layout -----------------------------------------------------------------

def test_reads_a_key_mounted_as_kubelet_mounts_a_secret(tmp_path, resolver):
    ts = project(tmp_path, {"hmac.key": KEY}, mode=0o400)
    assert (tmp_path / "hmac.key").is_symlink() and (tmp_path / "..data").is_symlink()
    assert os.readlink(tmp_path / "hmac.key") == "..data/hmac.key"
    assert os.readlink(tmp_path / "..data") == ts.name
    assert read_key(tmp_path / "hmac.key") == KEY


def test_reads_the_new_key_after_kubelet_updates_the_secret(tmp_path, resolver):
    project(tmp_path, {"hmac.key": KEY}, mode=0o400)
    project(tmp_path, {"hmac.key": KEY[::-1]}, mode=0o400)
    assert read_key(tmp_path / "hmac.key") == KEY[::-1]


def test_kubelet_default_mode_0644_is_refused(tmp_path, resolver):
    project(tmp_path, {"hmac.key": KEY})  # no defaultMode in the pod spec
    with pytest.raises(ConfigError, match=r"mode 0644 is group/world accessible \(want 0400 or 0600\)"):
        read_key(tmp_path / "hmac.key")


@pytest.mark.parametrize("link", [
    "ABS",                         # absolute, to a key outside the directory
    "../outside/hmac.key",         # relative, climbing out
    "..data/../../outside/hmac.key",
], ids=["absolute", "dotdot", "dotdot-through-data"])
def test_a_link_leading_outside_the_directory_is_refused(tmp_path, resolver, link):
    outside = tmp_path / "outside"
    outside.mkdir()
    _key_file(outside / "hmac.key")
    volume = tmp_path / "volume"
    volume.mkdir()
    project(volume, {"other": b"x"}, mode=0o400)
    (volume / "hmac.key").symlink_to(str(outside / "hmac.key") if link == "ABS" else link)
    with pytest.raises(ConfigError, match=r"a symlink leads outside .*/volume \(refused\)$"):
        read_key(volume / "hmac.key")


def test_a_data_link_pointing_outside_is_refused(tmp_path, resolver):
    """An attacker who could swap ``..data`` still cannot point the key elsewhere."""
    (tmp_path / "elsewhere").mkdir()
    _key_file(tmp_path / "elsewhere" / "hmac.key")
    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "..data").symlink_to("../elsewhere")
    (volume / "hmac.key").symlink_to("..data/hmac.key")
    with pytest.raises(ConfigError, match="leads outside"):
        read_key(volume / "hmac.key")


def test_a_symlink_loop_is_refused(tmp_path, resolver):
    (tmp_path / "hmac.key").symlink_to("loop")
    (tmp_path / "loop").symlink_to("hmac.key")
    with pytest.raises(ConfigError, match="symlink loop"):
        read_key(tmp_path / "hmac.key")


# --- not a regular file, or no file at all: one line, no hang ----------------------------------

def _fifo(p: Path) -> None:
    os.mkfifo(p, 0o600)


def _dir(p: Path) -> None:
    p.mkdir(mode=0o700)


def _socket(p: Path) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    s.close()


@pytest.mark.parametrize("make,kind", [(_fifo, "a FIFO"), (_dir, "a directory"), (_socket, "a socket")],
                         ids=["fifo", "directory", "socket"])
@pytest.mark.parametrize("through_link", [False, True], ids=["direct", "via-kubelet-links"])
def test_a_key_path_that_is_not_a_regular_file_is_one_clear_error(tmp_path, resolver, deadline, make, kind,
                                                                   through_link):
    if through_link:
        ts = project(tmp_path, {"other": b"x"}, mode=0o400)
        make(ts / "hmac.key")
        (tmp_path / "hmac.key").symlink_to("..data/hmac.key")
    else:
        make(tmp_path / "hmac.key")
    with pytest.raises(ConfigError) as exc:
        read_key(tmp_path / "hmac.key")
    assert str(exc.value) == f"HMAC key {tmp_path}/hmac.key: is {kind}, not a regular file"


def test_a_missing_directory_is_key_missing(tmp_path, resolver):
    path = tmp_path / "absent" / "hmac.key"
    for call in (read_key, create_key, lambda p: load_key(p, create=True)):
        with pytest.raises(KeyMissing) as exc:
            call(path)
        assert exc.value.path == str(path)
        assert str(exc.value) == f"no HMAC key at {path}: directory {tmp_path}/absent does not exist"
    assert os.listdir(tmp_path) == []


def test_a_directory_path_that_is_a_file_is_a_clear_error(tmp_path, resolver):
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"cannot open directory .*/file: Not a directory"):
        read_key(tmp_path / "file" / "hmac.key")


@pytest.mark.parametrize("dangling", [False, True], ids=["absent", "dangling-link"])
def test_reading_never_creates_a_key(tmp_path, resolver, dangling):
    if dangling:
        (tmp_path / "hmac.key").symlink_to("..data/hmac.key")
    with pytest.raises(KeyMissing) as exc:
        load_key(tmp_path / "hmac.key")
    assert str(exc.value) == f"no HMAC key at {tmp_path}/hmac.key"
    assert os.listdir(tmp_path) == (["hmac.key"] if dangling else [])


# --- the checks on the file itself -------------------------------------------------------------

@pytest.mark.parametrize("content, mode, needle", [
    (KEY, 0o640, "mode 0640 is group/world accessible"),
    (KEY, 0o604, "mode 0604 is group/world accessible"),
    (KEY[:31], 0o600, "31 bytes, want 32"),
    (KEY + b"x", 0o600, "33 bytes, want 32"),
    (b"", 0o400, "0 bytes, want 32"),
], ids=["group-readable", "world-readable", "short", "long", "empty"])
def test_unsafe_key_files_are_refused(tmp_path, resolver, content, mode, needle):
    _key_file(tmp_path / "hmac.key", content, mode)
    with pytest.raises(ConfigError, match=needle):
        read_key(tmp_path / "hmac.key")


def test_a_key_owned_by_someone_else_is_refused(tmp_path, resolver):
    if os.geteuid() != 0:
        pytest.skip("giving a file away needs root")
    _key_file(tmp_path / "hmac.key")
    os.chown(tmp_path / "hmac.key", 65534, 65534)
    with pytest.raises(ConfigError, match="owned by uid 65534, not 0"):
        read_key(tmp_path / "hmac.key")


@pytest.mark.parametrize("mode", [0o400, 0o600])
def test_owner_only_modes_are_accepted(tmp_path, resolver, mode):
    _key_file(tmp_path / "hmac.key", mode=mode)
    assert read_key(tmp_path / "hmac.key") == KEY


# --- creating ----------------------------------------------------------------------------------

def test_create_makes_a_0600_key_once(tmp_path, resolver):
    path = tmp_path / "hmac.key"
    key = load_key(path, create=True)
    assert len(key) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_key(path, create=True) == key == read_key(path)
    assert create_key(path) == key  # never replaces a key that is there
    assert os.listdir(tmp_path) == ["hmac.key"]


def test_create_does_not_paper_over_a_bad_key(tmp_path, resolver):
    _key_file(tmp_path / "hmac.key", mode=0o644)
    with pytest.raises(ConfigError, match="group/world accessible"):
        load_key(tmp_path / "hmac.key", create=True)
    assert (tmp_path / "hmac.key").read_bytes() == KEY
