"""Fixtures of the cache tests."""

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

TINY_GEMMA_WINDOW = 24


@pytest.fixture(scope="module")
def tiny_gemma() -> Gemma3ForCausalLM:
    """A random Gemma-3 of three sliding-window layers (window `TINY_GEMMA_WINDOW`) and one full layer, head_dim 32."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=TINY_GEMMA_WINDOW, max_position_embeddings=512,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )
    return Gemma3ForCausalLM(cfg).eval()
