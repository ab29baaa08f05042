"""Side-by-side cache benchmark: streaming perplexity, bytes held, ratio and speed, in one process; the cache specs
(`CacheSpec`) every suite of `hf-kvcache compare` parses."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from hf_kvcache.options import check_int, parse_options_json
from hf_kvcache.attention.plain import unserved
from hf_kvcache.registry import attached, build_cache, cache_names
from hf_kvcache.transformers_compat import cache_kwargs

from .assets import load_model, load_text, load_tokens
from .perplexity import streaming_perplexity


@dataclass
class CacheSpec:
    """A cache to benchmark: a registered name (or "dynamic") plus options, with a label for tables."""

    name: str
    options: dict = field(default_factory=dict)
    label: str = ""
    lookahead: int = 0  # h2o, question-aware suites: draft tokens scored with the question (`evict_with_lookahead`)

    def __post_init__(self) -> None:
        check_int("lookahead", self.lookahead, lo=0, hint=" (draft tokens scored beside the question)")
        if self.lookahead and self.name != "h2o":
            raise ValueError(f"lookahead (draft tokens scored beside the question) is for an h2o cache; "
                             f"got {self.lookahead!r} for {self.name!r}")

    @classmethod
    def parse(cls, text: str) -> "CacheSpec":
        """`name` or `name:{json options}` or `label=name:{json}`; an h2o spec's `"lookahead"` key is not a cache
        option but the draft tokens of the question-aware suites' eviction (`evict_with_lookahead`)."""
        label = ""
        if "=" in text.split(":", 1)[0]:
            label, text = text.split("=", 1)
        name, _, opts = text.partition(":")
        options = parse_options_json(opts, f"the options of {name!r}")
        lookahead = options.pop("lookahead", 0) if name == "h2o" else 0
        shown = {**options, "lookahead": lookahead} if lookahead else options
        return cls(name, options, label or (name if not shown else f"{name} {json.dumps(shown)}"), lookahead)

    def build(self, model) -> Cache:
        if self.name == "dynamic":
            if self.options:
                raise ValueError("the dynamic cache takes no options")
            return DynamicCache(config=model.config)
        if self.name in PEER_CACHES:
            return build_peer_cache(self.name, model.config, **self.options)
        return build_cache(self.name, model.config, **self.options)


# How `run_benchmark` drives the model: inside `attached` (as generate does); a user's plain loop
# `model(ids, past_key_values=cache)` (on an sdpa model its calls that ask for queries / mass are served by the
# "hf_kvcache" attention: `hf_kvcache.attention.plain`); or that loop unserved (`serve_plain_loops(False)`: what an
# eager model's loop gives, and what "plain" measured before the service existed).
LOOPS = ("attached", "plain", "unserved")


def driving(loop: str, model, cache) -> contextlib.AbstractContextManager:
    """The context a stream of `loop` (one of `LOOPS`) runs `model` with `cache` in."""
    if loop == "attached":
        return attached(model, cache)
    if loop == "unserved":
        return unserved()
    if loop == "plain":
        return contextlib.nullcontext()
    raise ValueError(f"unknown loop {loop!r}; choose among {list(LOOPS)}")


# transformers' own QuantizedCache, as a peer to compare with: name -> backend
PEER_CACHES = {"hf-quanto": "quanto", "hf-hqq": "hqq"}
PEER_OPTIONS = ("nbits", "q_group_size", "residual_length", "axis_key", "axis_value")


def build_peer_cache(name: str, config, **options) -> Cache:
    """`transformers.QuantizedCache(backend=...)` (needs `pip install optimum-quanto` / `pip install hqq`)."""
    from transformers import QuantizedCache

    missing = missing_peer_package(name)
    if missing is not None:
        raise ValueError(f"the {name} peer cache (transformers' QuantizedCache) needs its backend: {missing}")
    unknown = sorted(set(options) - set(PEER_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {name}; valid options: {list(PEER_OPTIONS)}")
    return QuantizedCache(backend=PEER_CACHES[name], config=config, **options)


PEER_PACKAGES = {"hf-quanto": ("optimum.quanto", "optimum-quanto"), "hf-hqq": ("hqq", "hqq")}


def missing_peer_package(name: str) -> str | None:
    """The pip install command a peer cache still needs, or None when its package is importable."""
    import importlib.util

    module, package = PEER_PACKAGES[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"pip install {package}  (or pip install 'hf-kvcache[peers]')"


def available_caches(with_requirements: bool = False) -> list:
    """Names `--caches` takes; with `with_requirements`, (name, missing install or None) pairs."""
    names = ["dynamic"] + cache_names() + list(PEER_CACHES)
    if not with_requirements:
        return names
    return [(n, missing_peer_package(n) if n in PEER_CACHES else None) for n in names]


def parse_specs(texts: list[str]) -> list[CacheSpec]:
    """Specs of `--caches`, with distinct labels (the rows, the table and the plot name caches by label)."""
    if not texts:
        raise ValueError("give at least one cache: --caches dynamic int4 ...")
    specs = [CacheSpec.parse(t) for t in texts]
    names = available_caches()
    seen: set[str] = set()
    for spec in specs:
        if spec.name not in names:
            raise ValueError(f"unknown cache {spec.name!r} in --caches; pick among: {', '.join(names)} "
                             "(hf-kvcache caches lists them)")
        if spec.label in seen:
            raise ValueError(f"two caches share the label {spec.label!r}; name one: 'other-{spec.name}={spec.name}:"
                             "{...}'")
        seen.add(spec.label)
    return specs


@torch.inference_mode()
def decode_tokens_per_s(model, cache: Cache, next_ids: torch.Tensor) -> float:
    """Tokens/s of single-token decoding steps on a filled cache (adds `next_ids` to it)."""
    t0 = time.perf_counter()
    for i in range(next_ids.shape[1]):
        model(input_ids=next_ids[:, i : i + 1], **cache_kwargs(cache), use_cache=True)
    return next_ids.shape[1] / (time.perf_counter() - t0)


def run_benchmark(
    specs: list[CacheSpec],
    model_name: str = "smollm2-135m",
    text: str = "moby-dick",
    start: int = 5000,
    tokens: int = 2048,
    chunk: int = 32,
    decode_steps: int = 16,
    progress: bool = True,
    loop: str = "attached",
    dtype: torch.dtype = torch.float32,
) -> list[dict]:
    """One row per spec; the first spec is the baseline for `delta_pct` (`dtype`: the model's).

    `loop`: one of `LOOPS`: "attached" runs each cache inside `attached(model, cache)`, as `generate` does (the
    "hf_kvcache" attention, which reports queries to the cache and reads its codes in place); "plain" the user's own
    loop `model(ids, past_key_values=cache)` with the model's own attention (served where a layer asks); "unserved"
    that loop with nothing reported to the cache. Rows carry `loop`."""
    torch.manual_seed(0)
    model, tokenizer = load_model(model_name, dtype=dtype)
    ids = load_tokens(tokenizer, load_text(text), start, tokens + decode_steps)
    stream, extra = ids[:, :tokens], ids[:, tokens:]
    for spec in specs:  # every spec checked before the first row is measured: a bad one costs no finished rows
        spec.build(model)
    rows = []
    for spec in specs:
        cache = spec.build(model)
        # as generate runs it: the attention the cache needs (mass, queries for calibration, fused reads); or plain
        with driving(loop, model, cache):
            r = streaming_perplexity(model, stream, cache, chunk, progress=progress)
            row = {"cache": spec.label, "loop": loop, **r.to_dict()}
            if hasattr(cache, "quality_metrics"):  # the online proxy, measured before the decode steps
                row["proxy"] = cache.quality_metrics()["proxy"]
            stats = cache.memory_stats() if hasattr(cache, "memory_stats") else {}
            if "tiers" in stats:  # bytes and tokens per tier
                row["tiers"] = stats["tiers"]
            if stats.get("archive_switches"):  # an adaptive archive: where each layer changed format
                row["archive_switches"] = stats["archive_switches"]
            if decode_steps:
                row["decode_tokens_per_s"] = decode_tokens_per_s(model, cache, extra)
        rows.append(row)
    base = rows[0]["perplexity"]
    for row in rows:
        row["delta_pct"] = 100.0 * (row["perplexity"] / base - 1.0)
    return rows
