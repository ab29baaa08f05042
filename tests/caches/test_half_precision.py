"""Every registered cache with a bf16 and an fp16 model (options from the contract suite's `CASES`: caches that
compress a 32-token prompt).

- Caches the fused attention reads in place (`reads_fused`): the fused path (what `generate` and `attached` run)
  gives the logits of the same cache read back through the model's own SDPA attention in a plain loop.
- Every cache: `generate` runs in the model's dtype, the cache hands keys back in that dtype, and logits stay finite.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from models import tiny_llama
from test_contract import CASES

import hf_kvcache
from hf_kvcache.registry import build_cache

P, STEPS = 32, 6
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
FUSED = sorted(n for n in CASES if getattr(build_cache(n, **CASES[n]), "reads_fused", False))

# largest |fused - plain| logit allowed: the two paths round the same dequantized keys and values differently (fp32
# softmax partials against SDPA in the model's dtype); measured maxima over FUSED: bf16 0.0205 (kivi), fp16 0.0087
BOUND = {torch.bfloat16: 0.03, torch.float16: 0.012}


pytestmark = pytest.mark.usefixtures("single_thread")


def _logits(model, cache, ids, fused: bool) -> torch.Tensor:
    """Logits `[batch, 1 + STEPS, vocab]` of a 32-token prefill then single-token steps (teacher forced)."""
    out = []
    with torch.no_grad(), (hf_kvcache.attached(model, cache) if fused else contextlib.nullcontext()):
        out.append(model(ids[:, :P], past_key_values=cache).logits[:, -1])
        for i in range(P, P + STEPS):
            out.append(model(ids[:, i : i + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1)


@DTYPES
@pytest.mark.parametrize("name", FUSED)
def test_fused_attention_matches_the_plain_loop_in_half_precision(name, dtype):
    ids = torch.randint(0, 256, (2, P + STEPS), generator=torch.Generator().manual_seed(0))
    plain = _logits(tiny_llama(dtype), build_cache(name, **CASES[name]), ids, fused=False)
    fused = _logits(tiny_llama(dtype), build_cache(name, **CASES[name]), ids, fused=True)
    assert plain.dtype == fused.dtype == dtype
    assert torch.isfinite(fused).all() and torch.isfinite(plain).all()
    diff = (fused.float() - plain.float()).abs().max().item()
    assert 0 < diff <= BOUND[dtype], f"{name}: fused vs plain logits differ by {diff} (0: the fused path never ran)"


@DTYPES
@pytest.mark.parametrize("name", sorted(CASES))
def test_generate_runs_in_the_models_dtype(name, dtype):
    model = tiny_llama(dtype)
    ids = torch.randint(0, 256, (2, P), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=0,
                         cache_implementation=name, cache_config=CASES[name], return_dict_in_generate=True,
                         output_logits=True)
    assert out.sequences.shape == (2, P + STEPS)
    logits = torch.stack(out.logits, 1)
    assert torch.isfinite(logits).all()  # generate hands logits back in float32
    keys, _ = out.past_key_values.layers[0].materialize()
    assert keys.dtype == dtype
