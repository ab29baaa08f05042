"""The RULER-style suite: the task generator (seeded, sized in tokens, answers derivable from the context), its paired
scoring, and one run of `compare --suite ruler` on a tiny random model."""

import json
import math
import re
from collections import Counter

import pytest
import torch

from hf_kvcache.cli import main
from hf_kvcache.eval.paired import paired_difference
from hf_kvcache.eval.suites.ruler import SampleLog, markdown_tables, pareto_points, summary_rows
from hf_kvcache.eval.ruler_tasks import (HAYSTACK_TASKS, LONG_ANSWER_TASKS, NEEDLE, TASKS, TaskGenerator, TaskOptions,
                                         parse_speeches, score, spread_depth)

TOKENS = 1024


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from hf_kvcache.eval.assets import model_dir

    return AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def gen(tokenizer, moby_text):
    from hf_kvcache.eval.assets import load_plays

    return TaskGenerator(tokenizer, moby_text, load_plays())


@pytest.fixture(scope="module")
def samples(gen):
    return {task: gen.samples(task, TOKENS, 3, seed=5) for task in TASKS}


# ---- the generator ---------------------------------------------------------------------------------------------------
def test_samples_come_from_the_seed_and_more_samples_keep_the_first_ones(gen, samples):
    for task in ("niah_multikey", "vt", "fwe", "qa_speaker"):
        again = gen.samples(task, TOKENS, 2, seed=5)
        assert [s.context_ids for s in again] == [s.context_ids for s in samples[task][:2]]
        assert [s.expected for s in again] == [s.expected for s in samples[task][:2]]
        assert gen.samples(task, TOKENS, 1, seed=6)[0].context_ids != again[0].context_ids
        assert samples[task][0].context_ids != samples[task][1].context_ids


def test_prompts_are_sized_in_model_tokens(gen, samples):
    for task, group in samples.items():
        for s in group:
            if task in HAYSTACK_TASKS:
                assert s.tokens == TOKENS, task
            else:  # a list fills the prompt to within one more word (cwe: rare_count copies of it)
                assert TOKENS - 12 <= s.tokens <= TOKENS, task
            assert s.new_tokens >= len(gen.ids(" " + ", ".join(s.expected)))


def test_the_single_needle_is_in_the_context_at_its_stated_depth(gen, samples, tokenizer):
    for s in samples["niah_single"]:
        (depth,) = s.depths
        start = round(depth * len(s.context_ids))
        key = re.search(r"word '(\w+)'", tokenizer.decode(s.question_ids)).group(1)
        needle = gen.ids(NEEDLE.format(key=key, value=s.expected[0]))
        assert s.context_ids[start : start + len(needle)] == needle
        # at a sentence end near the depth the sample asked for (van der Corput: 0.5, 0.25, 0.75)
        assert abs(depth - spread_depth(s.index)) < 0.06
    assert [round(spread_depth(i), 3) for i in range(4)] == [0.5, 0.25, 0.75, 0.125]


def test_depths_of_several_needles_spread_and_ascend(samples):
    for task in ("niah_multikey", "niah_multivalue", "niah_multiquery", "vt"):
        for s in samples[task]:
            assert s.depths == sorted(s.depths) and 0 < s.depths[0] and s.depths[-1] < 1
            assert len(s.depths) == (4 if task.startswith("niah") else 10)


def _needles(text: str) -> list[tuple[str, str]]:
    return re.findall(r"The secret number for the word '(\w+)' is (\d{7})\.", text)


def test_needle_answers_are_derivable_from_the_context(samples, tokenizer):
    for task in ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"):
        for s in samples[task]:
            found = _needles(tokenizer.decode(s.context_ids))
            asked = re.findall(r"'(\w+)'", tokenizer.decode(s.question_ids).split("Answer:")[0])
            assert sorted(v for k in asked for key, v in found if key == k) == sorted(s.expected), task
            assert len(found) == (1 if task == "niah_single" else 4)
            if task == "niah_multikey":  # three distractors with other keys
                assert len({k for k, _ in found}) == 4 and len(asked) == 1



def test_the_long_answer_task_asks_for_every_needle_in_order(gen, tokenizer):
    """niah_recall (not among the default tasks): 16 needles of different keys, none named in the question; the
    expected values in the order they appear, and room to write them all (~150 tokens)."""
    assert LONG_ANSWER_TASKS == ("niah_recall",) and "niah_recall" not in TASKS
    for s in gen.samples("niah_recall", 2048, 2, seed=5):
        found = _needles(tokenizer.decode(s.context_ids))
        assert [v for _, v in found] == s.expected and len({k for k, _ in found}) == 16
        assert s.tokens == 2048 and s.depths == sorted(s.depths) and len(s.depths) == 16
        question = tokenizer.decode(s.question_ids)
        assert "in the order they appear" in question and not any(f"'{k}'" in question for k, _ in found)
        assert s.new_tokens >= len(gen.ids(s.gold_text)) > 100

def test_variable_tracking_answer_is_the_chain_of_the_asked_value(samples, tokenizer):
    for s in samples["vt"]:
        text = tokenizer.decode(s.context_ids)
        value = re.search(r"the value (\d+)", tokenizer.decode(s.question_ids)).group(1)
        holds = {a for a, v in re.findall(r"VAR ([A-Z]{5}) = (\d+)\.", text) if v == value}
        links = re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", text)
        while True:  # follow the assignments in order of appearance until nothing new holds the value
            more = {b for b, a in links if a in holds} - holds
            if not more:
                break
            holds |= more
        assert holds == set(s.expected) and len(holds) == 5


def test_word_tasks_ask_for_the_words_the_context_repeats_most(samples, tokenizer):
    o = TaskOptions()
    for s in samples["cwe"]:
        counts = Counter(tokenizer.decode(s.context_ids).split("\n\n", 1)[1].split())
        top = counts.most_common(o.common_words + 1)
        assert {w for w, _ in top[:-1]} == set(s.expected)
        assert all(c == o.common_count for _, c in top[:-1]) and top[-1][1] == o.rare_count
    for s in samples["fwe"]:
        counts = Counter(tokenizer.decode(s.context_ids).split("\n\n", 1)[1].split()).most_common()
        assert [w for w, _ in counts[:3]] == s.expected and counts[2][1] > counts[3][1]


def test_the_play_question_quotes_a_line_of_the_hidden_excerpt(samples, tokenizer):
    for s in samples["qa_speaker"]:
        text = tokenizer.decode(s.context_ids)
        line = re.search(r'says "(.+)"\?', tokenizer.decode(s.question_ids)).group(1)
        assert f"{s.expected[0].upper()}. {line}" in text
        assert text.count(line) == 1


def test_parse_speeches_splits_scenes_and_drops_stage_directions():
    play = ("# A Play\n\n## ACT I\n\n### SCENE I. A room.\n\n_Enter A and B_\n\n**ALPHA**  \nFirst line,  \nsecond line."
            "\n\n**BETA**  \nReply.\n\n### SCENE II. Elsewhere.\n\n**ALPHA**  \nAgain.\n")
    assert parse_speeches(play) == [[("ALPHA", "First line,\nsecond line."), ("BETA", "Reply.")], [("ALPHA", "Again.")]]


def test_score_is_the_fraction_of_expected_strings_found():
    assert score(["1234567"], " 1234567.") == 1.0
    assert score(["ABCDE", "FGHIJ", "KLMNO", "PQRST"], "abcde, fghij and more") == 0.5
    assert score(["Orlando"], " the old man") == 0.0


@pytest.mark.parametrize("call, message", [
    (lambda g: g.samples("niah", 1024, 1), "unknown task 'niah'; pick from niah_single"),
    (lambda g: g.samples("vt", 1024, 0), "samples per task must be >= 1"),
    (lambda g: g.samples("niah_multikey", 100, 1), "ask for more tokens"),
    (lambda g: g.samples("cwe", 300, 1), "cannot hold cwe's 10 x 30 common words"),
    (lambda g: TaskGenerator(g.tokenizer, "word " * 5000).samples("qa_speaker", 512, 1), "needs the plays"),
])
def test_bad_generator_input_names_the_fix(gen, call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(gen)


@pytest.mark.parametrize("options, message", [
    (dict(needles=1), "needles and .speeches must be >= 2"),
    (dict(hops=0), "hops must be >= 1"),
    (dict(common_count=4, rare_count=3), "common_count > rare_count + 1"),
    (dict(zipf=0.0), "zipf must be > 0"),
    (dict(recall_items=0), "recall_items must be >= 1"),
])
def test_bad_task_options(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TaskOptions(**options)


# ---- paired scoring --------------------------------------------------------------------------------------------------
def test_paired_difference_weighs_each_group_the_same():
    same = paired_difference([1.0, 0.0, 1.0], [1.0, 0.0, 1.0])
    assert (same.difference, same.low, same.high, same.n) == (0.0, 0.0, 0.0, 3)
    # group x: -1 on one of two items (-0.5); group y: +0 on four items; the mean over groups is -0.25
    d = paired_difference([0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], ["x", "x", "y", "y", "y", "y"], samples=4000)
    assert d.difference == -0.25 and -0.5 <= d.low < d.high <= 0.0
    # a group of one item cannot be resampled: the items are then one group, each weighing the same
    one = paired_difference([0, 1, 1], [1, 1, 1], ["x", "y", "y"], samples=4000)
    assert one.difference == pytest.approx(-1 / 3) and -1.0 <= one.low < one.high == 0.0
    assert math.isnan(paired_difference([1.0], [0.0]).low)  # one item: no interval
    with pytest.raises(ValueError, match="same items"):
        paired_difference([1.0], [1.0, 0.0])


# ---- the suite, end to end on a tiny random model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(tokenizer, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_ruler_suite_writes_sample_rows_then_summary_rows_and_resumes(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "ruler.json"
    tasks = ["niah_single", "fwe", "qa_speaker"]
    argv = ["compare", "--suite", "ruler", "--model", tiny_model_dir, "--tokens", "512", "--task-samples", "1",
            "--tasks", *tasks, "--caches", "dynamic", "int4", "h2o", "--budgets", "0.5", "--json", str(path)]
    assert main(argv) == 0
    rows = json.loads(path.read_text())
    caches = ["dynamic", "int4", "h2o budget=0.5"]
    assert [(r["cache"], r["task"]) for r in rows] == [(c, t) for c in caches for t in [*tasks, "average"]]
    for r in rows:
        assert list(r)[:4] == ["suite", "cache", "model", "tokens"] and r["suite"] == "ruler" and r["tokens"] == 512
        assert r["mode"] == "agnostic" and r["samples"] == (3 if r["task"] == "average" else 1)
        assert 0.0 <= r["accuracy"] <= 1.0 and "hf-kvcache compare --suite ruler" in r["command"]
        assert ("delta_pts" in r) == (r["cache"] != "dynamic")
        # one sample per task: no interval for a task, one over the three samples for the average
        assert ("low_pts" in r) == (r["cache"] != "dynamic" and r["task"] == "average")
        if "low_pts" in r:
            assert r["low_pts"] <= r["delta_pts"] <= r["high_pts"]
        for s in r["results"]:
            assert s["cache"] == r["cache"] and 0.0 <= s["score"] <= 1.0 and s["bytes"] > 0
            assert s["score"] == score(s["expected"], s["answer"]) and s["answer_nll"] > 0
        # the right answer's nll: every cache, and paired against the full cache's (an interval for the average)
        assert r["nll"] > 0 and ("delta_nll" in r) == (r["cache"] != "dynamic")
        assert ("low_nll" in r) == ("low_pts" in r)
    by = {(r["cache"], r["task"]): r for r in rows}
    assert by["int4", "average"]["ratio"] > 3 * by["dynamic", "average"]["ratio"]  # 4-bit vs the fp32 full cache
    assert all(r["answer_ratio"] > 0 and r["results"][0]["answer_bytes"] > 0 for r in rows)
    assert by["h2o budget=0.5", "average"]["held"] < 0.55 * by["dynamic", "average"]["held"]
    # int4 took the full cache's prefill (eval/replay.py); h2o needs the attention of its own
    assert {r["cache"]: {s["replayed"] for s in r["results"]} for r in rows} == {
        "dynamic": {False}, "int4": {True}, "h2o budget=0.5": {False}}
    assert "vs full (pts)" in capsys.readouterr().out
    assert "| samples | answer nll | nll vs full, 95 % interval |" in markdown_tables(rows)

    # a cut-off run leaves sample rows: resume runs only the missing samples, --from-json summarizes either file
    done = {("dynamic", "niah_single"), ("int4", "niah_single"), ("dynamic", "fwe")}
    kept = [s for r in rows if (r["cache"], r["task"]) in done for s in r["results"]]
    path.write_text(json.dumps(kept))
    argv[argv.index("qa_speaker")] = "--resume"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count(" .. 512 ") == 3  # h2o on niah_single, int4 and h2o on fwe
    rows = json.loads(path.read_text())
    assert {(r["cache"], r["task"]) for r in rows} == {(c, t) for c in caches for t in ("niah_single", "fwe", "average")}
    # two caches missing on fwe: the full cache's prefill was recorded again, and int4 took it
    assert [s["replayed"] for r in rows if r["task"] == "fwe" and r["cache"] == "int4" for s in r["results"]] == [True]
    assert main(["compare", "--from-json", str(path)]) == 0
    assert "vs full (pts)" in capsys.readouterr().out
    # the Pareto front of the run: ratio once answered against points lost, one point per cache
    png = tmp_path / "front.png"
    assert main(["compare", "--from-json", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 0 and "| cache | ratio vs fp16 | accuracy % | points lost | Pareto |" in out
    points = {p.label: p for p in pareto_points(rows)}
    assert set(points) == set(caches) and points["dynamic"].delta_pct == 0.0
    average = {r["cache"]: r for r in json.loads(path.read_text()) if r["task"] == "average"}
    assert points["int4"].ratio == average["int4"]["answer_ratio"]
    assert points["int4"].delta_pct == -average["int4"]["delta_pts"]
    with pytest.raises(ValueError, match="one model, length and mode"):
        pareto_points(rows + [dict(s, tokens=1024) for r in rows for s in r["results"]])


def test_kept_prefills_are_replayed_by_a_later_run_on_the_same_samples(tiny_model_dir, tmp_path, capsys):
    store = tmp_path / "prefills"
    base = ["compare", "--suite", "ruler", "--model", tiny_model_dir, "--tokens", "512", "--task-samples", "1",
            "--tasks", "niah_single", "--prefills", str(store)]
    assert main([*base, "--caches", "dynamic", "int4"]) == 2
    assert "is not a folder; create it first" in capsys.readouterr().err
    store.mkdir()
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main([*base, "--caches", "dynamic", "int4", "--json", str(first)]) == 0
    assert len(list(store.iterdir())) == 1  # one file per sample
    assert main([*base, "--caches", "dynamic", "int4", "int8", "--json", str(second)]) == 0
    one = {r["cache"]: r["results"][0] for r in json.loads(first.read_text()) if r["task"] == "niah_single"}
    two = {r["cache"]: r["results"][0] for r in json.loads(second.read_text()) if r["task"] == "niah_single"}
    assert not one["dynamic"]["replayed"] and all(r["replayed"] for r in two.values())  # no prefill ran again
    assert all(two[c]["answer"] == one[c]["answer"] and two[c]["bytes"] == one[c]["bytes"] for c in one)


def test_question_mode_runs_quantizing_caches_and_bad_suite_input(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "q.json"
    assert main(["compare", "--suite", "ruler", "--model", tiny_model_dir, "--tokens", "512", "--task-samples", "2",
                 "--tasks", "niah_single", "--caches", "dynamic", "kivi", "--mode", "question", "--json",
                 str(path)]) == 0
    rows = json.loads(path.read_text())
    assert [(r["cache"], r["samples"]) for r in rows] == [("dynamic", 2), ("dynamic", 2), ("kivi", 2), ("kivi", 2)]
    assert all(s["held"] == 512 for r in rows for s in r["results"])  # context + question held when answering
    assert [s["replayed"] for s in rows[2]["results"]] == [True, True]  # kivi took the prefill of context + question
    for argv, message in [
        (["--tasks", "niah"], "unknown task(s) ['niah']"),
        (["--resume"], "--resume continues the sample rows"),
        (["--caches", "int4", "--budgets", "0.5"], "none of --caches is one"),
    ]:
        assert main(["compare", "--suite", "ruler", "--model", tiny_model_dir, "--tokens", "512", *argv]) == 2
        assert message in capsys.readouterr().err
    assert math.isclose(spread_depth(0), 0.5)


def test_budgets_leave_a_cache_that_sets_its_own_budget_as_it_is(tiny_model_dir, tmp_path):
    """`--budgets` expands `h2o` once per budget; `h2o-own`, which sets its own budget, runs once with it (it used to
    be expanded too, each copy with the flag's budget under the spec's label)."""
    path = tmp_path / "b.json"
    assert main(["compare", "--suite", "ruler", "--model", tiny_model_dir, "--tokens", "512", "--task-samples", "1",
                 "--tasks", "niah_single", "--caches", "dynamic", 'h2o-own=h2o:{"budget":0.5}', "h2o",
                 "--budgets", "0.25", "--json", str(path)]) == 0
    caches = sorted({r["cache"] for r in json.loads(path.read_text())})
    assert caches == ["dynamic", "h2o budget=0.25", "h2o-own"]


def test_a_resumed_run_keeps_the_commands_that_measured_its_earlier_samples(tmp_path):
    """Summary rows written by an earlier run carry its command; resuming stamps it on their samples, and the new
    summaries list it in `earlier_commands` (only where such samples are)."""
    def sample(cache, task, n):
        return dict(suite="ruler", cache=cache, model="m", tokens=512, mode="agnostic", task=task, sample=n, seed=0,
                    score=1.0, held=10, seconds=1.0, bytes=10, fp16_bytes=20)
    earlier = summary_rows([sample("dynamic", "vt", 0), sample("int4", "vt", 0)])
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{**r, "command": "hf-kvcache compare OLD"} for r in earlier]))
    log = SampleLog(str(path), resume=True)
    assert {s["command"] for s in log.rows} == {"hf-kvcache compare OLD"}
    rows = summary_rows(log.rows + [sample("int8", "vt", 0), sample("int4", "vt", 1)])
    by = {(r["cache"], r["task"]): r for r in rows}
    assert by["dynamic", "vt"]["earlier_commands"] == ["hf-kvcache compare OLD"]
    assert by["int4", "average"]["earlier_commands"] == ["hf-kvcache compare OLD"]  # one old sample, one new
    assert "earlier_commands" not in by["int8", "vt"]
