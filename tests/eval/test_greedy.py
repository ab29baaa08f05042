"""`--suite greedy`: leading tokens equal to DynamicCache's greedy generation."""

import json

import torch

from hf_kvcache.cli import main
from hf_kvcache.eval.suites.greedy import agreement


def test_agreement_counts_the_leading_equal_tokens():
    ref = torch.tensor([5, 6, 7, 8])
    assert agreement(ref, torch.tensor([5, 6, 7, 8])) == 4
    assert agreement(ref, torch.tensor([5, 6, 0, 8])) == 2
    assert agreement(ref, torch.tensor([0, 6, 7, 8])) == 0
    assert agreement(ref, torch.tensor([5, 6])) == 2  # generation stopped early


def test_bad_counts_name_the_flag(capsys):
    assert main(["compare", "--suite", "greedy", "--new-tokens", "0"]) == 2
    assert "--new-tokens must be >= 1, got 0" in capsys.readouterr().err


def test_dynamic_agrees_with_itself(moby_text, tmp_path):
    path = tmp_path / "rows.json"
    assert main(["compare", "--suite", "greedy", "--tokens", "64", "--new-tokens", "4", "--caches", "dynamic", "int8",
                 "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["cache"] for r in rows] == ["reference", "dynamic", "int8"]  # the reference, then each cache
    ref, same, int8 = rows
    assert len(ref["reference_gaps"]) == 4 and all(g >= 0 for g in ref["reference_gaps"])
    assert same["same"] == 4 and 0 <= int8["same"] <= 4
    assert {r["tokens"] for r in rows} == {64} and {r["start"] for r in rows} == {5000}
