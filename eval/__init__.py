"""Evaluation: real assets, streaming perplexity, benchmarks (installed as `hf_kvcache.eval`)."""

from .assets import ZOO, AssetError, ZooModel, cache_dir, load_model, load_text, load_tokens, model_dir, zoo_names
from .perplexity import PerplexityResult, forward_perplexity, streaming_perplexity

__all__ = [
    "AssetError",
    "ZOO",
    "ZooModel",
    "cache_dir",
    "load_model",
    "model_dir",
    "zoo_names",
    "load_text",
    "load_tokens",
    "PerplexityResult",
    "forward_perplexity",
    "streaming_perplexity",
]
