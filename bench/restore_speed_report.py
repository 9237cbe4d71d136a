"""Merge bench/restore_speed.py outputs into one results file, a Markdown table and a chart.

Usage: ``python -m bench.restore_speed_report OUT.json IN.json [IN.json ...] [--png OUT.png] [--md OUT.md]``

OUT.json holds ``runs``: one object per restore with ``case``, ``path``, ``cache``,
``cold_start_s``, ``restore_s``, ``first_answer_s``, ``phases`` (seconds), ``bytes`` (per phase),
``sol_s``, ``identical``; plus, per case, the checkpoint's phases, the artifact's size and the
ceilings measured in the same run (``cases``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

KEYS = ("case", "path", "cache", "fill_threads", "cold_start_s", "restore_s", "first_answer_s", "phases", "bytes", "sol_s",
        "identical", "stream", "node_cache", "warm_up", "cache_written_s", "call", "route")
PHASES = (("inspect", "inspect (host files hashed: once per plugin process)", "#ccb974"),
          ("stage", "stage (copy + hash)", "#dd8452"), ("rootfs_apply", "rootfs", "#937860"),
          ("criu_restore", "CRIU restore", "#4c72b0"), ("fill", "bulk fill (hash + write)", "#55a868"),
          ("stream_start", "stream start", "#8172b3"),
          ("cuda_restore", "CUDA restore (streamed: while the pages are served)", "#c44e52"),
          ("stream", "serve's tail after the CUDA restore", "#da8bc3"))


def merge(inputs: list[Path]) -> dict[str, Any]:
    out: dict[str, Any] = {"what": "bench/restore_speed.py on the H200 through containerd + runc + CRIU + the plugin",
                           "runs": [], "cases": {}}
    for path in inputs:
        doc = json.loads(path.read_text())
        out["cases"][doc["case"]] = {
            "gpus": doc.get("gpus"), "criu": doc.get("criu"), "host": doc.get("host"),
            "model": doc.get("model"), "checkpoint_s": doc["source"]["checkpoint"],
            "cold": doc["source"]["cold"], "artifact_bytes": doc["artifact_bytes"],
            "ceilings": doc["ceilings"]}
        for run in doc["runs"]:
            rec = {k: run.get(k) for k in KEYS} | {"table": run.get("table")}
            if run.get("warm_up"):  # a node cache run's first restore, which writes the entry
                rec["path"] = f"{run.get('path')} (cache cold)"
            elif run.get("path") == "map":
                rec["path"] = "map (cache warm)"
            elif run.get("path") == "stream+cache":
                rec["path"] = "stream (cache made as it restores)"
            elif run.get("path") == "auto" and run.get("route"):  # the default: the way it took
                rec["path"] = f"auto: {run['route'].get('path')}/{run['route'].get('kind')}"
            out["runs"].append(rec)
    return out


def markdown(doc: dict[str, Any]) -> str:
    lines = ["| call | case | path | artifact | restore s | first answer s | cold start s | x cold | SOL s | x SOL | "
             "inspect | stage | CRIU | fill | CUDA | serve GB/s (threads) | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        if r.get("restore_s") is None:
            continue
        p = r.get("phases") or {}
        st = r.get("stream") or {}
        serve = (f"{st['bytes_verified'] / 1e9 / st['seconds']:.2f} ({st['threads']})"
                 if st.get("seconds") else "-")
        lines.append(
            f"| {r.get('call') or ''} | {r['case']} | {r['path']} | {r['cache']} | {r['restore_s']:.2f} | {r.get('first_answer_s') or 0:.2f} | "
            f"{r['cold_start_s']:.1f} | {r['cold_start_s'] / r['restore_s']:.1f} | {r['sol_s']:.2f} | "
            f"{r['restore_s'] / r['sol_s']:.1f} | {p.get('inspect', 0):.2f} | {p.get('stage', 0):.2f} | "
            f"{p.get('criu_restore', 0):.2f} | {p.get('fill', 0):.2f} | {p.get('cuda_restore', 0):.2f} | {serve} | "
            f"{r['identical']} |")
    return "\n".join(lines)


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [r for r in doc["runs"] if r.get("restore_s")]
    fig, ax = plt.subplots(figsize=(13, 0.55 * len(runs) + 1.6))
    labels = []
    for i, r in enumerate(runs):
        left = 0.0
        for key, label, color in PHASES:
            v = (r.get("phases") or {}).get(key, 0.0)
            ax.barh(i, v, left=left, color=color, label=label if i == 0 else None)
            left += v
        ax.barh(i, max(r["restore_s"] - left, 0), left=left, color="#bbbbbb", label="other" if i == 0 else None)
        ax.plot([r["sol_s"]], [i], marker="|", markersize=18, color="black", label="speed of light" if i == 0 else None)
        ax.text(r["restore_s"] + 0.2, i, f"{r['restore_s']:.1f} s (cold {r['cold_start_s']:.0f} s)", va="center",
                fontsize=8)
        threads = (r.get("stream") or {}).get("threads")
        call = f"call {r['call']}: " if r.get("call") else ""
        labels.append(f"{call}{r['case']}, {r['path']}{f' ({threads} threads)' if threads else ''}, {r['cache']}")
    ax.set_yticks(range(len(runs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from container create to restored")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Restore through containerd + the plugin on one H200: the paths compared within each call")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    doc = merge(args.inputs)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    table = markdown(doc)
    if args.md:
        args.md.write_text(table + "\n")
    print(table)
    if args.png:
        plot(doc, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
