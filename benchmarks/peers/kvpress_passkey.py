"""NVIDIA kvpress on the very same passkey trials, for a side-by-side with `hf-kvcache passkey`.

kvpress pins transformers < 5.3, so this script runs in its own virtual environment and imports nothing from
hf_kvcache (the trials come as token ids in a JSON file):

    python -m venv /tmp/kvpress-venv && /tmp/kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5
    hf-kvcache passkey --dump-trials /tmp/passkey_trials.json --context 1024 --trials 20
    MODEL=$(python -c "from hf_kvcache.eval.assets import model_dir; print(model_dir('smollm2-135m'))")
    /tmp/kvpress-venv/bin/python benchmarks/peers/kvpress_passkey.py /tmp/passkey_trials.json --model $MODEL \\
        --presses none streaming_llm observed_attention snapkv --compression-ratio 0.8 --mode question

Same protocols as `hf_kvcache.eval.suites.passkey` (`--mode`):
* agnostic: the context is prefilled in one forward inside the press (kvpress compresses during prefill only), then
  the question is fed and the answer decoded greedily;
* question: context + question are prefilled in one forward inside the press (kvpress has no question-aware switch;
  compressing the prompt that ends with the question is how it is made question-aware: its SnapKV window, 64 tokens,
  then holds the question; TOVA scores by the last question token), the first answer token comes from that
  forward's logits, the rest are decoded over the compressed cache.
The question and answer tokens get their true positions (kvpress's cache length no longer counts the evicted tokens).
Budgets as ours: `--compression-ratio r` keeps f = 1 - r of the context, ceil(f x context tokens) -- plus, in the
question mode, the question's tokens, i.e. the press gets the ratio that keeps ceil(f x context) + question tokens of
context + question (which of them it keeps is its own choice: kvpress protects no question token, except SnapKV's
window and TOVA's last token). Each result records `held`, the tokens layer 0 holds when the answer starts, and the
trial's `length` when the trials file has one (`hf_kvcache.eval.needle.dump_grid_trials`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import sys
import time

import torch


def make_press(name: str, ratio: float):
    import kvpress

    presses = {
        "none": None,
        "streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
        "observed_attention": lambda: kvpress.ObservedAttentionPress(compression_ratio=ratio),
        "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio),
        "knorm": lambda: kvpress.KnormPress(compression_ratio=ratio),
        "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
        "expected_attention": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
        # context reconstruction (kvpress's defaults: budgets ranked across layers, 2048-token replay chunks)
        "kvzip": lambda: kvpress.KVzipPress(compression_ratio=ratio),
    }
    if name not in presses:
        raise SystemExit(f"unknown press {name!r}; choose from {sorted(presses)}")
    return presses[name]() if presses[name] else None


def press_ratio(keep_fraction: float, context: int, question: int, mode: str) -> float:
    """The compression_ratio under which a press over `context` (+ `question`, mode "question") tokens keeps
    ceil(keep_fraction x context) (+ question) of them (kvpress keeps int(tokens x (1 - ratio)))."""
    keep = math.ceil(keep_fraction * context - 1e-9) + (question if mode == "question" else 0)
    total = context + (question if mode == "question" else 0)
    return 1.0 - (keep + 0.5) / total


@torch.inference_mode()
def answer_with_press(model, tokenizer, name: str, keep_fraction: float, context_ids: list[int],
                      question_ids: list[int], new_tokens: int, eager: bool, mode: str = "agnostic") -> dict:
    """The greedy answer under press `name` keeping `keep_fraction` of the context (see the module docstring for
    `mode`): `{"answer", "held"}` (the tokens layer 0 holds when the answer starts) and `bytes` / `fp16_bytes`, what
    every key and value tensor of the cache holds then and its fp16 equivalent."""
    from transformers import DynamicCache

    cache = DynamicCache()
    n, q = len(context_ids), len(question_ids)
    press = make_press(name, press_ratio(keep_fraction, n, q, mode))
    prompt = context_ids + (question_ids if mode == "question" else [])
    with press(model) if press is not None else contextlib.nullcontext():
        logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True,
                       output_attentions=eager).logits
    held = int(cache.layers[0].keys.shape[2])
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    nbytes, fp16_bytes = sum(t.nbytes for t in tensors), sum(2 * t.numel() for t in tensors)
    pos = len(prompt)
    ids = torch.tensor([question_ids])
    answer = []
    for step in range(new_tokens):
        if mode == "agnostic" or step > 0:
            position_ids = torch.arange(pos, pos + ids.shape[1])[None]
            logits = model(input_ids=ids, past_key_values=cache, position_ids=position_ids, use_cache=True).logits
            pos += ids.shape[1]
        nxt = int(logits[0, -1].argmax())
        answer.append(nxt)
        if nxt == tokenizer.eos_token_id:
            break
        ids = torch.tensor([[nxt]])
    return {"answer": tokenizer.decode(answer, skip_special_tokens=True), "held": held, "bytes": nbytes,
            "fp16_bytes": fp16_bytes}


def run_trial(model, tokenizer, name: str, keep_fraction: float, trial: dict, new_tokens: int, eager: bool,
              mode: str = "agnostic") -> dict:
    a = answer_with_press(model, tokenizer, name, keep_fraction, trial["context_ids"], trial["question_ids"],
                          new_tokens, eager, mode)
    text = a["answer"]
    m = re.search(r"\d+", text)
    out = {"depth": trial["depth"], "key": trial["key"], "answer": text, "correct": bool(m and m.group(0) == trial["key"]),
           "held": a["held"]}
    return out | ({"length": trial["length"]} if "length" in trial else {})


def _command() -> str:
    """This run's command line, kept in every row it writes (`OMP_NUM_THREADS` first when set)."""
    threads = os.environ.get("OMP_NUM_THREADS")
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(["python", *sys.argv])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trials")
    ap.add_argument("--model", required=True, help="the local model folder (hf_kvcache.eval.assets.model_dir)")
    ap.add_argument("--presses", nargs="+", default=["none", "streaming_llm", "observed_attention", "snapkv"])
    ap.add_argument("--compression-ratio", type=float, default=0.8, help="fraction removed (0.8 keeps 20 %%)")
    ap.add_argument("--mode", choices=["agnostic", "question"], default="agnostic",
                    help="agnostic: the context compressed before the question; question: context + question")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    with open(args.trials) as f:
        trials = json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    print(f"kvpress {kvpress.__version__ if hasattr(kvpress, '__version__') else '?'}, transformers "
          f"{transformers.__version__}, torch {torch.__version__}; {len(trials)} trials, "
          f"compression_ratio={args.compression_ratio} (keeps {100 * (1 - args.compression_ratio):.0f} % of the context), "
          f"mode={args.mode}")
    depths = sorted({t["depth"] for t in trials})
    rows = []
    for name in args.presses:
        eager = name == "observed_attention"
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=torch.float32, attn_implementation="eager" if eager else "sdpa"
        ).eval()
        t0 = time.perf_counter()
        keep = 1.0 - args.compression_ratio
        results = [run_trial(model, tokenizer, name, keep, t, args.new_tokens, eager, args.mode) for t in trials]
        acc = {f"{d:g}": sum(r["correct"] for r in results if r["depth"] == d) / max(1, sum(r["depth"] == d for r in results))
               for d in depths}
        rows.append({"press": name, "mode": args.mode, "compression_ratio": args.compression_ratio, "accuracy": acc, "mean": sum(r["correct"] for r in results) / len(results),
                     "trials": len(results), "seconds": time.perf_counter() - t0, "results": results,
                     "command": _command()})
        print(f"{name}: " + "  ".join(f"depth {d}: {100 * a:.0f}%" for d, a in acc.items())
              + f"  mean {100 * rows[-1]['mean']:.1f}%  ({rows[-1]['seconds']:.0f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
