"""`hf-kvcache paired`: the perplexity ratio of two caches on the same tokens, with a paired block bootstrap."""

import json
import math

import pytest
import torch

from hf_kvcache.cli import main
from hf_kvcache.eval.paired import chunk_tokens, paired_ratio, paired_time_ratio


def test_chunk_tokens_count_what_streaming_scores():
    assert chunk_tokens(2048, 32).tolist() == [31.0] + [32.0] * 63
    assert chunk_tokens(70, 32).tolist() == [31.0, 32.0, 6.0]


def test_ratio_and_interval():
    tokens = chunk_tokens(2048, 32)
    g = torch.Generator().manual_seed(0)
    b = (3.0 + torch.rand(64, generator=g)) * tokens
    same = paired_ratio(b.tolist(), b.tolist(), tokens)
    assert same.ratio == 1.0 and same.low == same.high == 1.0 and same.a_better == 0.0
    # A better by exactly 0.01 nats per token on every chunk: the ratio and both ends are exp(-0.01)
    shifted = paired_ratio((b - 0.01 * tokens).tolist(), b.tolist(), tokens)
    assert shifted.ratio == pytest.approx(math.exp(-0.01)) and shifted.a_better == 1.0
    assert shifted.low == pytest.approx(math.exp(-0.01)) and shifted.high == pytest.approx(math.exp(-0.01))
    # noise of +-0.2 nats per token and chunk around a gap of 0.01: the interval holds the gap and reaches past 1
    noise = 0.2 * (2 * torch.rand(64, generator=g) - 1) * tokens
    noisy = paired_ratio((b - 0.01 * tokens + noise).tolist(), b.tolist(), tokens)
    assert noisy.low < noisy.ratio < noisy.high and noisy.low < 1.0 < noisy.high


def test_rows_from_files_and_errors(tmp_path, capsys):
    tokens = chunk_tokens(128, 32)
    ours = [{"cache": "a", "model": "m", "tokens": 128, "chunk_nll": (2.0 * tokens).tolist()},
            {"cache": "b", "model": "m", "tokens": 128, "chunk_nll": (2.1 * tokens).tolist()}]
    theirs = [{"press": "tova", "budget": "ratio:0.5", "model": "m", "tokens": 128,
               "chunk_nll": (2.05 * tokens).tolist()},
              {"press": "tova", "budget": "ratio:0.2", "model": "other", "tokens": 128, "chunk_nll": [1.0] * 4}]
    (tmp_path / "ours.json").write_text(json.dumps(ours))
    (tmp_path / "theirs.json").write_text(json.dumps(theirs))
    assert main(["paired", f"{tmp_path}/ours.json#cache=a", f"{tmp_path}/theirs.json#press=tova,budget=ratio:0.5",
                 "--block", "2"]) == 0
    assert f"= {math.exp(-0.05):.4f}" in capsys.readouterr().out
    for spec, match in [(f"{tmp_path}/theirs.json#press=tova", "2 rows match"),
                        (f"{tmp_path}/theirs.json#press", "use key=value pairs"),
                        (f"{tmp_path}/theirs.json#budget=ratio:0.2", "disagree on model")]:
        assert main(["paired", f"{tmp_path}/ours.json#cache=a", spec]) == 2
        assert match in capsys.readouterr().err


def test_time_ratio_of_rounds_taken_in_turns():
    # B takes half A's time every round: twice as fast, and every resample of the rounds says so
    assert paired_time_ratio([1.0, 2.0, 1.5], [0.5, 1.0, 0.75]) == pytest.approx((2.0, 2.0, 2.0))
    # a slow spell of the machine hits both in round 2: pairing keeps the interval narrow and around the ratio
    ratio, low, high = paired_time_ratio([1.0, 3.0, 1.0, 1.1], [1.0, 2.9, 1.05, 1.0])
    assert ratio == pytest.approx(6.1 / 5.95) and low < ratio < high and high - low < 0.1
    assert all(math.isnan(x) for x in paired_time_ratio([1.0], [2.0])[1:])  # one round: no spread to resample
    with pytest.raises(ValueError, match="same rounds"):
        paired_time_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_time_ratio([1.0, 0.0], [1.0, 1.0])
