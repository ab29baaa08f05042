"""The lm-eval model `hf-kvcache` (hf_kvcache.eval.lm_eval) on the offline tasks of eval/tasks.

Contexts are capped with `max_length=96` (for both `hf` and `hf-kvcache`): the rolling task then scores several
windows per document, the cloze contexts are cut from the left, and the whole file stays cheap on 2 CPU cores.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval model needs lm-eval: pip install -e '.[eval]'")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hf_kvcache.eval import lm_eval as kv_lm_eval  # noqa: E402
from hf_kvcache.eval.lm_eval import TASKS_DIR, HFKVCacheLM, parse_cache_config  # noqa: E402

PPL, CLOZE = "kvcache_pydoc_ppl", "kvcache_moby_cloze"
LIMITS = {PPL: 1, CLOZE: 2}
MAX_LENGTH = 96
KIVI2 = {"bits": 2, "residual_length": 16}


@pytest.fixture(scope="module")
def task_manager() -> TaskManager:
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


def evaluate(lm, task_manager: TaskManager, task: str, limit: int | None = None) -> tuple[dict, list[float]]:
    """(aggregated metrics, every loglikelihood lm-eval asked for, doc by doc and choice by choice)."""
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=task_manager, limit=limit or LIMITS[task], log_samples=True,
        bootstrap_iters=0,
    )
    lls: list[float] = []
    for sample in out["samples"][task]:
        for resp in sample["filtered_resps"]:
            lls.append(float(resp[0]) if isinstance(resp, (list, tuple)) else float(resp))
    return out["results"][task], lls


def make_lm(smol, cls=HFKVCacheLM, **kwargs):
    model, tokenizer = smol
    # a copy of the tokenizer: HFLM may set its pad token, and the session's tokenizer is shared with other tests
    return cls(pretrained=model, tokenizer=copy.deepcopy(tokenizer), batch_size=1, max_length=MAX_LENGTH, **kwargs)


@pytest.fixture(scope="module")
def hf_results(smol, task_manager) -> dict[str, tuple[dict, list[float]]]:
    """lm-eval's own `hf` model: the reference (one plain forward pass per request)."""
    lm = make_lm(smol, cls=HFLM)
    return {task: evaluate(lm, task_manager, task) for task in (PPL, CLOZE)}


@pytest.fixture(scope="module")
def dynamic_results(smol, task_manager) -> dict[str, tuple[dict, list[float]]]:
    lm = make_lm(smol, cache="dynamic")
    return {task: evaluate(lm, task_manager, task) for task in (PPL, CLOZE)}


# ---- registration, arguments, task files (no model run) ----------------------------------------------------------
def test_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("hf-kvcache") is HFKVCacheLM


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cache": "nope"}, r"valid choices: \['dynamic', .*'kivi'"),
        ({"cache": "kivi", "cache_config": "{bits: 2}"}, "not valid JSON"),
        ({"cache": "kivi", "cache_config": "[2]"}, "JSON object"),
        ({"cache": "kivi", "cache_config": {"bitz": 2}}, "valid options"),
        ({"cache": "kivi", "cache_config": {"bits": 0}}, "bits must be"),
        ({"cache": "dynamic", "cache_config": {"bits": 2}}, "no cache_config"),
        ({"chunk": 0}, "chunk"),
        ({"share_prefix": "yes"}, "share_prefix"),
    ],
)
def test_bad_args_raise_value_error(smol, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_lm(smol, **kwargs)


def test_cache_config_from_the_command_line():
    """lm-eval's own `--model_args` parser: a whole JSON object, or key=value values with the JSON one separate."""
    import argparse

    from lm_eval._cli.utils import MergeDictAction

    parser = argparse.ArgumentParser()
    parser.add_argument("--model_args", nargs="+", action=MergeDictAction)
    forms = (
        ['{"pretrained": "smollm2-135m", "cache": "kivi", "cache_config": {"bits": 2, "residual_length": 16}}'],
        ["pretrained=smollm2-135m,cache=kivi", 'cache_config={"bits": 2, "residual_length": 16}'],
    )
    for form in forms:
        args = parser.parse_args(["--model_args", *form]).model_args
        assert args["cache"] == "kivi" and parse_cache_config(args["cache_config"]) == KIVI2
    assert parse_cache_config('{"bits": 2, "residual_length": 16}') == KIVI2
    assert parse_cache_config(None) == {} and parse_cache_config("") == {}


def test_cli_wrapper_adds_the_task_folder(monkeypatch):
    import sys

    import lm_eval.__main__

    seen: list[list[str]] = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    kv_lm_eval.main(["--model", "hf-kvcache", "--tasks", PPL])
    kv_lm_eval.main(["--model", "hf-kvcache", "--tasks", PPL, "--include_path", "/elsewhere"])
    assert seen[0][-2:] == ["--include_path", str(TASKS_DIR)]
    assert seen[1].count("--include_path") == 1 and seen[1][-1] == "/elsewhere"


def test_task_files_are_well_formed():
    for name, count in (("pydoc_ppl.jsonl", 24), ("moby_cloze.jsonl", 40)):
        rows = [json.loads(line) for line in (TASKS_DIR / name).read_text(encoding="utf-8").splitlines()]
        assert len(rows) == count
    assert all(len(r["choices"]) == 4 and 0 <= r["label"] < 4 for r in rows)
    assert len({r["label"] for r in rows}) == 4  # the answer is not always in the same place


# ---- scores -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_dynamic_cache_scores_equal_hf(hf_results, dynamic_results):
    """Streaming through DynamicCache in chunks of 32 gives `hf`'s scores (measured: at most ~1e-4 nats apart on
    loglikelihoods of -100 to -900, from float summation order; the tolerance is 2e-3)."""
    for task in (PPL, CLOZE):
        (ref_metrics, ref), (metrics, got) = hf_results[task], dynamic_results[task]
        assert len(got) == len(ref) > 0
        assert max(abs(a - b) for a, b in zip(ref, got)) < 2e-3, (task, ref, got)
    assert dynamic_results[CLOZE][0]["acc,none"] == hf_results[CLOZE][0]["acc,none"]
    assert math.isclose(
        dynamic_results[PPL][0]["word_perplexity,none"], hf_results[PPL][0]["word_perplexity,none"], rel_tol=1e-5
    )


@pytest.mark.slow
def test_two_bit_cache_scores_differently(smol, task_manager, dynamic_results):
    """KIVI 2-bit with a 16-token residual: every scored token attends to a mostly 2-bit past, so the scores move
    (and perplexity rises), unlike with `hf`, where a cache changes nothing."""
    lm = make_lm(smol, cache="kivi", cache_config=KIVI2)
    metrics, got = evaluate(lm, task_manager, PPL)
    ref_metrics, ref = dynamic_results[PPL]
    assert min(abs(a - b) for a, b in zip(ref, got)) > 0.5, (ref, got)
    assert metrics["word_perplexity,none"] > ref_metrics["word_perplexity,none"]
    _, got_cloze = evaluate(lm, task_manager, CLOZE)
    assert max(abs(a - b) for a, b in zip(dynamic_results[CLOZE][1], got_cloze)) > 0.05


@pytest.mark.slow
def test_shared_prefix_gives_the_same_scores(smol):
    """The choices of one question stream their common context once and continue from copies of the cache; the
    chunk boundaries do not move, so the scores equal scoring each choice from scratch."""
    model, tokenizer = smol
    context = tokenizer("Call me Ishmael. Some years ago, never mind how long precisely, having little or no money "
                        "in my purse, and nothing particular to interest me on shore, I thought I would sail about a "
                        "little and see the watery part of the world.", add_special_tokens=False).input_ids
    choices = [
        tokenizer(" " + c, add_special_tokens=False).input_ids for c in ("It is a way I have.", "The sea is blue.")
    ]
    requests = [(None, context, c) for c in choices]
    scores = {}
    for share in (True, False):
        lm = make_lm(smol, cache="kivi", cache_config=KIVI2, chunk=8, share_prefix=share)
        scores[share] = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    assert len(context) >= 16  # at least two whole chunks are shared
    assert scores[True] == scores[False]


@pytest.mark.slow
def test_generate_until_uses_a_fresh_cache(smol):
    lm = make_lm(smol, cache="dynamic")
    built = []
    new_cache = lm.new_cache
    lm.new_cache = lambda: built.append(new_cache()) or built[-1]
    request = Instance("generate_until", {}, ("The whale", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}), 0)
    ours = lm.generate_until([request], disable_tqdm=True)
    ref = make_lm(smol, cls=HFLM).generate_until([request], disable_tqdm=True)
    assert len(built) == 1 and built[0].get_seq_length() > 0
    assert ours == ref and ours[0].strip()


@pytest.mark.slow
def test_zoo_name_and_attention_mass_cache():
    """`pretrained` takes the zoo name; H2O (ranks tokens by attention) runs each request attached to the model (the
    hf_kvcache attention reports the mass it needs: without it the second forward raises), and the model is handed
    back with its own attention implementation afterwards."""
    lm = HFKVCacheLM(pretrained="smollm2-135m", cache="h2o", cache_config='{"budget": 0.5}', batch_size=1, chunk=8)
    assert lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")  # no device given: not hf's "cuda"
    ids = lm.tok_encode("Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.")
    ((logprob, _),) = lm._loglikelihood_tokens([(None, ids[:12], ids[12:])], disable_tqdm=True)
    assert lm.model.config._attn_implementation == "sdpa"
    assert math.isfinite(logprob) and logprob < 0


# ---- the `lm_eval` command line itself (hf_kvcache_lm_eval.pth + hf_kvcache_lm_eval_hook) ---------------------------
def _fresh_python(code: str) -> str:
    """stdout of `code` in a new interpreter of this environment (so that site-packages' .pth files run)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_lm_eval_registry_gets_a_lazy_placeholder_at_no_start_up_cost():
    """After `pip install` (regular or -e), the .pth installs the hook; importing lm-eval's registry registers
    `hf-kvcache` as a `module:class` string, importing neither torch nor this package until the model is asked for."""
    out = _fresh_python(
        "import sys\n"
        "assert 'hf_kvcache_lm_eval_hook' in sys.modules, 'no hook: reinstall with pip install -e .'\n"
        "from lm_eval.api.registry import model_registry\n"
        "print(model_registry._objs['hf-kvcache'], 'torch' in sys.modules, 'hf_kvcache' in sys.modules)\n"
        "print(model_registry.get('hf-kvcache').__module__)\n"
    )
    assert out.split() == ["hf_kvcache.eval.lm_eval:HFKVCacheLM", "False", "False", "hf_kvcache.eval.lm_eval"]


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_model(tmp_path):
    """The `lm_eval` console script (or `python -m lm_eval`, the same entry point, where lm-eval's script is not in
    this environment's bin folder) on the offline task, 2 documents, with no import of this package in the command."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "lm_eval"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lm_eval"]
    out = subprocess.run(
        [*command, "--model", "hf-kvcache", "--model_args",
         f"pretrained=smollm2-135m,cache=dynamic,max_length={MAX_LENGTH}", "--tasks", PPL, "--include_path", str(TASKS_DIR), "--limit", "2", "--device", "cpu", "--batch_size", "1",
         "--output_path", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "hf-kvcache (" in out.stdout and PPL in out.stdout
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    metrics = results["results"][PPL]
    assert results["config"]["model"] == "hf-kvcache" and results["n-samples"][PPL]["effective"] == 2
    assert 1 < metrics["byte_perplexity,none"] < metrics["word_perplexity,none"] < math.inf
