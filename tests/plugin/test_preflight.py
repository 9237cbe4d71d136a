"""`rekindle doctor`'s checks that connect: the NRI socket (one ttrpc exchange through the mux,
without registering), containerd's config as containerd merges it (imports), the store."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from nri_plugin.preflight import check_nri_socket
from runtime.doctor import check_containerd_api, check_nri_config, check_store

from .fake_runtime import FakeRuntime


class RuntimeThread:
    """The Python NRI runtime on its own loop, so the check's asyncio.run can talk to it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.registered = []

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main():
            async with FakeRuntime(self.path) as rt:
                self.stop = asyncio.Event()
                self.ready.set()
                conn_task = asyncio.create_task(rt.next_plugin(timeout=30))
                await self.stop.wait()
                if conn_task.done() and not conn_task.exception():
                    conn = conn_task.result()
                    self.registered.append(conn.registered.done())
                    conn.close()
                conn_task.cancel()
        self.loop.run_until_complete(main())

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(5)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(5)


def test_nri_socket_check_completes_a_ttrpc_exchange_without_registering(tmp_path):
    path = str(tmp_path / "nri.sock")
    with RuntimeThread(path) as rt:
        check = check_nri_socket(path)
    assert check.ok, check
    assert "ttrpc exchange ok (the runtime answered Unimplemented" in check.detail
    assert rt.registered == [False]  # the doctor never registered as a plugin


def test_a_socket_that_does_not_speak_ttrpc_fails(tmp_path):
    path = str(tmp_path / "mute.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen()
    stop = threading.Event()

    def serve():  # accepts and says nothing
        srv.settimeout(0.1)
        held = []
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except TimeoutError:
                pass
        for c in held:
            c.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        check = check_nri_socket(path, timeout=0.5)
    finally:
        stop.set()
        t.join(2)
        srv.close()
    assert not check.ok and check.required and "no NRI ttrpc exchange" in check.detail


def test_missing_socket_fails_with_the_hint(tmp_path):
    check = check_nri_socket(str(tmp_path / "none.sock"))
    assert not check.ok and "is NRI enabled" in check.detail


V2 = 'version = 2\n'
NRI = '[plugins."io.containerd.nri.v1.nri"]\n'


@pytest.mark.parametrize("main, dropin, version, ok, words", [
    (V2, None, "1.7.24~ds1", False, "NRI is off (containerd 1.7.24~ds1 defaults"),
    (V2, None, "v2.1.9", True, "NRI on"),
    (V2 + NRI + "disable = false\n", None, "1.7.24", True, "NRI on"),
    (V2 + NRI + "disable = true\n", None, "v2.1.9", False, "disable = true"),
    (V2 + 'imports = ["conf.d/*.toml"]\n', NRI + "disable = false\n", "1.7.24", True, "conf.d/10-nri.toml"),
    (V2 + 'imports = ["conf.d/*.toml"]\n' + NRI + "disable = false\n", NRI + "disable = true\n", "1.7.24",
     False, "disable = true"),
    (V2 + NRI + "disable = false\ndisable_connections = true\n", None, "1.7.24", False, "external plugins"),
    (V2 + NRI + 'disable = false\nsocket_path = "/run/other.sock"\n', None, "1.7.24", False, "not on"),
], ids=["1.7-default-off", "2.x-default-on", "enabled", "disabled", "drop-in-enables",
        "drop-in-overrides-main", "no-connections", "other-socket"])
def test_nri_config_as_containerd_merges_it(tmp_path, main, dropin, version, ok, words):
    cfg = tmp_path / "config.toml"
    cfg.write_text(main)
    if dropin is not None:
        (tmp_path / "conf.d").mkdir()
        (tmp_path / "conf.d" / "10-nri.toml").write_text(dropin)
    check = check_nri_config(str(cfg), version, "/var/run/nri/nri.sock")
    assert check.ok is ok and words in check.detail, check


def test_unreadable_config_is_a_warning(tmp_path):
    check = check_nri_config(str(tmp_path / "absent.toml"), "1.7.24")
    assert (check.ok, check.required) == (False, False)


def test_store_is_written_and_its_space_reported(tmp_path):
    store, space = check_store(str(tmp_path))
    assert store.ok and "writable" in store.detail and "GiB free" in store.detail
    assert os.listdir(tmp_path) == []  # the probe file is gone
    assert space.name == "store-space" and not space.required
    (bad,) = check_store(str(tmp_path / "missing"))
    assert not bad.ok and bad.required


def test_containerd_api_check_without_a_socket(tmp_path):
    check, version = check_containerd_api(str(tmp_path / "containerd.sock"))
    assert not check.ok and version == ""
