"""The one-shot GPU check (`hf-kvcache gpu-check`): it refuses to run without CUDA (saying how to dry-run), and its
sections run end to end on the CPU with tiny sizes (the torch paths), writing JSON and a markdown table."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_kvcache.eval import gpu_check
from hf_kvcache.eval.gpu_sections import Deadline, correctness, decode_timing, to_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_cuda_the_check_fails_and_names_the_dry_run(tmp_path):
    with pytest.raises(ValueError, match="--dry-run"):
        gpu_check.main(["--out", str(tmp_path)])
    assert not (tmp_path / "gpu_check.json").exists()


def test_sections_run_on_the_cpu_and_write_json_and_markdown(tmp_path):
    opts = dataclasses.replace(gpu_check.CheckOptions.dry(tmp_path), generate_caches=("dynamic", "int4"),
                               prompt_tokens=48, new_tokens=2)
    data = gpu_check.run(opts)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved.keys() == data.keys() and {"environment", "bandwidth", "correctness", "decode", "generate"} <= set(saved)
    cases = data["correctness"]
    assert {r["case"].split()[0] for r in cases} == {"kivi", "tokens", "subspace", "pack"}
    assert all(r["ok"] for r in cases), [r for r in cases if not r["ok"]]
    caches = {r["cache"].split(" (")[0] for r in data["decode"]}
    assert caches == {"sdpa bf16", "tiered", "int4", "int8", "kivi", "subspace archive"}
    assert all(r["ms"] > 0 and r["bytes"] > 0 for r in data["decode"])
    assert [r["cache"] for r in data["generate"]] == ["dynamic", "int4"]
    assert all(r["new_tokens"] == 3 and r["decode_tok_s"] > 0 for r in data["generate"])
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## correctness" in md and "## decode" in md and "| tiered |" in md


def test_chosen_sections_run_alone_and_an_unknown_one_is_refused(tmp_path):
    opts = dataclasses.replace(gpu_check.CheckOptions.dry(tmp_path), sections=("environment", "decode"))
    data = gpu_check.run(opts)
    assert {k for k in data if not k.endswith("_seconds")} == {"environment", "decode"}
    assert {r["cache"].split(" (")[0] for r in data["decode"]} == {"sdpa bf16", "tiered", "int4", "int8", "kivi", "subspace archive"}
    with pytest.raises(ValueError, match="choose among"):
        gpu_check.run(dataclasses.replace(opts, sections=("decode", "graphs")))


def test_a_wrong_kernel_result_is_reported_not_passed(monkeypatch):
    """A kernel whose output is off shows up as ok=False with its error, so the check cannot pass silently."""
    from hf_kvcache.kernels import decode_attention as da

    real = da.decode_attention

    def off_by_a_bit(*args, **kwargs):
        out, mass = real(*args, **kwargs)
        return out + 0.5, mass

    monkeypatch.setattr(da, "decode_attention", off_by_a_bit)
    opts = gpu_check.CheckOptions.dry(None)
    rows = correctness("cpu", opts, Deadline(60))
    kivi = [r for r in rows if r["case"].startswith("kivi")]
    assert kivi and not any(r["ok"] for r in kivi)
    assert all(r["out_err"] >= 0.49 for r in kivi)


def test_to_device_copies_nested_segment_tensors():
    from hf_kvcache.eval.gpu_sections import token_case

    seg = token_case(1, 2, 40, 64, "int4", True, seed=0)
    moved = to_device(seg, "cpu")
    assert moved.keys.codes is not None and moved.key_codec.shift.shape == seg.key_codec.shift.shape
    assert torch.equal(moved.positions, seg.positions)


def test_decode_timing_reads_fewer_bytes_from_the_quantized_caches():
    opts = dataclasses.replace(gpu_check.CheckOptions.dry(None), lengths=(512,))
    rows = decode_timing("cpu", opts, Deadline(60), copy_gbps=None)
    by_cache = {r["cache"].split(" (")[0]: r for r in rows}
    sdpa = by_cache["sdpa bf16"]["bytes"]
    # bf16 K/V is 2 bytes a value; int4 codes + scales, int8 codes + scales
    assert by_cache["int4"]["bytes"] < 0.3 * sdpa and by_cache["int8"]["bytes"] < 0.55 * sdpa
