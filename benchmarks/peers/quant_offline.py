"""Offline comparison of archive quantizers on captured attention tensors (KIVI, KVQuant nuq, subspace).

Input: a capture file `cap_<model>_<T>.pt` holding `{"captured": {layer: (query, key, value, sliding_window)},
"scaling": float}` (fp16, `[1, heads, T, head_dim]`, post-RoPE queries and keys, one prefill forward). For every
layer, the first `--cut` tokens of keys and values are quantized and dequantized, and the attention output of the
last `--tail` queries (causal, sliding window respected, GQA by repeating KV heads) is compared with the exact one:
relative error `||out - ref|| / ||ref||`, also with only keys or only values quantized.

KVQuant (sensitivity-weighted by the attention mass each calibration token receives, unless "-unweighted") and
subspace keys are quantized pre-RoPE: RoPE is undone with default cos/sin for positions 0..T-1 and the
model's rope_theta (per layer type, read from the zoo's config.json under ~/.cache/hf-kvcache/models/), then
re-applied. Codebooks and bases are fitted on the first `--calib` tokens of the same layer.

Bytes per element count every tensor (codes, scales, zero points/offsets, outlier indices and values, and the
layer's codebooks/bases once), over the `--cut` quantized tokens of keys and values; fp16 is 2.0.

    python benchmarks/peers/quant_offline.py /tmp/exp/cap_qwen2.5-coder-0.5b_1024.pt
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections.abc import Callable

import torch

from hf_kvcache.quant import kvquant as kvq
from hf_kvcache.quant import subspace as sub
from hf_kvcache.quant.kivi import dequantize_kivi, quantize_kivi

MODELS_DIR = os.path.expanduser("~/.cache/hf-kvcache/models")


def rope_thetas(model: str, n_layers: int) -> list[float]:
    """rope_theta of each layer from the zoo model's config.json (per layer type when the config has several)."""
    cands = sorted(glob.glob(os.path.join(MODELS_DIR, f"{model}*", "config.json")))
    if not cands:
        raise ValueError(f"no config.json for {model!r} under {MODELS_DIR}; load the model once with hf_kvcache.eval")
    cfg = json.load(open(cands[0]))
    rp = cfg.get("rope_parameters") or {}
    types = cfg.get("layer_types") or ["full_attention"] * n_layers
    if "rope_theta" in rp:
        return [float(rp["rope_theta"])] * n_layers
    if rp:
        return [float(rp[t]["rope_theta"]) for t in types[:n_layers]]
    return [float(cfg.get("rope_theta", 10000.0))] * n_layers


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, sw: int | None) -> torch.Tensor:
    """softmax(q k^T * scaling) v for the last q.shape[2] positions; causal, sliding window `sw` if given."""
    hq, hk, tq, tk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    i = torch.arange(tk - tq, tk)[:, None]
    j = torch.arange(tk)[None]
    allowed = j <= i
    if sw:
        allowed &= (i - j) < sw
    s = (q @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.nbytes for t in ts)


# A method: (q, k_post, v, cos, sin, calib, scaling) -> (k_hat_post, v_hat, bytes, of which fitted state: codebooks or
# bases, a fixed cost per layer that long contexts amortize); k/v are the tokens to quantize,
# q the queries of the same positions (only the first `calib` are used, for sensitivity weights).
Method = Callable[..., tuple[torch.Tensor, torch.Tensor, int]]


def kivi(bits: int) -> Method:
    def run(q, k, v, cos, sin, calib, scaling):
        qk = quantize_kivi(k, bits, 64, "channel")
        qv = quantize_kivi(v, bits, min(64, v.shape[-1]), "token", clip_search=True)
        return dequantize_kivi(qk), dequantize_kivi(qv), nbytes(qk.tensors() + qv.tensors()), 0

    return run


def kvquant(
    bits: int, pre_rope: bool = True, outlier_frac: float = 0.01, v_group: int | None = None, weighted: bool = True
) -> Method:
    def run(q, k, v, cos, sin, calib, scaling):
        kp = kvq.undo_rope(k, cos, sin) if pre_rope else k
        w = kvq.attention_sensitivity(q[:, :, :calib], k[:, :, :calib], scaling) if weighted else None
        cbk = kvq.fit_codebook(kp[:, :, :calib], bits, "channel", 64, outlier_frac, weights=w)
        cbv = kvq.fit_codebook(v[:, :, :calib], bits, "token", v_group, outlier_frac, weights=w)
        qk, qv = kvq.quantize_nuq(kp, cbk), kvq.quantize_nuq(v, cbv)
        kh = kvq.dequantize_nuq(qk)
        kh = kvq.apply_rope(kh, cos, sin) if pre_rope else kh
        return kh, kvq.dequantize_nuq(qv), nbytes(qk.tensors() + qv.tensors()), cbk.nbytes + cbv.nbytes

    return run


def subspace(bits: int, rank_frac: float = 1.0, top_bits: int | None = None, k_group: int = 16, v_group: int = 32):
    """Subspace archive: keys pre-RoPE with per-direction (axis="channel", 64-token groups) steps in subspaces of
    `k_group` directions, values with per-token rms scales per subspace of `v_group` directions; `top_bits`: width of
    the leading subspace (the others get `bits`); `rank_frac`: fraction of the directions kept."""

    def widths(r: int, group: int):
        n = -(-r // group)
        return bits if top_bits is None else (top_bits,) + (bits,) * (n - 1)

    def run(q, k, v, cos, sin, calib, scaling):
        kp = kvq.undo_rope(k, cos, sin)
        r = max(1, int(round(rank_frac * k.shape[-1])))
        bk, bv = sub.fit_subspace(kp[:, :, :calib], r), sub.fit_subspace(v[:, :, :calib], r)
        qk = sub.quantize_subspace(kp, bk, widths(r, k_group), k_group, axis="channel")
        qv = sub.quantize_subspace(v, bv, widths(r, v_group), v_group, axis="token")
        kh = kvq.apply_rope(sub.dequantize_subspace(qk), cos, sin)
        return kh, sub.dequantize_subspace(qv), nbytes(qk.tensors() + qv.tensors()), bk.nbytes + bv.nbytes

    return run


METHODS: dict[str, Method] = {
    "kivi2": kivi(2),
    "kivi3": kivi(3),
    "kvquant3": kvquant(3),
    "kvquant2": kvquant(2),
    "kvquant3-unweighted": kvquant(3, weighted=False),
    "kvquant3-postrope": kvquant(3, pre_rope=False),
    "kvquant2-noout": kvquant(2, outlier_frac=0.0),
    "kvquant2-3%out": kvquant(2, outlier_frac=0.03),
    "kvquant2-vg64": kvquant(2, v_group=64),
    "subspace2": subspace(2),
    "subspace2-top3": subspace(2, top_bits=3),
    "subspace2-r1/2": subspace(2, 0.5),
    "subspace3-r1/2": subspace(3, 0.5),
}


def evaluate(path: str, cut: int, tail: int, calib: int, methods: list[str]) -> dict[str, dict]:
    d = torch.load(path)
    cap, scaling = d["captured"], d["scaling"]
    m = re.match(r"cap_(.+)_\d+\.pt$", os.path.basename(path))
    model = m.group(1) if m else os.path.basename(path)
    layers = sorted(cap)
    thetas = rope_thetas(model, max(layers) + 1)
    res: dict[str, dict] = {n: {"err": [], "kerr": [], "verr": [], "bytes": 0, "state": 0, "elems": 0} for n in methods}
    conc = []
    for li in layers:
        q, k, v, sw = cap[li]
        q, k, v = q.float(), k.float(), v.float()
        t, dh = k.shape[2], k.shape[3]
        cos, sin = kvq.rope_cos_sin(t, dh, thetas[li])
        qs = q[:, :, -tail:]
        ref = attention(qs, k, v, scaling, sw)
        # diagnostic: share of the keys' energy in per-channel means, post-RoPE vs pre-RoPE (higher pre-RoPE when
        # the theta is right: RoPE spins the fixed channel offsets)
        kp = kvq.undo_rope(k, cos, sin)
        conc.append((k.mean(2).norm() / k.norm() * t**0.5, kp.mean(2).norm() / kp.norm() * t**0.5))
        kc, vc = k[:, :, :cut], v[:, :, :cut]
        for n in methods:
            kh, vh, nb, ns = METHODS[n](q[:, :, :cut], kc, vc, cos[:, :cut], sin[:, :cut], calib, scaling)
            kq, vq = torch.cat([kh, k[:, :, cut:]], 2), torch.cat([vh, v[:, :, cut:]], 2)
            r = res[n]
            for key, kk, vv in (("err", kq, vq), ("kerr", kq, v), ("verr", k, vq)):
                out = attention(qs, kk, vv, scaling, sw)
                r[key].append(((out - ref).norm() / ref.norm()).item())
            r["bytes"] += nb
            r["state"] += ns
            r["elems"] += kc.numel() + vc.numel()
    post, pre = (sum(c[i].item() for c in conc) / len(conc) for i in (0, 1))
    print(f"{model}: {len(layers)} layers, keys' mean-channel energy share post-RoPE {post:.3f}, pre-RoPE {pre:.3f}")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("captures", nargs="+", help="cap_<model>_<T>.pt files")
    ap.add_argument("--cut", type=int, default=960, help="tokens quantized (a multiple of 64)")
    ap.add_argument("--tail", type=int, default=64, help="queries evaluated (the last ones)")
    ap.add_argument("--calib", type=int, default=512, help="tokens the codebooks/bases are fitted on")
    methods_help = f"comma-separated subset of {list(METHODS)}".replace("%", "%%")  # argparse formats help with %
    ap.add_argument("--methods", default=",".join(METHODS), help=methods_help)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    names = a.methods.split(",")
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise SystemExit(f"unknown methods {bad}; choose from {list(METHODS)}")
    for path in a.captures:
        res = evaluate(path, a.cut, a.tail, a.calib, names)
        print(
            "| method | bytes/elem | x vs fp16 | bytes/elem w/o fitted state | attn err mean | max | keys only "
            "| values only |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for n in names:
            r = res[n]
            bpe = r["bytes"] / r["elems"]
            bpe_data = (r["bytes"] - r["state"]) / r["elems"]
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            print(
                f"| {n} | {bpe:.4f} | {2 / bpe:.2f} | {bpe_data:.4f} | {mean(r['err']):.4f} | {max(r['err']):.4f} | "
                f"{mean(r['kerr']):.4f} | {mean(r['verr']):.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
