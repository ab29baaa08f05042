"""lm-evaluation-harness model `hf-kvcache`: lm-eval's `hf` model, scoring through a compressed KV cache.

lm-eval's own `hf` model scores `loglikelihood` with one plain forward pass over context + continuation, so whatever
KV cache the model is given changes nothing there (lm-eval issue 3298). This model instead streams every scored input
through a fresh cache `chunk` tokens at a time, exactly like `hf_kvcache.eval.streaming_perplexity`: each scored token
is predicted while attending to the compressed past. `generate_until` passes a fresh cache to `generate`.

Importing this module registers the model with lm-eval. lm-eval's own `lm_eval` command finds it too once the package
is installed (regular or editable): `hf_kvcache_lm_eval.pth` registers the lazy placeholder
"hf_kvcache.eval.lm_eval:HFKVCacheLM" when lm-eval imports its registry (`hf_kvcache_lm_eval_hook`). This module is
also a command line: it adds this package's offline tasks (`eval/tasks`) as `--include_path` unless one is given, and
then runs lm-eval's own command line with the same arguments:

    python -m hf_kvcache.eval.lm_eval --model hf-kvcache --model_args pretrained=smollm2-135m,cache=tiered \\
        --tasks kvcache_pydoc_ppl,kvcache_moby_cloze --device cpu --batch_size 1
    python -m hf_kvcache.eval.lm_eval --model hf-kvcache \\
        --model_args '{"pretrained":"smollm2-135m","cache":"kivi","cache_config":{"bits":2,"residual_length":16}}' \\
        --tasks kvcache_pydoc_ppl --device cpu --batch_size 1

(lm-eval reads `--model_args` as one JSON object when its first value contains a brace, so a `cache_config` goes either
in that JSON form or as a separate value: `--model_args pretrained=smollm2-135m cache=kivi 'cache_config={"bits": 2}'`.)

From Python: `import hf_kvcache.eval.lm_eval` and then `lm_eval.simple_evaluate(model="hf-kvcache", ...)`, or pass an
`HFKVCacheLM(...)` instance as `model`.

Model args (besides every `hf` one): `pretrained` (a folder, a hub id, `smollm2-135m`, or a loaded model), `cache`
(`dynamic` or a name of `hf_kvcache.cache_names()`), `cache_config` (a dict or a JSON object string of that cache's
options), `chunk` (tokens per forward step while scoring, default 32) and `share_prefix` (default true: requests with
the same context, such as the choices of one multiple-choice question, stream their common whole-chunk prefix once and
continue from copies of that cache; the chunk boundaries are the same as without sharing, so the scores are too).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache

import hf_kvcache  # noqa: F401  (registers the caches and the "hf_kvcache" attention)
from hf_kvcache.registry import attached
from hf_kvcache.options import parse_options_json
from hf_kvcache.eval.assets import model_dir
from hf_kvcache.registry import build_cache, cache_names
from hf_kvcache.transformers_compat import cache_kwargs

MODEL_NAME = "hf-kvcache"
DYNAMIC = "dynamic"
TASKS_DIR = Path(__file__).resolve().parent / "tasks"
TASKS = ("kvcache_pydoc_ppl", "kvcache_moby_cloze")


def cache_choices() -> list[str]:
    """Valid values of the `cache` model arg."""
    return [DYNAMIC, *cache_names()]


def parse_cache_config(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """`cache_config` as a dict: a dict, a JSON object string (as typed on the command line), or None / "" for {}."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, str):
        return parse_options_json(value, "cache_config")
    raise ValueError(f"cache_config must be a dict or a JSON object string, got {type(value).__name__}")


@dataclass
class _Scored:
    """One loglikelihood request being scored. The model input is `tokens[:-1]`; the logits at input position `i`
    predict `tokens[i + 1]`, and positions `first .. len(tokens) - 2` (the continuation) are scored."""

    tokens: list[int]
    first: int
    logprob: float = 0.0
    greedy: bool = True

    @property
    def input_len(self) -> int:
        return len(self.tokens) - 1


@register_model(MODEL_NAME) if __name__ != "__main__" else (lambda cls: cls)  # `python -m` registers the import
class HFKVCacheLM(HFLM):
    """lm-eval's `HFLM` whose loglikelihoods are computed by streaming through a fresh compressed cache per request.

    Scoring is one request at a time (plus prefix sharing, see the module docstring); `batch_size` still applies to
    `generate_until`. Only decoder-only (causal) models are supported.
    """

    def __init__(
        self,
        pretrained: str | PreTrainedModel = "smollm2-135m",
        cache: str = DYNAMIC,
        cache_config: dict[str, Any] | str | None = None,
        chunk: int = 32,
        share_prefix: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(cache, str) or cache not in cache_choices():
            raise ValueError(f"unknown cache {cache!r}; valid choices: {cache_choices()}")
        options = parse_cache_config(cache_config)
        if cache == DYNAMIC:
            if options:
                raise ValueError(f"cache=dynamic takes no cache_config (got {options}); name a compressed cache")
        else:
            build_cache(cache, None, **copy.deepcopy(options))  # unknown options / bad values -> ValueError, early
        if isinstance(chunk, str) and chunk.strip().isdigit():
            chunk = int(chunk)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1 (tokens per forward step), got {chunk!r}")
        if not isinstance(share_prefix, bool):
            raise ValueError(f"share_prefix must be true or false, got {share_prefix!r}")
        self.cache_name = cache
        self.cache_options = options
        self.chunk = chunk
        self.share_prefix = share_prefix
        if isinstance(pretrained, str):
            pretrained = model_dir(pretrained)
        if kwargs.get("device") is None:  # hf's default is "cuda" even on a machine without one
            kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(pretrained=pretrained, **kwargs)
        if self.backend != "causal":
            raise ValueError(f"{MODEL_NAME} supports decoder-only models (backend='causal'), got {self.backend!r}")
        self.new_cache()  # the real model config: any remaining bad option fails now, not in the middle of a run

    # ---- caches ---------------------------------------------------------------------------------------------------
    def new_cache(self) -> Cache:
        """A fresh cache for one request (each forward runs it `attached` to the model, as generate does)."""
        config = self.model.config
        if self.cache_name == DYNAMIC:
            return DynamicCache(config=config)
        return build_cache(self.cache_name, config.get_text_config(decoder=True), **copy.deepcopy(self.cache_options))

    def get_model_info(self) -> dict[str, Any]:
        return {
            **super().get_model_info(),
            "kv_cache": self.cache_name,
            "kv_cache_config": self.cache_options,
            "kv_cache_chunk": self.chunk,
        }

    # ---- scoring --------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _feed(self, cache: Cache, inputs: list[int], start: int, stop: int, scored: list[_Scored]) -> None:
        """Run input positions `start..stop-1` through `cache` in chunks that end at multiples of `self.chunk` (so
        `start` must be one), adding to each of `scored` the log-probabilities of its tokens predicted there. The
        forwards run with the cache attached to the model as generate runs it (the attention it needs: mass for
        eviction, queries for calibration, fused reads of codes), and the model is handed back afterwards."""
        with attached(self.model, cache):
            self._feed_attached(cache, inputs, start, stop, scored)

    def _feed_attached(self, cache: Cache, inputs: list[int], start: int, stop: int, scored: list[_Scored]) -> None:
        for a in range(start, stop, self.chunk):
            b = min(a + self.chunk, stop)
            ids = torch.tensor([inputs[a:b]], dtype=torch.long, device=self.device)
            with torch.autocast(
                device_type=self.device.type,
                dtype=self.mixed_precision_dtype,
                enabled=self.mixed_precision_dtype is not None,
            ):
                logits = self.model(input_ids=ids, **cache_kwargs(cache), use_cache=True).logits[0]
            lo = max(a, min(s.first for s in scored))
            if lo >= b:
                continue
            logprobs = F.log_softmax(logits[lo - a :], dim=-1, dtype=self.softmax_dtype)
            for s in scored:
                s_lo, s_hi = max(lo, s.first), min(b, s.input_len)
                if s_lo >= s_hi:
                    continue
                rows = logprobs[s_lo - lo : s_hi - lo]
                targets = torch.tensor(s.tokens[s_lo + 1 : s_hi + 1], dtype=torch.long, device=rows.device)
                s.logprob += float(rows.gather(1, targets[:, None]).sum())
                s.greedy = s.greedy and bool((rows.argmax(dim=-1) == targets).all())

    def _score_group(self, group: list[_Scored]) -> None:
        """Score requests that share a context: the common whole-chunk prefix of their inputs once, then each one
        from its own copy of that cache."""
        shared = 0
        if self.share_prefix and len(group) > 1:
            first = group[0].tokens
            lcp = min(s.input_len for s in group)
            for s in group[1:]:
                n = 0
                while n < lcp and s.tokens[n] == first[n]:
                    n += 1
                lcp = n
            shared = lcp // self.chunk * self.chunk
        if shared == 0:
            for s in group:
                self._feed(self.new_cache(), s.tokens[:-1], 0, s.input_len, [s])
            return
        cache = self.new_cache()
        self._feed(cache, group[0].tokens[:shared], 0, shared, group)
        for i, s in enumerate(group):
            own = cache if i == len(group) - 1 else copy.deepcopy(cache)
            self._feed(own, s.tokens[:-1], shared, s.input_len, [s])

    def _loglikelihood_tokens(
        self,
        requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
        disable_tqdm: bool = False,
        override_bs: int | None = None,
    ) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether it is the greedy one) per request, in request order.

        Inputs longer than `max_length` are cut from the left as `hf` does; `override_bs` is ignored (one request or
        one shared-context group at a time)."""
        scored: list[_Scored] = []
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError("loglikelihood requests need a non-empty context and continuation (token ids)")
            if len(continuation) > self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
            tokens = (context + continuation)[-(self.max_length + 1) :]
            scored.append(_Scored(tokens=tokens, first=len(tokens) - 1 - len(continuation)))
            groups.setdefault(tuple(context), []).append(i)
        bar = tqdm(
            total=len(requests), disable=disable_tqdm or self.rank != 0, desc=f"loglikelihood ({self.cache_name})"
        )
        for members in groups.values():
            self._score_group([scored[i] for i in members])
            for i in members:
                answer = (scored[i].logprob, scored[i].greedy)
                if requests[i][0] is not None:  # rolling windows carry no key; lm-eval caches them per document
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
            bar.update(len(members))
        bar.close()
        return [(s.logprob, s.greedy) for s in scored]

    # ---- generation -----------------------------------------------------------------------------------------------
    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any):
        """`hf`'s generation with a fresh cache of this model's kind (under this transformers version's cache
        keyword; the prompt is prefilled in one pass, as `generate` does)."""
        generation_kwargs.update(cache_kwargs(self.new_cache()))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line (`run`, `ls`, `validate` or the legacy form) with the `hf-kvcache` model registered;
    `--include_path` defaults to this package's offline tasks (`kvcache_pydoc_ppl`, `kvcache_moby_cloze`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", str(TASKS_DIR)]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *args]
    cli_evaluate()


if __name__ == "__main__":
    from hf_kvcache.eval.lm_eval import main as _main  # the importable module is the one that registers the model

    _main()
