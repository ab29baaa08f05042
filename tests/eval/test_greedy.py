"""`hf_kvcache.eval.greedy`: leading tokens equal to DynamicCache's greedy generation."""

import pytest
import torch

from hf_kvcache.eval.bench import parse_specs
from hf_kvcache.eval.greedy import agreement, greedy_rows, main


def test_agreement_counts_the_leading_equal_tokens():
    ref = torch.tensor([5, 6, 7, 8])
    assert agreement(ref, torch.tensor([5, 6, 7, 8])) == 4
    assert agreement(ref, torch.tensor([5, 6, 0, 8])) == 2
    assert agreement(ref, torch.tensor([0, 6, 7, 8])) == 0
    assert agreement(ref, torch.tensor([5, 6])) == 2  # generation stopped early


def test_bad_counts_name_the_flag():
    with pytest.raises(ValueError, match="--new-tokens \\(0\\)"):
        main(["--new-tokens", "0"])


def test_dynamic_agrees_with_itself(moby_text):
    rows, gaps = greedy_rows(parse_specs(["dynamic", "int8"]), "smollm2-135m", start=5000, prompt_tokens=64,
                             new_tokens=4)
    assert rows[0]["cache"] == "dynamic" and rows[0]["same"] == 4
    assert 0 <= rows[1]["same"] <= 4 and len(gaps) == 4 and all(g >= 0 for g in gaps)
