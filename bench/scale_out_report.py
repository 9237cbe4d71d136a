"""Chart and table of bench/scale_out.py outputs: per run, the slowest pod's first answer and the
peak of the pods' summed PSS, for 1 and N pods of each round.

Usage: ``python -m bench.scale_out_report OUT.png IN.json [IN.json ...] [--md OUT.md]`` (each
input is labelled by its ``label`` key when it has one, else its file name).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

GIB = 1 << 30


def rows(docs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for label, doc in docs:
        for r in doc["runs"]:
            if r.get("error"):
                continue
            out.append({"label": label, "pods": r["pods"], "round": f"{r['path']}:{r['cache']}",
                        "first_answer_s": r["max_first_answer_s"], "restore_s": r["max_restore_s"],
                        "ratio_to_one": r.get("ratio_to_one"), "peak_pss_gib": r["peak_pss_bytes"] / GIB,
                        "peak_host_gib": r["peak_host_bytes"] / GIB, "steady_pss_gib": r["steady_pss_bytes"] / GIB,
                        "identical": r["identical"]})
    return out


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| run | round | pods | slowest first answer s | x one pod | peak PSS GiB | peak host GiB (less the baseline) | steady PSS GiB | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['label']} | {r['round']} | {r['pods']} | {r['first_answer_s']:.2f} | "
                     f"{r['ratio_to_one'] or 1:.2f} | {r['peak_pss_gib']:.1f} | {r['peak_host_gib']:.1f} | "
                     f"{r['steady_pss_gib']:.1f} | {r['identical']} |")
    return "\n".join(lines)


def plot(table: list[dict[str, Any]], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 0.45 * len(table) + 1.8), sharey=True)
    names = [f"{r['label']}  {r['round']}  x{r['pods']}" for r in table]
    ys = range(len(table))
    a.barh(list(ys), [r["first_answer_s"] for r in table], color=["#c44e52" if "off" in r["round"] else "#55a868"
                                                                  for r in table])
    a.set_xlabel("slowest pod's first answer, s")
    b.barh(list(ys), [r["peak_pss_gib"] for r in table], color="#4c72b0")
    b.set_xlabel("peak of the pods' summed PSS, GiB")
    a.set_yticks(list(ys), names, fontsize=8)
    a.invert_yaxis()
    for ax, key in ((a, "first_answer_s"), (b, "peak_pss_gib")):
        for i, r in enumerate(table):
            ax.text(r[key], i, f" {r[key]:.1f}", va="center", fontsize=7)
    fig.suptitle("Pods restored at once from one artifact on one H200 (the workload in each label): off = no node "
                 "cache, warm = mapped from its entry, cold = no entry yet (streamed restores make it and share it)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("png", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    docs = []
    for p in args.inputs:
        doc = json.loads(p.read_text())
        docs.append((doc.get("label") or p.stem, doc))
    table = rows(docs)
    plot(table, args.png)
    text = markdown(table)
    if args.md:
        args.md.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
