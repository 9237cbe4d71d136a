"""The sandbox's containerd config is of the version each runtime writes itself, with its servers
where that version has them (config v4, containerd 2.3 and later: in plugins, not in top-level
[grpc] and [ttrpc]), every socket private to the sandbox."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from devtools.sandbox import Runtime, SandboxConfig, render_containerd_config


@pytest.mark.parametrize("runtime,version", [(Runtime.V1_7, 2), (Runtime.V2_1, 3), (Runtime.V2_2, 3),
                                             (Runtime.V2_4, 4)])
def test_each_runtime_gets_its_own_config_version_and_private_sockets(runtime, version, tmp_path: Path):
    doc = tomllib.loads(render_containerd_config(SandboxConfig(dir=tmp_path, runtime=runtime)))
    assert doc["version"] == version
    if version >= 4:
        assert "grpc" not in doc and "ttrpc" not in doc
        servers = doc["plugins"]
        grpc, ttrpc = servers["io.containerd.server.v1.grpc"], servers["io.containerd.server.v1.ttrpc"]
    else:
        grpc, ttrpc = doc["grpc"], doc["ttrpc"]
    assert grpc["address"] == str(tmp_path / "containerd.sock")
    assert ttrpc["address"] == str(tmp_path / "containerd.sock.ttrpc")
    nri = doc["plugins"]["io.containerd.nri.v1.nri"]
    assert nri["disable"] is False and nri["socket_path"] == str(tmp_path / "nri.sock")


def test_cdi_is_switched_off_only_where_the_switch_still_exists(tmp_path: Path):
    def runtime_table(rt: Runtime) -> dict:
        return tomllib.loads(render_containerd_config(SandboxConfig(dir=tmp_path, runtime=rt)))["plugins"][
            "io.containerd.cri.v1.runtime"]
    assert runtime_table(Runtime.V2_1)["enable_cdi"] is False
    assert runtime_table(Runtime.V2_2)["enable_cdi"] is False
    assert "enable_cdi" not in runtime_table(Runtime.V2_4)  # gone in 2.3: CDI is always on
