"""hf-kvcache compare --suite: the one row schema and formatter, the suites' options, bad input, small real runs."""

import json

import pytest

from hf_kvcache.kernels import native
from hf_kvcache.eval.paired import paired_time_ratio
from hf_kvcache.eval.rows import COMMON, format_rows, make_row

from hf_kvcache.cli import main


# ---- the one formatter -----------------------------------------------------------------------------------------------
def test_format_rows_one_table_per_section_with_a_front_where_rows_have_ratio_and_delta():
    rows = [
        make_row("s", "base", "m", 64, section="runs", perplexity=10.0, delta_pct=0.0, ratio=1.0, bytes=100),
        make_row("s", "small", "m", 64, section="runs", perplexity=10.5, delta_pct=5.0, ratio=4.0, bytes=25),
        make_row("s", "worse", "m", 64, section="runs", perplexity=11.0, delta_pct=10.0, ratio=2.0, bytes=50),
        make_row("s", "t0", "m", 64, section="timing", compress_ms=0.5, options={"a": 1}, results=[1, 2]),
    ]
    text = format_rows(rows)
    runs, timing = text.split("\n\n")
    assert runs.splitlines()[0] == "[runs] tokens=64"
    head, _, *lines = runs.splitlines()[1:]
    assert head.split() == ["cache", "ppl", "delta", "bytes", "held", "vs", "fp16", "Pareto"]
    marks = {line.split()[0]: line.split()[-1] == "yes" for line in lines}
    assert marks == {"base": True, "small": True, "worse": False}
    assert "+5.00%" in lines[1] and "4.00x" in lines[1]
    # no ratio in the timing rows: no Pareto column; lists / dicts and the common keys said above stay out
    assert timing.splitlines()[1].split() == ["cache", "compress", "ms/block"]
    assert "Pareto" not in timing and "options" not in timing and "suite" not in text and "0.500" in timing


def test_format_rows_shows_tokens_when_they_vary_and_a_dash_where_a_row_lacks_a_column():
    rows = [make_row("kernels", "fused", "m", 128, ms=1.0), make_row("kernels", "fused", "m", 256, ms=2.0, batch=4)]
    lines = format_rows(rows).splitlines()
    assert lines[0].split() == ["cache", "batch", "tokens", "ms"]
    assert lines[2].split() == ["fused", "-", "128", "1.000"] and lines[3].split() == ["fused", "4", "256", "2.000"]


def test_every_row_has_the_common_keys_first():
    assert list(make_row("passkey", "dynamic", "m", 8, accuracy=1.0)) == [*COMMON, "accuracy"]


# ---- options and bad input -------------------------------------------------------------------------------------------
def test_presets_are_valid_specs_with_distinct_labels():
    from hf_kvcache.eval.compare import parse_specs
    from hf_kvcache.eval.suites.perplexity import PRESETS

    for name, texts in PRESETS.items():
        specs = parse_specs(texts) if texts else []
        assert [s.label for s in specs][:2] == (["dynamic", "tiered"] if texts else []), name


@pytest.mark.parametrize("argv, message", [
    (["--suite", "perplexity", "--tokens", "64", "128", "--caches", "dynamic"], "takes one --tokens value"),
    (["--suite", "kernels", "--png", "k.png"], "--suite kernels has neither"),
    (["--suite", "cpac", "--sections", "speed"], "unknown cpac section(s) ['speed']"),
    (["--suite", "perplexity"], "give at least one cache"),
    (["--suite", "decode", "--decode-steps", "0", "--caches", "dynamic"], "times at least one step"),
    (["--suite", "append", "--tokens", "0"], "cached lengths >= 1"),
    (["--suite", "long", "--caches", "tiered", "--tokens", "128"], "add it to --caches"),
    (["--suite", "long", "--tokens", "100", "--chunk", "64"], "multiple of --chunk 64"),
    (["--suite", "ruler", "--trials", "3", "--loop", "plain"],
     "--suite ruler takes no --loop (options of perplexity, peers, ablations, long, long-perplexity); --trials "
     "(options of passkey, needle)"),
])
def test_bad_suite_input_is_a_clear_error_before_any_run(capsys, argv, message):
    assert main(["compare", *argv]) == 2
    assert message in capsys.readouterr().err


def test_every_suite_flag_is_generated_from_its_options_dataclass():
    import dataclasses

    from hf_kvcache.cli import build_parser
    from hf_kvcache.eval.suites import SUITES, options_class, suite_options
    from hf_kvcache.eval.suites.options import own_fields
    from hf_kvcache.eval.suites.ruler import RulerOptions

    parser = build_parser()
    compare = parser._subparsers._group_actions[0].choices["compare"]
    flags = {a.dest: a for a in compare._actions}
    for suite in SUITES:
        cls = options_class(suite)
        for f in own_fields(cls):
            assert f.name in flags and flags[f.name].help, (suite, f.name)
    args = parser.parse_args(["compare", "--suite", "ruler", "--tasks", "vt", "--task-samples", "3", "--resume",
                              "--seed", "1"])
    from hf_kvcache.eval.compare import options_of

    opts = options_of(args)
    assert type(opts) is RulerOptions
    assert (opts.tasks, opts.task_samples, opts.resume, opts.seed, opts.mode) == (["vt"], 3, True, 1, "agnostic")
    assert dataclasses.asdict(suite_options("ruler")) == dataclasses.asdict(RulerOptions(suite="ruler"))
    with pytest.raises(ValueError, match="--suite kernels takes no --tasks"):
        suite_options("kernels", tasks=["vt"])


def test_from_json_rejects_what_compare_did_not_write(capsys, tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"pressure": []}))
    assert main(["compare", "--from-json", str(path)]) == 2
    assert "holds no rows" in capsys.readouterr().err


# ---- small real runs -------------------------------------------------------------------------------------------------
def test_long_suite_one_stream_per_cache_rows_as_they_come_and_a_rerun_measures_nothing(capsys, tmp_path):
    path = tmp_path / "long.json"
    argv = ["compare", "--suite", "long", "--tokens", "128", "256", "--chunk", "64", "--loop", "plain",
            "--caches", "dynamic", "tiered_long", "--json", str(path)]
    assert main(argv) == 0
    rows = json.loads(path.read_text())
    assert [(r["cache"], r["tokens"]) for r in rows] == [("dynamic", 128), ("tiered_long", 128), ("dynamic", 256),
                                                          ("tiered_long", 256)]
    assert all(r["loop"] == "plain" and len(r["chunk_nll"]) == r["tokens"] // 64 for r in rows)
    assert rows[0]["delta_pct"] == 0 and rows[3]["low_pct"] <= rows[3]["delta_pct"] <= rows[3]["high_pct"]
    assert rows[3]["ratio"] > rows[1]["ratio"] > 1  # the tiers fill as the stream grows
    capsys.readouterr()
    assert main(argv) == 0  # every row is in the file: nothing is streamed again
    assert " .. " not in capsys.readouterr().out and json.loads(path.read_text()) == rows
    # a rerun asking for fewer caches measures nothing and keeps the rows it did not ask for, commands and all
    assert main(argv[:-3] + ["--json", str(path)]) == 0
    assert " .. " not in capsys.readouterr().out
    assert sorted(map(json.dumps, json.loads(path.read_text()))) == sorted(map(json.dumps, rows))
    assert main(["compare", "--from-json", str(path)]) == 0
    assert "tiered_long" in capsys.readouterr().out


def test_perplexity_suite_loads_the_model_in_the_dtype_asked(tmp_path):
    """`--model-dtype bfloat16`: the caches hold bf16 keys / values (the full cache's bytes are the fp16 size), the
    rows say the dtype, and the perplexity stays close to the float32 model's."""
    rows = {}
    for dtype in ("float32", "bfloat16"):
        path = tmp_path / f"{dtype}.json"
        assert main(["compare", "--suite", "perplexity", "--tokens", "128", "--decode-steps", "0", "--caches",
                     "dynamic", "int8", "--model-dtype", dtype, "--json", str(path)]) == 0
        rows[dtype] = json.loads(path.read_text())
    f32, bf16 = rows["float32"], rows["bfloat16"]
    assert "model_dtype" not in f32[0] and [r["model_dtype"] for r in bf16] == ["bfloat16", "bfloat16"]
    assert bf16[0]["bytes"] == f32[0]["bytes"] // 2 and bf16[0]["ratio"] == 1.0
    # measured 91.02 in bfloat16 against 89.61 in float32 (+1.6 %) over these 128 tokens of SmolLM2
    assert bf16[0]["perplexity"] == pytest.approx(f32[0]["perplexity"], rel=0.02)


def test_append_suite_rows_and_json_round_trip(capsys, tmp_path):
    """No model: random keys into a tiered and a uniform cache; only tiered layers report the storing part."""
    path = tmp_path / "append.json"
    assert main(["compare", "--suite", "append", "--tokens", "64", "160", "--decode-steps", "2",
                 "--caches", "tiered", "int4", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(r["suite"], r["cache"], r["tokens"]) for r in rows] == [
        ("append", "tiered", 64), ("append", "tiered", 160), ("append", "int4", 64), ("append", "int4", 160)]
    for r in rows:
        assert 0 < r["update_ms"] <= r["update_worst_ms"]
        assert ("store_ms" in r) == (r["cache"] == "tiered")
    out = capsys.readouterr().out
    assert main(["compare", "--from-json", str(path)]) == 0
    assert capsys.readouterr().out.strip() in out


def test_kernels_suite_on_the_cpu(capsys, tmp_path):
    path = tmp_path / "kernels.json"
    assert main(["compare", "--suite", "kernels", "--device", "cpu", "--tokens", "64", "--batch", "1", "--iters",
                 "1", "--kv-heads", "2", "--head-dim", "64", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["cache"] for r in rows] == ["fused", "sdpa fp32", "dequantize + sdpa"]
    assert all(r["tokens"] == 64 and r["batch"] == 1 and r["ms"] > 0 and r["gb_per_s"] > 0 for r in rows)
    assert rows[1]["vs_sdpa"] == 1.0 and rows[0]["vs_sdpa"] == pytest.approx(rows[1]["ms"] / rows[0]["ms"])


@pytest.mark.slow
def test_passkey_suite_runs_each_budget_of_a_budget_taking_cache(capsys, tmp_path):
    path = tmp_path / "passkey.json"
    assert main(["compare", "--suite", "passkey", "--tokens", "160", "--depths", "1", "--trials", "1",
                 "--caches", "dynamic", "h2o", "--budgets", "0.5", "64", "--json",
                 str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["cache"] for r in rows] == ["dynamic", "h2o budget=0.5", "h2o budget=64"]
    for r in rows:
        assert r["tokens"] == 160 and r["trials"] == 1 and r["accuracy"] == r["depth 1"]
        assert r["accuracy"] == float(r["results"][0]["correct"])
    assert main(["compare", "--suite", "passkey", "--tokens", "160", "--caches", "dynamic", "int4",
                 "--budgets", "0.5"]) == 2
    assert "none of --caches is one" in capsys.readouterr().err


@pytest.mark.slow
def test_decode_suite_runs_a_fused_cache_both_ways(capsys, tmp_path):
    path = tmp_path / "decode.json"
    assert main(["compare", "--suite", "decode", "--tokens", "96", "--decode-steps", "2", "--chunk", "32",
                 "--caches", "dynamic", "tiered", 'tova=h2o:{"budget":0.5,"policy":"tova"}', "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    # where the compiled CPU kernel is available the fused attention also runs through its torch path
    torch_path = ["tiered, fused, torch path"] if native.available()[0] else []
    # an evicting cache runs once, under the attention that reports what it ranks tokens by
    assert [r["cache"] for r in rows] == ["dynamic", "tiered, dequantize + SDPA", "tiered, fused (hf_kvcache)",
                                          *torch_path, "tova"]
    assert all(r["decode_tokens_per_s"] > 0 and r["step_peak_mb"] >= 0 and r["cache_mb"] > 0 for r in rows)
    assert all(r["prefill_tokens_per_s"] > 0 for r in rows) and rows[0]["prefill_vs_first"] == 1.0
    assert rows[0]["vs_first"] == 1.0 and "vs_dequantize" not in rows[1] and "vs_dequantize" not in rows[-1]
    # two steps are one round of turns: each round's time is kept, and one round gives no interval
    assert all(len(r["round_seconds"]) == 1 and "vs_first_low" not in r for r in rows)
    assert all(r["first_round_s"] == r["round_seconds"][0] and "steady_vs_first" not in r for r in rows)
    for fused in rows[2:-1]:
        assert fused["vs_dequantize"] == pytest.approx(fused["decode_tokens_per_s"] / rows[1]["decode_tokens_per_s"])


@pytest.mark.slow
def test_decode_suite_reads_the_rounds_after_the_first_apart(tmp_path):
    """From three rounds of 8 steps a row has its speed over the rounds after the first (where a calibrating cache
    has calibrated), paired with the first variant's same rounds."""
    path = tmp_path / "decode.json"
    assert main(["compare", "--suite", "decode", "--tokens", "64", "--decode-steps", "24", "--chunk", "32",
                 "--caches", "dynamic", "int8", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    base = rows[0]["round_seconds"]
    assert all(len(r["round_seconds"]) == 3 for r in rows)
    assert rows[0]["steady_vs_first"] == 1.0
    for r in rows:
        assert r["first_round_s"] == r["round_seconds"][0]
        expect = paired_time_ratio(base[1:], r["round_seconds"][1:])
        assert (r["steady_vs_first"], r["steady_vs_first_low"], r["steady_vs_first_high"]) == expect


@pytest.mark.slow
def test_shared_prefix_suite_shares_the_prompt_pages_and_no_sample_changes(tmp_path):
    path = tmp_path / "shared.json"
    assert main(["compare", "--suite", "shared-prefix", "--start", "0", "--tokens", "192", "--samples", "3",
                 "--decode-steps", "4", "--caches", 'unshared=paged_quant:{"share": false}',
                 'shared=paged_quant:{"share": true}', "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [r["cache"] for r in rows] == ["unshared", "shared"]
    unshared, shared = rows
    # 192 prompt tokens = 3 pages of 64 in 30 layers, per row: 270 entries, 90 distinct pages when shared
    assert unshared["pages"] == unshared["page_refs"] == shared["page_refs"] == 270 and shared["pages"] == 90
    assert shared["vs_first"] < 0.4 and shared["samples_sha"] == unshared["samples_sha"]  # measured 0.37
    assert shared["ratio"] == pytest.approx(shared["fp16_bytes"] / shared["bytes"])


@pytest.mark.slow
def test_needle_suite_one_row_per_cell_and_a_heatmap_per_cache(tmp_path):
    path = tmp_path / "needle.json"
    assert main(["compare", "--suite", "needle", "--tokens", "256", "512", "--depths", "0.1", "0.9", "--trials", "1",
                 "--caches", "dynamic", "h2o", "--budgets", "0.5", "--mode", "question", "--heatmaps",
                 str(tmp_path), "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(r["cache"], r["tokens"], r["depth"]) for r in rows] == [
        (c, n, d) for c in ("dynamic", "h2o budget=0.5") for n in (256, 512) for d in (0.1, 0.9)]
    assert all(r["mode"] == "question" and r["trials"] == 1 and len(r["results"]) == 1 for r in rows)
    held = {(r["cache"], r["tokens"]): r["held"] for r in rows}
    assert held["h2o budget=0.5", 512] < 0.6 * held["dynamic", 512]  # evicted to half the context before answering
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["dynamic_question.png", "h2o_budget_0.5_question.png"]


def test_calibration_suite_reports_each_layers_recipe_and_refuses_caches_without_recipes(capsys, tmp_path, moby_text):
    path = tmp_path / "recipes.json"
    assert main(["compare", "--suite", "calibration", "--tokens", "640", "--chunk", "128", "--caches", "tiered",
                 "--json", str(path)]) == 0
    (row,) = json.loads(path.read_text())
    assert row["cache"] == "tiered" and row["perplexity"] > 1 and row["ratio"] > 0
    chosen = [r for r in row["recipes"] if r is not None]
    assert len(row["recipes"]) == 30 and chosen  # SmolLM2-135M's layers
    assert all(r["rotation"] in ("none", "keys", "values", "both") and r["errors"] for r in chosen)
    assert "layer  0:" in capsys.readouterr().out
    assert main(["compare", "--suite", "calibration", "--tokens", "96", "--caches", "int8"]) == 2
    assert "keeps none: pass tiered caches" in capsys.readouterr().err


def test_prefill_memory_and_reconstruct_cost_measure_each_row_in_a_fresh_process(tmp_path, moby_text):
    """Each row in its own spawned process: a peak above the loaded model (never below it, by construction), and the
    bytes the cache holds."""
    path = tmp_path / "memory.json"
    assert main(["compare", "--suite", "prefill-memory", "--tokens", "96", "--new-tokens", "2", "--caches", "dynamic",
                 "int8", "--json", str(path)]) == 0
    dynamic, int8 = json.loads(path.read_text())
    assert (dynamic["cache"], int8["cache"]) == ("dynamic", "int8") and int8["new_tokens"] == 2
    assert dynamic["peak_added_bytes"] > 0 and dynamic["cache_bytes"] is None and int8["cache_bytes"] > 0
    assert int8["vs_dynamic"] == int8["peak_added_bytes"] / dynamic["peak_added_bytes"]
    path = tmp_path / "cost.json"
    spec = 'span=h2o:{"budget": 0.5, "policy": {"name": "reconstruct", "chunk": 32, "scope": "span"}}'
    assert main(["compare", "--suite", "reconstruct-cost", "--tokens", "96", "--chunk", "48", "--variants", "plain",
                 "reconstruct", "--caches", spec, "int8", 'la=h2o:{"budget": 0.25, "policy": "snapkv", "lookahead": 2}',
                 "--json", str(path)]) == 0
    plain, scored, span, int8, draft = json.loads(path.read_text())
    assert [r["cache"] for r in (plain, scored, span, int8, draft)] == ["plain", "reconstruct", "span", "int8", "la"]
    assert scored["peak_mib"] > 0 and "score_seconds" not in plain and "score_seconds" not in int8
    for row in (scored, span, draft):
        assert row["seconds"] >= row["prefill_seconds"] > 0 and row["score_seconds"] > 0


def test_adapt_suite_adapts_after_every_window_and_writes_its_folder(tmp_path, capsys, moby_text):
    out = tmp_path / "adapt"
    out.mkdir()
    path = tmp_path / "rows.json"
    assert main(["compare", "--suite", "adapt", "--tokens", "64", "--chunk", "32", "--steps", "2", "--windows", "2",
                 "--starts", "16:2", "--out", str(out), "--json", str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(r["cache"], r["sample"], r["window"]) for r in rows] == [("start 16:2", 1, 0), ("start 16:2", 2, 1)]
    assert rows[1]["tail_length"] == rows[0]["next_tail_length"]  # each sample runs with what the last one adapted
    assert all(r["ppl"] > 1 and r["ref_ppl"] > 1 and r["verdict"] for r in rows)
    assert {p.name for p in out.iterdir()} == {"convergence.csv", "convergence.png", "summary.json"}
    assert main(["compare", "--suite", "adapt", "--starts", "16"]) == 2
    assert "write TAIL:BITS" in capsys.readouterr().err


def test_from_json_plots_long_context_rows_at_the_length_asked(tmp_path, capsys):
    rows = "docs/rows/long_ppl_gemma3-270m.json"  # 8192 and 16384 tokens
    png = tmp_path / "front.png"
    assert main(["compare", "--from-json", rows, "--png", str(png)]) == 2
    assert "hold lengths [8192, 16384]: pick one with --tokens N" in capsys.readouterr().err
    assert main(["compare", "--from-json", rows, "--tokens", "16384", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0 and "tiered [attached = plain]" in out and "tiered [unserved]" in out
