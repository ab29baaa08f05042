import json
import os
import shlex
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
    stays close to the uncompressed one on it (measured -0.7 %; with key_quant="token" -1.4 %)."""
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


# ---- demo ------------------------------------------------------------------------------------------------------------
def test_demo_defaults_cover_every_cache_family():
    from hf_kvcache.cli import build_parser
    from hf_kvcache.registry import cache_names

    caches = build_parser().parse_args(["demo"]).caches
    assert {"int8", "int4", "fp8", "tiered", "kivi", "h2o", "cpac"} <= set(caches) <= set(cache_names())


def test_demo_rejects_unknown_cache_before_loading(capsys):
    assert main(["demo", "--caches", "int4", "int5"]) == 2
    err = capsys.readouterr().err
    assert "['int5']" in err and "pick among" in err and "tiered" in err


@pytest.mark.slow
def test_demo_generates_and_tabulates_each_cache(capsys):
    """Every cache answers the prompt (one progress line each, in order), then one table row per cache, in order."""
    assert main(["demo", "--caches", "int8", "h2o", "--text", "pydoc", "--start", "0", "--tokens", "48",
                 "--chunk", "16", "--new-tokens", "6", "--decode-steps", "0"]) == 0
    out = capsys.readouterr().out
    answers = [line for line in out.splitlines() if line.startswith("[")]
    assert [a.split(":")[0] for a in answers] == ["[1/3] dynamic", "[2/3] int8", "[3/3] h2o"]
    assert all(len(a.split(": ", 2)[2].strip()) > 0 for a in answers)  # each printed a non-empty answer
    table = out[out.index("\ncache ") + 1:].splitlines()
    rows = {line.split()[0]: line.split() for line in table[2:5]}
    assert list(rows) == ["dynamic", "int8", "h2o"]
    assert rows["dynamic"][2] == "+0.00%"
    # int8 of a fp32 model: 1.94x the fp16 bytes in codes and scales; at 48 tokens the 46 KB of key statistics
    # (pre-RoPE keys) bring it to 1.79x
    assert float(rows["int8"][4].rstrip("x")) > 1.75
    assert "took" in out and "generation" in out


# ---- compare ---------------------------------------------------------------------------------------------------------
def _dominated(row: dict, rows: list[dict]) -> bool:
    """Brute force: another row at least as small (ratio) and as good (delta), better in one."""
    return any(o is not row and o["ratio"] >= row["ratio"] and o["delta_pct"] <= row["delta_pct"]
               and (o["ratio"] > row["ratio"] or o["delta_pct"] < row["delta_pct"]) for o in rows)


def _marks(table: str) -> dict[str, bool]:
    """cache label -> marked on the front, from a compare table."""
    lines = table.splitlines()
    assert lines[0].split()[-1] == "Pareto"
    return {line.split()[0]: line.split()[-1] == "yes" for line in lines[2:]}


def test_compare_table_marks_the_front():
    from hf_kvcache.eval.compare import compare_table

    rows = [{"cache": "a", "perplexity": 10.0, "delta_pct": 0.0, "ratio": 1.0},
            {"cache": "b", "perplexity": 10.1, "delta_pct": 1.0, "ratio": 2.0},
            {"cache": "c", "perplexity": 10.5, "delta_pct": 5.0, "ratio": 2.0},  # b is as small and better
            {"cache": "d", "perplexity": 10.3, "delta_pct": 3.0, "ratio": 4.0},
            {"cache": "e", "perplexity": 10.4, "delta_pct": 4.0, "ratio": 3.0}]  # d is smaller and better
    assert _marks(compare_table(rows)) == {"a": True, "b": True, "c": False, "d": True, "e": False}


@pytest.mark.parametrize("argv, message", [
    (["--png", "out.jpg"], "ending in .png"),
    (["--json", "no/such/folder/rows.json"], "mkdir -p no/such/folder"),
    (["--caches", "int4", "int4"], "share the label 'int4'"),
    (["--caches", "int4:{bad"], "JSON"),
    (["--caches", "dynamic", "int5"], "unknown cache 'int5'"),
])
def test_compare_bad_input_is_a_clear_error(capsys, tmp_path, argv, message):
    args = ["compare", "--tokens", "8"] + ([] if "--caches" in argv else ["--caches", "dynamic", "int4"])
    assert main(args + argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_compare_writes_rows_table_and_png(capsys, tmp_path):
    """One run on the real model: the rows (bench schema) as JSON, a table marking the Pareto front, a real PNG."""
    import struct

    rows_path, png_path = tmp_path / "rows.json", tmp_path / "front.png"
    caches = ["dynamic", "int8", "fp8", "int4", 'k2=kivi:{"bits": 2, "residual_length": 16}', 'h2o:{"budget": 0.5}']
    assert main(["compare", "--text", "pydoc", "--start", "0", "--tokens", "48", "--chunk", "16", "--decode-steps",
                 "0", "--caches", *caches, "--json", str(rows_path), "--png", str(png_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(rows_path.read_text())
    labels = ["dynamic", "int8", "fp8", "int4", "k2", 'h2o {"budget": 0.5}']
    assert [r["cache"] for r in rows] == labels
    command = shlex.split(rows[0]["command"].removeprefix(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "))
    assert command[0] == "hf-kvcache" and command[1:4] == ["compare", "--text", "pydoc"] and command[-10:-4] == caches
    for r in rows:
        assert r["command"] == rows[0]["command"] and r["tokens"] == 48 and r["bytes"] > 0 and r["perplexity"] > 1
        assert r["ratio"] == pytest.approx(r["fp16_bytes"] / r["bytes"])
        assert r["delta_pct"] == pytest.approx(100 * (r["perplexity"] / rows[0]["perplexity"] - 1))
    assert rows[0]["delta_pct"] == 0.0 and rows[3]["ratio"] > rows[1]["ratio"] > rows[0]["ratio"]
    marks = _marks(out[out.index("cache "):out.index("wrote")].strip())
    assert marks == {r["cache"].split()[0]: not _dominated(r, rows) for r in rows}
    data = png_path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100 and len(data) > 5000
