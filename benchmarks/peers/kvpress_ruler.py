"""NVIDIA kvpress presses on the very samples of `hf-kvcache compare --suite ruler`, scored and paired as ours are.

Three steps, the middle one in kvpress's own environment (it pins transformers < 5.3; see README.md here):

    # 1. main environment: the samples of a run as token ids
    python benchmarks/peers/kvpress_ruler.py dump --model qwen2.5-coder-0.5b --tokens 4096 --task-samples 1 \\
        --out /tmp/ruler_qwen2.5-coder-0.5b_4096.json
    # 2. kvpress environment: every press at every kept fraction, the answers (written after each one)
    OMP_NUM_THREADS=1 /tmp/kvpress-env/bin/python benchmarks/peers/kvpress_ruler.py run \\
        /tmp/ruler_qwen2.5-coder-0.5b_4096.json --model-dir $MODEL --presses snapkv tova --keep 0.5 0.25 \\
        --mode agnostic --json /tmp/kvpress_answers.json
    # 3. main environment: scored by `ruler_tasks.score`, added as sample rows to our rows of the same samples
    #    (answers to samples the file has no full-cache row for are left out, and counted)
    python benchmarks/peers/kvpress_ruler.py score /tmp/kvpress_answers.json \\
        --samples /tmp/ruler_qwen2.5-coder-0.5b_4096.json --into docs/rows/ruler_qwen2.5-coder-0.5b_4096_agnostic.json
    hf-kvcache compare --from-json docs/rows/ruler_qwen2.5-coder-0.5b_4096_agnostic.json

Step 2 runs `kvpress_passkey.answer_with_press` (same protocols: "agnostic" compresses the context before the
question, "question" compresses context + question). A press row is labelled `kvpress-<press> keep=<f>` and pairs
with our full cache (`dynamic`) on the same (model, tokens, mode, seed, task, sample); `bytes` are the key / value
tensors the press's cache holds when the answer starts. Only step 2 imports kvpress, and it imports nothing of
hf_kvcache.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def dump(args: argparse.Namespace) -> None:
    from hf_kvcache.eval.assets import load_model, load_plays, load_text
    from hf_kvcache.eval.ruler_tasks import TASKS, TaskGenerator

    _, tokenizer = load_model(args.model)
    tasks = args.tasks or list(TASKS)
    gen = TaskGenerator(tokenizer, load_text(args.text), load_plays() if "qa_speaker" in tasks else None)
    samples = [dict(task=s.task, sample=s.index, context_ids=s.context_ids, question_ids=s.question_ids,
                    expected=s.expected, depths=[round(d, 4) for d in s.depths], new_tokens=s.new_tokens)
               for task in tasks for s in gen.samples(task, args.tokens, args.task_samples, args.seed)]
    with open(args.out, "w") as f:
        json.dump({"model": args.model, "tokens": args.tokens, "seed": args.seed, "samples": samples}, f)
    print(f"{len(samples)} samples of {args.model} at {args.tokens} tokens -> {args.out}")


def run(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from kvpress_passkey import _command, answer_with_press
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    with open(args.samples) as f:
        data = json.load(f)
    done = []
    if os.path.exists(args.json):
        with open(args.json) as f:
            done = json.load(f)
    key = lambda r: (r["press"], r["keep"], r["task"], r["sample"])  # noqa: E731
    have = {key(r) for r in done}
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    models = {}
    for s in data["samples"]:
        for press in args.presses:
            eager = press == "observed_attention"
            if eager not in models:
                models[eager] = AutoModelForCausalLM.from_pretrained(
                    args.model_dir, dtype=torch.float32, attn_implementation="eager" if eager else "sdpa").eval()
            for keep in args.keep:
                row = dict(press=press, keep=keep, task=s["task"], sample=s["sample"])
                if key(row) in have:
                    continue
                t0 = time.perf_counter()
                a = answer_with_press(models[eager], tokenizer, press, keep, s["context_ids"], s["question_ids"],
                                      s["new_tokens"], eager, args.mode)
                done.append(row | a | dict(mode=args.mode, seconds=time.perf_counter() - t0, model=data["model"],
                                           tokens=data["tokens"], seed=data["seed"], command=_command(),
                                           versions=f"transformers {transformers.__version__}, torch "
                                                    f"{torch.__version__}"))
                with open(args.json + ".tmp", "w") as f:
                    json.dump(done, f, indent=1)
                os.replace(args.json + ".tmp", args.json)
                print(f"  .. {s['task']} #{s['sample']} {press} keep={keep}: {a['answer'][:60]!r} "
                      f"({done[-1]['seconds']:.1f} s)", flush=True)


def score_into(args: argparse.Namespace) -> None:
    from hf_kvcache.eval.rows import make_row, write_json
    from hf_kvcache.eval.ruler_tasks import score
    from hf_kvcache.eval.suites.ruler import SAMPLE_KEYS, sample_rows_of

    with open(args.answers) as f:
        answers = json.load(f)
    with open(args.samples) as f:
        expected = {(s["task"], s["sample"]): s for s in json.load(f)["samples"]}
    with open(args.into) as f:
        rows = sample_rows_of(json.load(f))
    have = {tuple(r.get(k) for k in SAMPLE_KEYS) for r in rows}
    paired = {(r["model"], r["tokens"], r["mode"], r["task"], r["sample"], r.get("seed")): r for r in rows
              if r["cache"] == "dynamic"}
    for r in paired.values():  # the dumped samples must be the ones our rows answered
        s = expected.get((r["task"], r["sample"]))
        if s is not None and (s["expected"], s["depths"]) != (r["expected"], r["depths"]):
            raise SystemExit(f"{args.samples} is not the samples of {args.into}: {r['task']} #{r['sample']} expects "
                             f"{s['expected']} there, {r['expected']} in the rows; dump with the rows' model, tokens "
                             "and seed")
    added = unpaired = 0
    for a in answers:
        if (a["model"], a["tokens"], a["mode"], a["task"], a["sample"], a["seed"]) not in paired:
            unpaired += 1  # no full-cache row of ours on this sample: nothing to compare it with
            continue
        s = expected[a["task"], a["sample"]]
        row = make_row("ruler", f"kvpress-{a['press']} keep={a['keep']:g}", a["model"], a["tokens"], mode=a["mode"],
                       task=a["task"], sample=a["sample"], seed=a["seed"], score=score(s["expected"], a["answer"]),
                       answer=a["answer"], expected=s["expected"], depths=s["depths"], held=a["held"],
                       bytes=a["bytes"], fp16_bytes=a["fp16_bytes"], seconds=a["seconds"], peer=a["versions"],
                       peer_command=a["command"])
        if tuple(row.get(k) for k in SAMPLE_KEYS) not in have:
            rows.append(row)
            added += 1
    write_json(args.into, rows)
    print(f"{added} kvpress rows added to {args.into}" + (f"; {unpaired} left out: the file has no full-cache row "
                                                           "of their sample" if unpaired else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    d = sub.add_parser("dump", help="main environment: the samples as token ids")
    d.add_argument("--model", required=True)
    d.add_argument("--tokens", type=int, required=True)
    d.add_argument("--task-samples", type=int, default=1)
    d.add_argument("--tasks", nargs="+", default=None)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--text", default="moby-dick")
    d.add_argument("--out", required=True)
    r = sub.add_parser("run", help="kvpress environment: the presses' answers")
    r.add_argument("samples")
    r.add_argument("--model-dir", required=True, help="the local model folder (hf_kvcache.eval.assets.model_dir)")
    r.add_argument("--presses", nargs="+", default=["snapkv", "tova", "expected_attention", "knorm"])
    r.add_argument("--keep", nargs="+", type=float, default=[0.5, 0.25], help="fractions of the context kept")
    r.add_argument("--mode", choices=["agnostic", "question"], default="agnostic")
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--json", required=True, help="the answers (rewritten after each; a rerun keeps those present)")
    s = sub.add_parser("score", help="main environment: scored sample rows added to a ruler rows file")
    s.add_argument("answers")
    s.add_argument("--samples", required=True, help="the file of step 1")
    s.add_argument("--into", required=True, help="a rows file of `compare --suite ruler` on the same samples")
    args = ap.parse_args()
    {"dump": dump, "run": run, "score": score_into}[args.step](args)


if __name__ == "__main__":
    main()
