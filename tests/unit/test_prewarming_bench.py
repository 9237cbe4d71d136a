"""bench/prewarming.py's pure parts: the plugin's pre-warm lines read back, the figures and ratios
against the targets, the kernel's counters, the store's name taken away and put back, the node
cache's entries by label, and the tables."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench import prewarming as prewarm
from bench.prewarming import Name, ReadOnce, WarmLog, WarmUp

LABEL = "default/cpu-1gib-pw"
V = ".version-cpu-1gib-pw-1796581859073363-14cfd7cd534790f7"


def _line(clock: str, msg: str, level: str = "INFO", logger: str = "nri_plugin.prewarm") -> str:
    return f"2026-12-06 {clock} {level:<7} {logger}: {msg}\n"


def _t(clock: str) -> float:
    hms, ms = clock.split(",")
    return time.mktime(time.strptime(f"2026-12-06 {hms}", "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


LOG = "".join([
    _line("18:30:34,445", "pre-warm: looking at the store every 1s (0 listed)"),
    _line("18:30:58,000", "pre-warm: default/other .version-other-1-00 published, queued for this node's cache"),
    _line("18:30:59,499", f"pre-warm: {LABEL} {V} published, queued for this node's cache"),
    _line("18:30:59,506", f"pre-warm: writing {LABEL} {V} into this node's cache (1025.2 MiB)"),
    _line("18:31:00,000", "restored default/x into 1234: 1 processes", logger="runtime.restore"),
    _line("18:31:01,000", f"{LABEL}: pre-warm resumed after a restore"),
    _line("18:31:02,806", f"pre-warm: {LABEL} {V} warm on this node: 1030.1 MiB in 3.30s (4 pause(s) for restores)"),
    _line("18:31:09,000", f"pre-warm: {LABEL} {V} published, queued for this node's cache"),  # a later one
])


def test_a_warm_up_is_read_from_its_lines_and_only_its_first() -> None:
    got = prewarm.parse_warm_log(LOG, LABEL)
    assert got == WarmLog(queued_at=_t("18:30:59,499"), writing_at=_t("18:30:59,506"), warm_at=_t("18:31:02,806"),
                          write_s=3.30, mib=1030.1, pauses=4)
    assert got.done


def test_a_warm_up_that_paused_says_when_and_for_how_long() -> None:
    text = LOG.replace("(4 pause(s) for restores)", "(4 pause(s) for restores, the first 0.45s in, 2.61s paused in all)")
    got = prewarm.parse_warm_log(text, LABEL)
    assert (got.pauses, got.first_pause_s, got.paused_s) == (4, 0.45, 2.61)


def test_a_refused_warm_up_is_done_with_its_reason() -> None:
    text = _line("10:00:00,000", f"pre-warm: {LABEL} {V} published, queued for this node's cache") + _line(
        "10:00:01,000", f"pre-warm: {LABEL} {V} refused: its entry needs 1030.0 MiB, more than the cache's bound",
        level="WARNING")
    got = prewarm.parse_warm_log(text, LABEL)
    assert got.refused == "its entry needs 1030.0 MiB, more than the cache's bound" and got.done
    assert got.warm_at is None


@pytest.mark.parametrize("label", ["default/other", "default/cpu-1gib", "default/cpu-1gib-pw2"],
                         ids=["another", "a prefix of it", "it a prefix"])
def test_other_artifacts_lines_are_not_its(label: str) -> None:
    got = prewarm.parse_warm_log(LOG.replace("default/other", "default/zzz"), label)
    assert got == WarmLog() and not got.done


def test_a_warm_up_under_way_is_not_done() -> None:
    got = prewarm.parse_warm_log(LOG.split("pre-warm resumed")[0], LABEL)
    assert got.writing_at is not None and got.warm_at is None and not got.done


def test_figures_count_from_the_publish_and_from_the_look() -> None:
    w = WarmUp("disk", 100.0, 102.5, WarmLog(queued_at=100.5, write_s=1.9))
    assert w.figures(1.25) == {"publish_to_warm_s": 2.5, "seen_to_warm_s": 2.0, "look_delay_s": 0.5,
                               "write_s": 1.9, "x_read": 2.0, "seen_x_read": 1.6}
    assert WarmUp("disk", 100.0).figures(None)["x_read"] is None  # not complete, no read


def test_a_record_carries_the_faster_reads_figures() -> None:
    read = ReadOnce("dropped", 1 << 30, 1 << 29, {"deep": 0.8, "shallow": 0.5})
    rec = WarmUp("disk", 10.0, 11.0, WarmLog(queued_at=10.2), read=read).record()
    assert rec["read_s"] == 0.5 and rec["read_page_cache"] == "dropped"
    assert rec["figures"]["x_read"] == 2.0
    json.dumps(rec)  # the result document takes it as it is


def _doc(**over: Any) -> dict[str, Any]:
    reads = {"disk": 0.5, "page-cache": 0.1}
    ups = [WarmUp(k, 0.0, 1.0, WarmLog(queued_at=0.4), read=ReadOnce("x", 1, 1, {"deep": reads[k]})
                  if k in reads else None).record() for k in ("fresh", "disk", "page-cache")]
    doc: dict[str, Any] = {"case": "cpu-1gib", "interval_s": 1.0, "warm_ups": ups, "pairs": [{"ratio": 1.02}],
                           "mapped": {"ratio": 1.2}, "skipped": [], "failures": []}
    return {**doc, **over}


def test_targets_are_the_disk_and_page_cache_warm_ups_the_pairs_and_the_mapped_path() -> None:
    doc = _doc()
    got = {t["what"]: (t["value"], t["target"]) for t in prewarm.targets(doc)}
    assert got == {"warm-up (disk) over one read": (2.0, 1.10), "warm-up (page-cache) over one read": (10.0, 1.10),
                   "restore during a warm-up over alone (0)": (1.02, 1.05),
                   "first restore, pre-warmed, over the mapped path": (1.2, 1.05)}
    fresh = doc["warm_ups"][0]  # shown against the page-cache read, not a target
    assert fresh["read_s"] == 0.1 and fresh["figures"]["x_read"] == 10.0


def test_targets_of_a_run_cut_short_are_those_it_has() -> None:
    assert prewarm.targets(_doc(warm_ups=[], pairs=[], mapped={})) == []


@pytest.mark.parametrize(("a", "b", "want"), [
    ((0.0, 2.0), (1.0, 3.0), 1.0),
    ((0.0, 1.0), (2.0, 3.0), 0.0),
    ((0.0, 5.0), (1.0, 2.0), 1.0),
    ((0.0, None), (1.0, 2.0), None),
], ids=["partly", "apart", "within", "open"])
def test_overlap(a: tuple[float, float | None], b: tuple[float, float], want: float | None) -> None:
    assert prewarm.overlap(a, b) == want


def test_ratio_met_and_span() -> None:
    assert prewarm.ratio(3.0, 2.0) == 1.5 and prewarm.ratio(None, 2.0) is None and prewarm.ratio(1.0, 0.0) is None
    assert [prewarm.met(v, 1.05) for v in (1.05, 1.06, None)] == ["yes", "NO", "-"]
    assert prewarm.span(1.0, 3.5) == 2.5 and prewarm.span(None, 1.0) is None


def test_the_kernels_counters() -> None:
    assert prewarm.vmstat("nr_free_pages 10\ncompact_stall 3\nthp_file_alloc 7\nbad\n") == \
        {"compact_stall": 3, "thp_file_alloc": 7}
    assert prewarm.cpu_busy("cpu  100 1 50 1000 20 0 3 4 0 0\ncpu0 1 2 3 4 5\n") == 100 + 1 + 50 + 3 + 4
    stat = "6976 (a (b) c) R 6969 6969 14870 0 -1 4194304 99 0 0 0 250 40 0 0 20 0 1 0"
    assert prewarm.proc_cpu(stat) == 290
    assert prewarm.delta({"a": 1, "b": 2}, {"a": 1, "b": 5, "c": 1}) == {"b": 3, "c": 1}


def test_the_plugins_environment() -> None:
    assert prewarm.plugin_env(1.0, "auto", map_all=True) == {
        "REKINDLE_PREWARM_INTERVAL": "1", "REKINDLE_CACHE_TMPFS": "1", "REKINDLE_RESTORE_PATH": "auto",
        "REKINDLE_MAP": "all"}
    assert prewarm.plugin_env(0, "bulk", map_all=False)["REKINDLE_PREWARM_INTERVAL"] == "0"
    assert "REKINDLE_MAP" not in prewarm.plugin_env(2.5, "auto", map_all=False)


def test_a_name_taken_away_and_put_back_points_to_the_same_version(tmp_path: Path) -> None:
    ns = tmp_path / "default"
    (ns / V).mkdir(parents=True)
    os.symlink(V, ns / "cpu-1gib-pw")
    name = Name(tmp_path, "cpu-1gib-pw")
    assert name.version == ns / V
    name.hide()
    name.hide()  # twice: still away, the version remembered
    assert not name.link.is_symlink() and name.version == ns / V
    before = time.time()
    at = name.publish()
    assert os.readlink(name.link) == V and at >= before - 1
    assert sorted(os.listdir(ns)) == sorted([V, "cpu-1gib-pw"])  # no link left behind
    name.hide()
    name.ensure()
    assert os.readlink(name.link) == V


def test_a_name_never_published_cannot_be_taken_away(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Name(tmp_path, "nothing").hide()


def _entry(cache: Path, key: str, label: str, complete: bool = True) -> None:
    (cache / key).mkdir(parents=True)
    if complete:
        (cache / key / "entry.json").write_text(json.dumps({"key": key, "label": label}))


def test_entries_are_found_and_removed_by_label(tmp_path: Path) -> None:
    plugin = SimpleNamespace(state_dir=tmp_path)
    cache = tmp_path / "cache" / "v1"
    _entry(cache, "aa", LABEL)
    _entry(cache, "bb", "default/other")
    _entry(cache, "cc", LABEL, complete=False)  # no entry.json: not complete, not counted
    (cache / ".tmp-dd-1").mkdir()
    assert prewarm.entry_of(plugin, LABEL) == cache / "aa"
    assert prewarm.writing(plugin)
    assert prewarm.remove_entries(plugin, LABEL) == ["aa"]
    assert prewarm.entry_of(plugin, LABEL) is None
    assert prewarm.remove_entries(plugin) == ["bb"]
    assert sorted(p.name for p in cache.iterdir()) == [".tmp-dd-1", "cc"]


def test_the_last_look_is_read_from_the_state_file(tmp_path: Path) -> None:
    plugin = SimpleNamespace(state_dir=tmp_path)
    assert prewarm.looked_at(plugin) == 0.0
    (tmp_path / "prewarm.json").write_text(json.dumps({"updated": 12.5, "artifacts": []}))
    assert prewarm.looked_at(plugin) == 12.5
    (tmp_path / "prewarm.json").write_text("{")
    assert prewarm.looked_at(plugin) == 0.0


def test_a_pair_says_whether_the_warm_up_still_ran() -> None:
    p = {"ratio": 1.5, "answer_ratio": 2.0, "warm_up_pauses": 0, "warm_up_over_disk": 0.9,
         "alone": {"counters": {"plugin_cpu_ms": 1000}}, "during": {"counters": {"plugin_cpu_ms": 2500}}}
    line = prewarm.pair_line(0, p)
    assert "restore x1.500" in line and "done before the restore took the disk" in line and "1.00 / 2.50" in line
    assert "paused 4 time(s)" in prewarm.pair_line(1, {**p, "warm_up_pauses": 4})
    assert "restore x-" in prewarm.pair_line(2, {})


def test_the_phase_table_puts_each_restore_in_a_column() -> None:
    pairs = [{"alone": {"phases": {"stage": 0.1, "stream": 0.5, "total": 0.7, "source_cold_start": 9.0}},
              "during": {"phases": {"stage": 0.1, "stream": 1.5, "total": 1.7}}}]
    lines = prewarm.phase_table(pairs).splitlines()
    assert lines[0].split() == ["phase", "s", "alone-0", "during-0"]
    assert [ln.split()[0] for ln in lines[1:]] == ["stage", "stream", "total"]
    assert lines[2].split()[1:] == ["0.500", "1.500"]


def test_the_tables_of_a_whole_run_and_of_one_cut_short() -> None:
    doc = _doc()
    doc["targets"] = prewarm.targets(doc)
    text = prewarm.tables(doc)
    assert "1. warm-up" in text and "2. a restore" in text and "3. the first restore" in text
    assert "warm-up (disk) over one read" in text and "NO" in text
    cut = prewarm.tables(_doc(warm_ups=[], pairs=[], mapped={}, failures=[{"step": "disk", "error": "boom"}]))
    assert "failures: [('disk', 'boom')]" in cut


def test_the_cache_bound_is_passed_only_when_set() -> None:
    assert prewarm.plugin_env(1.0, "auto", map_all=False, cache_bytes=5 << 30)["REKINDLE_CACHE_BYTES"] == str(5 << 30)
