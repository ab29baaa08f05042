"""hf-kvcache pareto: merging bench rows, the front, the table and plot, bad inputs."""

from __future__ import annotations

import json

import pytest

from hf_kvcache.cli import main
from hf_kvcache.eval.pareto import front, load_points


def _rows(path, rows):
    path.write_text(json.dumps([{"cache": c, "perplexity": p, "ratio": r, "delta_pct": d} for c, p, r, d in rows]))
    return str(path)


def test_front_table_and_plot(tmp_path, capsys):
    a = _rows(tmp_path / "a.json", [("dynamic", 50.0, 0.5, 0.0), ("x", 51.0, 4.0, 2.0), ("y", 60.0, 3.0, 20.0)])
    b = _rows(tmp_path / "b.json", [("dynamic", 50.0, 0.5, 0.0), ("y", 50.5, 3.0, 1.0), ("z", 55.0, 8.0, 10.0)])
    points = load_points([a, b])
    assert {p.label: p.delta_pct for p in points}["y"] == 1.0  # the later file's row wins
    assert [p.label for p in front(points)] == ["dynamic", "y", "x", "z"]
    out = tmp_path / "out" / "m"
    assert main(["pareto", a, b, "--drop", "dynamic", "--title", "m", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| z | 8.00x | 55.000 | +10.00 % | yes |" in text and "| y | 3.00x | 50.500 | +1.00 % | yes |" in text
    assert (tmp_path / "out" / "m.png").stat().st_size > 10_000 and "dynamic" not in (tmp_path / "out" / "m.md").read_text()


def test_dominated_rows_are_off_the_front(tmp_path):
    a = _rows(tmp_path / "a.json", [("base", 50.0, 0.5, 0.0), ("good", 50.5, 4.0, 1.0), ("worse", 52.0, 3.9, 4.0)])
    assert "worse" not in [p.label for p in front(load_points([a]))]


def test_bad_inputs_name_the_fix(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["pareto", str(bad)]) == 2
    assert "write them with hf-kvcache bench --json" in capsys.readouterr().err
    a = _rows(tmp_path / "a.json", [("dynamic", 50.0, 0.5, 0.0)])
    b = _rows(tmp_path / "b.json", [("dynamic", 70.0, 0.5, 0.0)])
    with pytest.raises(ValueError, match="cannot share one front"):
        load_points([a, b])
    lacking = tmp_path / "c.json"
    lacking.write_text(json.dumps([{"cache": "x", "ratio": 2.0}]))
    with pytest.raises(ValueError, match=r"lacks \['perplexity', 'delta_pct'\]"):
        load_points([str(lacking)])


def test_proxy_correlation(tmp_path):
    from hf_kvcache.eval.proxy_check import correlation, pairs

    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"cache": "dynamic", "delta_pct": 0.0}] + [
        {"cache": f"c{i}", "delta_pct": d, "proxy": q} for i, (q, d) in enumerate([(0.01, 0.5), (0.02, 3.0), (0.05, 2.0),
                                                                                    (0.1, 9.0)])]))
    pts = pairs(str(path))
    assert [p[0] for p in pts] == ["c0", "c1", "c2", "c3"]
    r, s = correlation([q for _, q, _ in pts], [d for _, _, d in pts])
    assert s == pytest.approx(0.8)  # ranks 0,1,2,3 vs 0,2,1,3
    assert r == pytest.approx(0.9127, abs=1e-3)  # numpy.corrcoef of the same points
    with pytest.raises(ValueError, match="at least 3"):
        correlation([0.1, 0.2], [1.0, 2.0])


def test_tokens_keeps_one_window_of_a_file_that_holds_two(tmp_path, capsys):
    rows = [{"cache": c, "perplexity": p, "ratio": r, "delta_pct": d, "tokens": t} for c, p, r, d, t in (
        ("dynamic", 50.0, 0.5, 0.0, 2048), ("tiered", 50.2, 4.5, 0.4, 2048),
        ("dynamic", 40.0, 0.5, 0.0, 4096), ("tiered", 40.4, 4.8, 1.0, 4096))]
    path = tmp_path / "two.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(ValueError, match="baseline perplexity 40.000 differs from 50.000"):
        load_points([str(path)])
    assert {p.label: p.ratio for p in load_points([str(path)], tokens=4096)} == {"dynamic": 0.5, "tiered": 4.8}
    assert main(["pareto", str(path), "--tokens", "1024"]) == 2
    assert "no rows of 1024-token runs" in capsys.readouterr().err


def test_proxy_check_command_prints_the_correlations(tmp_path, capsys):
    from hf_kvcache.cli import main

    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"cache": f"c{i}", "delta_pct": d, "proxy": q}
                                for i, (q, d) in enumerate([(0.01, 0.5), (0.02, 3.0), (0.05, 2.0), (0.1, 9.0)])]))
    assert main(["proxy-check", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| rows | points | Pearson | Spearman |" and lines[-1].startswith("| pooled | 4 | ")
    assert lines[-1].endswith("| 0.800 |")  # ranks 0 1 2 3 against 0 2 1 3
