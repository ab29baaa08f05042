"""The per-token C kernel, two builds side by side: `python benchmarks/native/ab_token_kernel.py OLD.c [TOKENS]`.

Builds `OLD.c` (e.g. `git show HEAD~1:kernels/native_decode.c > /tmp/old.c`) and the working tree's
`kernels/native_decode.c`, then times `token_partial_native` on SmolLM2-shaped segments (3 KV heads, 3 query rows
each, head dim 64; int8 and int4, keys as they come and pre-RoPE) alternating the two libraries in one process, 12
rounds of 100 calls each, one thread. Prints the median of each and the largest relative difference of their outputs.
Both builds must take the same arguments (the Python side is the working tree's)."""
import sys, time, torch
from pathlib import Path
torch.set_num_threads(1)
from hf_kvcache.caches.uniform import UniformQuantOptions, UniformPreRopeKeys
from hf_kvcache.kernels import native
from hf_kvcache.kernels.segments import TokenSegment
from hf_kvcache.rope import KeyRotation
from transformers import AutoConfig
new_src = native.SOURCE
native.SOURCE = Path(sys.argv[1]); lib_old = native._compile()
native.SOURCE = new_src; lib_new = native._compile()
T = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
cfg = AutoConfig.for_model("llama", hidden_size=576, num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0)
rope = KeyRotation.from_config(cfg)
g = torch.Generator().manual_seed(0)
k = torch.randn(1, 3, T, 64, generator=g); v = torch.randn(1, 3, T, 64, generator=g)
q = torch.randn(1, 3, 3, 64, generator=g); dk = torch.randn(1, 3, 1, 64); dv = torch.randn(1, 3, 1, 64)
def seg_for(bits, prerope):
    opts = UniformQuantOptions(dtype=f"int{bits}")
    if not prerope:
        return TokenSegment(opts.quantize(k), opts.quantize(v))
    codec = UniformPreRopeKeys(rope, opts.bits, scale_power=0.5, per_row=True, options=opts)
    pos = torch.arange(T); pre = codec.derotate(k, pos); codec.fit(pre)
    return TokenSegment(codec.quantize_pre(pre), opts.quantize(v), codec, pos)
def run(lib, seg, calls):
    native._build.lib = lib
    ts = []
    for _ in range(calls):
        t = time.perf_counter(); native.token_partial_native(q, seg, None, dense=(dk, dv)); ts.append(time.perf_counter() - t)
    return ts
for bits in (8, 4):
    for prerope in (False, True):
        seg = seg_for(bits, prerope)
        a = run(lib_old, seg, 1); b = run(lib_new, seg, 1)
        native._build.lib = lib_old; ro = native.token_partial_native(q, seg, None, dense=(dk, dv)); ro = [t.clone() for t in ro]
        native._build.lib = lib_new; rn = native.token_partial_native(q, seg, None, dense=(dk, dv))
        diff = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(ro, rn))
        old, new = [], []
        for r in range(12):
            old += run(lib_old, seg, 100); new += run(lib_new, seg, 100)
        mo, mn = sorted(old)[len(old) // 2] * 1e6, sorted(new)[len(new) // 2] * 1e6
        print(f"int{bits} prerope={prerope} T={T}: old {mo:.0f} us, new {mn:.0f} us, new/old {mn/mo:.2f}, max rel diff {diff:.1e}")
