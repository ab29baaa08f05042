"""Triton kernels under the interpreter against their torch references, and compiled for Hopper in a subprocess."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from hf_kvcache.kernels import native
from hf_kvcache.kernels.decode_attention import decode_attention, reference_attention
from hf_kvcache.kernels.kivi_pack import kivi_keys_triton, kivi_values_triton
from hf_kvcache.kernels.segments import FullSegment, QuantSegment
from hf_kvcache.quant.kivi import kivi_key_codes, kivi_value_codes
from random_kv import subspace_case, token_segment

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET before triton loads"


# the three kernels of a quantized segment: the torch path (from_codes), the compiled CPU kernel, Triton (interpreted)
PATHS = {
    "torch": dict(use_triton=False, use_native=False),
    "native": dict(use_triton=False, use_native=None),
    "triton": dict(use_triton=True),
}
each_path = pytest.mark.parametrize("path", list(PATHS))


def kernel(path: str) -> dict:
    """decode_attention's keyword arguments for `path` (skips the native one where no C compiler works)."""
    if path == "native":
        ok, why = native.available()
        if not ok:
            pytest.skip(f"the native CPU kernel is unavailable here: {why}")
    return PATHS[path]


def quant_segment(b, h, t, d, k_bits, v_bits, k_group=32, v_group=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(b, h, t, d, generator=g) * 2, torch.randn(b, h, t, d, generator=g)
    kc, ks, kz = kivi_key_codes(k, k_bits, k_group, use_triton=False)
    vc, vs, vz = kivi_value_codes(v, v_bits, v_group, use_triton=False)
    return QuantSegment(kc, ks, kz, vc, vs, vz, k_bits, v_bits, k_group, v_group, d)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pack_kernels_bit_identical(bits, dtype):
    g = torch.Generator().manual_seed(bits)
    k = (torch.randn(2, 3, 64, 64, generator=g) * 3).to(dtype)
    v = torch.randn(3, 1, 13, 64, generator=g).to(dtype)  # 39 rows: not a multiple of the row block
    for ref, tri in ((kivi_key_codes(k, bits, 32, use_triton=False), kivi_keys_triton(k, bits, 32)),
                     (kivi_value_codes(v, bits, 16, use_triton=False), kivi_values_triton(v, bits, 16))):
        for a, b in zip(ref, tri):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_pack_kernels_reject_bad_shapes():
    with pytest.raises(ValueError, match="multiple of group"):
        kivi_keys_triton(torch.randn(1, 1, 40, 64), 2, 32)
    with pytest.raises(ValueError, match="bits must be one of"):
        kivi_values_triton(torch.randn(1, 1, 4, 64), 5, 32)


def left_padded_mask(b, q_len, total, pads):
    cols, rows = torch.arange(total), torch.arange(total - q_len, total)
    mask = (cols[None, :] <= rows[:, None]).expand(b, 1, q_len, total).clone()
    for i, p in enumerate(pads):
        mask[i, :, :, :p] = False
    return mask


@each_path
@pytest.mark.parametrize(
    "batch,kv_heads,group,q_len,pads",
    [(1, 3, 3, 1, None), (3, 2, 7, 2, (0, 5, 40)), (3, 1, 1, 16, (3, 0, 9)), (2, 3, 3, 5, None)],
)
def test_decode_attention_matches_reference(path, batch, kv_heads, group, q_len, pads):
    d = 64
    g = torch.Generator().manual_seed(7)
    segments = [
        quant_segment(batch, kv_heads, 96, d, 2, 2, seed=1),  # archive: 2-bit
        quant_segment(batch, kv_heads, 64, d, 4, 4, seed=2),  # warm: 4-bit
        FullSegment(torch.randn(batch, kv_heads, 9, d, generator=g), torch.randn(batch, kv_heads, 9, d, generator=g)),
        FullSegment(torch.randn(batch, kv_heads, q_len, d, generator=g),
                    torch.randn(batch, kv_heads, q_len, d, generator=g)),
    ]
    total = sum(s.tokens for s in segments)
    mask = None if pads is None else left_padded_mask(batch, q_len, total, pads)
    q = torch.randn(batch, kv_heads * group, q_len, d, generator=g)
    ref_out, ref_mass = reference_attention(q, segments, mask)
    out, mass = decode_attention(q, segments, mask, return_mass=True, **kernel(path), block=64)
    # the native kernel sums in another order (-ffast-math; measured 3.0e-6), as the torch path's blocks do
    torch.testing.assert_close(out, ref_out, atol=4e-6 if path == "native" else 2e-6, rtol=1e-5)
    torch.testing.assert_close(mass, ref_mass, atol=2e-6, rtol=1e-5)
    assert mass.shape == (batch, kv_heads, total)
    if pads is not None:
        assert all(float(mass[i, :, :p].abs().sum()) == 0 for i, p in enumerate(pads))
    if path == "torch":  # the torch path in blocks of several sizes (scales folded in: fp32 sums in another order)
        for block in (64, 100, 2048, None):
            blocked, none = decode_attention(q, segments, mask, block=block, **kernel(path))
            assert none is None
            torch.testing.assert_close(blocked, ref_out, atol=4e-6, rtol=1e-5)


def test_decode_attention_odd_lengths_and_3bit():
    """3-bit codes (packed 8 codes in 3 bytes): the Triton kernel and the torch path; the native kernel has no variant
    for them, so decode_attention keeps the torch path there."""
    torch.manual_seed(0)  # unseeded, one run in session 76 drew a query past the bound
    seg = quant_segment(2, 1, 32 * 3, 64, 3, 3, k_group=32, v_group=64)
    q = torch.randn(2, 5, 1, 64)
    ref, _ = reference_attention(q, [seg])
    assert not native.supports(q.view(2, 1, 5, 64), seg)
    for path in PATHS:
        out, _ = decode_attention(q, [seg], **PATHS[path], block=64)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "hf_kvcache.kernels.compile_check", "--quick"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 14 kernel variants for sm_90" in proc.stdout


@each_path
@pytest.mark.parametrize("kind", ["matrix", "hadamard"])
def test_decode_attention_rotated_segment(path, kind):
    """Keys/values stored as k @ R, v @ R (R a dense orthogonal matrix, or the Walsh-Hadamard transform the tiered
    cache holds): attention must equal attention over the unrotated tensors."""
    from hf_kvcache.quant.rotation import hadamard_rotation, rotate

    g = torch.Generator().manual_seed(3)
    rot, _ = torch.linalg.qr(torch.randn(64, 64, generator=g))
    rot = rot if kind == "matrix" else hadamard_rotation(64, 0)
    k, v = torch.randn(2, 2, 64, 64, generator=g), torch.randn(2, 2, 64, 64, generator=g)
    kc, ks, kz = kivi_key_codes(rotate(k, rot), 8, 32, use_triton=False)
    vc, vs, vz = kivi_value_codes(rotate(v, rot), 8, 32, use_triton=False)
    seg = QuantSegment(kc, ks, kz, vc, vs, vz, 8, 8, 32, 32, 64, k_rotation=rot, v_rotation=rot)
    q = torch.randn(2, 6, 1, 64, generator=g)
    ref, ref_mass = reference_attention(q, [seg])
    exact, _ = reference_attention(q, [FullSegment(k, v)])
    out, mass = decode_attention(q, [seg], return_mass=True, **kernel(path))
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mass, ref_mass, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out, exact, atol=0.05, rtol=0.05)  # 8-bit codes: close to the unquantized result
    packed, _ = decode_attention(q, [seg, FullSegment(k[:, :, :5], v[:, :, :5])], block=32, **kernel(path))
    ref, _ = reference_attention(q, [seg, FullSegment(k[:, :, :5], v[:, :, :5])])
    torch.testing.assert_close(packed, ref, atol=2e-6, rtol=1e-5)


@each_path
@pytest.mark.parametrize("pads", [None, (0, 2)], ids=["no-mask", "left-padded"])
def test_decode_attention_overlay_replaces_positions(path, pads):
    """A full-precision overlay (attention sinks) over the first positions of a quantized segment: those positions
    attend to the overlay's keys/values, never to the codes under it, and their mass lands on those positions."""
    g = torch.Generator().manual_seed(11)
    b, h, d = 2, 3, 64
    seg = quant_segment(b, h, 64, d, 2, 2, seed=4)
    tail = FullSegment(torch.randn(b, h, 5, d, generator=g), torch.randn(b, h, 5, d, generator=g))
    sinks = FullSegment(torch.randn(b, h, 4, d, generator=g) * 3, torch.randn(b, h, 4, d, generator=g), overlay_at=0)
    segments = [seg, tail, sinks]
    mask = None if pads is None else left_padded_mask(b, 1, 69, pads)
    q = torch.randn(b, h * 3, 1, d, generator=g)
    ref_out, ref_mass = reference_attention(q, segments, mask)
    out, mass = decode_attention(q, segments, mask, return_mass=True, **kernel(path), block=32)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mass, ref_mass, atol=2e-6, rtol=1e-5)
    assert mass.shape == (b, h, 69)
    packed, _ = decode_attention(q, segments, mask, **kernel(path), block=32)
    torch.testing.assert_close(packed, ref_out, atol=2e-6, rtol=1e-5)
    # the overlay really replaced the codes: without it the result differs
    no_overlay, _ = decode_attention(q, [seg, tail], mask, **kernel(path), block=32)
    assert (no_overlay - out).abs().max() > 1e-3
    with pytest.raises(ValueError, match="outside"):
        decode_attention(q, [tail, FullSegment(tail.keys, tail.values, overlay_at=3)])


@each_path
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_attention_half_precision_queries(path, dtype):
    """fp16 / bf16 queries and a 16-bit tail: the output comes back in the query dtype, equal to the float32
    reference up to that dtype's rounding."""
    g = torch.Generator().manual_seed(5)
    seg = quant_segment(2, 3, 64, 64, 2, 2, seed=6)
    tail = FullSegment(torch.randn(2, 3, 7, 64, generator=g).to(dtype), torch.randn(2, 3, 7, 64, generator=g).to(dtype))
    q = torch.randn(2, 9, 2, 64, generator=g).to(dtype)
    ref, _ = reference_attention(q.float(), [seg, tail])
    for return_mass in (False, True):
        out, _ = decode_attention(q, [seg, tail], **kernel(path), return_mass=return_mass, block=32)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def test_the_cache_quantizer_dispatches_to_the_triton_kernels():
    """quantize_kivi (what the caches call) runs the fused Triton quantize+pack when asked (on CUDA: by default when
    no clipping is asked for) and stores exactly what its torch path stores."""
    from hf_kvcache.quant.kivi import _triton_serves, quantize_kivi

    torch.manual_seed(0)
    x = torch.randn(2, 3, 64, 64) * 2
    for axis in ("channel", "token"):
        ref, tri = quantize_kivi(x, 2, 32, axis, use_triton=False), quantize_kivi(x, 2, 32, axis, use_triton=True)
        assert torch.equal(ref.codes, tri.codes) and torch.equal(ref.scale, tri.scale) and torch.equal(ref.zero, tri.zero)
    assert _triton_serves(x, 4, 32, 1.0, False) and not _triton_serves(x, 4, 32, 1.0, True)
    assert not _triton_serves(x, 5, 32, 1.0, False) and not _triton_serves(x[..., :48], 4, 32, 1.0, False)


def test_torch_path_blocks_bound_their_buffers():
    """The CPU path's automatic block: decode queries (3 rows) take the whole 8K segment in one block; a prefill chunk
    (1536 rows) takes blocks whose scores and scaled queries stay within BLOCK_ELEMENTS, and the result is the same."""
    from hf_kvcache.kernels import from_codes

    seg = quant_segment(1, 3, 8192, 64, 2, 2, k_group=64, v_group=64)
    assert [(a, b) for a, b, _ in from_codes.blocks(seg, 3, None)] == [(0, 8192)]
    spans = [(a, b) for a, b, _ in from_codes.blocks(seg, 1536, None)]
    assert spans[0] == (0, 448) and spans[-1][1] == 8192 and all(b - a <= 448 for a, b in spans)
    assert 3 * 1536 * 448 <= from_codes.BLOCK_ELEMENTS
    small = quant_segment(1, 3, 256, 64, 2, 2, k_group=64, v_group=64)
    q, mask = torch.randn(1, 9, 40, 64), torch.ones(1, 1, 40, 256, dtype=torch.bool)
    ref, _ = reference_attention(q, [small], mask)
    old = from_codes.BLOCK_ELEMENTS
    try:
        from_codes.BLOCK_ELEMENTS = 3 * 3 * 40 * 64  # 3 rows per query head: one key group per block
        assert len(list(from_codes.blocks(small, 120, None))) == 4
        out, _ = decode_attention(q, [small], attention_mask=mask)
    finally:
        from_codes.BLOCK_ELEMENTS = old
    torch.testing.assert_close(out, ref, atol=4e-6, rtol=1e-5)


@each_path
def test_decode_attention_per_row_window_mask(path):
    """A sliding window over a chunk of queries: each query row hides a different number of the oldest quantized keys
    (what Gemma-3's sliding layers ask during a chunked prefill); every row must match the reference."""
    seg = quant_segment(1, 2, 64, 64, 2, 2, seed=9)
    tail = FullSegment(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 64))
    q_len, total = 4, 68
    rows = torch.arange(total - q_len, total).view(-1, 1)
    cols = torch.arange(total).view(1, -1)
    mask = ((cols <= rows) & (cols > rows - 40)).view(1, 1, q_len, total)  # window of 40
    q = torch.randn(1, 6, q_len, 64)
    ref, ref_mass = reference_attention(q, [seg, tail], mask)
    for return_mass in (False, True):
        out, mass = decode_attention(q, [seg, tail], mask, return_mass=return_mass, **kernel(path), block=32)
        torch.testing.assert_close(out, ref, atol=4e-6, rtol=1e-5)
    torch.testing.assert_close(mass, ref_mass, atol=4e-6, rtol=1e-5)


def native_or_skip():
    ok, why = native.available()
    if not ok:
        pytest.skip(f"the native CPU kernel is unavailable here: {why}")


@pytest.mark.parametrize(
    "d,k_bits,v_bits,k_group,v_group",
    [(64, 2, 2, 64, 64), (64, 4, 4, 32, 32), (64, 8, 8, 16, 64), (128, 2, 4, 32, 16), (64, 4, 2, 64, 32),
     (256, 8, 2, 32, 256), (128, 2, 8, 48, 128)],
)
@pytest.mark.parametrize("chunks", [1, 3, 40])
def test_native_partial_matches_torch_path(d, k_bits, v_bits, k_group, v_group, chunks):
    """The compiled kernel's softmax partial equals the torch path's, for each head dim and width it has a variant
    for, with a left-padding key mask and the tokens split into chunks (more chunks than key groups: empty ones)."""
    native_or_skip()
    from hf_kvcache.kernels.from_codes import quant_partial_codes

    b, h, m, t = 2, 3, 5, k_group * 6
    seg = quant_segment(b, h, t, d, k_bits, v_bits, k_group=k_group, v_group=v_group, seed=d + k_bits)
    q = torch.randn(b, h, m, d, generator=torch.Generator().manual_seed(1)) / d**0.5
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, : k_group + 7] = False  # row 1 left-padded over more than a key group
    assert native.supports(q, seg)
    ref = quant_partial_codes(q, seg, valid.view(b, 1, 1, t))
    got = native.quant_partial_native(q, seg, valid, chunks=chunks)
    torch.testing.assert_close(got[0], ref[0], atol=2e-6, rtol=1e-5)  # row max
    ref_out, got_out = ref[2] / ref[1].unsqueeze(-1), got[2] / got[1].unsqueeze(-1)
    # both sum in fp32 in different orders (the kernel under -ffast-math): measured up to 3.8e-6 apart
    torch.testing.assert_close(got_out, ref_out, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(got[1].log() + got[0], ref[1].log() + ref[0], atol=2e-6, rtol=1e-5)


def test_native_row_that_sees_no_key():
    """A batch row whose keys of this segment are all masked: max -inf, sum 0, output 0 (an empty partial), and
    decode_attention still attends over the row's tail alone."""
    native_or_skip()
    seg = quant_segment(2, 2, 64, 64, 2, 2, seed=3)
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[0] = False
    q = torch.randn(2, 2, 3, 64)
    mx, total, acc = native.quant_partial_native(q, seg, valid, chunks=2)
    assert torch.isneginf(mx[0]).all() and (total[0] == 0).all() and (acc[0] == 0).all()
    assert torch.isfinite(mx[1]).all() and (total[1] > 0).all()
    tail = FullSegment(torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64))
    mask = left_padded_mask(2, 1, 67, (64, 0))
    ref, _ = reference_attention(q.view(2, 6, 1, 64), [seg, tail], mask)
    out, _ = decode_attention(q.view(2, 6, 1, 64), [seg, tail], mask, use_native=True)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def test_native_supports_only_its_variants():
    """No variant (so decode_attention keeps the torch path): 3-bit codes, head_dim 80, more than 16 rows, key groups
    not a multiple of 16 tokens, queries on another device type."""
    native_or_skip()
    q = torch.randn(1, 1, 4, 64)
    assert native.supports(q, quant_segment(1, 1, 64, 64, 2, 4))
    assert not native.supports(q, quant_segment(1, 1, 64, 64, 3, 4))
    assert not native.supports(torch.randn(1, 1, 4, 80), quant_segment(1, 1, 64, 80, 2, 2, v_group=16))
    assert not native.supports(torch.randn(1, 1, 17, 64), quant_segment(1, 1, 64, 64, 2, 2))
    assert not native.supports(q, quant_segment(1, 1, 64, 64, 2, 2, k_group=8))
    assert not native.supports(q.to("meta"), quant_segment(1, 1, 64, 64, 2, 2))
    with native.turned_off():  # what the decode benchmark's torch-path variant runs under
        assert not native.supports(q, quant_segment(1, 1, 64, 64, 2, 4))
    assert native.supports(q, quant_segment(1, 1, 64, 64, 2, 4))


def test_native_kernel_unavailable_without_a_compiler(monkeypatch, tmp_path, caplog):
    """No C compiler: `available()` says why (once, as a warning) and decode_attention uses the torch path; with one,
    the library is built into HF_KVCACHE_NATIVE_DIR."""
    seg = quant_segment(1, 2, 64, 64, 2, 2)
    q = torch.randn(1, 6, 1, 64)
    ref, _ = reference_attention(q, [seg])
    monkeypatch.setattr(native, "_build", native._Build())
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level("WARNING", logger="hf_kvcache.kernels.native"):
        ok, why = native.available()
        out, _ = decode_attention(q, [seg])
    assert not ok and "no C compiler" in why and "no-such-cc" in why
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    monkeypatch.delenv("CC")
    monkeypatch.setattr(native, "_build", native._Build())
    monkeypatch.setenv("HF_KVCACHE_NATIVE", "0")
    assert native.available() == (False, "turned off by HF_KVCACHE_NATIVE=0")
    monkeypatch.delenv("HF_KVCACHE_NATIVE")
    monkeypatch.setattr(native, "_build", native._Build())
    monkeypatch.setenv("HF_KVCACHE_NATIVE_DIR", str(tmp_path / "build"))
    if native.available()[0]:
        assert len(list((tmp_path / "build").glob("native_decode_*.so"))) == 1
        out, _ = decode_attention(q, [seg], use_native=True)
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)



def test_a_header_change_rebuilds_the_sources_that_include_it(monkeypatch, tmp_path):
    """`build.compile_library` keys a build by the source and the headers it includes from its folder, so that an
    edited shared header (`fp16_bits.h`) never loads a library compiled from the old one."""
    import shutil

    from hf_kvcache.kernels.build import compile_library

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("HF_KVCACHE_NATIVE_DIR", str(tmp_path / "build"))
    (tmp_path / "answer.h").write_text("#define ANSWER 41\n")
    source = tmp_path / "answer.c"
    source.write_text('#include "answer.h"\nint answer(void) { return ANSWER; }\n')
    flags = ("-O1", "-shared", "-fPIC")
    assert compile_library(source, flags).answer() == 41
    (tmp_path / "answer.h").write_text("#define ANSWER 42\n")
    assert compile_library(source, flags).answer() == 42
    assert len(list((tmp_path / "build").glob("answer_*.so"))) == 2


@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 8, 16])
def test_native_kernels_take_any_number_of_rows(m):
    """The kernels work through the query rows four at a time: every remainder (and the 16-row maximum) gives the
    reference partial, for KIVI-layout codes and for per-token codes."""
    native_or_skip()
    from hf_kvcache.kernels.blockwise import dense_partial, finish
    from hf_kvcache.kernels.from_codes import quant_partial_codes

    q = torch.randn(1, 2, m, 64, generator=torch.Generator().manual_seed(m)) / 8
    seg = quant_segment(1, 2, 96, 64, 4, 2, k_group=32, v_group=32, seed=m)
    got, ref = finish(native.quant_partial_native(q, seg, None)), finish(quant_partial_codes(q, seg, None))
    torch.testing.assert_close(got[0], ref[0], atol=5e-6, rtol=1e-5)  # measured up to 1.9e-6
    tok = token_segment(1, 2, 77, 64, "int4", prerope=True, seed=m)
    k, v = tok.dequantize(torch.float32)
    got, ref = finish(native.token_partial_native(q, tok, None)), finish(dense_partial(q, k, v, None))
    torch.testing.assert_close(got[0], ref[0], atol=5e-6, rtol=1e-5)  # measured up to 3.2e-6

@pytest.mark.parametrize(
    "d,dtype,group_size,symmetric,prerope",
    [(64, "int4", None, None, False), (64, "int4", None, None, True), (64, "int8", None, None, True),
     (128, "int4", 16, False, True), (256, "int8", 64, False, False), (256, "int4", None, None, True),
     (64, "fp8_e4m3", None, None, False), (128, "fp8_e5m2", 32, None, False), (64, "fp8_e4m3", None, None, True)],
)
@pytest.mark.parametrize("chunks", [1, 3])
def test_native_token_partial_matches_dequantized_keys(d, dtype, group_size, symmetric, prerope, chunks):
    """The compiled kernel over per-token codes (the uniform cache's formats, fp8 through a table of code values;
    pre-RoPE keys rotated back tile by tile, RoPE's attention scaling folded into the angles) gives the partial of its dequantized keys and values, with a
    left-padding key mask, each row at its own positions, and the tokens split into chunks."""
    native_or_skip()
    from hf_kvcache.kernels.blockwise import dense_partial, finish

    b, h, m, t = 2, 3, 5, 203  # not a multiple of the 64-token tile
    seg = token_segment(b, h, t, d, dtype, group_size, symmetric, prerope, pad=(0, 9), seed=d)
    q = torch.randn(b, h, m, d, generator=torch.Generator().manual_seed(1)) / d**0.5
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, :9] = False
    assert native.supports_tokens(q, seg)
    k, v = seg.dequantize(torch.float32)
    ref = dense_partial(q, k, v, valid.view(b, 1, 1, t))
    got = native.token_partial_native(q, seg, valid, chunks=chunks)
    (ref_out, ref_lse), (got_out, got_lse) = finish(ref), finish(got)  # partials differ in form, not in meaning
    # fp32 sums in other orders (the kernel under -ffast-math): measured up to 2.3e-6 (output) and 1.9e-6 (lse)
    torch.testing.assert_close(got_out, ref_out, atol=4e-6, rtol=1e-5)
    torch.testing.assert_close(got_lse, ref_lse, atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("prerope", [False, True])
def test_native_token_output_is_the_normalized_partial(prerope):
    """`token_output_native` (a decode step's call: the kernel normalizes its merged partial) gives the very bits of
    `normalized` over `token_partial_native`'s partial, a new token attended beside the codes, a padded row masked."""
    native_or_skip()
    from hf_kvcache.kernels.blockwise import normalized

    seg = token_segment(2, 3, 203, 64, "int8", prerope=prerope, pad=(0, 9), seed=3)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 3, 64, generator=g) / 8
    dense = (torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g))
    valid = torch.ones(2, 203, dtype=torch.bool)
    valid[1, :9] = False
    out = native.token_output_native(q, seg, valid, dense=dense)
    assert out.shape == (2, 3, 3, 64)
    assert torch.equal(out, normalized(native.token_partial_native(q, seg, valid, dense=dense)))


# measured max |composed - every column| of the output, int4 / int8: 2.0e-6 / 2.2e-6 (start 0), 3.9e-6 / 4.5e-6 (300),
# 1.6e-4 / 1.4e-4 (16000), 3.2e-4 / 3.0e-4 (32565: the last 8-bit segment that composes); 4.0e-4 / exact (40000)
@pytest.mark.parametrize("start,composed_tol", [(0, 4e-6), (300, 6e-6), (16000, 2.5e-4), (32565, 4.5e-4),
                                                (32566, 5e-4), (40000, 5e-4)])
def test_native_token_angles_from_a_shared_table_are_the_computed_ones(start, composed_tol):
    """Consecutive positions shared by every row read their angles as columns of a table of positions 0.. (rows
    wider than the segment once a longer one has grown it). 4-bit codes compose each tile's angles from its first
    column and the angles of 0..63 (a rounding that grows with the position); 8-bit codes do while every position is
    below `COMPOSED_WIDE_POSITIONS`, and past it read the very bits of the angles computed for them alone."""
    native_or_skip()
    import dataclasses

    q = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(4)) / 8
    for dtype in ("int8", "int4"):
        seg = token_segment(1, 2, 203, 64, dtype, prerope=True, seed=5, start=start)  # positions [1, 1, t]
        alone = native.token_output_native(q, seg, None)
        shared = dataclasses.replace(seg, positions=seg.positions.flatten())
        rope = seg.key_codec.rope
        assert native._angles(rope, torch.arange(50000, 50203), 203)[2] == 65536  # a later layer grows the table
        out = native.token_output_native(q, shared, None)
        if dtype == "int8" and start + 203 > native.COMPOSED_WIDE_POSITIONS:
            assert torch.equal(out, alone)
        else:
            assert 0 < float((out - alone).abs().max()) < composed_tol
        assert native._angles(rope, shared.positions, 203)[2] == 65536  # read as a view of it


@each_path
@pytest.mark.parametrize("return_mass", [False, True])
@pytest.mark.parametrize("dtype,group_size,symmetric,prerope",
                         [("int4", None, None, True), ("int8", 16, False, True), ("int4", 16, False, False)])
def test_decode_attention_over_a_token_segment(path, return_mass, dtype, group_size, symmetric, prerope):
    """A per-token segment (keys pre-RoPE or as they come) plus the new token, with left padding (each row at its own
    positions): the Triton and native kernels (where they serve; the mass is always computed from the decoded keys)
    and the decoded fallback all match the reference."""
    seg = token_segment(2, 2, 150, 64, dtype, group_size, symmetric, prerope=prerope, pad=(0, 30), seed=5)
    g = torch.Generator().manual_seed(0)
    tail = FullSegment(torch.randn(2, 2, 1, 64, generator=g), torch.randn(2, 2, 1, 64, generator=g))
    q = torch.randn(2, 6, 1, 64, generator=g)
    mask = left_padded_mask(2, 1, 151, (0, 30))
    ref, ref_mass = reference_attention(q, [seg, tail], mask)
    out, mass = decode_attention(q, [seg, tail], mask, return_mass=return_mass, **kernel(path))
    # measured up to 1.4e-6 (native, -ffast-math), 4.8e-7 (Triton, interpreted), 5.7e-7 (decoded)
    torch.testing.assert_close(out, ref, atol=3e-6, rtol=1e-5)
    if return_mass:
        torch.testing.assert_close(mass, ref_mass, atol=4e-6, rtol=1e-5)


@pytest.mark.parametrize("new_tokens,hide_new,one_call", [((1,), False, True), ((2, 1), False, True),
                                                           ((1,), True, False), ((40, 30), False, False)])
def test_native_token_step_attends_codes_and_new_tokens_in_one_call(monkeypatch, new_tokens, hide_new, one_call):
    """A one-position step over a per-token segment and up to 64 full-precision tokens (the uniform caches' decode
    step) runs as one native call that also attends the new tokens; a mask that hides a new token, or more than 64 of
    them, takes the general path. Both match the reference."""
    native_or_skip()
    seg = token_segment(2, 2, 150, 64, "int4", prerope=True, pad=(0, 30), seed=7)
    g = torch.Generator().manual_seed(1)
    tails = [FullSegment(torch.randn(2, 2, n, 64, generator=g), torch.randn(2, 2, n, 64, generator=g))
             for n in new_tokens]
    total = 150 + sum(new_tokens)
    q = torch.randn(2, 6, 1, 64, generator=g)
    mask = left_padded_mask(2, 1, total, (0, 30))
    if hide_new:
        mask[1, ..., -1] = False
    calls = []  # per kernel call: whether it attended the new tokens beside the codes
    real_partial, real_output = native.token_partial_native, native.token_output_native
    monkeypatch.setattr(native, "token_partial_native",
                        lambda *a, **kw: calls.append(kw.get("dense") is not None) or real_partial(*a, **kw))
    monkeypatch.setattr(native, "token_output_native",
                        lambda *a, **kw: calls.append(kw.get("dense") is not None) or real_output(*a, **kw))
    ref, _ = reference_attention(q, [seg, *tails], mask)
    out, _ = decode_attention(q, [seg, *tails], mask)
    assert calls == ([True] if one_call else [False])
    # measured up to 1.4e-6 (both paths; the kernel runs under -ffast-math)
    torch.testing.assert_close(out, ref, atol=3e-6, rtol=1e-5)


def test_native_token_supports_only_its_variants():
    """No variant (the decoded fallback serves): head_dim 80, more than 16 rows, more than 32 key scales per token,
    queries on another device type."""
    native_or_skip()
    q = torch.randn(1, 1, 4, 64)
    assert native.supports_tokens(q, token_segment(1, 1, 32, 64, "int4"))
    assert native.supports_tokens(q, token_segment(1, 1, 32, 64, "fp8"))
    assert not native.supports_tokens(torch.randn(1, 1, 4, 80), token_segment(1, 1, 32, 80, "int8"))
    assert not native.supports_tokens(torch.randn(1, 1, 17, 64), token_segment(1, 1, 32, 64, "int4"))
    assert not native.supports_tokens(q, token_segment(1, 1, 32, 64, "int4", group_size=1))
    assert not native.supports_tokens(q.to("meta"), token_segment(1, 1, 32, 64, "int4"))


@pytest.mark.parametrize("pads", [None, (0, 3)], ids=["no-mask", "left-padded"])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_step_of_a_tiered_layer(pads, threads):
    """A tiered layer's decode step (a 2-bit archive with dense key and value rotations, a 4-bit warm tier with a
    Hadamard value rotation, sinks over the archive's first positions, a tail and the new token) runs as one native
    call (`native_step.step`) and gives the reference attention."""
    from hf_kvcache.kernels import native_step
    from hf_kvcache.quant.rotation import hadamard_rotation, rotate

    native_or_skip()
    g = torch.Generator().manual_seed(21)
    b, h, d, group = 2, 2, 64, 3
    matrix = torch.linalg.qr(torch.randn(d, d, generator=g))[0]
    hadamard = hadamard_rotation(d, 0)

    def segment(t, bits, k_rot, v_rot):
        k, v = torch.randn(b, h, t, d, generator=g) * 2, torch.randn(b, h, t, d, generator=g)
        k, v = (k if k_rot is None else rotate(k, k_rot)), rotate(v, v_rot)
        kc, ks, kz = kivi_key_codes(k, bits, 32, use_triton=False)
        vc, vs, vz = kivi_value_codes(v, bits, 32, use_triton=False)
        return QuantSegment(kc, ks, kz, vc, vs, vz, bits, bits, 32, 32, d, k_rotation=k_rot, v_rotation=v_rot)

    def full(t, **kw):
        return FullSegment(torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g), **kw)

    segments = [segment(256, 2, matrix, matrix), segment(96, 4, None, hadamard), full(7), full(1),
                full(4, overlay_at=0)]
    mask = None if pads is None else left_padded_mask(b, 1, 256 + 96 + 8, pads)
    q = torch.randn(b, h * group, 1, d, generator=g)
    calls = []
    real = native_step.step
    native_step.step = lambda *a, **k: calls.append(1) or real(*a, **k)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, _ = decode_attention(q, segments, mask, use_triton=False)
    finally:
        native_step.step = real
        torch.set_num_threads(before)
    ref, _ = reference_attention(q, segments, mask)
    assert calls == [1]
    torch.testing.assert_close(out, ref, atol=4e-6, rtol=1e-5)


@pytest.mark.parametrize("warm", [True, False], ids=["warm-tier", "no-warm-tier"])
@pytest.mark.parametrize("pads", [None, (0, 70)], ids=["no-mask", "left-padded"])
def test_native_step_with_a_subspace_archive(warm, pads):
    """A tiered layer's step over a subspace archive (pre-RoPE keys), a 4-bit warm tier (or none), a tail, the new
    token and sinks over the archive's first positions: the archive's partial from `native_subspace` merged inside the one native step call, which gives the
    reference attention."""
    from hf_kvcache.kernels import native_step
    from hf_kvcache.kernels.segments import SubspaceSegment
    from hf_kvcache.quant.subspace import fit_subspace, quantize_subspace_rows
    from hf_kvcache.rope import KeyRotation

    native_or_skip()
    g = torch.Generator().manual_seed(23)
    b, h, d, group, t = 2, 2, 64, 3, 256
    k = torch.randn(b, h, t, d, generator=g) * torch.linspace(0.2, 3.0, d)
    v = torch.randn(b, h, t, d, generator=g)
    keys = quantize_subspace_rows(k, fit_subspace(k, rank=40), (4, 3, 3, 2, 2), 8, rank=40, axis="channel")
    values = quantize_subspace_rows(v, fit_subspace(v, rank=64), (3, 1), 32, axis="token")
    rope = KeyRotation(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    segments = [SubspaceSegment(keys, values, rope, start=0)]
    if warm:
        wk, wv = torch.randn(b, h, 64, d, generator=g), torch.randn(b, h, 64, d, generator=g)
        kc, ks, kz = kivi_key_codes(wk, 4, 32, use_triton=False)
        vc, vs, vz = kivi_value_codes(wv, 4, 32, use_triton=False)
        segments.append(QuantSegment(kc, ks, kz, vc, vs, vz, 4, 4, 32, 32, d))
    segments += [FullSegment(torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g))
                 for n in (7, 1)]
    total = sum(s.tokens for s in segments)
    segments.append(FullSegment(torch.randn(b, h, 4, d, generator=g), torch.randn(b, h, 4, d, generator=g),
                                overlay_at=0))  # sinks over the archive's first positions
    mask = None if pads is None else left_padded_mask(b, 1, total, pads)
    q = torch.randn(b, h * group, 1, d, generator=g)
    calls = []
    real = native_step.step
    native_step.step = lambda *a, **kw: calls.append(kw.get("extra") is not None) or real(*a, **kw)
    try:
        out, _ = decode_attention(q, segments, mask, use_triton=False)
    finally:
        native_step.step = real
    ref, _ = reference_attention(q, segments, mask)
    assert calls == [True]
    torch.testing.assert_close(out, ref, atol=4e-6, rtol=1e-5)


@pytest.mark.parametrize("prerope", [True, False], ids=["pre-rope", "post-rope"])
@pytest.mark.parametrize("threads,rows,d", [(1, 3, 64), (2, 7, 128), (2, 1, 256)])
def test_native_subspace_partial_against_the_torch_path(prerope, threads, rows, d):
    """The compiled subspace kernel (`native_subspace.coefficient_partial`: codes unpacked in C, each key rebuilt in
    its group's scaled basis, values weighted in their whitened basis) against the torch path's blocks, for every
    code width 1-8 among the subspaces, a padded row, ranks below the head dim, several chunks on two threads."""
    from hf_kvcache.kernels import from_subspace, native_subspace

    if native_subspace.library() is None:
        pytest.skip("no C compiler: the native kernel is unavailable (the torch path serves)")
    b, t = 2, 2304 if threads > 1 else 320
    q, seg, valid = subspace_case(b, t, rows, d, prerope)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_subspace.coefficient_partial(q, seg, valid)
    finally:
        torch.set_num_threads(before)
    ref = from_subspace.blockwise_partial(q, seg, valid.view(b, 1, 1, t), 128, from_subspace.subspace_scores,
                                          lambda p, part: from_subspace.subspace_coefficients(p, part.values))
    assert got is not None
    for name, x, y in zip(("max", "sum", "coefficients"), got, ref):
        # float32 sums of up to 2304 terms in another order: measured within 4.5e-6 of the largest entry
        torch.testing.assert_close(x, y, atol=8e-6 * float(y.abs().max()), rtol=2e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("d,full_8bit", [(64, False), (128, False), (256, False), (64, True)])
def test_the_subspace_kernel_reads_codes_alike_in_both_builds(d, full_8bit):
    """Where the CPU has AVX-512 VBMI, the kernel reads a row of codes (at most 64 bytes) with one byte permutation;
    the build with -DHF_KVCACHE_SCALAR_CODES reads them a subspace at a time. Both give the same partial bit for bit:
    the keys' rows here are 35 / 71 / 143 bytes and the values' 29 / 59 / 119 (both paths in one call at 128), and
    64 / 64 at 8 bits (a whole 64-byte load). On a CPU without VBMI both builds read a subspace at a time."""
    from hf_kvcache.kernels import native_subspace

    if native_subspace.library() is None:
        pytest.skip("no C compiler: the native kernel is unavailable (the torch path serves)")
    q, seg, valid = subspace_case(2, 320, 3, d, prerope=True, full_8bit=full_8bit)
    assert (seg.keys.codes.shape[-1] == 64) == full_8bit
    vector = native_subspace.coefficient_partial(q, seg, valid)
    scalar_lib = native_subspace._compile(native_subspace.SCALAR_CODES_FLAGS)
    real = native_subspace.library
    native_subspace.library = lambda: scalar_lib
    try:
        scalar = native_subspace.coefficient_partial(q, seg, valid)
    finally:
        native_subspace.library = real
    for x, y in zip(vector, scalar):
        assert torch.equal(x, y)


@pytest.mark.parametrize("prerope,use_native", [(False, True), (True, True), (True, False)],
                         ids=["post-rope", "pre-rope-native", "pre-rope-torch"])
@pytest.mark.parametrize("q_len,d", [(1, 64), (3, 128)])
def test_decode_attention_over_a_subspace_segment(prerope, use_native, q_len, d):
    """A subspace archive read in place (keys per direction in subspaces of their own widths, values per token and
    subspace; post-RoPE keys folded into the query, pre-RoPE keys rebuilt with RoPE from the segment's first
    position): output and mass equal the dequantize-then-attend reference, over several blocks, with a padding mask
    and a full-precision tail after it."""
    from hf_kvcache.kernels.segments import SubspaceSegment
    from hf_kvcache.quant.subspace import fit_subspace, quantize_subspace_rows
    from hf_kvcache.rope import KeyRotation

    g = torch.Generator().manual_seed(5)
    b, h, t = 2, 2, 256
    k = torch.randn(b, h, t, d, generator=g) * torch.linspace(0.2, 3.0, d)
    v = torch.randn(b, h, t, d, generator=g)
    keys = quantize_subspace_rows(k, fit_subspace(k, rank=48), (4, 3, 2, 2, 2, 2), 8, axis="channel", token_group=64)
    if prerope and use_native:  # the compiled kernel serves this shape (where a compiler works)
        from hf_kvcache.kernels import native_subspace

        assert native_subspace.library() is not None or not native.available()[0]
    values = quantize_subspace_rows(v, fit_subspace(v, rank=64), (3, 2), 32, axis="token")
    rope = KeyRotation(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)) if prerope else None
    segments = [SubspaceSegment(keys, values, rope, start=100),
                FullSegment(torch.randn(b, h, 5, d, generator=g), torch.randn(b, h, 5, d, generator=g))]
    q = torch.randn(b, 2 * h, q_len, d, generator=g)
    mask = torch.ones(b, 1, q_len, t + 5, dtype=torch.bool)
    mask[0, :, :, :7] = False  # a left-padded row
    mask[..., t:] &= torch.ones(q_len, 5, dtype=torch.bool).tril(5 - q_len)  # the tail's new tokens: causal
    ref, ref_mass = reference_attention(q, segments, mask)
    with contextlib.nullcontext() if use_native else native.turned_off():
        out, mass = decode_attention(q, segments, mask, return_mass=True, block=64)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(mass, ref_mass, atol=2e-6, rtol=1e-5)


def test_subspace_basis_weights_are_kept_per_basis_and_rank_while_the_basis_lives():
    """`native_subspace.basis_weights` computes a basis's float32 weights (sigma times the basis) once per rank, gives
    the same tensors back on every later step, and lets them go with the basis."""
    import gc

    from hf_kvcache.kernels import native_subspace

    _, seg, _ = subspace_case(2, 256, 3, 64, prerope=True)
    keys = seg.keys
    w, mean = native_subspace.basis_weights(keys)
    basis = keys.basis
    expected = basis.sigma[:, : keys.rank, None].float() * basis.basis[:, :, : keys.rank].float().transpose(-1, -2)
    assert torch.equal(w, expected) and torch.equal(mean, basis.mean.float())
    again = native_subspace.basis_weights(keys)
    assert again[0] is w and again[1] is mean
    before, own = native_subspace.held_weight_bytes(), w.nbytes + mean.nbytes
    assert before >= own
    del seg, keys, basis, w, mean, again, expected
    gc.collect()
    assert native_subspace.held_weight_bytes() <= before - own
