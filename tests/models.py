"""Tiny random transformers models shared by the tests (importable: pytest puts this folder on sys.path)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(dtype: torch.dtype = torch.float32, head_dim: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, vocab: int = 256, seed: int = 0, **config) -> LlamaForCausalLM:
    """A random Llama (GQA `heads` / `kv_heads`, RoPE) in `dtype`, in eval mode, with the SDPA attention."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=2 * heads * head_dim,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=4096, attn_implementation="sdpa", **config)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def cache_config(**config) -> LlamaConfig:
    """The Llama config of the cache unit tests (uniform, tiered, CPAC): 2 layers, 3 KV heads of 2 query heads
    each, head_dim 64, vocabulary 128; `config` adds or overrides fields (layer types, sliding window, ...)."""
    return LlamaConfig(num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                       hidden_size=6 * 64, vocab_size=128, **config)


def eviction_config(head_dim: int = 16, **config) -> LlamaConfig:
    """The Llama config of the eviction tests (H2O, policies, merge, the policy contract): 2 layers, 2 KV heads of
    2 query heads each, hidden size 64, vocabulary 97; `config` adds fields."""
    return LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                       hidden_size=64, intermediate_size=128, vocab_size=97, **config)


def eviction_llama(attention: str | None = None) -> LlamaForCausalLM:
    """The random Llama of `eviction_config()` (seed 0) in eval mode; `attention` sets its attention implementation
    (None: transformers' default, SDPA)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(eviction_config()).eval()
    if attention is not None:
        model.set_attn_implementation(attention)
    return model


def codec_llama(layers: int = 2, max_positions: int = 2048) -> LlamaForCausalLM:
    """A random Llama (seed 0) of the codec / store / archive tests, in eval mode: hidden size 128 (4 query heads of
    2 KV heads, head_dim 32), vocabulary 128, `layers` layers, `max_positions` positions; its config is
    `model.config`."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).eval()
