"""Evaluation: real assets, streaming perplexity, benchmarks (installed as `hf_kvcache.eval`)."""

from .assets import AssetError, cache_dir, load_model, load_text, load_tokens
from .perplexity import PerplexityResult, forward_perplexity, streaming_perplexity

__all__ = [
    "AssetError",
    "cache_dir",
    "load_model",
    "load_text",
    "load_tokens",
    "PerplexityResult",
    "forward_perplexity",
    "streaming_perplexity",
]
