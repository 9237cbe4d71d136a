"""The checkpoint and restore requests are built in one place from the settings, for the plugin
and the CLI alike (they used to differ: the CLI's checkpoint dropped the layer cap, the capture
timeout and the bulk run length)."""

from __future__ import annotations

import dataclasses

from nri_plugin.agent import checkpoint_request, restore_request
from nri_plugin.config import Settings


def test_every_request_field_the_settings_own_comes_from_them(tmp_path) -> None:  # type: ignore[no-untyped-def]
    s = Settings.from_flags(dict(state_dir=str(tmp_path), max_layer_bytes=1 << 30, capture_timeout=77,
                                 bulk_min_run=1 << 21, fill_threads=5, serve_threads=3, warm_rest=True,
                                 restore_path="stream"))
    ck = checkpoint_request(s, "c1", "ns", "art")
    assert (ck.max_layer_bytes, ck.capture_timeout, ck.bulk_min_run) == (1 << 30, 77, 1 << 21)
    assert checkpoint_request(s, "c1", "ns", "art", max_layer_bytes=1 << 20).max_layer_bytes == 1 << 20
    rs = restore_request(s, "c1", "ns", "art", image="img", image_ref="sha256:x")
    assert (rs.threads, rs.path.value, rs.max_layer_bytes) == (5, "stream", 1 << 30)
    assert (rs.serve_threads, rs.warm_rest) == (3, True)
    assert rs.log_dir == ck.log_dir == f"{tmp_path}/logs"
    assert rs.undo_dir == f"{tmp_path}/rootfs-undo"
    assert {f.name for f in dataclasses.fields(rs)} >= {"threads", "max_layer_bytes", "undo_dir", "path"}
