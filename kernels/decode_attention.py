"""Decode attention straight from compressed segments: queries of the last step(s) attend over
[quantized segments | full-precision segments] without expanding the cache to full precision.

Each segment yields an online-softmax partial (row max `m`, row sum `l`, unnormalized output `acc`); partials are merged
with log-sum-exp, so every byte of the cache is read once. GQA: the query heads of one KV head (times the query
positions) form the rows of one tile, so KV is never repeated. On CUDA quantized segments run in a Triton kernel
(split along tokens, flash-decoding style); elsewhere in the torch path of `kernels.from_codes`, which computes
scores and outputs from the codes with the scales folded in, `block` tokens at a time in reusable scratch (extra memory
O(block), not O(cached tokens)). Per-token segments (`TokenSegment`, the uniform cache's codes) run in their Triton
kernel on CUDA (`triton_tokens`), in the compiled CPU kernel (`native`) elsewhere where it serves, and are otherwise
decoded into the full-precision partial (as is every one when the attention mass is asked for). Subspace segments (a
tiered archive coded in fitted bases) run in the Triton kernel (`triton_subspace`) on CUDA, the compiled CPU kernel
(`native_subspace`) where it serves, and the torch path of `from_subspace` elsewhere. Every full-precision
piece (tail, new tokens, overlays) makes one more partial. A one-position step over one per-token segment and its
new tokens (the uniform caches' decode step) is a single native call that attends both; on CUDA a one-position step
over full-precision pieces alone is torch's SDPA over them joined. Full-precision overlays
(sinks) replace the positions under them: those columns of the quantized segment are masked and the overlay attends
in their place. `reference_attention` is the dequantize-then-SDPA reference all paths are tested against.
"""

from __future__ import annotations

import functools
import math

import torch

from . import native, native_step, native_subspace
from .blockwise import combine, dense_partial, finish, rows_mask, scratch
from .from_codes import quant_mass_codes, quant_partial_codes
from .from_subspace import in_model_basis, subspace_mass, subspace_partial
from .segments import (FullSegment, QuantSegment, Segment, SubspaceSegment, TokenSegment, dense_segments,
                       split_overlays)
from hf_kvcache.quant.rotation import Rotation, rotate, unrotate

NEG_INF = float("-inf")


# ---- shapes and masks -------------------------------------------------------------------------------------------------
def group_queries(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, L, D] -> [B, Hkv, group * L, D] (rows of one KV head: its query heads, then positions)."""
    b, hq, l, d = query.shape
    if hq % kv_heads:
        raise ValueError(f"{hq} query heads cannot share {kv_heads} KV heads")
    return query.reshape(b, kv_heads, (hq // kv_heads) * l, d)


def ungroup_rows(x: torch.Tensor, q_heads: int, q_len: int) -> torch.Tensor:
    b, hkv, _, d = x.shape
    return x.reshape(b, q_heads, q_len, d)


def _column_mask(mask: torch.Tensor | None, start: int, stop: int, q_len: int, total: int, causal_tail: bool):
    """Boolean [B|1, 1, L, stop-start] for key columns [start, stop), or None when nothing is masked."""
    if mask is not None:
        m = mask[..., start:stop]
        return m if m.dtype == torch.bool else m > NEG_INF
    if not causal_tail or q_len == 1:
        return None
    # query i sits at position total - q_len + i and sees keys up to it
    cols = torch.arange(start, stop).view(1, -1)
    rows = torch.arange(total - q_len, total).view(-1, 1)
    return (cols <= rows).view(1, 1, q_len, stop - start)


# ---- partials ---------------------------------------------------------------------------------------------------------
def _masked_scores(q, k, row_mask):
    s = q @ k.transpose(-1, -2)
    return s if row_mask is None else s.masked_fill(~row_mask, NEG_INF)


# ---- entry point ------------------------------------------------------------------------------------------------------
def decode_attention(
    query: torch.Tensor,
    segments: list[Segment],
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    return_mass: bool = False,
    block: int | None = None,
    use_triton: bool | None = None,
    use_native: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of `query` [B, Hq, L, D] over `segments` (in key order).

    `attention_mask`: None (causal among the last L keys) or [B|1, 1, L, T_total] boolean (True = attend) / additive.
    Quantized segments must precede the queries (they hold past tokens); full segments may hold the new ones.
    Returns (output [B, Hq, L, D] in the query dtype, mass [B, Hkv, T_total] or None): mass is the attention
    probability each key received, summed over the query heads of its KV group and the query positions.
    `block`: tokens per block of the torch path (None: `from_codes.BLOCK_ELEMENTS` codes). `use_triton` (default: on
    CUDA) and `use_native` (None or True: on CPU wherever `native.supports` the segment; False keeps the torch path)
    pick the kernel for quantized segments.
    """
    b, hq, q_len, d = query.shape
    segments, overlays = split_overlays(segments)
    kv_heads = (segments[0].keys if isinstance(segments[0], FullSegment) else segments[0].k_codes).shape[1]
    group = hq // kv_heads
    scaling = 1.0 / math.sqrt(d) if scaling is None else scaling
    if use_triton is None:
        use_triton = query.is_cuda
    gpu_step = use_triton and q_len == 1 and attention_mask is None and not return_mass  # one launch serves it
    if gpu_step and not overlays and all(isinstance(s, FullSegment) for s in segments):
        return _dense_step_sdpa(query, segments, scaling), None
    q = group_queries((query if query.dtype == torch.float32 else query.float()) * scaling, kv_heads)
    total = sum(s.tokens for s in segments)
    dot_f32 = query.dtype == torch.float32  # the GPU kernels' dots: fp32 for fp32 models, else fp16 operands
    if not (return_mass or use_triton or use_native is False or overlays or q_len != 1):
        out = _token_step_native(q, segments, attention_mask, total, group)
        if out is not None:  # the output alone: nobody reads the log-sum-exp here
            return _in_dtype(ungroup_rows(out, hq, q_len), query.dtype), None
    if not (return_mass or use_triton or use_native is False or q_len != 1):
        out = _segments_step_native(q, segments, overlays, attention_mask, total, group)
        if out is not None:
            return _in_dtype(ungroup_rows(out, hq, q_len), query.dtype), None
    if gpu_step:
        out = _step_triton(q, segments, overlays, query.dtype, dot_f32)
        if out is not None:
            return ungroup_rows(out, hq, q_len), None
    partials, quant_spans, dense, start = [], [], [], 0
    rotated_q: dict[int, torch.Tensor] = {}  # queries rotated once per key rotation
    pending = None  # (v_rotation, partial) of consecutive quantized segments sharing a value rotation
    for seg in segments:
        stop = start + seg.tokens
        cmask = _column_mask(attention_mask, start, stop, q_len, total, causal_tail=isinstance(seg, FullSegment))
        hidden = _overlaid_columns(overlays, start, stop, query.device)
        if hidden is not None:  # columns an overlay replaces: masked here, the overlay attends in their place
            cmask = ~hidden.view(1, 1, 1, -1) if cmask is None else cmask & ~hidden.view(1, 1, 1, -1)
        if not isinstance(seg, FullSegment):
            key_valid = None if cmask is None else cmask[:, 0, -1, :].expand(b, -1)
            # the torch path masks per query row (a sliding window hides old keys from the later rows of a chunk)
            seg_mask = rows_mask(cmask, group) if cmask is not None and cmask.shape[2] > 1 else cmask
        if isinstance(seg, TokenSegment):  # a kernel where one serves, else decoded into the dense partial
            part = None if return_mass else _token_kernel_partial(q, seg, key_valid, seg_mask, use_triton, use_native,
                                                                  dot_f32)
            if part is not None:
                partials.append(part)
            else:
                dense.append((FullSegment(*seg.dequantize(torch.float32)), start, cmask))
        elif isinstance(seg, SubspaceSegment):  # a kernel where one serves (Triton / native), else the torch path
            coeffs = None
            if use_triton and _one_key_mask(seg_mask):
                from .triton_subspace import coefficient_partial  # triton is imported where it is launched
                coeffs = coefficient_partial(q, seg, key_valid, dot_f32)
            elif use_native is not False and _one_key_mask(seg_mask):
                coeffs = native_subspace.coefficient_partial(q, seg, key_valid)
            partials.append(subspace_partial(q, seg, seg_mask, block, coeffs))
            quant_spans.append((seg, start, stop, key_valid, seg_mask, q, False))
        elif isinstance(seg, QuantSegment):
            seg.check()
            q_seg = _in_key_basis(q, seg, rotated_q)
            # the Triton and native kernels take one key mask for all rows: a per-row mask goes through the torch path
            seg_native = not use_triton and use_native is not False and native.supports(q_seg, seg)
            kernel = (use_triton or seg_native) and _one_key_mask(seg_mask)
            seg_triton = kernel and use_triton
            if seg_triton:
                part = _quant_partial_triton(q_seg, seg, key_valid, dot_f32)
            elif kernel:
                part = native.quant_partial_native(q_seg, seg, key_valid)
            else:
                part = quant_partial_codes(q_seg, seg, seg_mask, block)
            if pending is not None and pending[0] is seg.v_rotation:
                pending = (seg.v_rotation, combine(pending[1], part))
            else:
                if pending is not None:
                    partials.append(_unrotated(*pending))
                pending = (seg.v_rotation, part)
            quant_spans.append((seg, start, stop, key_valid, seg_mask, q_seg, seg_triton))
        else:
            dense.append((seg, start, cmask))
        start = stop
    if pending is not None:
        partials.append(_unrotated(*pending))
    for o in overlays:
        dense.append((o, o.overlay_at, _column_mask(attention_mask, o.overlay_at, o.overlay_at + o.tokens, q_len,
                                                    total, causal_tail=False)))
    if dense:  # every full-precision piece (tail, new tokens, overlays) in one partial
        dk, dv, row_mask = _dense_keys(dense, b, q_len, group)
        partials.append(dense_partial(q, dk, dv, row_mask))
    out, lse = finish(functools.reduce(combine, partials))
    mass = None
    if return_mass:
        mass = q.new_zeros((b, kv_heads, total))
        for seg, start, stop, key_valid, seg_mask, q_seg, seg_triton in quant_spans:
            if seg_triton:
                from .triton_decode import quant_mass_triton

                mass[..., start:stop] = quant_mass_triton(q_seg, seg, key_valid, lse)
            elif isinstance(seg, SubspaceSegment):
                mass[..., start:stop] = subspace_mass(q_seg, seg, seg_mask, lse, block)
            else:
                mass[..., start:stop] = quant_mass_codes(q_seg, seg, seg_mask, lse, block)
        if dense:
            p = _masked_scores(q, dk, row_mask).sub_(lse.unsqueeze(-1)).exp_().sum(2)
            positions = torch.cat([torch.arange(s0, s0 + seg.tokens) for seg, s0, _ in dense]).to(query.device)
            mass.index_add_(2, positions, p)
    return ungroup_rows(out, hq, q_len).to(query.dtype), mass


def _dense_step_sdpa(query: torch.Tensor, segments: list[FullSegment], scaling: float) -> torch.Tensor:
    """A one-position step over full-precision pieces alone on CUDA (a cache that has not quantized anything yet):
    torch's SDPA over the pieces joined along tokens. Output `[B, Hq, 1, D]` in the query dtype."""
    pieces = [s for s in segments if s.tokens] or segments[:1]
    keys = pieces[0].keys if len(pieces) == 1 else torch.cat([s.keys for s in pieces], dim=2)
    values = pieces[0].values if len(pieces) == 1 else torch.cat([s.values for s in pieces], dim=2)
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys.to(query.dtype), values.to(query.dtype), scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1])


def _step_triton(q, segments: list[Segment], overlays: list[FullSegment], out_dtype: torch.dtype, dot_f32: bool):
    """A one-position step without a mask on CUDA: each quantized segment's kernel leaves its split partials (a
    subspace archive's taken to the other segments' value basis), and `triton_step` merges them with the
    full-precision pieces in one launch. Output `[B, Hkv, group, D]` in
    `out_dtype`, or None where this path does not serve (more segments or pieces than one launch takes, value
    rotations that differ, a shape no kernel serves)."""
    from . import triton_quant, triton_step, triton_subspace
    from .triton_tokens import supports_tokens, token_partial_triton

    quant = [s for s in segments if not isinstance(s, FullSegment)]
    pieces = [s for s in [*segments, *overlays] if isinstance(s, FullSegment) and s.tokens]
    if len(quant) > triton_step.MAX_SETS or len(pieces) > triton_step.MAX_PIECES:
        return None
    # a subspace archive's partial comes to the model's basis, then to the other segments' value rotation
    coded = [s for s in quant if not isinstance(s, SubspaceSegment)]
    rotations = {id(getattr(s, "v_rotation", None)) for s in coded}
    v_rotation = getattr(coded[0], "v_rotation", None) if coded else None
    unread_rotation = v_rotation is not None and (q.shape[-1] > triton_step.MAX_ROTATED_DIM
                                                  or native_step.value_rotation_matrix(v_rotation, q.shape[-1]) is None)
    if len(rotations) > 1 or unread_rotation or any(p.keys.stride(-1) != 1 or p.values.stride(-1) != 1 for p in pieces):
        return None
    rotated_q: dict[int, torch.Tensor] = {}
    launches, start = [], 0
    for seg in segments:
        stop = start + seg.tokens
        if isinstance(seg, TokenSegment):
            if not supports_tokens(q, seg):
                return None
            launches.append((seg, q, start, stop))
        elif isinstance(seg, QuantSegment):
            seg.check()
            q_seg = _in_key_basis(q, seg, rotated_q)
            if not triton_quant.supports(q_seg, seg):
                return None
            launches.append((seg, q_seg, start, stop))
        elif isinstance(seg, SubspaceSegment):
            if not triton_subspace.serves(q, seg):
                return None
            launches.append((seg, q, start, stop))
        start = stop
    sets = []
    for seg, q_seg, start, stop in launches:
        hidden = _overlaid_columns(overlays, start, stop, q.device)
        key_valid = None if hidden is None else (~hidden).view(1, -1).expand(q.shape[0], -1)
        if isinstance(seg, TokenSegment):
            sets.append(token_partial_triton(q_seg, seg, key_valid, dot_f32=dot_f32, merged=False))
        elif isinstance(seg, SubspaceSegment):
            sets.append(triton_subspace.split_partials_in_basis(q_seg, seg, key_valid, dot_f32, v_rotation))
        else:
            sets.append(triton_quant.quant_partial_rows(q_seg, seg, key_valid, dot_f32=dot_f32, merged=False))
    return triton_step.step_attention(q, sets, [(p.keys, p.values) for p in pieces], v_rotation, out_dtype)


def _quant_partial_triton(q, seg: QuantSegment, key_valid, dot_f32: bool):
    """The partial of a Triton kernel over a KIVI-layout segment: the row-wise kernel (`triton_quant`) where it serves
    the widths and shapes, else the general one (`triton_decode`)."""
    from . import triton_quant

    if triton_quant.supports(q, seg):
        return triton_quant.quant_partial_rows(q, seg, key_valid, dot_f32=dot_f32)
    from .triton_decode import quant_partial_triton

    return quant_partial_triton(q, seg, key_valid, dot_f32=dot_f32)


def _token_kernel_partial(q, seg: TokenSegment, key_valid, seg_mask, use_triton: bool, use_native: bool | None,
                          dot_f32: bool = True):
    """The partial of the kernel that serves this per-token segment (Triton on CUDA, else the native CPU kernel), or
    None where none does (a per-row mask, a shape without a variant, the native kernel turned off)."""
    if not _one_key_mask(seg_mask):
        return None
    if use_triton:
        from .triton_tokens import supports_tokens, token_partial_triton

        return token_partial_triton(q, seg, key_valid, dot_f32=dot_f32) if supports_tokens(q, seg) else None
    if use_native is not False and native.supports_tokens(q, seg):
        return native.token_partial_native(q, seg, key_valid)
    return None


def _in_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _token_step_native(q, segments: list[Segment], attention_mask, total: int, group: int):
    """The normalized output `[B, H, group, D]` of a one-position step (grouped queries `q` [B, H, group, D]) over one
    per-token segment followed by a few full-precision tokens that every row sees (the uniform caches' decode step),
    in one native call; None where that does not apply (other segments, a masked new token, more than
    `native.max_dense()` new tokens, a shape the kernel has no variant for)."""
    seg, rest = segments[0], segments[1:]
    if not isinstance(seg, TokenSegment) or not rest or not all(isinstance(s, FullSegment) for s in rest):
        return None
    if not native.supports_tokens(q, seg) or total - seg.tokens > native.max_dense():
        return None
    key_valid = None
    if attention_mask is not None:
        cols = _column_mask(attention_mask, 0, total, 1, total, causal_tail=False)[:, 0, -1]  # [B|1, total]
        if not bool(cols[:, seg.tokens :].all()):
            return None
        key_valid = cols[:, : seg.tokens].expand(q.shape[0], -1)
    dk, dv, _ = _dense_keys([(s, 0, None) for s in rest], q.shape[0], 1, group)
    return native.token_output_native(q, seg, key_valid, dense=(dk, dv))


def _segments_step_native(q, segments: list[Segment], overlays: list[FullSegment], attention_mask, total: int,
                          group: int) -> torch.Tensor | None:
    """The normalized output `[B, H, group, D]` of a one-position step over quantized segments followed by full-
    precision ones (and overlays), in one native call (`native_step`: the tiered layer's step; a subspace archive in
    front is one `native_subspace` call before it, its partial merged in that call); None where
    that does not apply (a per-token segment, a quantized segment after full-precision ones, an overlay over
    full-precision columns, no variant)."""
    b = q.shape[0]
    cols = None if attention_mask is None else _column_mask(attention_mask, 0, total, 1, total, False)[:, 0, -1]
    quant, dense, rotated, start, extra = [], [], {}, 0, None
    for seg in segments:
        stop = start + seg.tokens
        if isinstance(seg, (QuantSegment, SubspaceSegment)) and not dense:
            valid = None if cols is None else cols[:, start:stop].expand(b, -1)
            visible = _visible_columns(overlays, start, stop, q.device)
            if visible is not None:
                valid = visible.expand(b, -1) if valid is None else valid & visible
            if isinstance(seg, QuantSegment):
                seg.check()
                quant.append((_in_key_basis(q, seg, rotated), seg, valid))
            elif start == 0:  # a subspace archive comes first: its partial merges into the step's call
                coeffs = native_subspace.step_partial(q, seg, valid)
                if coeffs is None:
                    return None
                extra = (coeffs[0], coeffs[1], in_model_basis(seg.values, coeffs[2], coeffs[1]))
            else:
                return None
        elif isinstance(seg, FullSegment) and _overlaid_columns(overlays, start, stop, q.device) is None:
            dense.append((seg, start, None))
        else:
            return None
        start = stop
    for o in overlays:
        dense.append((o, o.overlay_at, None))
    dense_valid = None
    if cols is not None and dense:
        dense_valid = torch.cat([cols[:, s0 : s0 + seg.tokens] for seg, s0, _ in dense], 1)
        dense_valid = None if bool(dense_valid.all()) else dense_valid
    dk, dv = _dense_keys(dense, b, 1, group)[:2] if dense else (None, None)
    return native_step.step(q, quant, None if dk is None else (dk, dv), dense_valid, extra=extra)


def _one_key_mask(seg_mask: torch.Tensor | None) -> bool:
    """Whether every query row sees the same keys (what the Triton and native kernels take)."""
    return seg_mask is None or seg_mask.shape[2] == 1 or bool((seg_mask == seg_mask[:, :, -1:]).all())


def _in_key_basis(q: torch.Tensor, seg: QuantSegment, rotated: dict[int, torch.Tensor]) -> torch.Tensor:
    """The queries in the basis of the segment's stored keys (`q @ R` for keys stored as `k @ R`), rotated once per
    rotation of a step (`rotated`, by the rotation's id)."""
    if seg.k_rotation is None:
        return q
    q_seg = rotated.get(id(seg.k_rotation))
    if q_seg is None:
        q_seg = rotated[id(seg.k_rotation)] = rotate(q, seg.k_rotation)
    return q_seg


def _unrotated(v_rotation: Rotation | None, part):
    """A partial over values stored as v @ R, brought back to the model's basis (its output times R^T)."""
    if v_rotation is None:
        return part
    m, l, acc = part
    return m, l, unrotate(acc.float(), v_rotation)


def _dense_keys(dense, b: int, q_len: int, group: int):
    """Keys, values (float32, concatenated into scratch buffers; one unmasked float32 piece of `b` rows as it is, no
    copy) and row mask of the full-precision pieces. Callers only read them."""
    first = dense[0][0].keys
    if len(dense) == 1 and dense[0][2] is None:
        seg = dense[0][0]
        if seg.keys.dtype == seg.values.dtype == torch.float32 and seg.keys.shape[0] == seg.values.shape[0] == b:
            return seg.keys.contiguous(), seg.values.contiguous(), None
    h, d, n = first.shape[1], first.shape[3], sum(seg.tokens for seg, _, _ in dense)
    dk = scratch("dense_k", b * h * n * d, torch.float32, first.device).view(b, h, n, d)
    dv = scratch("dense_v", b * h * n * d, torch.float32, first.device).view(b, h, n, d)
    pos = 0
    for seg, _, _ in dense:
        dk[:, :, pos : pos + seg.tokens].copy_(seg.keys)
        dv[:, :, pos : pos + seg.tokens].copy_(seg.values)
        pos += seg.tokens
    if all(cm is None for _, _, cm in dense):
        return dk, dv, None
    batch = max(cm.shape[0] for _, _, cm in dense if cm is not None)
    cols = [
        (cm if cm is not None else torch.ones(1, 1, q_len, seg.tokens, dtype=torch.bool, device=dk.device))
        .expand(batch, 1, q_len, seg.tokens)
        for seg, _, cm in dense
    ]
    return dk, dv, rows_mask(torch.cat(cols, -1), group)


def _overlaid_columns(overlays: list[FullSegment], start: int, stop: int, device) -> torch.Tensor | None:
    """Boolean [stop - start]: columns of [start, stop) some overlay replaces; None when none does (read only: the
    same tensor serves every layer of a step)."""
    return _columns(overlays, start, stop, device, 0)


def _visible_columns(overlays: list[FullSegment], start: int, stop: int, device) -> torch.Tensor | None:
    """The negation of `_overlaid_columns` (read only), None when no overlay reaches [start, stop)."""
    return _columns(overlays, start, stop, device, 1)


def _columns(overlays: list[FullSegment], start: int, stop: int, device, which: int) -> torch.Tensor | None:
    spans = tuple((o.overlay_at, o.tokens) for o in overlays
                  if max(start, o.overlay_at) < min(stop, o.overlay_at + o.tokens))
    return _hidden_and_visible(spans, start, stop, device, torch.is_inference_mode_enabled())[which] if spans else None


@functools.lru_cache(maxsize=16)
def _hidden_and_visible(spans: tuple[tuple[int, int], ...], start: int, stop: int, device,
                        inference: bool) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = torch.zeros(stop - start, dtype=torch.bool, device=device)
    for at, tokens in spans:
        hidden[max(start, at) - start : min(stop, at + tokens) - start] = True
    return hidden, ~hidden


def reference_attention(query, segments, attention_mask=None, scaling=None):
    """Dequantize everything, repeat KV heads, plain softmax attention: what the fused paths must match."""
    k, v = dense_segments(segments)
    b, hq, q_len, d = query.shape
    group = hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scaling = 1.0 / math.sqrt(d) if scaling is None else scaling
    s = (query.float() * scaling) @ k.transpose(-1, -2)
    mask = _column_mask(attention_mask, 0, k.shape[2], q_len, k.shape[2], causal_tail=True)
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    p = torch.softmax(s, -1)
    mass = p.reshape(b, hq // group, group, q_len, -1).sum((2, 3))
    return (p @ v).to(query.dtype), mass
