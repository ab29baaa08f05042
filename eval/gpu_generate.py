"""The `generate` section of `hf-kvcache gpu-check`: end-to-end tokens/s of `generate` with each cache, on a zoo
architecture with random weights in bf16 (prefill and decode timed apart by a streamer)."""

from __future__ import annotations

import time
import traceback

import torch

from .gpu_sections import Deadline, sync

# architectures of zoo models (the values their GGUF headers carry), for the random-weight generate timing
ARCHITECTURES = {
    "qwen2.5-coder-0.5b": dict(
        model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True),
}



def random_model(name: str, device: str, dtype: torch.dtype):
    """A model of the zoo architecture `name` with random weights (seeded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHITECTURES[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class TokenClock:
    """A `generate` streamer that stamps the time (after a device sync) at each `put`: the prompt, then every new
    token, so prefill and decode are timed apart inside one call."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.stamps: list[float] = []

    def put(self, value) -> None:
        sync(self.device)
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate_timing(device: str, opts, deadline: Deadline) -> list[dict]:
    import hf_kvcache  # noqa: F401  (registers the cache names with generate)

    dtype = torch.bfloat16
    model = random_model(opts.model, device, dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, opts.prompt_tokens), generator=torch.Generator().manual_seed(1)).to(device)
    rows = []
    for name in opts.generate_caches:
        if deadline.passed():
            rows.append(dict(cache="(budget spent)"))
            break
        kwargs = {} if name == "dynamic" else dict(cache_implementation=name)
        try:  # compiles this cache's kernels outside the timings (a short prompt, a few decode steps)
            with torch.no_grad():
                model.generate(ids[:, :300], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                               **kwargs)
        except Exception:
            pass  # the timed calls below report the error
        row = dict(model=f"{opts.model} architecture, random weights, bf16", prompt=opts.prompt_tokens, cache=name)
        try:
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            clock = TokenClock(device)
            sync(device)
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=opts.new_tokens + 1, min_new_tokens=opts.new_tokens + 1,
                                     do_sample=False, pad_token_id=0, streamer=clock, **kwargs)
            sync(device)
            first, last = clock.stamps[1], clock.stamps[-1]  # stamps[0] is the prompt, [1] the prefill's token
            row.update(prefill_s=first - t0, decode_tok_s=(len(clock.stamps) - 2) / (last - first),
                       new_tokens=int(out.shape[1] - ids.shape[1]))
            if device.startswith("cuda"):
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as exc:
            row.update(error=f"{type(exc).__name__}: {exc}"[:300], trace=traceback.format_exc(limit=6)[-1200:])
        rows.append(row)
    base = next((r for r in rows if r.get("cache") == "dynamic" and "decode_tok_s" in r), None)
    for r in rows:
        if base and "decode_tok_s" in r:
            r["vs_dynamic"] = r["decode_tok_s"] / base["decode_tok_s"]
    return rows
