"""eval/kernel_report.py: Triton kernels compiled for sm_90 with their resources and H100 occupancy, and the bytes
roofline of the fused decode step (formula against a real cache, hand-checked sizes)."""

import json

import pytest

from hf_kvcache.cli import main
from hf_kvcache.eval import kernel_report as kr


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One small run through the CLI: the tiered archive's decode kernel and the warm tier's value packer, and the
    roofline at 1K / 4K tokens (a real cache per layout and head_dim)."""
    path = tmp_path_factory.mktemp("kernel_report") / "report.json"
    assert main(["kernel-report", "--quick", "--kernels", "_quant_attn_kernel,_values_kernel", "--jobs", "1",
                 "--contexts", "1024,4096", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_compiled_variants_have_real_resources(report):
    rows = report["kernels"]
    assert {r["kernel"] for r in rows} == {"_quant_attn_kernel", "_values_kernel"}
    for r in rows:
        assert "error" not in r, r
        assert 0 < r["n_regs"] <= 255
        assert r["n_spills"] >= 0 and r["n_spills"] == (r["stack_bytes"] + r["local_bytes"]) // 4
        assert r["num_warps"] == 4  # Triton's default: no launch site sets it
        assert 0 < r["occupancy"] <= 1
        assert r["occupancy"] == r["blocks_per_sm"] * r["num_warps"] / 64
        assert r["blocks_per_sm"] == min(r["blocks_by"].values())
    attn = next(r for r in rows if r["kernel"] == "_quant_attn_kernel")
    assert attn["constexprs"] == {"HAS_VALID": True, "M_PAD": 16, "D": 64, "BLOCK": 64, "K_BITS": 2, "V_BITS": 2,
                                  "K_GROUP": 64, "V_GROUP": 64, "DOT_F32": True}
    assert attn["shared"] > 0  # tl.dot stages its operands through shared memory


def test_occupancy_hand_checked():
    # 255 registers x 32 threads -> 8192 per warp (units of 256); 65536 / (8192 x 4 warps) = 2 blocks = 8 warps
    occ = kr.occupancy(255, 4, 45120, static_shared=1024)
    assert occ["blocks_per_sm"] == 2 and occ["limiter"] == "registers" and occ["occupancy"] == 8 / 64
    assert occ["shared_per_block"] == 47232  # dynamic + static + the driver's 1 KiB = 47168, in units of 128 bytes
    # 24 registers (21 blocks' worth), 1 KiB of shared memory: 2048 threads / 128 = 16 blocks of 4 warps = all 64
    occ = kr.occupancy(24, 4, 1024)
    assert occ["blocks_per_sm"] == 16 and occ["limiter"] == "threads" and occ["occupancy"] == 1.0
    # 100 KiB of shared memory per block: two fit in 228 KiB
    occ = kr.occupancy(64, 4, 100 * 1024)
    assert occ["blocks_per_sm"] == 2 and occ["limiter"] == "shared"
    # more than one block may use: the kernel cannot launch
    assert kr.occupancy(32, 4, 228 * 1024)["occupancy"] == 0


def test_layout_bytes_hand_checked():
    """Tiered default at 1024 tokens, head_dim 64: tail 64 (fp16), warm 448 (4-bit, groups of 32), archive 512
    (2-bit, key groups of 64 tokens, value groups of 64 channels), 4 fp16 sinks laid over the archive."""
    got = kr.layout_bytes(kr.layout_options("tiered"), 1024, 64)
    archive = 512 * (2 * 16) + 2 * 2 * (512 // 64) * 64 + 2 * 2 * 512 * 1  # codes K+V, key s/z per group, value s/z
    warm = 448 * (2 * 32) + 2 * 2 * (448 // 32) * 64 + 2 * 2 * 448 * 2
    assert (archive, warm) == (20480, 35840)
    assert got["tiers"] == {
        "archive": {"tokens": 512, "bytes": 20480},
        "warm": {"tokens": 448, "bytes": 35840},
        "tail": {"tokens": 64, "bytes": 64 * 64 * 2 * 2},
        "sink": {"tokens": 4, "bytes": 4 * 64 * 2 * 2},
    }
    assert got["bytes"] == 73728 < kr.fp16_bytes(1024, 64) == 262144


@pytest.mark.parametrize("layout,tokens,head_dim", [("tiered", 1024, 64), ("tiered", 1000, 128), ("tiered", 100, 64),
                                                    ("kivi-2", 1000, 64)])
def test_layout_formula_matches_a_real_cache(layout, tokens, head_dim):
    formula = kr.layout_bytes(kr.layout_options(layout), tokens, head_dim)
    real = kr.measured_bytes(layout, tokens, head_dim, chunk=300)
    assert real["tokens"] == tokens
    assert real["bytes"] == formula["bytes"]
    for tier, stats in real["tiers"].items():
        assert stats == formula["tiers"][tier], tier


def test_roofline_rows(report):
    rows = report["roofline"]
    assert {(r["model"], r["context"], r["layout"]) for r in rows} == {
        (m.name, n, layout) for m in kr.MODELS for n in (1024, 4096) for layout in ("fp16", *kr.LAYOUTS)}
    for r in rows:
        fp16 = next(x for x in rows if x["model"] == r["model"] and x["context"] == r["context"]
                    and x["layout"] == "fp16")
        assert fp16["kv_bytes"] == r["context"] * r["head_dim"] * 2 * 2 * r["kv_heads"] * r["layers"]
        assert r["t_kv_us_H100"] == pytest.approx(r["kv_bytes"] / 3.35e12 * 1e6)
        assert r["t_kv_us_H200"] < r["t_kv_us_H100"]
        if r["layout"] != "fp16":
            assert r["formula_matches"] and r["kv_bytes"] == r["formula_bytes"]
            assert r["kv_bytes"] < fp16["kv_bytes"] and r["speedup_kv"] == pytest.approx(
                fp16["kv_bytes"] / r["kv_bytes"])
            assert 1 < r["speedup_step"] < r["speedup_kv"]  # the weights are read at every step either way
    smol = next(r for r in rows if r["model"] == "SmolLM2-135M" and r["context"] == 1024 and r["layout"] == "tiered")
    assert smol["kv_bytes"] == 73728 * 3 * 30  # the hand-checked layer above, times KV heads and layers


def test_kernels_suite_says_what_it_needs(capsys):
    """The GPU timing suite stays runnable for when a GPU is lent: its module says what it needs, and asking for CUDA
    where none is visible is a clear error before anything is timed."""
    import torch

    from hf_kvcache.cli import main
    from hf_kvcache.eval.suites import kernels

    doc = " ".join(kernels.__doc__.split())
    assert "Needs a CUDA GPU" in doc and "kernel-report" in doc
    if not torch.cuda.is_available():
        assert main(["compare", "--suite", "kernels", "--device", "cuda"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
