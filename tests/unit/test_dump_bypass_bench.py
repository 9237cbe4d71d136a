"""bench/dump_bypass.py on this machine, through the real CRIU: the threads' read covers every
page CRIU dumps, and the parent image set it would hand CRIU is one CRIU's reader accepts."""

from __future__ import annotations

import json
import os

import pytest

from bench import dump_bypass
from runtime.criu import image_files as img

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="CRIU dumps need root")


def test_the_threads_read_at_least_every_page_criu_writes(tmp_path) -> None:
    out = tmp_path / "lab.json"
    assert dump_bypass.main(["--cpu-gib", "0.06", "--rounds", "criu,read", "--threads", "2",
                             "--dir", str(tmp_path), "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    whole, read = doc["rounds"]
    assert whole["mode"] == "criu" and read["mode"] == "read"
    assert whole["pages_written"] * dump_bypass.PAGE >= 0.06 * (1 << 30)  # the target's memory is in it
    # CRIU leaves out zero pages, which the threads read too: never less than CRIU's
    assert read["read_bytes"] >= whole["pages_written"] * dump_bypass.PAGE
    assert doc["soft_dirty"] in (True, False)
    assert not list(tmp_path.glob("dump-bypass-*"))  # its work dir is gone


def test_the_parent_pagemap_covers_the_whole_user_address_space(tmp_path) -> None:
    dump_bypass.write_parent(tmp_path, [42])
    pm = img.read_pagemap(str(tmp_path), 42)
    spans = sorted((e.vaddr, e.vaddr + img.nr_pages(e) * dump_bypass.PAGE) for e in pm.entries)
    assert spans[0][0] == 0 and spans[-1][1] == dump_bypass.USER_TOP
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert (tmp_path / f"pages-{pm.pages_id}.img").exists()
    raw = img.read_raw(str(tmp_path / "inventory.img"))
    assert raw.magic[:4] == (0x54564319).to_bytes(4, "little") and len(raw.entries) == 1
