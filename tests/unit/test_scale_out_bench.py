"""bench/scale_out.py's pure parts: the memory sampler's reading of /proc, the round specs, the
figures and the tables."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from bench import scale_out
from bench.scale_out import Round, Sample

GIB = 1 << 30

MEMINFO = """MemTotal:       24000000 kB
MemFree:         1000000 kB
MemAvailable:   20000000 kB
Buffers:          100000 kB
"""

ROLLUP = """55d0c1a2b000-7ffd5a9f1000 ---p 00000000 00:00 0                          [rollup]
Rss:             1049600 kB
Pss_Dirty:        999999 kB
Pss:              524800 kB
Pss_Anon:         524288 kB
Pss_File:            512 kB
Shared_Clean:       1024 kB
"""


def test_used_memory_is_total_less_available() -> None:
    assert scale_out.meminfo_used(MEMINFO) == (24000000 - 20000000) * 1024


def test_pss_is_the_pss_line_not_its_breakdown() -> None:
    assert scale_out.rollup_pss(ROLLUP) == 524800 * 1024


def test_a_text_without_the_line_is_an_error() -> None:
    with pytest.raises(ValueError, match="MemAvailable"):
        scale_out.meminfo_used("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match="Pss"):
        scale_out.rollup_pss("Rss: 1 kB\nPss_Anon: 1 kB\n")


def _proc(tmp_path: Path, pss_kib: dict[int, int]) -> str:
    (tmp_path / "meminfo").write_text(MEMINFO)
    for pid, kib in pss_kib.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "smaps_rollup").write_text(f"Rss: {kib * 2} kB\nPss: {kib} kB\n")
    return str(tmp_path)


def test_pss_sums_the_processes_and_skips_those_gone(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {10: 1000, 11: 24})
    assert scale_out.pss_of([10, 11, 12], proc) == 1024 * 1024  # 12 exited meanwhile
    assert scale_out.node_used(proc) == 4000000 * 1024


def test_the_sampler_samples_until_stopped(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {7: 2048})
    sampler = scale_out.Sampler(lambda: [7], interval=0.01, proc=proc)
    sampler.start()
    deadline = time.monotonic() + 10
    while len(sampler.samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = sampler.stop()
    assert len(samples) >= 3
    assert {(s.used, s.pss) for s in samples} == {(4000000 * 1024, 2048 * 1024)}
    assert [s.t for s in samples] == sorted(s.t for s in samples)
    n = len(samples)
    time.sleep(0.05)
    assert len(sampler.samples) == n  # stopped means stopped


def test_memory_figures_peak_from_the_baseline_and_steady_after_the_last_answer() -> None:
    samples = [Sample(0.0, 10 * GIB, 0), Sample(0.1, 14 * GIB, 3 * GIB), Sample(0.2, 13 * GIB, 4 * GIB),
               Sample(1.0, 12 * GIB, 2 * GIB), Sample(1.1, 12 * GIB, 2 * GIB), Sample(1.2, 11 * GIB, 3 * GIB)]
    got = scale_out.memory_figures(samples, 10 * GIB, answered_at=1.0)
    assert got == {"samples": 6, "baseline_host_bytes": 10 * GIB, "peak_host_bytes": 4 * GIB,
                   "peak_pss_bytes": 4 * GIB, "steady_host_bytes": 2 * GIB, "steady_pss_bytes": 2 * GIB}
    unanswered = scale_out.memory_figures(samples, 10 * GIB, answered_at=None)
    assert unanswered["peak_host_bytes"] == 4 * GIB and unanswered["steady_pss_bytes"] is None
    assert scale_out.memory_figures([], 1, 0.0)["peak_pss_bytes"] is None


def test_rounds_parse_with_their_plugin_environment(monkeypatch) -> None:
    for k in scale_out.PASSED_ENV:
        monkeypatch.delenv(k, raising=False)
    got = scale_out.parse_rounds("bulk:off, bulk:warm,stream:cold")
    assert got == [Round("bulk", "off"), Round("bulk", "warm"), Round("stream", "cold")]
    assert got[0].env() == {"REKINDLE_RESTORE_PATH": "bulk", "REKINDLE_MAX_PARALLEL": "2", "REKINDLE_CACHE_BYTES": "0"}
    assert got[1].env(pods=4) == {"REKINDLE_RESTORE_PATH": "bulk", "REKINDLE_MAX_PARALLEL": "4",
                                  "REKINDLE_CACHE_TMPFS": "1"}
    assert got[2].env("all") == {"REKINDLE_RESTORE_PATH": "stream", "REKINDLE_MAX_PARALLEL": "2",
                                 "REKINDLE_CACHE_TMPFS": "1", "REKINDLE_MAP": "all"}
    assert got[2].spec == "stream:cold"
    monkeypatch.setenv("REKINDLE_STREAM_WARM_REST", "1")  # a measurement setting is handed on
    assert got[1].env()["REKINDLE_STREAM_WARM_REST"] == "1"
    cont = scale_out.parse_rounds("stream:cold:continue")[0]  # a round's own let-go wins over the passed one
    monkeypatch.setenv("REKINDLE_LET_GO", "unregister")
    assert cont == Round("stream", "cold", "continue") and cont.spec == "stream:cold:continue"
    assert cont.env()["REKINDLE_LET_GO"] == "continue" and got[2].env()["REKINDLE_LET_GO"] == "unregister"


@pytest.mark.parametrize("bad", ["bulk", "bulk:hot", "stock:off", "bulk:off,", ":warm", "stream:cold:faster"])
def test_a_bad_round_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="PATH:CACHE"):
        scale_out.parse_rounds(bad)


def test_a_bad_round_on_the_command_line_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        scale_out.main(["--case", "cpu-1gib", "--rounds", "bulk:off,bulk:hot"])
    assert e.value.code == 2
    assert "bulk:hot" in capsys.readouterr().err


def _run(rnd: str, pods: int, firsts: list[float | None], pss: int, same: bool = True) -> dict[str, Any]:
    path, cache = rnd.split(":")
    rec: dict[str, Any] = {"round": rnd, "pods": pods, "path": path, "cache": cache,
                              "peak_host_bytes": pss + GIB, "peak_pss_bytes": pss, "steady_pss_bytes": pss}
    per_pod = [{"restore_s": f and f - 0.5, "first_answer_s": f, "identical": same and f is not None,
                "cache": {"state": cache, "mapped_bytes": 0}} for f in firsts]
    scale_out.summarize(rec, per_pod)
    return rec


def test_a_run_summary_takes_the_slowest_pod_and_needs_every_pod_identical() -> None:
    rec = _run("bulk:warm", 3, [2.0, 3.0, 2.5], GIB)
    assert rec["max_first_answer_s"] == 3.0 and rec["max_restore_s"] == 2.5
    assert rec["restore_s"] == [1.5, 2.5, 2.0] and rec["identical"] is True
    assert rec["cache_info"] == [{"state": "warm", "mapped_bytes": 0}] * 3
    failed = _run("bulk:warm", 2, [2.0, None], GIB)
    assert failed["max_first_answer_s"] is None and failed["identical"] is False
    assert _run("bulk:warm", 2, [2.0, 2.0], GIB, same=False)["identical"] is False


def test_ratio_to_one_is_the_slowest_of_n_over_the_one() -> None:
    one, many = _run("bulk:off", 1, [2.0], GIB), _run("bulk:off", 4, [3.0, 5.0, 4.0, 4.5], 4 * GIB)
    scale_out.set_ratio_to_one(one, many)
    assert (one["ratio_to_one"], many["ratio_to_one"]) == (1.0, 2.5)
    broken = _run("bulk:off", 1, [None], GIB)
    scale_out.set_ratio_to_one(broken, many)
    assert many["ratio_to_one"] is None


def test_runs_compare_with_bulk_off_of_as_many_pods() -> None:
    runs = [_run("bulk:off", 1, [2.0], GIB), _run("bulk:off", 4, [4.0] * 4, 4 * GIB),
            _run("bulk:warm", 1, [1.0], GIB), _run("bulk:warm", 4, [3.0] * 4, GIB),
            {"round": "stream:warm", "pods": 4, "path": "stream", "cache": "warm", "error": "no entry"}]
    scale_out.set_vs_bulk_off(runs)
    assert runs[1]["vs_bulk_off"] == {"max_first_answer_s": 1.0, "peak_host_bytes": 1.0, "peak_pss_bytes": 1.0,
                                      "steady_pss_bytes": 1.0}
    assert runs[3]["vs_bulk_off"] == {"max_first_answer_s": 0.75, "peak_host_bytes": 0.4, "peak_pss_bytes": 0.25,
                                      "steady_pss_bytes": 0.25}
    assert runs[2]["vs_bulk_off"]["max_first_answer_s"] == 0.5
    assert "vs_bulk_off" not in runs[4]
    rows = [line.split() for line in scale_out.vs_bulk_off_table(runs).splitlines()[1:]]
    assert rows == [["1", "bulk:off", "1.00", "1.00", "1.00", "1.00"], ["4", "bulk:off", "1.00", "1.00", "1.00", "1.00"],
                    ["1", "bulk:warm", "0.50", "1.00", "1.00", "1.00"], ["4", "bulk:warm", "0.75", "0.40", "0.25", "0.25"]]


def test_the_table_shows_each_run_and_an_error_as_such() -> None:
    one, many = _run("bulk:warm", 1, [2.0], GIB), _run("bulk:warm", 2, [3.0, 3.5], GIB + GIB // 2)
    scale_out.set_ratio_to_one(one, many)
    err = {"round": "stream:warm", "pods": 2, "path": "stream", "cache": "warm",
           "error": "no complete cache entry (x/*/entry.json) 300 s after the warm-up restore answered"}
    lines = scale_out.table([one, many, err]).splitlines()
    assert lines[0].split()[:3] == ["pods", "path", "cache"]
    assert lines[2].split() == ["2", "bulk", "warm", "3.00", "3.50", "1.75", "2.50", "1.50", "1.50", "True", "warm"]
    assert lines[3].split()[:4] == ["2", "stream", "warm", "ERROR:"] and "no complete cache entry" in lines[3]


def test_a_sealed_tree_is_removed(tmp_path: Path) -> None:
    entry = tmp_path / "cache" / "v1" / "k"
    entry.mkdir(parents=True)
    (entry / "fill-8.bin").write_bytes(b"x" * 10)
    (entry / "entry.json").write_text("{}")
    (entry / "fill-8.bin").chmod(0o444)  # as the node cache leaves its files
    entry.chmod(0o700)
    scale_out.remove_sealed(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
    (tmp_path / "f").write_text("")
    scale_out.remove_sealed(tmp_path / "f")
    scale_out.remove_sealed(tmp_path / "f")  # already gone: nothing to do
    assert list(tmp_path.iterdir()) == []
