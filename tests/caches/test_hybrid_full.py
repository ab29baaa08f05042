"""`TieredQuantOptions.hybrid_full`: the full-attention layers of a model that also has sliding-window layers run
with their own overrides, and only there (tiny random Gemma-3 and Llama, no download)."""

import pytest
import torch
from transformers import LlamaConfig

import hf_kvcache  # noqa: F401
from hf_kvcache import TieredQuantCache
from hf_kvcache.caches.tiered import HYBRID_FULL_FIELDS, SLIDING_DEFAULT, TieredQuantOptions

SMALL = dict(tail_length=8, warm_length=16, group_size=8, archive_group_size=8, target_ratio=None, sink_length=0,
             rotation="none", archive_candidates=None)
OVER = {"archive_bits": 3, "archive_key_bits": 2, "value_group_size": 32, "warm_length": 8}


def run(model, cache, ids):
    with torch.no_grad():
        return torch.cat([model(ids[:, i : i + 16], past_key_values=cache).logits for i in range(0, ids.shape[1], 16)], 1)


def test_only_the_full_layers_of_a_hybrid_model_take_it(tiny_gemma):
    cache = TieredQuantCache(config=tiny_gemma.config, **SMALL, hybrid_full=OVER)
    full, sliding = cache.layers[3], cache.layers[0]
    assert full.in_hybrid and not sliding.in_hybrid
    assert (full.plan.archive_bits, full.plan.archive_key_bits, full.plan.value_group_size, full.plan.warm_length) == (
        3, 2, 32, 8)
    assert full.plan.hybrid_full is None and cache.options.hybrid_full == OVER
    # sliding layers take `sliding` over the top-level options, not over the hybrid ones
    assert sliding.plan == TieredQuantOptions(**SMALL).for_sliding()
    # a model without sliding layers, and a cache without a config, never read it
    llama = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1)
    for c in (TieredQuantCache(config=llama, **SMALL, hybrid_full=OVER), TieredQuantCache(**SMALL, hybrid_full=OVER)):
        c.update(torch.randn(1, 1, 40, 32), torch.randn(1, 1, 40, 32), 0)
        assert not c.layers[0].in_hybrid and c.layers[0].plan == TieredQuantOptions(**SMALL, hybrid_full=OVER)


@pytest.mark.parametrize("target_ratio", [None, 3.0])
def test_the_same_codes_as_the_top_level_spelling(tiny_gemma, target_ratio):
    """On a hybrid model, `hybrid_full` gives the full layers what the same options at the top level give them, with
    the sliding layers pinned to what they ran before: the same logits and bytes, bit for bit (with a memory target
    sizing the warm tier too)."""
    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(3))
    base = {**SMALL, "target_ratio": target_ratio}
    top = {**base, **OVER, "sliding": {**SLIDING_DEFAULT, "archive_key_bits": None, "value_group_size": None,
                                        "warm_length": 16}}
    sliding_as_before = {**SLIDING_DEFAULT, "warm_length": 16}
    a, b = (TieredQuantCache(config=tiny_gemma.config, **top),
            TieredQuantCache(config=tiny_gemma.config, **base, sliding=sliding_as_before, hybrid_full=OVER))
    ref = TieredQuantCache(config=tiny_gemma.config, **base, sliding=sliding_as_before)
    la, lb, lr = run(tiny_gemma, a, ids), run(tiny_gemma, b, ids), run(tiny_gemma, ref, ids)
    assert torch.equal(la, lb) and a.memory_stats()["bytes"] == b.memory_stats()["bytes"]
    assert [x.nbytes() for x in a.layers] == [x.nbytes() for x in b.layers]
    # the overrides did change the full layer (3-bit values in 32-channel groups), and only it
    assert not torch.equal(la, lr)
    assert [x.nbytes() for x in a.layers[:3]] == [x.nbytes() for x in ref.layers[:3]]
    assert a.layers[3].nbytes() != ref.layers[3].nbytes()


def test_checked_like_sliding():
    assert set(HYBRID_FULL_FIELDS) < set(TieredQuantOptions.__dataclass_fields__)
    assert TieredQuantOptions().hybrid_full is None
    opts = TieredQuantOptions(hybrid_full={**OVER, "warm_length": 64})
    assert TieredQuantOptions.from_json(opts.to_json()) == opts
    with pytest.raises(ValueError, match="hybrid_full must be a JSON object"):
        TieredQuantOptions(hybrid_full=3)
    with pytest.raises(ValueError, match=r"\['archive_quantizer'\] cannot be set for the full layers of a model with "
                                         "sliding-window layers alone; use the keys"):
        TieredQuantOptions(hybrid_full={"archive_quantizer": "subspace"})
    with pytest.raises(ValueError, match=r"hybrid_full=\{'warm_length': 40\}: warm_length=40 must be a multiple"):
        TieredQuantOptions(hybrid_full={"warm_length": 40})
