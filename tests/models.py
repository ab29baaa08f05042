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
