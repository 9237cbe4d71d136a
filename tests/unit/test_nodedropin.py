"""The NRI toggle's drop-in mode and its refusal of k3s/RKE2, on real-world configs in a fake node root."""

from __future__ import annotations

import json
import socket
import tomllib
from pathlib import Path, PurePosixPath

import pytest

from nri_plugin.node import containerd_config, dropin, toggle
from nri_plugin.node.host import HostView
from runtime.containerd import defaults
from runtime.errors import ConfigError, ManagedContainerd

DATA = Path(__file__).resolve().parent.parent / "data"
NRI = defaults.NRI_PLUGIN
SOCK = "/run/test/nri.sock"
CFG = PurePosixPath("/etc/containerd/config.toml")
DROP = PurePosixPath("/etc/containerd/conf.d/99-rekindle-nri.toml")

REAL_CONFIGS = [  # (file, config version)
    ("containerd-1.7.24-debian.toml", 2),
    ("containerd-1.7.24-default.toml", 2),
    ("containerd-2.1.9-default.toml", 3),
]


@pytest.fixture
def node(tmp_path: Path) -> HostView:
    """A node's root: /etc/containerd exists, as on a node with containerd installed."""
    root = tmp_path / "node"
    (root / "etc/containerd").mkdir(parents=True)
    return HostView(root)


def put(view: HostView, path: str | PurePosixPath, text: str) -> Path:
    p = view.see(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def read(view: HostView, path: str | PurePosixPath) -> str:
    return view.see(path).read_text()


def nri_of(text: str) -> dict:
    return tomllib.loads(text)["plugins"][NRI]


def files_under(view: HostView) -> list[str]:
    return sorted(str(view.host_path(p)) for p in view.root.rglob("*") if p.is_file())


@pytest.mark.parametrize("name,version", REAL_CONFIGS)
def test_real_config_gets_a_drop_in_and_one_import(node: HostView, name: str, version: int) -> None:
    original = (DATA / name).read_text()
    put(node, CFG, original)
    res = dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert res.changed and res.restart_needed and res.import_added and res.version == version
    assert res.drop_in == DROP

    drop = read(node, DROP)
    assert tomllib.loads(drop)["version"] == version  # containerd refuses an import newer than its root
    nri = nri_of(drop)
    assert (nri["disable"], nri["disable_connections"], nri["socket_path"]) == (False, False, SOCK)
    main = read(node, CFG)
    assert tomllib.loads(main)["imports"] == [str(DROP)]
    # The main config gained the import and nothing else: the same TOML once imports is set aside.
    before, after = tomllib.loads(original), tomllib.loads(main)
    before.pop("imports", None)
    after.pop("imports")
    assert after == before
    assert [ln for ln in original.splitlines() if ln not in main.splitlines()] in ([], ["imports = []"])
    # Backup of the main config only (the drop-in is new).
    (backup,) = res.backups
    assert backup.name.startswith("config.toml.rekindle-backup-")
    assert read(node, backup) == original


@pytest.mark.parametrize("name,version", REAL_CONFIGS)
def test_second_run_changes_nothing(node: HostView, name: str, version: int) -> None:
    put(node, CFG, (DATA / name).read_text())
    dropin.apply_drop_in(CFG, None, SOCK, view=node)
    files = files_under(node)
    snapshot = {f: read(node, f) for f in files}
    again = dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert not again.changed and not again.restart_needed and not again.import_added and again.backups == ()
    assert files_under(node) == files and {f: read(node, f) for f in files} == snapshot


def test_nri_settings_of_the_main_config_travel_into_the_drop_in(node: HostView) -> None:
    """containerd 1.7 replaces a plugin's whole table with an imported one: keep the operator's keys."""
    put(node, CFG, 'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  disable = true\n'
                   '  plugin_request_timeout = "3s"\n  plugin_path = "/opt/custom/nri"\n')
    dropin.apply_drop_in(CFG, None, SOCK, view=node)
    nri = nri_of(read(node, DROP))
    assert nri["disable"] is False
    assert nri["plugin_request_timeout"] == "3s" and nri["plugin_path"] == "/opt/custom/nri"
    # The main config's own table is left as it was: the drop-in wins, being imported.
    assert nri_of(read(node, CFG))["disable"] is True


def test_an_existing_glob_import_is_reused(node: HostView) -> None:
    """GPU Operator nodes: the toolkit already imports conf.d/*.toml; the main config stays untouched."""
    main = 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n\n[plugins."io.containerd.grpc.v1.cri"]\n'
    put(node, CFG, main)
    put(node, "/etc/containerd/conf.d/99-nvidia.toml",
        'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n  runtime_type = "x"\n')
    res = dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert res.changed and not res.import_added and res.backups == ()
    assert read(node, CFG) == main
    assert nri_of(read(node, DROP))["socket_path"] == SOCK


def test_relative_import_is_resolved_against_the_config_dir(node: HostView) -> None:
    main = 'version = 3\nimports = ["conf.d/*.toml"]\n'
    put(node, CFG, main)
    res = dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert not res.import_added and read(node, CFG) == main


def test_nri_table_imported_before_is_folded_in(node: HostView) -> None:
    put(node, CFG, 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n')
    put(node, "/etc/containerd/conf.d/10-site.toml",
        'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  plugin_registration_timeout = "9s"\n')
    dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert nri_of(read(node, DROP))["plugin_registration_timeout"] == "9s"


def test_nri_table_imported_after_is_refused(node: HostView) -> None:
    put(node, CFG, 'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n')
    put(node, "/etc/containerd/conf.d/zz-site.toml",
        'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  disable = true\n')
    before = files_under(node)
    with pytest.raises(ConfigError, match="zz-site.toml is imported after .*99-rekindle-nri.toml"):
        dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert files_under(node) == before


def test_explicit_import_listed_after_is_refused(node: HostView) -> None:
    put(node, CFG, 'version = 2\nimports = ["/etc/containerd/conf.d/99-rekindle-nri.toml", "/etc/site.toml"]\n')
    put(node, "/etc/site.toml", 'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  disable = true\n')
    with pytest.raises(ConfigError, match="/etc/site.toml is imported after"):
        dropin.apply_drop_in(CFG, None, SOCK, view=node)


def test_absent_main_config_is_created_with_the_import(node: HostView) -> None:
    res = dropin.apply_drop_in(CFG, None, SOCK, view=node, new_file_version=3)
    assert res.config_created and res.import_added and res.backups == ()
    assert tomllib.loads(read(node, CFG)) == {"version": 3, "imports": [str(DROP)]}
    assert tomllib.loads(read(node, DROP))["version"] == 3


def test_a_stale_drop_in_is_rewritten_with_a_backup(node: HostView) -> None:
    put(node, CFG, "version = 2\n")
    dropin.apply_drop_in(CFG, None, "/run/old/nri.sock", view=node)
    old = read(node, DROP)
    res = dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert res.changed and not res.import_added
    (backup,) = res.backups
    assert backup.parent == DROP.parent and read(node, backup) == old
    assert not str(backup).endswith(".toml")  # never picked up by a conf.d/*.toml import
    assert nri_of(read(node, DROP))["socket_path"] == SOCK


def test_dry_run_writes_nothing_and_shows_both_files(node: HostView) -> None:
    put(node, CFG, (DATA / "containerd-1.7.24-debian.toml").read_text())
    before = files_under(node)
    res = dropin.apply_drop_in(CFG, None, SOCK, dry_run=True, view=node)
    assert res.changed and not res.restart_needed and res.backups == ()
    assert files_under(node) == before
    assert f"+++ {DROP}" in res.diff and f"+++ {CFG}" in res.diff
    assert f'+imports = ["{DROP}"]' in res.diff


@pytest.mark.parametrize("text,match", [
    ('[plugins.cri]\n  sandbox_image = "pause"\n', "version 1"),
    ('version = 2\nimports = "conf.d/*.toml"\n', "'imports' must be a list of strings"),
    ("version = 2\n[plugins\n", "not valid TOML"),
])
def test_bad_main_config_is_refused_untouched(node: HostView, text: str, match: str) -> None:
    put(node, CFG, text)
    with pytest.raises(ConfigError, match=match):
        dropin.apply_drop_in(CFG, None, SOCK, view=node)
    assert files_under(node) == [str(CFG)] and read(node, CFG) == text


def test_node_paths_are_written_into_the_import_not_the_view(tmp_path: Path) -> None:
    """Seen through /proc/1/root (here a directory), the import names the path containerd opens."""
    view = HostView(tmp_path / "proc-1-root")
    put(view, CFG, "version = 2\n")
    dropin.apply_drop_in(CFG, None, SOCK, view=view)
    assert tomllib.loads(read(view, CFG))["imports"] == ["/etc/containerd/conf.d/99-rekindle-nri.toml"]
    assert str(tmp_path) not in read(view, CFG) + read(view, DROP)


# --- k3s and RKE2 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dist,config_dir,service", [
    ("k3s", "/var/lib/rancher/k3s/agent/etc/containerd", "k3s-agent"),
    ("RKE2", "/var/lib/rancher/rke2/agent/etc/containerd", "rke2-agent"),
])
@pytest.mark.parametrize("mode", ["drop-in", "in-place"])
def test_k3s_and_rke2_are_refused_with_advice(tmp_path: Path, dist: str, config_dir: str, service: str,
                                              mode: str) -> None:
    view = HostView(tmp_path / "node")
    view.see(config_dir).mkdir(parents=True)
    with pytest.raises(ManagedContainerd) as exc:
        if mode == "drop-in":
            dropin.apply_drop_in(CFG, None, SOCK, view=view)
        else:
            containerd_config.apply(CFG, SOCK, view=view)
    e = exc.value
    assert (e.distribution, e.config_dir) == (dist, config_dir)
    msg = str(e)
    for part in (f"{config_dir}/config.toml.tmpl", "config-v3.toml.tmpl", '{{ template "base" . }}',
                 f'socket_path = "{SOCK}"', service, "one node at a time", "nri.patchConfig=false"):
        assert part in msg, part
    # Nothing was created on the node: not even /etc/containerd.
    assert not view.see("/etc").exists()


def test_cli_refuses_k3s_with_the_advice_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "node"
    (root / "var/lib/rancher/k3s/agent/etc/containerd").mkdir(parents=True)
    rc = toggle.main(["--json", "--drop-in", "--host-root", str(root), "--config", str(CFG)])
    out = capsys.readouterr()
    assert rc == 1 and out.out == ""
    assert out.err.startswith("error: this node's containerd is run by k3s")


# --- the command line -----------------------------------------------------------------------------

def test_cli_json_in_drop_in_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "node"
    view = HostView(root)
    put(view, CFG, (DATA / "containerd-1.7.24-default.toml").read_text())
    argv = ["--json", "--drop-in", "--host-root", str(root), "--config", str(CFG), "--socket-path", SOCK]
    assert toggle.main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["mode"] == "drop-in" and first["drop_in"] == str(DROP) and first["path"] == str(CFG)
    assert first["changed"] and first["restart_needed"] and first["import_added"]
    assert first["backup"] == first["backups"][0] and first["backup"].startswith(f"{CFG}.rekindle-backup-")
    assert first["nri_live"] is False
    # containerd restarted: NRI's socket is there now, nothing changes any more.
    view.see(SOCK).parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(view.see(SOCK)))
        assert toggle.main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert (second["changed"], second["restart_needed"], second["backup"], second["nri_live"]) == (
        False, False, None, True)


def test_cli_custom_drop_in_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "node"
    view = HostView(root)
    put(view, CFG, "version = 2\n")
    assert toggle.main(["--drop-in", "/etc/containerd/rekindle.toml", "--host-root", str(root),
                           "--config", str(CFG)]) == 0
    assert "imported from /etc/containerd/config.toml" in capsys.readouterr().out
    assert tomllib.loads(read(view, CFG))["imports"] == ["/etc/containerd/rekindle.toml"]


def test_cli_restart_needs_the_node_itself(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        toggle.main(["--restart", "--host-root", str(tmp_path)])
    assert exc.value.code == 2


def test_an_unreadable_node_root_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/proc/1/root from a pod that is not privileged or not in the host's pid namespace."""
    rc = toggle.main(["--drop-in", "--host-root", str(tmp_path / "absent"), "--config", str(CFG)])
    assert rc == 1
    assert capsys.readouterr().err.startswith(f"error: cannot read the node's files through {tmp_path / 'absent'}")


def test_a_blocked_drop_in_path_is_one_line_and_leaves_the_config(node: HostView,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    put(node, CFG, "version = 2\n")
    put(node, "/etc/containerd/conf.d", "a file where the drop-in dir should be\n")
    rc = toggle.main(["--drop-in", "--host-root", str(node.root), "--config", str(CFG)])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error: ") and "conf.d" in err and "Traceback" not in err
    assert read(node, CFG) == "version = 2\n"  # the main config never names a file that was not written
