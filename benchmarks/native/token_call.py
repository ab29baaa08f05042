"""The per-token C kernel's call on a real cache, from any checkout: `python benchmarks/native/token_call.py CHECKOUT
MODEL SPEC TOKENS CALLS`.

Prefills MODEL with TOKENS of Moby Dick into the cache SPEC (a `--caches` spec of `hf-kvcache compare`, e.g. `int4`)
with the package imported from CHECKOUT (a `git worktree` at an earlier commit, or this one), then times
`native.token_output_native` (one decode step's call: the segment and one new token) on layers 2, 5 and 20, CALLS
times each after 20 warm-up calls, one thread. Prints the median and the 10th percentile in microseconds. Two
checkouts run at the same time on the two cores, then swapped, compare a change with its parent where the Python
side of the call changed too (`ab_token_kernel.py` needs both builds to take the same arguments).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from from_tree import _TreeFinder

root = Path(sys.argv[1]).resolve()
sys.meta_path.insert(0, _TreeFinder(root))
import torch
from hf_kvcache.eval.assets import load_model, load_text, load_tokens
from hf_kvcache.eval.bench import CacheSpec
from hf_kvcache.kernels import native

from hf_kvcache.registry import attached

torch.set_num_threads(1)
model_name, spec, tokens, calls = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
model, tok = load_model(model_name, attn_implementation="hf_kvcache")
ids = load_tokens(tok, load_text("moby-dick"), 0, tokens + 80)
cache = CacheSpec.parse(spec).build(model)
times = {}
with torch.inference_mode(), attached(model, cache):
    for s in range(0, tokens, 1024):
        model(ids[:, s : min(tokens, s + 1024)], past_key_values=cache, use_cache=True, logits_to_keep=1)
    model(ids[:, tokens : tokens + 1], past_key_values=cache, use_cache=True)
    for layer in (2, 5, 20):
        seg = cache.layers[layer].attention_segments()[0]
        heads, dim = seg.keys.codes.shape[1], model.config.head_dim
        group = model.config.num_attention_heads // heads
        torch.manual_seed(0)
        q = torch.randn(1, heads, group, dim) * dim**-0.5
        new = (torch.randn(1, heads, 1, dim), torch.randn(1, heads, 1, dim))
        for _ in range(20):
            native.token_output_native(q, seg, None, dense=new)
        ts = []
        for _ in range(calls):
            t0 = time.perf_counter()
            native.token_output_native(q, seg, None, dense=new)
            ts.append(time.perf_counter() - t0)
        ts.sort()
        times[layer] = f"{1e6 * ts[len(ts) // 2]:.0f} / {1e6 * ts[len(ts) // 10]:.0f}"
print(f"{root.name}: {spec}, {tokens} tokens, us a call (median / p10) by layer: {times}")
