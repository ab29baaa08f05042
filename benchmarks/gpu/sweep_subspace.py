"""A launch sweep of the subspace archive's Triton kernel on a GPU (the settings `kernels/triton_subspace.py`'s
`SUB_LAUNCH` was chosen from on the cubins alone): tiles of 16-64 tokens, 16 / 32 channel pairs per rebuild step, 4 / 8
warps, at 32K tokens, keys pre-RoPE (the tiered default), head dims 64 / 128, batch 1 / 8, fp16 operand dots (a bf16
model). GPU time of the kernel alone (split partials unmerged, replayed from a CUDA graph), bandwidth on the bytes the
segment holds, and the output's largest difference from the default launch. Writes sweep_subspace.json and .md into
--out.

    python benchmarks/gpu/sweep_subspace.py --out DIR [--budget-s 90]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from hf_kvcache.eval.gpu_check import _table
from hf_kvcache.eval.gpu_sections import Deadline, graph_ms, segment_bytes, subspace_case
from hf_kvcache.kernels.triton_subspace import coefficient_partial, subspace_launch

SETTINGS = [dict(block=bl, channels=ch, num_warps=w) for bl in (16, 32, 64) for ch in (16, 32) for w in (4, 8)]
CASES = [dict(head_dim=d, batch=b) for d in (128, 64) for b in (8, 1)]
COLUMNS = ["head_dim", "batch", "block", "channels", "num_warps", "default", "ms", "gb_per_s", "max_err", "error",
           "setting"]


def _output(part) -> torch.Tensor:
    m, l, acc = part
    return acc / l.unsqueeze(-1)


def sweep(device: str, deadline: Deadline, tokens: int = 32768, kv_heads: int = 8, group: int = 4,
          iters: int = 20) -> list[dict]:
    built = []
    for c in CASES:
        seg, _ = subspace_case(c["batch"], kv_heads, tokens, c["head_dim"], True, c["batch"], device)
        q = torch.randn(c["batch"], kv_heads, group, c["head_dim"], device=device) / math.sqrt(c["head_dim"])
        built.append((dict(c, tokens=tokens), seg, q, _output(coefficient_partial(q, seg, None, dot_f32=False))))
    rows = []
    for s in SETTINGS:
        for base, seg, q, ref in built:
            if deadline.passed():
                return rows + [dict(setting="(budget spent)")]
            block, channels, warps = subspace_launch(base["head_dim"], False)
            row = dict(base, **s, default=s == dict(block=block, channels=channels, num_warps=warps))
            try:
                row["max_err"] = float((_output(coefficient_partial(q, seg, None, False, **s)) - ref).abs().max())
                row["ms"] = graph_ms(lambda: coefficient_partial(q, seg, None, False, merged=False, **s), iters)
                row["gb_per_s"] = segment_bytes([seg]) / row["ms"] / 1e6
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--budget-s", type=float, default=90.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise ValueError("the sweep times CUDA graphs: run it on a GPU machine (benchmarks/gpu/run_check.sh's setup)")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = sweep("cuda", Deadline(args.budget_s))
    (args.out / "sweep_subspace.json").write_text(json.dumps(rows, indent=1))
    (args.out / "sweep_subspace.md").write_text(_table(rows, COLUMNS))
    best = {}
    for r in rows:
        key = (r.get("head_dim"), r.get("batch"))
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    print(_table(list(best.values()), COLUMNS))


if __name__ == "__main__":
    main()
