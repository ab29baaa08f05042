"""Per-layer decode attention of a tiered cache (SmolLM2, N tokens): the one-call native step (`kernels/native_step.py`)
against the general native path (one kernel call per segment, merged in torch), in one process, interleaved.

    OMP_NUM_THREADS=2 python benchmarks/native_step_bench.py N THREADS
"""
import sys, time, statistics, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
import hf_kvcache.kernels.decode_attention as da
import hf_kvcache.attention.fused as fu
from hf_kvcache.eval.assets import load_model, load_tokens, load_text
from hf_kvcache.eval.bench import CacheSpec
from hf_kvcache.registry import attached
N = int(sys.argv[1])
model, tok = load_model("smollm2-135m", attn_implementation="hf_kvcache")
ids = load_tokens(tok, load_text("moby-dick"), 0, N + 8)
cache = CacheSpec.parse("tiered").build(model)
calls = []
orig = da.decode_attention
def spy(query, segments, mask=None, *a, **k):
    calls.append((query, segments, mask, a, k))
    return orig(query, segments, mask, *a, **k)
fu.decode_attention = spy
with torch.inference_mode(), attached(model, cache):
    for s in range(0, N, 512):
        model(ids[:, s:min(N, s + 512)], past_key_values=cache, use_cache=True, logits_to_keep=1)
    calls.clear()
    model(ids[:, N:N + 1], past_key_values=cache, use_cache=True)
fu.decode_attention = orig
step_fn = da._segments_step_native
def run(one_call):
    da._segments_step_native = step_fn if one_call else (lambda *a, **k: None)
    t0 = time.perf_counter()
    for q, segs, mask, a, k in calls:
        orig(q, segs, mask, *a, **k)
    return (time.perf_counter() - t0) / len(calls) * 1e6
with torch.inference_mode():
    for q, segs, mask, a, k in calls[:3]:  # the two paths agree
        da._segments_step_native = step_fn; x = orig(q, segs, mask, *a, **k)[0]
        da._segments_step_native = lambda *a, **k: None; y = orig(q, segs, mask, *a, **k)[0]
        assert (x - y).abs().max() < 1e-4, (x - y).abs().max()
    res = {True: [], False: []}
    for _ in range(15):
        for one in (True, False):
            res[one].append(run(one))
da._segments_step_native = step_fn
a, b = statistics.median(res[True]), statistics.median(res[False])
print(f"{N} tokens, {torch.get_num_threads()} thread(s), {len(calls)} layers: one call {a:.0f} us/layer, "
      f"per segment {b:.0f} us/layer (medians of 15 interleaved passes), ratio {b / a:.2f}x")
