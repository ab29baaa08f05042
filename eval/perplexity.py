"""Streaming perplexity: the text goes through the cache chunk by chunk, so every token is predicted while
attending to the (compressed) past, exactly as during generation."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
from transformers.cache_utils import Cache

from hf_kvcache.caches.base import memory_stats
from hf_kvcache.transformers_compat import cache_kwargs


@dataclass
class PerplexityResult:
    perplexity: float
    tokens: int
    bytes: int
    fp16_bytes: int
    ratio: float
    seconds: float
    # summed nll of the tokens scored in each chunk (the first chunk scores chunk_size - 1): what a paired comparison
    # of two caches on the same tokens resamples (`hf_kvcache.eval.paired`)
    chunk_nll: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


@torch.inference_mode()
def streaming_perplexity(
    model,
    input_ids: torch.Tensor,
    cache: Cache,
    chunk_size: int = 32,
    progress: bool = False,
    on_chunk: Callable[[int, list[float]], None] | None = None,
    nll_block: int | None = None,
) -> PerplexityResult:
    """Perplexity of `input_ids` ([1, N]) fed in chunks of `chunk_size` tokens through `cache`.

    Token t is scored from the logits of position t-1, whichever chunk that position was in. `chunk_nll` holds the
    summed nll per chunk, or with `nll_block` per block of that many positions (token t in block t // nll_block, so
    the first block scores nll_block - 1 tokens, as a first chunk does): finer units for a paired interval when the
    chunks are long. `on_chunk(start, chunk_nll)` is called after each chunk with the sums so far.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n = input_ids.shape[1]
    if n < 2:
        raise ValueError("need at least 2 tokens to score")
    if nll_block is not None and nll_block < 1:
        raise ValueError(f"nll_block must be >= 1 (or None: one sum per chunk), got {nll_block}")
    input_ids = input_ids.to(model.device)
    chunk_nll, scored, last_logits = [], 0, None
    starts = range(0, n, chunk_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc="perplexity", unit="chunk", leave=False)
    t0 = time.perf_counter()
    for start in starts:
        chunk = input_ids[:, start : start + chunk_size]
        logits = model(input_ids=chunk, **cache_kwargs(cache), use_cache=True).logits[0].float()
        preds = logits[:-1] if last_logits is None else torch.cat([last_logits, logits[:-1]])
        targets = chunk[0, 1:] if last_logits is None else chunk[0]
        if nll_block is None:  # one fused sum per chunk (a sum of the per-token losses rounds differently)
            chunk_nll.append(torch.nn.functional.cross_entropy(preds, targets, reduction="sum").item())
        else:  # target positions first..start+len-1, summed into the blocks they fall in
            nll = torch.nn.functional.cross_entropy(preds, targets, reduction="none")
            first = start + chunk.shape[1] - targets.numel()
            block_of = torch.arange(first, first + targets.numel()) // nll_block
            sums = torch.zeros(int(block_of[-1]) + 1, dtype=torch.float64).index_add_(0, block_of, nll.double())
            chunk_nll.extend([0.0] * (sums.numel() - len(chunk_nll)))
            for b in range(int(block_of[0]), sums.numel()):
                chunk_nll[b] += sums[b].item()
        scored += targets.numel()
        last_logits = logits[-1:]
        if on_chunk is not None:
            on_chunk(start, chunk_nll)
    seconds = time.perf_counter() - t0
    stats = memory_stats(cache)
    return PerplexityResult(math.exp(sum(chunk_nll) / scored), n, stats["bytes"], stats["fp16_bytes"], stats["ratio"],
                            seconds, chunk_nll)


@torch.inference_mode()
def forward_perplexity(model, input_ids: torch.Tensor) -> float:
    """Perplexity from one ordinary forward pass (no cache): the reference for `streaming_perplexity`."""
    logits = model(input_ids=input_ids.to(model.device), use_cache=False).logits[0].float()
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1], input_ids[0, 1:].to(logits.device)).item())
