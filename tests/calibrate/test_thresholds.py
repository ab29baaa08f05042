"""Threshold adaptation (hf_kvcache.calibrate.thresholds): the ADR rule, bounds, rounding, hysteresis, JSON files,
the nearest-entry store, and the mixin on the real TieredQuantCache."""

import json
import random

import pytest
import torch
from transformers import LlamaConfig

from hf_kvcache import KIVICache, TieredQuantCache
from hf_kvcache.calibrate import (
    ADR_RULE, AdaptiveThresholds, AdaptRule, AdaptState, Bounds, Feedback, Thresholds, ThresholdStore, adapt,
    load_thresholds_file, save_thresholds_file,
)

BAD, OK, GOOD = 0.10, 0.02, 0.001  # degraded / within the 3 % target / under half of it


# ---- feedback, thresholds, bounds -----------------------------------------------------------------------------------
def test_feedback_verdicts_and_coercion():
    assert Feedback(0.031).verdict == "degraded" and Feedback(0.031).signal == 1
    assert Feedback(0.03).verdict == "within-target" and Feedback(0.015).verdict == "within-target"
    assert Feedback(0.0149).verdict == "good-with-margin" and Feedback(-0.2).signal == -1
    assert Feedback(0.05, target=0.06).signal == 0 and Feedback(0.05, target=0.06, margin=0.9).signal == -1
    assert Feedback.coerce(0.02) == Feedback(0.02) and Feedback.coerce(1) == Feedback(1.0)
    assert Feedback.from_perplexity(20.6, 20.0).delta == pytest.approx(0.03)
    for bad, match in [(dict(delta=float("nan")), "finite"), (dict(delta="0.1"), "finite"),
                       (dict(delta=0.1, target=0), "target"), (dict(delta=0.1, margin=1.0), "margin")]:
        with pytest.raises(ValueError, match=match):
            Feedback(**bad)
    with pytest.raises(ValueError, match="Feedback or a relative"):
        Feedback.coerce("bad")


def test_thresholds_validate_and_roundtrip():
    th = Thresholds(96, 3)
    assert Thresholds.from_dict(json.loads(json.dumps(th.to_dict()))) == th
    for d, match in [({"tail_length": -1, "archive_bits": 2}, "non-negative"),
                     ({"tail_length": 64, "archive_bits": 9}, "1..8"),
                     ({"tail_length": 64, "archive_bits": True}, "1..8"),
                     ({"tail_length": 64}, "lack"), ({"tail_length": 64, "archive_bits": 2, "x": 1}, "unknown"),
                     ([64, 2], "JSON object")]:
        with pytest.raises(ValueError, match=match):
            Thresholds.from_dict(d)


def test_bounds_rounding_is_outward_and_clamped():
    b = Bounds()  # tail in [16, 1024] in steps of 32, bits {2, 3, 4}
    assert [b.grow_tail(t, 1.2) for t in (16, 32, 64, 96, 1000, 1024)] == [32, 64, 96, 128, 1024, 1024]
    assert [b.shrink_tail(t, 0.9) for t in (512, 256, 64, 32, 16)] == [448, 224, 32, 16, 16]
    assert b.clamp(Thresholds(0, 1)) == Thresholds(16, 2) and b.clamp(Thresholds(5000, 8)) == Thresholds(1024, 4)
    assert b.clamp(Thresholds(40, 3)) == Thresholds(64, 3)  # off-step lengths go up to the next step
    assert b.contains(Thresholds(16, 2)) and b.contains(Thresholds(224, 4)) and not b.contains(Thresholds(40, 2))
    assert Bounds(bits=(2, 4)).step_bits(2, 1) == 4 and Bounds(bits=(2, 4)).clamp_bits(3) == 4
    for kw, match in [(dict(min_tail=64, max_tail=32), "min_tail"), (dict(tail_step=0), "tail_step"),
                      (dict(bits=(4, 2)), "ascending"), (dict(bits=()), "ascending"), (dict(bits=(2, 9)), "1..8")]:
        with pytest.raises(ValueError, match=match):
            Bounds(**kw)
    with pytest.raises(ValueError, match="grow"):
        AdaptRule(grow=0.9)
    with pytest.raises(ValueError, match="patience"):
        AdaptRule(patience=0)


# ---- the rule -------------------------------------------------------------------------------------------------------
def test_the_literal_adr_rule_moves_both_knobs_every_signal():
    assert adapt(Thresholds(64, 2), BAD, rule=ADR_RULE) == Thresholds(96, 3)  # x1.2 = 76.8 -> 96, +1 bit
    assert adapt(Thresholds(256, 4), GOOD, rule=ADR_RULE) == Thresholds(224, 3)  # x0.9 = 230.4 -> 224, -1 bit
    assert adapt(Thresholds(256, 4), OK, rule=ADR_RULE) == Thresholds(256, 4)
    assert adapt(Thresholds(1024, 4), BAD, rule=ADR_RULE) == Thresholds(1024, 4)  # bounded
    assert adapt(Thresholds(16, 2), GOOD, rule=ADR_RULE) == Thresholds(16, 2)
    assert adapt(Thresholds(5000, 7), OK) == Thresholds(1024, 4)  # even unchanged means within bounds


def test_default_rule_moves_the_boundary_first_and_bits_after_patience():
    st, th = AdaptState(), Thresholds(16, 2)
    seen = []
    for _ in range(4):
        th = adapt(th, BAD, state=st)
        seen.append((th.tail_length, th.archive_bits))
    assert seen == [(32, 2), (64, 2), (96, 3), (128, 3)]  # bits on the 3rd degraded sample; the count restarts
    assert st.min_bits == 3 and st.degraded == 1
    # within-target samples count for nothing; good ones shrink the boundary but do not erase degradations
    for fb in (OK, GOOD, OK):
        th = adapt(th, fb, state=st)
    assert th == Thresholds(96, 3) and st.degraded == 1
    th = adapt(th, BAD, state=st)
    assert th == Thresholds(128, 3)  # grew after a shrink: 128 is the boundary's floor now
    assert st.tail_floor == 128
    th = adapt(th, BAD, state=st)
    assert th == Thresholds(160, 4)  # the third degraded sample at 3 bits
    assert st.min_bits == 4 and st.tail_floor is None  # the floor belonged to 3 bits
    assert adapt(Thresholds(64, 2), BAD) == Thresholds(96, 2)  # no state: a fresh count each call


def test_good_samples_lower_the_bits_only_without_a_degradation_between():
    st, th = AdaptState(), Thresholds(256, 4)
    for fb in (GOOD, GOOD, BAD, GOOD, GOOD):
        th = adapt(th, fb, state=st)
    assert th.archive_bits == 4
    th = adapt(th, GOOD, state=st)
    assert th.archive_bits == 3


def test_boundary_floor_stops_the_shrinking():
    st, th = AdaptState(), Thresholds(256, 4)
    rule = AdaptRule(patience=10**6)  # the boundary alone
    th = adapt(th, GOOD, rule=rule, state=st)  # 224
    th = adapt(th, BAD, rule=rule, state=st)  # 224 degraded after a shrink: floor at 288
    assert th == Thresholds(288, 4) and st.tail_floor == 288
    for _ in range(5):
        th = adapt(th, GOOD, rule=rule, state=st)
    assert th == Thresholds(288, 4)
    th = adapt(th, BAD, rule=rule, state=st)  # the floor itself degraded
    assert th == Thresholds(352, 4) and st.tail_floor == 352


def test_ratchets_stop_the_bits_from_cycling():
    # 2 bits always degrade, 3 bits are always good with margin: the literal rule cycles forever
    quality = {2: BAD, 3: GOOD, 4: GOOD}
    th, bits = Thresholds(128, 3), []
    for _ in range(40):
        th = adapt(th, quality[th.archive_bits], rule=ADR_RULE)
        bits.append(th.archive_bits)
    assert bits[-6:] == [2, 3, 2, 3, 2, 3]
    # the default rule tries 2 bits once, comes back, and stays
    st, th, trace = AdaptState(), Thresholds(128, 3), []
    for _ in range(40):
        th = adapt(th, quality[th.archive_bits], state=st)
        trace.append(th)
    assert st.min_bits == 3 and [t.archive_bits for t in trace].count(2) == 3
    assert len(set(trace[-20:])) == 1 and trace[-1] == Thresholds(16, 3)


def test_boundary_ratchet_settles_on_a_threshold_curve():
    # quality depends on the boundary only: degraded below 200 tokens, good with margin from 200 on
    st, th, trace = AdaptState(), Thresholds(512, 4), []
    for _ in range(60):
        th = adapt(th, BAD if th.tail_length < 200 else GOOD, rule=AdaptRule(patience=10**6), state=st)
        trace.append(th.tail_length)
    assert len(set(trace[-40:])) == 1 and trace[-1] >= 200


def test_settles_under_noise_where_the_literal_rule_keeps_moving():
    """A synthetic quality surface shaped like SmolLM2's at 512 tokens (delta proportional to the archived share of
    the window, per bit width, times 1 +- 30 % noise per sample): from both extremes the default rule stops moving,
    and from then on every sample is within the target; the literal ADR rule still moves at the end."""
    base = {2: 0.15, 3: 0.04, 4: 0.01}
    settled = []
    for seed in range(10):
        for start in (Thresholds(16, 2), Thresholds(512, 4)):
            for rule in (AdaptRule(), ADR_RULE):
                rng = random.Random(seed)
                st, th, trace = AdaptState(), start, []
                for _ in range(300):
                    d = base[th.archive_bits] * max(0, 512 - th.tail_length) / 512 * (1 + 0.3 * rng.gauss(0, 1))
                    trace.append((th, d))
                    th = adapt(th, d, rule=rule, state=st)
                changes = [i for i in range(1, len(trace)) if trace[i][0] != trace[i - 1][0]]
                if rule is ADR_RULE:
                    assert changes[-1] > 280
                    continue
                settled.append(changes[-1])
                assert changes[-1] < 250 and all(d <= 0.03 for _, d in trace[changes[-1]:])
    assert sorted(settled)[len(settled) // 2] < 100  # the median run settles within 100 samples


# ---- store and files ------------------------------------------------------------------------------------------------
def test_store_returns_the_nearest_context_in_log_scale():
    store = ThresholdStore({("smol", 1024): Thresholds(64, 2), ("smol", 4096): Thresholds(128, 3),
                            ("qwen", 2048): Thresholds(256, 4)})
    assert store.get("smol", 1024) == Thresholds(64, 2)
    assert store.get("smol", 1900) == Thresholds(64, 2)  # log distance 0.62 vs 0.77
    assert store.get("smol", 2200) == Thresholds(128, 3)
    assert store.nearest("smol", 2048) == (4096, Thresholds(128, 3))  # a tie goes to the longer context
    assert store.get("smol", 100) == Thresholds(64, 2) and store.get("smol", 10**6) == Thresholds(128, 3)
    assert store.get("qwen", 10) == Thresholds(256, 4)
    assert store.get("gemma", 2048) is None
    assert store.models() == ["qwen", "smol"] and store.context_lengths("smol") == [1024, 4096] and len(store) == 3
    with pytest.raises(ValueError, match="context_length"):
        store.get("smol", 0)
    with pytest.raises(ValueError, match="model_id"):
        store.put("", 1024, Thresholds())


def test_json_roundtrip_of_both_file_kinds(tmp_path):
    store = ThresholdStore({("smol", 512): Thresholds(32, 3), ("smol", 4096): Thresholds(160, 2)})
    store.save(tmp_path / "store.json")
    assert ThresholdStore.load(tmp_path / "store.json") == store == load_thresholds_file(tmp_path / "store.json")
    doc = json.loads((tmp_path / "store.json").read_text())
    assert doc["format"] == "hf-kvcache-thresholds" and doc["version"] == 1 and len(doc["store"]) == 2
    save_thresholds_file(tmp_path / "one.json", Thresholds(96, 4))
    assert load_thresholds_file(tmp_path / "one.json") == Thresholds(96, 4)
    with pytest.raises(ValueError, match="not a store"):
        ThresholdStore.load(tmp_path / "one.json")


@pytest.mark.parametrize("text, match", [
    ("{not json", "not JSON"),
    ("[]", "not an hf-kvcache thresholds file"),
    ('{"format": "other", "version": 1, "thresholds": {}}', "not an hf-kvcache thresholds file"),
    ('{"format": "hf-kvcache-thresholds", "thresholds": {"tail_length": 64, "archive_bits": 2}}', "version"),
    ('{"format": "hf-kvcache-thresholds", "version": 2, "thresholds": {}}', "newer"),
    ('{"format": "hf-kvcache-thresholds", "version": 1}', "exactly one"),
    ('{"format": "hf-kvcache-thresholds", "version": 1, "thresholds": {"tail_length": 64}}', "lack"),
    ('{"format": "hf-kvcache-thresholds", "version": 1, "thresholds": {"tail_length": 64, "archive_bits": 0}}',
     "1..8"),
    ('{"format": "hf-kvcache-thresholds", "version": 1, "store": {}}', "must be a list"),
    ('{"format": "hf-kvcache-thresholds", "version": 1, "store": [{"model_id": "m", "context_length": 8}]}',
     "exactly model_id"),
    ('{"format": "hf-kvcache-thresholds", "version": 1, "store": [{"model_id": "m", "context_length": -8, '
     '"thresholds": {"tail_length": 64, "archive_bits": 2}}]}', "context_length"),
    ('{"format": "hf-kvcache-thresholds", "version": 1, "store": ['
     '{"model_id": "m", "context_length": 8, "thresholds": {"tail_length": 64, "archive_bits": 2}}, '
     '{"model_id": "m", "context_length": 8, "thresholds": {"tail_length": 32, "archive_bits": 2}}]}', "repeats"),
])
def test_bad_files_say_what_is_wrong(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_thresholds_file(path)


# ---- the mixin on the real cache ------------------------------------------------------------------------------------
B, H, D, LAYERS = 1, 2, 64, 2
OPTS = dict(tail_length=16, warm_length=0, archive_bits=2, group_size=16, archive_group_size=16, sink_length=0,
            rotation="none", clip_search=False, tail_dtype=None)


AdaptiveTiered = TieredQuantCache  # the tiered cache takes the mixin itself


def tiny_config():
    return LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=H, head_dim=D,
                       hidden_size=4 * D, vocab_size=64)


def feed(cache, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(tokens // 8):
        k, v = torch.randn(B, H, 8, D, generator=g), torch.randn(B, H, 8, D, generator=g)
        for layer in range(LAYERS):
            cache.update(k, v, layer)
    return cache.memory_stats()["tiers"]


def test_mixin_adapts_and_the_layers_run_with_the_new_thresholds_after_reset():
    cache = AdaptiveTiered(config=tiny_config(), **OPTS)
    before = feed(cache, 96)
    assert before["tail"]["tokens"] == 16 and before["archive"]["tokens"] == 80
    for _ in range(3):  # tail 16 -> 32 -> 48 -> 64 (steps of the group size 16), bits 2 -> 3 on the third
        th = cache.adapt_thresholds(Feedback(0.2))
    assert th == cache.thresholds() == Thresholds(64, 3)
    assert (cache.options.tail_length, cache.options.archive_bits) == (64, 3)
    assert [s.verdict for s in cache.history] == ["degraded"] * 3
    assert [s.after for s in cache.history] == [Thresholds(32, 2), Thresholds(48, 2), Thresholds(64, 3)]
    # the sequence in flight keeps the tiers it was written with
    assert feed(cache, 16, seed=1)["tail"]["tokens"] == 16
    cache.reset()
    after = feed(cache, 96)
    fresh = feed(TieredQuantCache(config=tiny_config(), **{**OPTS, "tail_length": 64, "archive_bits": 3}), 96)
    assert after == fresh
    assert after["tail"]["tokens"] == 64 and after["archive"]["tokens"] == 32
    assert after["archive"]["bytes"] * 80 / 32 > before["archive"]["bytes"]  # 3-bit codes: more bytes per token
    # and back down: good with margin shrinks the boundary; the bits stay, 2 bits failed (the width ratchet)
    for _ in range(3):
        th = cache.adapt_thresholds(0.0)
    assert th == Thresholds(16, 3)  # 64 -> 48 -> 32 -> 16
    cache.reset()
    assert feed(cache, 96) == feed(TieredQuantCache(config=tiny_config(), **{**OPTS, "archive_bits": 3}), 96)


def test_mixin_on_a_cache_without_config_updates_lazily_made_layers():
    cache = AdaptiveTiered(**OPTS)
    cache.adapt_thresholds(Feedback(0.2))
    cache.adapt_thresholds(0.2)
    assert cache.thresholds() == Thresholds(48, 2)
    assert feed(cache, 96)["tail"]["tokens"] == 48


def test_mixin_save_and_load(tmp_path):
    cache = AdaptiveTiered(config=tiny_config(), **OPTS)
    cache.adapt_thresholds(0.2)
    one = tmp_path / "one.json"
    assert cache.save_thresholds(one) == Thresholds(32, 2)
    store = tmp_path / "store.json"
    cache.save_thresholds(store, "tiny", 512)
    cache.set_thresholds(Thresholds(256, 4))
    cache.save_thresholds(store, "tiny", 8192)
    cache.save_thresholds(store, "other", 512)
    assert ThresholdStore.load(store).context_lengths("tiny") == [512, 8192]

    other = AdaptiveTiered(config=tiny_config(), **OPTS)
    assert other.load_thresholds(one) == Thresholds(32, 2) == other.thresholds()
    assert other.load_thresholds(store, "tiny", 1000) == Thresholds(32, 2)
    assert other.load_thresholds(store, "tiny", 6000) == Thresholds(256, 4)
    assert feed(other, 320)["tail"]["tokens"] == 256 and other.options.archive_bits == 4
    with pytest.raises(ValueError, match="pass model_id"):
        other.load_thresholds(store)
    with pytest.raises(ValueError, match="pass context_length"):
        other.load_thresholds(store, "tiny")
    with pytest.raises(ValueError, match="no entry for model 'gemma'"):
        other.load_thresholds(store, "gemma", 512)
    with pytest.raises(ValueError, match="not a store"):
        other.save_thresholds(one, "tiny", 512)
    with pytest.raises(ValueError, match="both model_id and context_length"):
        other.save_thresholds(store, "tiny")


def test_mixin_with_other_option_names_kivi():
    assert issubclass(KIVICache, AdaptiveThresholds) and KIVICache.threshold_fields == ("residual_length", "bits")
    cache = KIVICache(config=tiny_config(), residual_length=32, bits=2, group_size=16)
    assert cache.thresholds() == Thresholds(32, 2)
    for _ in range(3):
        cache.adapt_thresholds(0.5)
    assert (cache.options.residual_length, cache.options.bits) == (80, 3)
    assert feed(cache, 96)["tail"]["tokens"] == 80
