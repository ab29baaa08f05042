"""Passkey question-aware mode (context + question prefilled, then evicted to the budget) and the needle grid, on
SmolLM2-135M and Moby Dick."""

import math

import pytest
import torch

from hf_kvcache.eval.bench import CacheSpec
from hf_kvcache.eval.needle import format_grid, needle_grid, plot_grid, rows_from_results
from hf_kvcache.eval.suites.passkey import make_trials, question_aware_cache, run_trial
from hf_kvcache.registry import attached

SNAPKV_20 = CacheSpec.parse('h2o:{"budget":0.2,"policy":"snapkv"}')


@pytest.fixture(scope="module")
def trial(smol, moby_text):
    return make_trials(smol[1], moby_text, 160, (0.5,), 1, seed=3)[0]


def test_question_aware_evicts_before_decoding_and_keeps_the_question(smol, trial):
    model, tokenizer = smol
    n, q = len(trial.context_ids), len(trial.question_ids)
    cache, keep = question_aware_cache(model, SNAPKV_20, n, q)
    assert keep == math.ceil(0.2 * n) + q and cache.layers[0].window == q  # snapkv's window: the question
    ids = torch.tensor([trial.context_ids + trial.question_ids])
    with torch.inference_mode(), attached(model, cache):
        model(ids, past_key_values=cache)
        assert cache.tokens_held() == n + q  # nothing evicted before the question was seen
        full = cache.memory_stats()["bytes"]
        cache.evict_to(keep, protect_last=q)
        dropped = cache.memory_stats()["bytes"]
        for layer in cache.layers:
            pos = layer.held_positions()
            assert pos.shape[-1] == keep
            assert all((pos == p).any(-1).all() for p in range(n, n + q))  # every question token, every head
    assert dropped < 0.5 * full
    result = run_trial(model, tokenizer, SNAPKV_20, trial, new_tokens=4, mode="question")
    assert result["held"] == keep and result["bytes"] == dropped  # held when the answer starts


def test_the_two_modes_keep_different_context_tokens(smol, trial):
    """The same trial and budget: the agnostic cache ranks the context by the queries of its last tokens, the
    question-aware one by the question's (tova: the last question token's), so they keep different tokens."""
    model, _ = smol
    n, q = len(trial.context_ids), len(trial.question_ids)
    spec = CacheSpec.parse('h2o:{"budget":0.2,"policy":"tova"}')
    agnostic = spec.build(model)
    aware, keep = question_aware_cache(model, spec, n, q)
    with torch.inference_mode():
        with attached(model, agnostic):
            model(torch.tensor([trial.context_ids]), past_key_values=agnostic)
        with attached(model, aware):
            model(torch.tensor([trial.context_ids + trial.question_ids]), past_key_values=aware)
            aware.evict_to(keep, protect_last=q)
    a = set(agnostic.layers[0].held_positions()[0, 0].tolist())
    b = {p for p in aware.layers[0].held_positions()[0, 0].tolist() if p < n}
    assert len(a) == len(b) == math.ceil(0.2 * n)  # the same context budget
    assert a != b


def test_mode_and_cache_errors(smol, trial):
    model, tokenizer = smol
    with pytest.raises(ValueError, match="mode must be one of"):
        run_trial(model, tokenizer, SNAPKV_20, trial, mode="aware")
    cache, keep = question_aware_cache(model, CacheSpec.parse("int8"), 100, 10)  # no budget: built as it is
    assert keep is None and type(cache).__name__ == "UniformQuantCache"


def test_needle_grid_one_row_per_cell_and_a_png(smol, moby_text, tmp_path):
    model, tokenizer = smol
    rows = needle_grid(model, tokenizer, SNAPKV_20, lengths=(128, 160), depths=(0.5,), mode="question",
                       trials=1, text=moby_text, new_tokens=4)
    assert [(r["length"], r["depth"]) for r in rows] == [(128, 0.5), (160, 0.5)]
    for r in rows:
        assert r["trials"] == 1 and r["accuracy"] == float(r["results"][0]["correct"])
        assert r["held"] == math.ceil(0.2 * r["length"]) + 17  # the 17 question tokens of SmolLM2's tokenizer
    assert "128" in format_grid(rows)
    path = plot_grid(rows, str(tmp_path / "grid.png"))
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no result for the cell length=256"):
        rows_from_results([r["results"][0] | {"length": r["length"]} for r in rows], "x", "question", (256,), (0.5,))
