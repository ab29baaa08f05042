import json
import subprocess
import sys

import pytest

from hf_kvcache.cli import main
from hf_kvcache.eval.bench import CacheSpec


def test_cache_spec_parsing():
    assert CacheSpec.parse("int8") == CacheSpec("int8", {}, "int8")
    spec = CacheSpec.parse('small=uniform:{"dtype": "int4"}')
    assert spec.name == "uniform" and spec.options == {"dtype": "int4"} and spec.label == "small"
    with pytest.raises(ValueError, match="JSON object"):
        CacheSpec.parse("uniform:[1]")


def test_caches_lists_registered_names(capsys):
    assert main(["caches"]) == 0
    names = capsys.readouterr().out.split()
    assert {"dynamic", "int8", "int4", "fp8"} <= set(names)


@pytest.mark.slow
def test_ppl_command_on_real_model(capsys, smol, pydoc_text):
    """The command reports what the library measures for the same cache, text window and chunking, and an int4 cache
    stays close to the uncompressed one on it (measured -1.4 %)."""
    from transformers import DynamicCache

    from hf_kvcache import UniformQuantCache
    from hf_kvcache.eval import load_tokens, streaming_perplexity

    assert main(["ppl", "--text", "pydoc", "--start", "0", "--tokens", "64", "--chunk", "16",
                 "--cache", "uniform", "--cache-config", '{"dtype": "int4"}', "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    model, tok = smol
    ids = load_tokens(tok, pydoc_text, 0, 64)
    want = streaming_perplexity(model, ids, UniformQuantCache(config=model.config, dtype="int4"), 16)
    assert row["tokens"] == want.tokens == 64
    assert row["bytes"] == want.bytes and row["fp16_bytes"] == want.fp16_bytes and row["ratio"] == want.ratio
    assert row["perplexity"] == pytest.approx(want.perplexity, rel=1e-5)
    dense = streaming_perplexity(model, ids, DynamicCache(config=model.config), 16).perplexity
    assert abs(row["perplexity"] / dense - 1) < 0.02, (row["perplexity"], dense)


def test_bad_cache_config_is_a_clear_error(capsys):
    code = main(["ppl", "--text", "pydoc", "--tokens", "8", "--cache", "uniform", "--cache-config", '{"dtype": "int9"}'])
    assert code == 2
    assert "dtype='int9' is not valid" in capsys.readouterr().err


def test_console_script_is_installed():
    out = subprocess.run([sys.executable, "-m", "hf_kvcache.cli", "caches"], capture_output=True, text=True)
    assert out.returncode == 0 and "int4" in out.stdout
