"""Undoing what cropped tokens did to an evicting layer's scores, so that `crop` leaves the layer that never saw them.

`crop` works while nothing was evicted yet. With a policy that accumulates attention mass, a layer keeps until its
first eviction the queries of the last `crop_window` positions (in the model's dtype; counted in `memory_stats()`;
none when the budget never evicts), from which the mass the cropped queries gave is recomputed over the held keys
and taken out of the scores (undoing the decay too: `scores_without`). Window policies need nothing more: n cropped
tokens mean n new ones before the next eviction, which refill their window. A crop whose mass cannot be taken out
-- more tokens than `crop_window`, or quantized slots (the keys those queries saw exactly are now stored quantized)
-- still crops the storage (the prefix store encodes cropped copies), and the next update raises the ValueError
`crop_problem` wrote. Any crop once tokens were evicted raises at once (`check_not_evicted`).
"""

from __future__ import annotations

import torch

from ...policy.ring import QueryRing


def check_not_evicted(n: int, dropped: int, seen: int) -> None:
    """Raise when the layer already evicted `dropped` of the `seen` tokens: cropping `n` cannot restore them."""
    if dropped > 0:
        raise ValueError(
            f"H2OCache cannot crop {n} token(s): this layer already evicted {dropped} of the {seen} tokens it saw, so "
            "the cache before those tokens cannot be restored. Assisted / speculative decoding needs a cache that "
            "does not evict (or a budget that covers the whole sequence)."
        )


def mass_span(ring: QueryRing | None, keep: int, decay: float | None) -> tuple[int, int]:
    """(start, end of the kept part) of the queries whose mass a crop to `keep` tokens recomputes: the cropped ones,
    and with `decay` also the kept queries of the forward the crop cuts (its mass was added after fading the older
    mass by that whole forward's length)."""
    start = part_end = keep
    if decay is not None and ring is not None and keep > 0:
        part = ring.forward_of(keep - 1)
        if part is not None and part[1] > keep:
            start, part_end = part
    return start, part_end


def crop_problem(n: int, seen: int, start: int, ring: QueryRing | None, quant_bits: int | None, policy: str,
                 crop_window: int) -> str | None:
    """Why the mass of the queries of positions `start .. seen - 1` cannot be taken out after a crop of `n` tokens
    (None when it can)."""
    if quant_bits is not None:
        return (
            f"H2OCache cannot crop {n} token(s) with quant_bits={quant_bits} and policy={policy!r}: its scores hold "
            "the attention mass the cropped queries gave, which can be recomputed only from the keys those queries "
            "saw, now stored quantized. Use quant_bits=None, a policy that keeps no mass (tova, snapkv, expected, "
            "knorm, recent, sinks, strided) or budget=1.0 (nothing evicted: the scores never matter)"
        )
    if ring is None or not ring.covers(start, seen):
        return (
            f"H2OCache cannot crop {n} token(s): its scores hold the attention mass of the queries of positions "
            f"{start} .. {seen - 1}, and this layer keeps the queries of only the last crop_window={crop_window} "
            f"positions (reported by the 'hf_kvcache' attention, observe_queries) to take it out; build the cache "
            f"with crop_window >= {seen - start}"
        )
    return None


def scores_without(scores: torch.Tensor, att: torch.Tensor, ring: QueryRing, keep: int, seen: int, start: int,
                   part_end: int, decay: float | None) -> torch.Tensor:
    """The scores `[batch, kv_heads, slots]` of the layer that saw only `keep` tokens, from the attention `att
    [batch, kv_heads, seen - start, slots]` the queries of positions `start .. seen - 1` gave the held keys
    (`QueryRing.attention`). With `decay`, the forward `start .. end` cut by the crop counted its kept queries' mass
    `M` after fading the older mass by `end - start`: the scores are S d^(seen - keep) + ... + M d^(seen - end) with
    the cropped mass; they become S + ... + M, so M is recomputed too."""
    if decay is None:
        return scores - att.sum(2)
    d, n = decay, seen - keep
    ends = torch.tensor([ring.forward_of(p)[1] for p in range(start, seen)], dtype=torch.float32, device=att.device)
    cropped = torch.arange(start, seen, device=att.device) >= keep
    gone = (att * torch.where(cropped, d ** (seen - ends), 0.0)[:, None]).sum(2)
    kept = att[:, :, ~cropped].sum(2)
    return (scores - gone - d ** (seen - part_end) * kept) / d**n + kept
