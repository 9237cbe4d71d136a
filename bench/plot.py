"""Chart bench/gpu_restore.py results: cold start vs restore phases vs speed of light, per size.

Usage: ``python -m bench.plot RESULT.json [MORE.json ...] -o chart.png``

One group of horizontal bars per (file, size): the cold start (stacked by the worker's phases when
the result has them: bench/llm_restore.py); the restore path stacked by phase (verify, CRIU restore,
CUDA restore, unlock, rest); the checkpoint path stacked (lock, CUDA checkpoint, CRIU dump,
publish); and the speed-of-light restore time. Needs matplotlib (``pip install .[bench]``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

RESTORE = [("verify", "verify (hash)", "#dd8452"), ("criu_restore", "CRIU restore", "#4c72b0"),
           ("cuda_restore", "CUDA restore (H2D)", "#55a868"), ("cuda_unlock", "CUDA unlock", "#8172b2"),
           ("restore_other", "restore: rest", "#bbbbbb")]
CHECKPOINT = [("cuda_lock", "CUDA lock", "#ccb974"), ("cuda_checkpoint", "CUDA checkpoint (D2H)", "#c44e52"),
              ("criu_dump", "CRIU dump", "#64b5cd"), ("publish", "publish (hash)", "#937860")]
# bench/llm_restore.py: the cold start by the worker's phases (else one cold_start bar).
COLD = [("cold_import", "import torch + transformers", "#666666"), ("cold_load", "load weights to GPU", "#8c8c8c"),
        ("cold_eager_generate", "first eager generate", "#a6a6a6"),
        ("cold_compile_warmup", "torch.compile warm-up", "#c0c0c0"), ("cold_other", "cold start: rest", "#dddddd")]


def load(paths: list[Path]) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for p in paths:
        doc = json.loads(p.read_text())
        gpu = doc["gpus"][0]["name"] if doc.get("gpus") else "GPU"
        for r in doc["results"]:
            name = r.get("label") or f"{gpu}, {r['gib']:g} GiB"
            same = sum(1 for n, _ in rows if n.split(" #")[0] == name)
            name += f" #{same + 1}" if same else ""
            rows.append((name + ("" if doc.get("criu") else " (no CRIU)"), r))
    return rows


def plot(rows: list[tuple[str, dict[str, Any]]], out: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - optional dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(11, 2.4 + 1.5 * len(rows)))
    ticks, labels, seen = [], [], set()
    y, longest = 0.0, 0.0
    for name, r in reversed(rows):
        ph = r["phases_s"]
        cold = COLD if any(k in ph for k, _, _ in COLD) else [
            ("cold_start", "cold start (spawn, import torch, fill)", "#999999")]
        bars = [("cold start", cold),
                ("restore", RESTORE), ("checkpoint", CHECKPOINT)]
        for kind, parts in bars:
            left = 0.0
            for key, label, color in parts:
                if key not in ph:
                    continue
                ax.barh(y, ph[key], left=left, color=color, height=0.8,
                        label=None if label in seen else label)
                seen.add(label)
                left += ph[key]
            ax.text(left, y, f" {left:.1f} s", va="center", fontsize=8)
            longest = max(longest, left)
            ticks.append(y)
            labels.append(f"{name}: {kind}")
            y += 1
        ax.barh(y, r["sol_s"], color="#222222", height=0.8,
                label=None if "sol" in seen else "speed of light: bytes / min(read, pinned H2D)")
        seen.add("sol")
        ax.text(r["sol_s"], y, f" {r['sol_s']:.2f} s ({r['sol_gbps']:.0f} GB/s)", va="center", fontsize=8)
        ticks.append(y)
        labels.append(f"{name}: SOL")
        y += 1.6
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_title(title)
    ax.set_xlim(0, longest * 1.12)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--title", default="GPU process restore vs cold start (process level)")
    args = ap.parse_args(argv)
    rows = load(args.results)
    if not rows:
        print("no results to plot", file=sys.stderr)
        return 1
    plot(rows, args.out, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
