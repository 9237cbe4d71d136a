"""Tables of the fault drill: phase x fault -> outcome, and the load figure, as text and Markdown.

Contract: ``fault_tables(cells)`` and ``load_table(fig)`` return Markdown (which reads as plain
text too); ``update_readme(path, block)`` replaces what lies between the README's drill markers
(adding them at the end when absent) and leaves the rest of the file as it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.drill.cells import CHECKPOINT_PHASES, RESTORE_ROWS
from bench.drill.faults import Fault

BEGIN = "<!-- fault-drill:begin (written by python -m bench.fault_drill) -->"
END = "<!-- fault-drill:end -->"


def _cell_text(c: dict[str, Any]) -> str:
    if c.get("error"):
        return f"ERROR: {c['error'].splitlines()[0][:80]}"
    text = str(c["outcome"])
    if c["landed"] and c["landed"] != c["phase"] and not (c["phase"] == "open/inspect"
                                                           and c["landed"] in ("open", "inspect")):
        text += f" (landed in {c['landed']})"
    failed = [k["name"] for k in c["checks"] if not k["ok"]]
    return text + (" ✓" if c["ok"] else " ✗ " + "; ".join(failed))


def fault_tables(cells: list[dict[str, Any]]) -> str:
    out = []
    for flow, rows in (("checkpoint", CHECKPOINT_PHASES), ("restore", RESTORE_ROWS)):
        mine = {(c["phase"], c["fault"]): c for c in cells if c["flow"] == flow}
        if not mine:
            continue
        out.append(f"| {flow} phase | " + " | ".join(f.title for f in Fault) + " |")
        out.append("|---" * (len(Fault) + 1) + "|")
        for row in rows:
            if not any(r == row for r, _f in mine):  # the other restore path's row
                continue
            cols = [_cell_text(mine[(row, f.value)]) if (row, f.value) in mine else "not run" for f in Fault]
            out.append(f"| {row} | " + " | ".join(cols) + " |")
        out.append("")
    return "\n".join(out)


def details_table(cells: list[dict[str, Any]]) -> str:
    """One row per cell: where the fault took hold, the outcome and why, what the fault left."""
    out = ["| flow | phase | fault | landed in | outcome | reason | seen right after the fault | s |",
           "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        seen = {k: v for k, v in c["injected"].items() if v not in ([], "gone") and k != "after_s"}
        seen_text = ", ".join(f"{k}={v}" for k, v in seen.items()) or "-"
        reason = (c["reason"] or "-").replace("|", "/").splitlines()[0][:110]
        out.append(f"| {c['flow']} | {c['phase']} | {c['fault']} | {c['landed'] or '-'} | {c['outcome'] or '-'} "
                   f"| {reason} | {seen_text} | {c['seconds']} |")
    return "\n".join(out) + "\n"


def checks_list(cells: list[dict[str, Any]]) -> str:
    names: list[str] = []
    for c in cells:
        for k in c["checks"]:
            if k["name"] not in names:
                names.append(k["name"])
    return "\n".join(f"- {n}" for n in names)


def failures(cells: list[dict[str, Any]]) -> str:
    lines = []
    for c in cells:
        bad = [k for k in c["checks"] if not k["ok"]]
        if c.get("error") or bad:
            lines.append(f"- {c['flow']} {c['phase']} x {c['fault']}: " + (c.get("error") or "")
                         + "; ".join(f"{k['name']}: {k['detail']}" for k in bad))
    return "\n".join(lines) or "none"


def load_table(fig: dict[str, Any]) -> str:
    if "error" in fig:
        return f"load figure: {fig['error']}"
    h, cri = fig["handler_ms"], fig["cri_s"]
    base = fig.get("without_plugin")

    def ms(s: dict[str, Any]) -> str:
        return f"{s['p50']} / {s['p99']} / {s['max']} ms (n={s['n']})" if s["n"] else "none"

    def secs(s: dict[str, Any]) -> str:
        return f"{s['p50']:.2f} / {s['p99']:.2f} / {s['max']:.2f} s" if s["n"] else "none"

    def cri_row(name: str) -> tuple[str, str]:
        text = secs(cri[name]) + (f" (without the plugin: {secs(base['cri_s'][name])})" if base else "")
        return (f"CRI {name} p50 / p99 / max", text)

    rows = [
        ("pods created at once", f"{fig['pods']} ({fig['restore_pods']} annotated to restore one artifact, "
                                 f"WARMUP_MIB={fig['warmup_mib']}; pause pods are busybox)"),
        ("NRI timeouts (containerd log)", f"{fig['nri_timeouts']} (goal 0)"),
        ("plugin handler overruns", str(fig["plugin_overruns"])),
        ("plugin handler time, every request, p50 / p99 / max", ms(h["all"]) + " (goal p99 ≤ 20 ms)"),
        *[(f"  {m}", ms(s)) for m, s in h.items() if m != "all"],
        *[(f"  requests for {k}", ms(s)) for k, s in fig.get("handler_ms_by_pod", {}).items() if s["n"]],
        cri_row("RunPodSandbox"), cri_row("CreateContainer"), cri_row("StartContainer"),
        ("restores", ", ".join(f"{k}: {v}" for k, v in sorted(fig["restores"].items())) or "none"),
        ("restored pods answering as their source (pid, state)", str(fig["restored_serving_on"])),
        ("plain pods answering from a cold start", str(fig["plain_started_cold"])),
        ("pods answering", f"{fig['answering']} of {fig['pods']}"
                           + (f" (without the plugin: {base['answering']})" if base else "")),
        ("errors", str(len(fig["errors"])) + (f" (without the plugin: {len(base['errors'])})" if base else "")),
        ("all CRI calls returned after", f"{fig['created_s']} s"),
        ("wall time, to every pod answering", f"{fig['wall_s']} s"
                                              + (f" (without the plugin: {base['wall_s']} s)" if base else "")),
    ]
    if fig["cold_start_reasons"]:
        rows.append(("cold start reasons", "; ".join(f"{v}x {k}" for k, v in fig["cold_start_reasons"].items())))
    return "| load | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows) + "\n"


def update_readme(path: Path, block: str) -> None:
    text = path.read_text() if path.exists() else ""
    new = f"{BEGIN}\n{block.rstrip()}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + new + rest.split(END, 1)[1]
    else:
        text = (text.rstrip() + "\n\n" if text else "") + new + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
