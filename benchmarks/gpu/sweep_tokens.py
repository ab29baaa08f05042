"""A wider launch sweep of the per-token kernel on a GPU (the settings `kernels/triton_tokens.py` defaults come from):
tiles of 32-128 tokens, 2-8 warps, 4-16 programs per SM, pipeline stages, at 32K tokens for int4 / int8, keys as they
come and pre-RoPE, head dims 64 / 128, batch 1 / 8. Writes sweep_tokens.json and .md into --out.

    python benchmarks/gpu/sweep_tokens.py --out DIR [--budget-s 120]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_kvcache.eval.gpu_check import CheckOptions, _table
from hf_kvcache.eval.gpu_sections import Deadline, token_sweep

SETTINGS = [dict(block=bl, num_warps=w, waves=wv, num_stages=st) for bl in (32, 64, 128) for w in (2, 4, 8)
            for wv in (4, 8, 16) for st in (2, 3) if not (bl == 128 and w == 2)]
CASES = [dict(head_dim=128, dtype="int4", batch=8, prerope=False), dict(head_dim=128, dtype="int4", batch=8, prerope=True),
         dict(head_dim=128, dtype="int8", batch=8, prerope=False), dict(head_dim=64, dtype="int4", batch=8, prerope=False),
         dict(head_dim=128, dtype="int4", batch=1, prerope=False), dict(head_dim=64, dtype="int8", batch=1, prerope=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=120.0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    opts = CheckOptions(out=args.out)
    rows = token_sweep("cuda", opts, Deadline(args.budget_s), settings=SETTINGS, cases=CASES)
    (args.out / "sweep_tokens.json").write_text(json.dumps(rows, indent=1))
    cols = ["head_dim", "dtype", "batch", "prerope", "block", "num_warps", "waves", "num_stages", "ms", "gb_per_s",
            "max_err", "error", "setting"]
    (args.out / "sweep_tokens.md").write_text(_table(rows, cols))
    best = {}
    for r in rows:
        key = (r.get("head_dim"), r.get("dtype"), r.get("batch"), r.get("prerope"))
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    print(_table(list(best.values()), cols))


if __name__ == "__main__":
    main()
