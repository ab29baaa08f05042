"""`hf-kvcache report`: results pages rendered from their row files, and `--check` on the committed docs."""

import json
from pathlib import Path

import pytest

from hf_kvcache.cli import main
from hf_kvcache.eval.report import RegionSpec, find_regions, render, render_page

ROOT = Path(__file__).parents[2]

ROWS = [
    {"suite": "perplexity", "cache": "dynamic", "model": "m", "tokens": 64, "perplexity": 10.0, "delta_pct": 0.0,
     "bytes": 4096, "ratio": 0.5, "command": "hf-kvcache bench --caches dynamic int4"},
    {"suite": "perplexity", "cache": "int4", "model": "m", "tokens": 64, "perplexity": 10.25, "delta_pct": 2.5,
     "bytes": 1024, "ratio": 2.0, "command": "hf-kvcache bench --caches dynamic int4"},
]


@pytest.fixture
def repo(tmp_path):
    """A tiny repository: two row files (the second a report object whose rows sit under `rows`) and a page."""
    (tmp_path / "docs/rows").mkdir(parents=True)
    (tmp_path / "docs/results").mkdir()
    (tmp_path / "docs/rows/a.json").write_text(json.dumps(ROWS))
    other = [dict(r, model="n", delta_pct=r["delta_pct"] * 2) for r in ROWS]
    (tmp_path / "docs/rows/b.json").write_text(json.dumps({"rows": other, "args": {}}))
    return tmp_path


def test_a_region_renders_its_rows_as_a_markdown_table(repo):
    spec = RegionSpec.parse("docs/rows/a.json columns=cache,perplexity,delta_pct,bytes,ratio")
    assert render(spec, repo) == (
        "| cache | ppl | delta | bytes held | vs fp16 |\n"
        "| --- | --- | --- | --- | --- |\n"
        "| dynamic | 10.000 | +0.00% | 4,096 | 0.50x |\n"
        "| int4 | 10.250 | +2.50% | 1,024 | 2.00x |"
    )


def test_selectors_formats_and_one_column_per_file(repo):
    one = RegionSpec.parse("docs/rows/a.json#cache=int4 columns=cache,bytes:mib2,ratio:{:.1f}")
    assert render(one, repo).splitlines()[2] == "| int4 | 0.00 | 2.0 |"
    assert render(one, repo).splitlines()[0] == "| cache | bytes held (MiB) | vs fp16 |"
    pivot = RegionSpec.parse("docs/rows/a.json docs/rows/b.json columns=delta_pct,ratio by=file names='M|N'")
    assert render(pivot, repo).splitlines() == [
        "| cache | M | N |",
        "| --- | --- | --- |",
        "| dynamic | +0.00%, 0.50x | +0.00%, 0.50x |",
        "| int4 | +2.50%, 2.00x | +5.00%, 2.00x |",
    ]


def test_text_format_is_the_compare_table_after_its_command(repo):
    text = render(RegionSpec.parse("docs/rows/a.json format=text pareto=no"), repo).splitlines()
    assert text[0] == "```" and text[-1] == "```"
    assert text[1] == "$ hf-kvcache bench --caches dynamic int4"
    assert text[2].split() == ["cache", "ppl", "delta", "bytes", "held", "vs", "fp16"]


def test_suite_formats_render_through_the_suites_markdown():
    """format=ruler summarizes sample rows (a cut-off file) per cache and task; format=long gives paired deltas."""
    ruler = render(RegionSpec.parse("docs/rows/ruler_qwen2.5-coder-0.5b_4096_agnostic.json format=ruler"), ROOT)
    lines = ruler.splitlines()
    assert lines[0] == "**qwen2.5-coder-0.5b, 4096 tokens, mode agnostic**"
    assert lines[4].startswith("| dynamic | 0.50x | 100 |") and "| baseline | 7 |" in lines[4]
    long = render(RegionSpec.parse("docs/rows/long_ppl_smollm2-135m.json format=long"), ROOT).splitlines()
    assert long[0].startswith("| model | tokens | cache | loop | ppl | delta vs dynamic")
    assert any(line.startswith("| smollm2-135m | 8192 | tiered | plain |") and "%" in line for line in long)
    with pytest.raises(ValueError, match="format= 'text', 'table', 'ruler', 'long'"):
        RegionSpec.parse("docs/rows/a.json format=fancy")


def test_report_writes_regions_and_check_names_the_stale_one(repo, capsys):
    page = repo / "docs/results/p.md"
    page.write_text("# p\n\n<!-- rows: docs/rows/a.json columns=cache,perplexity -->\nold table\n<!-- /rows -->\n\n"
                    "  - in a list:\n\n  <!-- rows: docs/rows/b.json@rows columns=model,ratio -->\n  <!-- /rows -->\n")
    assert main(["report", "--check", "--root", str(repo)]) == 1
    out = capsys.readouterr()
    assert "docs/results/p.md:3 (docs/rows/a.json)" in out.out and "docs/results/p.md:9" in out.out
    assert "run hf-kvcache report" in out.err
    assert main(["report", "--root", str(repo)]) == 0
    text = page.read_text()
    assert "old table" not in text and "| int4 | 10.250 |\n<!-- /rows -->" in text
    assert "\n  | n | 2.00x |\n  <!-- /rows -->" in text  # a region in a list item keeps its indentation
    assert main(["report", "--check", "--root", str(repo)]) == 0
    rows = json.loads((repo / "docs/rows/a.json").read_text())
    rows[1]["perplexity"] = 10.5  # the row file moves: the page no longer matches it
    (repo / "docs/rows/a.json").write_text(json.dumps(rows))
    assert main(["report", "--check", "--root", str(repo)]) == 1


@pytest.mark.parametrize("page, message", [
    ("<!-- rows: docs/rows/a.json -->\n<!-- /rows -->", "name its columns="),
    ("<!-- rows: docs/rows/a.json colums=cache -->\n<!-- /rows -->", "unknown: ['colums']"),
    ("<!-- rows: docs/rows/a.json#cache=int2 columns=cache -->\n<!-- /rows -->", "no row matches"),
    ("<!-- rows: docs/rows/missing.json columns=cache -->\n<!-- /rows -->", "cannot read rows from docs/rows/missing"),
    ("<!-- rows: docs/rows/b.json@ttft columns=cache -->\n<!-- /rows -->", "name the key with PATH@KEY"),
    ("<!-- rows: docs/rows/a.json docs/rows/b.json columns=ratio by=file names=A -->\n<!-- /rows -->",
     "gives 1 names for 2 sources"),
    ("<!-- rows: docs/rows/a.json columns=cache -->\nno end", "not closed"),
])
def test_bad_regions_are_clear_errors(repo, page, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        render_page(page, repo, "p.md")


def test_the_committed_pages_match_their_rows(capsys):
    """`hf-kvcache report --check` on the repository: every rendered table equals what its row files render."""
    assert main(["report", "--check", "--root", str(ROOT)]) == 0, capsys.readouterr().out
    regions = sum(len(find_regions(p.read_text())) for p in (ROOT / "docs/results").glob("*.md"))
    assert regions >= 87  # the results pages are rendered, not retyped (87 regions since the first GPU run's table moved to docs/gpu)
