"""The NRI toggle over real-world containerd configs: result, idempotence, preservation, errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from nri_plugin.node import containerd_config
from nri_plugin.node import toggle as nritoggle
from runtime.containerd import defaults
from runtime.errors import ConfigError

DATA = Path(__file__).resolve().parent.parent / "data"
NRI = defaults.NRI_PLUGIN
SOCK = "/run/test/nri.sock"

# (file, config version, NRI table present before)
REAL_CONFIGS = [
    ("containerd-1.7.24-debian.toml", 2, False),   # Debian's shipped /etc/containerd/config.toml
    ("containerd-1.7.24-default.toml", 2, True),   # `containerd config default` of 1.7.24 (disable = true)
    ("containerd-2.1.9-default.toml", 3, True),    # `containerd config default` of 2.1.9 (on by default)
    ("containerd-2.2.7-default.toml", 3, True),    # `containerd config default` of 2.2.7
    ("containerd-2.4.0-beta.0-default.toml", 4, True),  # of 2.4.0-beta.0: version 4 since 2.3
]


def nri_table(text: str) -> dict:
    return tomllib.loads(text)["plugins"][NRI]


@pytest.mark.parametrize("name,version,had_nri", REAL_CONFIGS)
def test_enables_nri_in_real_configs(name: str, version: int, had_nri: bool) -> None:
    text = (DATA / name).read_text()
    assert (NRI in tomllib.loads(text).get("plugins", {})) == had_nri
    new, changed = containerd_config.enable_nri(text, SOCK)
    assert changed
    nri = nri_table(new)
    assert nri["disable"] is False
    assert nri["disable_connections"] is False
    assert nri["socket_path"] == SOCK
    assert nri["plugin_request_timeout"] == "2s"
    assert tomllib.loads(new)["version"] == version


@pytest.mark.parametrize("name,version,had_nri", REAL_CONFIGS)
def test_second_run_changes_nothing(name: str, version: int, had_nri: bool) -> None:
    once, _ = containerd_config.enable_nri((DATA / name).read_text(), SOCK)
    twice, changed = containerd_config.enable_nri(once, SOCK)
    assert not changed
    assert twice == once


@pytest.mark.parametrize("name,version,had_nri", REAL_CONFIGS)
def test_everything_else_is_kept(name: str, version: int, had_nri: bool) -> None:
    text = (DATA / name).read_text()
    new, _ = containerd_config.enable_nri(text, SOCK)
    before, after = tomllib.loads(text), tomllib.loads(new)
    before["plugins"].pop(NRI, None)
    after["plugins"].pop(NRI)
    assert after == before
    # Only NRI lines differ: every other line survives byte for byte, in order.
    old_lines = [ln for ln in text.splitlines() if ln.strip()]
    kept = [ln for ln in old_lines if ln in new.splitlines()]
    changed = [ln for ln in old_lines if ln not in kept]
    assert all(ln.strip().startswith(("disable", "socket_path")) for ln in changed), changed


def test_comments_and_unknown_settings_are_preserved() -> None:
    text = """# node config, managed by hand
version = 2
oom_score = -999  # keep containerd alive

[plugins."io.containerd.grpc.v1.cri"]
  # our mirror
  sandbox_image = "registry.local/pause:3.9"

[plugins."io.containerd.nri.v1.nri"]
  disable = true  # off until Rekindle
  plugin_request_timeout = "3s"
"""
    new, changed = containerd_config.enable_nri(text, SOCK)
    assert changed
    for line in ("# node config, managed by hand", "oom_score = -999  # keep containerd alive", "  # our mirror",
                 '  sandbox_image = "registry.local/pause:3.9"'):
        assert line in new.splitlines()
    nri = nri_table(new)
    assert nri["disable"] is False
    assert nri["plugin_request_timeout"] == "3s"  # an operator's value is not overwritten


def test_v3_without_nri_table_gets_it_explicitly() -> None:
    text = "version = 3\n\n[plugins.'io.containerd.cri.v1.runtime']\n  enable_cdi = true\n"
    new, changed = containerd_config.enable_nri(text, SOCK)
    assert changed
    assert nri_table(new)["disable"] is False
    assert tomllib.loads(new)["plugins"]["io.containerd.cri.v1.runtime"] == {"enable_cdi": True}


def test_wrong_typed_value_is_replaced() -> None:
    text = 'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  disable = 0\n  disable_connections = "false"\n'
    new, _ = containerd_config.enable_nri(text, SOCK)
    nri = nri_table(new)
    assert nri["disable"] is False and nri["disable_connections"] is False


@pytest.mark.parametrize("text", [
    "",
    "# nothing here yet\n",
])
def test_blank_file_gets_a_version(text: str) -> None:
    new, changed = containerd_config.enable_nri(text, SOCK, empty_version=3)
    assert changed
    assert tomllib.loads(new)["version"] == 3
    assert nri_table(new)["socket_path"] == SOCK


@pytest.mark.parametrize("text", [
    "version = 1\n",
    '[plugins.cri]\n  sandbox_image = "pause"\n',  # no version key: v1 by containerd's rules
    'root = "/var/lib/containerd"\n',
])
def test_v1_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="version 1.*migrate"):
        containerd_config.enable_nri(text, SOCK)


@pytest.mark.parametrize("text,match", [
    ("version = 2\n[plugins\n", "not valid TOML"),
    ("version = = 2\n", "not valid TOML"),
    ('version = "2"\n', "must be an integer"),
    ("version = 5\n", "version 5 is not supported"),
    ('version = 2\nplugins = "none"\n', "'plugins' is not a table"),
    ('version = 2\n[plugins]\n"io.containerd.nri.v1.nri" = 5\n', "is not a table"),
])
def test_bad_input_gives_a_clear_error(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        containerd_config.enable_nri(text, SOCK)


# --- apply: file handling ---------------------------------------------------------------------

def test_apply_backs_up_and_is_idempotent(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    original = (DATA / "containerd-1.7.24-debian.toml").read_text()
    cfg.write_text(original)
    cfg.chmod(0o600)
    first = containerd_config.apply(cfg, SOCK)
    assert first.changed and first.restart_needed and first.version == 2
    assert first.backup_path is not None and first.backup_path.read_text() == original
    assert first.backup_path.name.startswith("config.toml.rekindle-backup-")
    assert nri_table(cfg.read_text())["socket_path"] == SOCK
    assert cfg.stat().st_mode & 0o777 == 0o600
    second = containerd_config.apply(cfg, SOCK)
    assert not second.changed and not second.restart_needed and second.backup_path is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.toml", first.backup_path.name]


def test_apply_dry_run_writes_nothing(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text((DATA / "containerd-1.7.24-default.toml").read_text())
    before = cfg.read_text()
    res = containerd_config.apply(cfg, SOCK, dry_run=True)
    assert res.changed and not res.restart_needed and res.backup_path is None
    assert "-    disable = true" in res.diff and "+    disable = false" in res.diff
    assert cfg.read_text() == before
    assert list(tmp_path.iterdir()) == [cfg]


def test_apply_creates_an_absent_file(tmp_path: Path) -> None:
    cfg = tmp_path / "etc/containerd/config.toml"
    res = containerd_config.apply(cfg, SOCK, new_file_version=2)
    assert res.created and res.changed and res.backup_path is None
    assert tomllib.loads(cfg.read_text())["version"] == 2
    assert not containerd_config.apply(cfg, SOCK).changed


def test_apply_garbage_leaves_the_file_alone(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text("version = 2\n[plugins\n")
    with pytest.raises(ConfigError, match=str(cfg)):
        containerd_config.apply(cfg, SOCK)
    assert cfg.read_text() == "version = 2\n[plugins\n"
    assert list(tmp_path.iterdir()) == [cfg]


def test_main_reports_and_exits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text((DATA / "containerd-2.1.9-default.toml").read_text())
    assert nritoggle.main(["--config", str(cfg), "--socket-path", SOCK]) == 0
    assert "NRI enabled (config version 3); backup at" in capsys.readouterr().out
    assert nritoggle.main(["--config", str(cfg), "--socket-path", SOCK]) == 0
    assert "nothing changed" in capsys.readouterr().out
    cfg.write_text("version = 1\n")
    assert nritoggle.main(["--config", str(cfg)]) == 1
    assert "migrate" in capsys.readouterr().err


def test_main_json_reports_change_then_nothing(tmp_path, capsys):
    """The chart's init container parses this JSON to decide on a containerd restart."""
    import json

    from nri_plugin.node.toggle import main
    cfg = tmp_path / "config.toml"
    cfg.write_text((DATA / "containerd-1.7.24-debian.toml").read_text())
    assert main(["--json", "--config", str(cfg)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["changed"] and first["restart_needed"] and first["backup"] and first["version"] == 2
    assert main(["--json", "--config", str(cfg)]) == 0
    second = json.loads(capsys.readouterr().out)
    assert (second["changed"], second["restart_needed"], second["backup"]) == (False, False, None)
