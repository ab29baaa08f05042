"""The "hf_kvcache" attention function: same output as SDPA, attention mass equal to eager softmax column sums."""

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import hf_kvcache  # noqa: F401  (registers the attention)
from hf_kvcache import attention as attn
from hf_kvcache.attention import AttentionRequest, hand_over
from hf_kvcache.caches.base import CompressedLayer


class Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


class Recorder(CompressedLayer):
    wants_attention_mass = True

    def __init__(self):
        super().__init__()
        self.mass, self.visible = None, "unset"

    def observe_attention(self, mass):
        self.mass = mass

    def observe_visible_keys(self, visible):
        self.visible = visible


def padded_causal_mask(batch, q_len, past, pad):
    """transformers' own SDPA mask: causal over `past` cached tokens + `q_len` new ones, rows left-padded by `pad`."""
    kv = past + q_len
    padding = torch.arange(kv)[None, :] >= torch.tensor(pad)[:, None]
    return sdpa_mask(batch, q_len, kv, q_offset=past, attention_mask=padding, allow_is_causal_skip=False)


def eager_mass(q, k, mask, groups, scale):
    """Column sums of eager softmax probabilities, per KV head; fully masked (padding) query rows count zero."""
    s = (q @ repeat_kv(k, groups).transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = s.softmax(-1).nan_to_num(0.0)
    b, heads, q_len, kv = p.shape
    return p.view(b, heads // groups, groups, q_len, kv).sum(dim=(2, 3))


def inputs(groups, q_len, past, batch=3, kv_heads=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = past + q_len
    q = torch.randn(batch, kv_heads * groups, q_len, d, generator=g)
    k = torch.randn(batch, kv_heads, kv, d, generator=g)
    v = torch.randn(batch, kv_heads, kv, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("groups", [1, 3, 7])
@pytest.mark.parametrize("q_len", [1, 9, 300])
def test_output_equals_sdpa_and_mass_equals_eager(groups, q_len, monkeypatch):
    monkeypatch.setattr(attn.kernels, "QUERY_BLOCK", 64)  # several query blocks for the long prompt
    past, pad = 20, [0, 4, 11]
    q, k, v = inputs(groups, q_len, past)
    mask = padded_causal_mask(3, q_len, past, pad)
    module = Module(groups)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    fast, _ = attn.hf_kvcache_attention(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=0)

    layer = Recorder()
    hand_over(k, AttentionRequest(layer))
    out, weights = attn.hf_kvcache_attention(module, q, k, v, mask, scaling=0.25)
    assert weights is None and out.shape == (3, q_len, q.shape[1], 16)
    valid_rows = mask.any(-1)[:, 0]  # [b, q]: padding query rows see nothing; compare the rest
    torch.testing.assert_close(out[valid_rows], ref[valid_rows], atol=1e-5, rtol=0)
    assert layer.mass.shape == (3, 2, past + q_len) and layer.mass.dtype == torch.float32
    torch.testing.assert_close(layer.mass, eager_mass(q, k, mask, groups, 0.25), atol=1e-4, rtol=1e-5)
    # padding keys receive nothing and are reported invisible
    for row, p in enumerate(pad):
        assert layer.mass[row, :, :p].abs().sum().item() == 0.0
        assert not layer.visible[row, :p].any() and layer.visible[row, p:].all()


@pytest.mark.parametrize("groups", [1, 3])
def test_causal_without_mask(groups):
    """No mask (transformers skipped it): prefill is causal, decoding sees everything; mass over the same keys."""
    module = Module(groups)
    for q_len, past in [(12, 0), (1, 30)]:
        q, k, v = inputs(groups, q_len, past)
        ref, _ = sdpa_attention_forward(module, q, k, v, None)
        layer = Recorder()
        hand_over(k, AttentionRequest(layer))
        out, _ = attn.hf_kvcache_attention(module, q, k, v, None)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        causal = torch.ones(q_len, past + q_len, dtype=torch.bool).tril(past)[None, None]
        torch.testing.assert_close(layer.mass, eager_mass(q, k, causal, groups, 16**-0.5), atol=1e-4, rtol=1e-5)
        assert layer.visible is None


def test_float_mask_and_per_head_mask():
    groups, q_len, past = 3, 5, 7
    q, k, v = inputs(groups, q_len, past)
    bool_mask = padded_causal_mask(3, q_len, past, [0, 2, 3]).expand(-1, q.shape[1], -1, -1).clone()
    bool_mask[:, 1, :, past - 1] = False  # one query head may not see one key
    float_mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    module = Module(groups)
    for mask in (bool_mask, float_mask):
        ref, _ = sdpa_attention_forward(module, q, k, v, mask)
        layer = Recorder()
        hand_over(k, AttentionRequest(layer))
        out, _ = attn.hf_kvcache_attention(module, q, k, v, mask)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.mass, eager_mass(q, k, bool_mask, groups, 16**-0.5), atol=1e-4, rtol=1e-5)


def test_long_prompt_never_builds_the_full_matrix(monkeypatch):
    """The mass path works on blocks of QUERY_BLOCK query positions."""
    monkeypatch.setattr(attn.kernels, "QUERY_BLOCK", 32)
    biggest = []
    real_softmax = torch.softmax

    def spy(x, dim, *a, **kw):
        biggest.append(x.numel())
        return real_softmax(x, dim, *a, **kw)

    monkeypatch.setattr(attn.kernels.torch, "softmax", spy)
    q, k, v = inputs(3, 200, 0, batch=1)
    layer = Recorder()
    hand_over(k, AttentionRequest(layer))
    attn.hf_kvcache_attention(Module(3), q, k, v, None)
    assert max(biggest) <= 1 * 6 * 32 * 200
    torch.testing.assert_close(layer.mass.sum(), torch.tensor(6.0 * 200), rtol=1e-5, atol=0)


def test_registered_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["hf_kvcache"] is attn.hf_kvcache_attention
    assert AttentionMaskInterface._global_mapping["hf_kvcache"] is sdpa_mask


def test_kernel_dispatch_is_pluggable(monkeypatch):
    calls = []

    class Fused:
        name = "fake_fused"

        def supports(self, call):
            return call.want_mass

        def __call__(self, call):
            calls.append(call)
            return attn.BlockwiseTorchKernel()(call)

    monkeypatch.setattr(attn, "KERNELS", list(attn.KERNELS))
    attn.register_kernel(Fused())
    q, k, v = inputs(3, 4, 6)
    attn.hf_kvcache_attention(Module(3), q, k, v, None)
    assert not calls  # no mass wanted: SDPA fast path
    hand_over(k, AttentionRequest(Recorder()))
    attn.hf_kvcache_attention(Module(3), q, k, v, padded_causal_mask(3, 4, 6, [0, 0, 0]))
    assert len(calls) == 1 and calls[0].groups == 3


@pytest.mark.slow
def test_model_logits_equal_sdpa(smol, moby_text):
    from hf_kvcache.eval import load_tokens

    model, tok = smol
    ids = load_tokens(tok, moby_text, 5000, 48)
    before = model.config._attn_implementation
    try:
        with torch.inference_mode():
            model.set_attn_implementation("sdpa")
            ref = model(ids).logits
            model.set_attn_implementation("hf_kvcache")
            out = model(ids).logits
            # padded batch, through a cache that asks for attention mass (H2O with a budget that keeps everything)
            batch = torch.cat([ids[:, :40], torch.cat([torch.zeros(1, 8, dtype=ids.dtype), ids[:, :32]], 1)])
            am = torch.ones_like(batch)
            am[1, :8] = 0
            ref_b = model(batch, attention_mask=am).logits
            cache = hf_kvcache.H2OCache(config=model.config, budget=1000)
            out_b = model(batch, attention_mask=am, past_key_values=cache).logits
    finally:
        model.set_attn_implementation(before)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(out_b[0], ref_b[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(out_b[1, 8:], ref_b[1, 8:], atol=1e-4, rtol=0)


def _generate(model, ids, cache=None, **kw):
    out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         past_key_values=cache, **kw)
    return out.sequences, torch.stack(out.logits)


@torch.no_grad()
def test_a_soft_capping_model_keeps_its_attention_with_a_cache_read_in_place():
    """The hf_kvcache attention has no soft-capping: `generate` leaves such a model on its own attention with a cache
    it would read in place (an optimization), which then hands over dequantized tensors as with any attention."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from hf_kvcache import UniformQuantCache

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=16,
                          attn_logit_softcapping=50.0)
    model = Gemma2ForCausalLM(config).eval()
    before = model.config._attn_implementation
    ids = torch.randint(0, 128, (1, 40))
    fused_name = _generate(model, ids, cache_implementation="int4")
    assert model.config._attn_implementation == before
    plain = UniformQuantCache(config=model.config, dtype="int4")
    plain.reads_fused = False
    reference = _generate(model, ids, plain)
    assert torch.equal(fused_name[0], reference[0]) and torch.equal(fused_name[1], reference[1])


@torch.no_grad()
def test_attention_sinks_read_a_bound_cache_through_its_decoded_tensors():
    """gpt-oss passes attention sinks (`s_aux`), which only SDPA takes: a cache read in place then hands that call
    its decoded tensors (before, SDPA read the placeholders and raised); the logits equal an unbound cache's."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from hf_kvcache import UniformQuantCache

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=16,
                          num_local_experts=2, num_experts_per_tok=1)
    model = GptOssForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 40))
    bound = _generate(model, ids, cache_implementation="int4")  # generate binds it and switches the attention
    model.set_attn_implementation("hf_kvcache")
    plain = UniformQuantCache(config=model.config, dtype="int4")
    plain.reads_fused = False
    reference = _generate(model, ids, plain)
    assert torch.equal(bound[0], reference[0]) and torch.equal(bound[1], reference[1])
