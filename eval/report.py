"""`hf-kvcache report`: the tables of the results pages, rendered from the row files the suites wrote.

A results page (`docs/results/*.md`, and the README) marks each table that comes from row files with a region:

    <!-- rows: docs/rows/uniform_zoo_smollm2-135m.json docs/rows/uniform_zoo_qwen2.5-coder-0.5b.json
         columns=delta_pct,ratio by=file names=SmolLM2|Qwen2.5 -->
    ... (written by `hf-kvcache report`) ...
    <!-- /rows -->

`hf-kvcache report` rewrites every region from its rows; `hf-kvcache report --check` rewrites nothing and exits 1,
naming each region whose text differs from what its rows render, so a table and its row file cannot drift.

The words of a region's opening comment (split as a shell splits them):
- sources: `PATH[@KEY][#key=value,...]`: a JSON row file (a list of rows, or an object whose `rows`, or `KEY`, holds
  them), optionally only the rows whose every `key` prints as `value` (the selector of `hf-kvcache paired`);
- `columns=a,b,...`: the row keys shown, each optionally `key:FORMAT` (FORMAT a Python format such as `{:.1f}`, or a
  name of `NAMED_FORMATS`); headers and formats of known keys come from `eval/rows.py` (`COLUMNS`);
- `by=file`: one line per label (`label=`, `cache` by default; several keys joined by a space) and one column per
  source, each cell the columns of that source's row joined by ", " (sources named by `names=A|B|...`);
- `format=text`: the rows as `hf-kvcache compare` prints them (`rows.format_rows`), in a code block, after the
  command that wrote them when every row records the same one; `pareto=no` drops its Pareto column;
- `format=ruler` / `format=long`: the suite's own markdown (`eval/suites/ruler.py:markdown_tables`, the summary of
  sample rows; `eval/long_context.py:markdown_table`, deltas vs the full cache with paired intervals).
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .rows import COLUMNS, DEPTH_PREFIX, Row, format_rows

def _ruler_markdown() -> Callable[[list[Row]], str]:
    from .suites.ruler import markdown_tables

    return markdown_tables


def _long_markdown() -> Callable[[list[Row]], str]:
    from .long_context import markdown_table

    return markdown_table


SUITES: dict[str, Callable[[], Callable[[list[Row]], str]]] = {"ruler": _ruler_markdown, "long": _long_markdown}
OPEN = re.compile(r"<!--\s*rows:(?P<spec>.*?)-->", re.DOTALL)
CLOSE = "<!-- /rows -->"
DEFAULT_PAGES = ("README.md", "docs/results/*.md")
MISSING = "-"
# name -> (how a value prints, what the header adds)
NAMED_FORMATS: dict[str, tuple[Callable[[Any], str], str]] = {
    "mib": (lambda v: f"{v / 2**20:.1f}", " (MiB)"),  # bytes -> MiB
    "mib2": (lambda v: f"{v / 2**20:.2f}", " (MiB)"),
    "pct": (lambda v: f"{v:+.2f}%", ""),
    "x": (lambda v: f"{v:.2f}x", ""),
}
# keys the suites write that `rows.COLUMNS` does not name (other suites' and peer scripts' rows): key, format, header
EXTRA_COLUMNS: dict[str, tuple[str, str]] = {key: (fmt, header) for key, fmt, header in (
    ("ppl", "{:.3f}", "ppl"), ("vs_fp16", "{:.3f}", "vs fp16"), ("vs_int8", "{:.2f}x", "vs int8"),
    ("bytes_per_token", "{:.0f}", "B/token"), ("encode_MBps", "{:.1f}", "enc MB/s"),
    ("decode_MBps", "{:.1f}", "dec MB/s"),
    ("peak_added_bytes", "{:,}", "peak bytes added"), ("cache_bytes", "{:,}", "cache bytes"), ("label", "{}", "row"),
)}


@dataclass(frozen=True)
class Source:
    """One row file and the rows of it a region takes."""

    path: str
    key: str = "rows"
    selector: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, word: str) -> Source:
        path, _, selector = word.partition("#")
        path, _, key = path.partition("@")
        pairs = [pair for pair in selector.split(",") if pair]
        if any("=" not in pair for pair in pairs):
            raise ValueError(f"selector {selector!r}: use key=value pairs separated by commas, e.g. cache=int4")
        return cls(path, key or "rows", tuple(tuple(pair.split("=", 1)) for pair in pairs))

    def rows(self, root: Path) -> list[Row]:
        """The selected rows of the file (`root`-relative path); a ValueError names the fix when there are none."""
        try:
            data = json.loads((root / self.path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read rows from {self.path}: {exc}; name a JSON row file (docs/rows/)") from exc
        rows = data.get(self.key) if isinstance(data, dict) else data
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{self.path} holds no rows under {self.key!r}: name the key with PATH@KEY")
        found = [r for r in rows if all(str(r.get(k)) == v for k, v in self.selector)]
        if not found:
            raise ValueError(f"{self.path}: no row matches {dict(self.selector)}; fix the #selector")
        return found


@dataclass(frozen=True)
class Column:
    """A row key shown in a table, with its header and how its values print."""

    key: str
    header: str
    fmt: str

    @classmethod
    def parse(cls, word: str) -> Column:
        key, _, fmt = word.partition(":")
        fallback = ("{:.0%}" if key.startswith(DEPTH_PREFIX) else "{}", key)  # passkey: accuracy per depth
        known_fmt, header = COLUMNS.get(key) or EXTRA_COLUMNS.get(key) or fallback
        if fmt and fmt not in NAMED_FORMATS and "{" not in fmt:
            raise ValueError(f"column {word!r}: a format is a Python format such as {{:.2f}} or one of "
                             f"{sorted(NAMED_FORMATS)}")
        return cls(key, header + NAMED_FORMATS[fmt][1] if fmt in NAMED_FORMATS else header, fmt or known_fmt)

    def cell(self, row: Row) -> str:
        value = row.get(self.key)
        if value is None:
            return MISSING
        if self.fmt in NAMED_FORMATS:
            return NAMED_FORMATS[self.fmt][0](value)
        try:
            return self.fmt.format(value)
        except (ValueError, TypeError):  # a label in a numeric column (e.g. "-" written by a suite)
            return str(value)


@dataclass
class RegionSpec:
    """What a region's opening comment asks for (see the module docstring)."""

    sources: list[Source]
    columns: list[Column] = field(default_factory=list)
    by_file: bool = False
    names: list[str] = field(default_factory=list)
    label: tuple[str, ...] = ("cache",)
    text: bool = False
    pareto: bool = True
    suite: str | None = None  # format=ruler / format=long: rendered by that suite's markdown function

    @classmethod
    def parse(cls, spec: str) -> RegionSpec:
        sources, options = [], {}
        for word in shlex.split(spec):
            name, eq, value = word.partition("=")
            if eq and "#" not in name and not name.endswith(".json") and "@" not in name:
                options[name] = value
            else:
                sources.append(Source.parse(word))
        unknown = set(options) - {"columns", "by", "names", "label", "format", "pareto"}
        if unknown or not sources:
            raise ValueError(f"rows region {spec.strip()!r}: give one or more row files and only the options "
                             "columns=, by=file, names=, label=, format=text, pareto=no" +
                             (f" (unknown: {sorted(unknown)})" if unknown else ""))
        if options.get("by", "file") != "file" or options.get("format", "text") not in ("text", "table", *SUITES):
            raise ValueError(f"rows region {spec.strip()!r}: by= takes only 'file', format= 'text', 'table', "
                             + ", ".join(repr(s) for s in SUITES))
        text = options.get("format") == "text"
        suite = options.get("format") if options.get("format") in SUITES else None
        columns = [Column.parse(w) for w in options.get("columns", "").split(",") if w]
        if not text and not suite and not columns:
            raise ValueError(f"rows region {spec.strip()!r}: name its columns=, or ask for format=text")
        names = options["names"].split("|") if "names" in options else [Path(s.path).stem for s in sources]
        if len(names) != len(sources):
            raise ValueError(f"rows region {spec.strip()!r}: names= gives {len(names)} names for "
                             f"{len(sources)} sources; separate them with |")
        return cls(sources, columns, "by" in options, names, tuple(options.get("label", "cache").split(",")),
                   text, options.get("pareto", "yes") != "no", suite)


def _label(row: Row, keys: tuple[str, ...]) -> str:
    return " ".join(str(row.get(k, MISSING)) for k in keys)


def _markdown(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(out + ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines])


def _by_file(spec: RegionSpec, tables: list[list[Row]]) -> str:
    labels: list[str] = []
    for rows in tables:
        labels += [lab for lab in (_label(r, spec.label) for r in rows) if lab not in labels]
    header = [spec.label[0] if len(spec.label) == 1 else " ".join(spec.label)] + spec.names
    lines = []
    for lab in labels:
        line = [lab]
        for rows in tables:
            row = next((r for r in rows if _label(r, spec.label) == lab), None)
            line.append(MISSING if row is None else ", ".join(c.cell(row) for c in spec.columns))
        lines.append(line)
    return _markdown(header, lines)


def render(spec: RegionSpec, root: Path) -> str:
    """The text a region holds: its rows as a markdown table (or `format_rows` text in a code block)."""
    tables = [source.rows(root) for source in spec.sources]
    if spec.by_file:
        return _by_file(spec, tables)
    rows = [r for rows in tables for r in rows]
    if spec.suite is not None:
        return SUITES[spec.suite]()(rows)
    if spec.text:
        commands = {r.get("command") for r in rows}
        head = f"$ {commands.pop()}\n" if len(commands) == 1 and None not in commands else ""
        return f"```\n{head}{format_rows(rows, pareto=spec.pareto)}\n```"
    return _markdown([c.header for c in spec.columns], [[c.cell(r) for c in spec.columns] for r in rows])


@dataclass
class Region:
    """A marked region of a page: where its body starts and ends (character offsets), what it asks for, and the
    indentation of its opening comment (a region inside a list item keeps the item's indentation)."""

    spec: str
    start: int
    end: int
    line: int
    indent: str = ""

    def name(self, page: str) -> str:
        first = shlex.split(self.spec)[0] if self.spec.strip() else "?"
        return f"{page}:{self.line} ({first})"


def find_regions(text: str, page: str = "<page>") -> list[Region]:
    """Every `<!-- rows: ... -->` ... `<!-- /rows -->` region of `text`; a ValueError names an unclosed one."""
    regions = []
    for match in OPEN.finditer(text):
        end = text.find(CLOSE, match.end())
        line = text.count("\n", 0, match.start()) + 1
        following = OPEN.search(text, match.end())
        if end < 0 or (following is not None and following.start() < end):
            raise ValueError(f"{page}:{line}: the rows region is not closed; end it with {CLOSE}")
        line_start = text.rfind("\n", 0, match.start()) + 1
        indent = text[line_start : match.start()]
        regions.append(Region(match.group("spec"), match.end(), end, line, indent if not indent.strip() else ""))
    return regions


def render_page(text: str, root: Path, page: str = "<page>") -> tuple[str, list[str]]:
    """`text` with every region rendered from its rows, and the names of the regions whose text changed."""
    out, changed, last = [], [], 0
    for region in find_regions(text, page):
        try:
            rendered = render(RegionSpec.parse(region.spec), root)
            body = "".join(f"\n{region.indent}{line}" for line in rendered.split("\n")) + "\n" + region.indent
        except ValueError as exc:
            raise ValueError(f"{page}:{region.line}: {exc}") from exc
        if text[region.start : region.end] != body:
            changed.append(region.name(page))
        out += [text[last : region.start], body]
        last = region.end
    return "".join(out) + text[last:], changed


def report(pages: list[str], root: Path, check: bool = False) -> list[str]:
    """Render every region of `pages` (paths or globs, relative to `root`); with `check`, write nothing. Returns
    the names of the regions that differed from their rows."""
    paths = sorted({p for pattern in pages for p in glob.glob(str(root / pattern))})
    if not paths:
        raise ValueError(f"no page matches {pages} under {root}; run from the repository root or pass --root")
    changed = []
    for path in paths:
        page = str(Path(path).relative_to(root))
        text = Path(path).read_text()
        new, differ = render_page(text, root, page)
        changed += differ
        if differ and not check:
            Path(path).write_text(new)
    return changed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pages", nargs="*", default=list(DEFAULT_PAGES),
                   help="pages (paths or globs under --root) whose rows regions are rendered")
    p.add_argument("--root", default=".", help="the repository root: row files and pages are relative to it")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming every region that differs from what its rows render")


def main_args(args: argparse.Namespace) -> int:
    changed = report(args.pages, Path(args.root), args.check)
    for name in changed:
        print(f"{'differs from its rows' if args.check else 'rendered'}: {name}")
    if args.check and changed:
        print(f"{len(changed)} region(s) differ from their rows: run hf-kvcache report", file=sys.stderr)
        return 1
    return 0
