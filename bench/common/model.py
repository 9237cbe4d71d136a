"""The LLM benches' test model: a Qwen2-7B-shaped causal LM with random weights, made once.

``python -m bench.common.model --model-dir DIR`` (and ``python -m bench.llm_restore make-model``)
makes it and prints its facts as JSON; the benches make it in a child (:func:`make_in_child`),
so their own process never imports torch or holds GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DIR = Path("/var/tmp/rekindle-llm-model")
QWEN2_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 32768,
            "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": None}
MARKER = "rekindle-bench-model.json"


def make_model(model_dir: Path) -> dict[str, Any]:
    """Random-weight Qwen2-7B-shaped model, initialised on the GPU, saved as safetensors."""
    if (model_dir / MARKER).exists():
        return {**json.loads((model_dir / MARKER).read_text()), "made_now": False}
    import torch  # noqa: PLC0415 - only making the model needs it
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415

    t0 = time.monotonic()
    shutil.rmtree(model_dir, ignore_errors=True)
    cfg = AutoConfig.for_model("qwen2", **QWEN2_7B)
    torch.manual_seed(0)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        except TypeError:
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    init_s = time.monotonic() - t0
    model.save_pretrained(model_dir, max_shard_size="4GB")
    files = sorted(model_dir.glob("*.safetensors"))
    info = {"params": sum(p.numel() for p in model.parameters()), "config": QWEN2_7B, "init_s": round(init_s, 2),
            "bytes": sum(f.stat().st_size for f in files), "files": len(files)}
    os.sync()
    info["make_s"] = round(time.monotonic() - t0, 2)
    (model_dir / MARKER).write_text(json.dumps(info, indent=1) + "\n")
    return {**info, "made_now": True}


def make_in_child(model_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The model made (or found) by a child Python: its facts and "", or None and the child's error."""
    r = subprocess.run([sys.executable, "-m", "bench.common.model", "--model-dir", str(model_dir)],
                       cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        return None, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    print(json.dumps(make_model(args.model_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
