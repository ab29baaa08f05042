"""The README is a user guide: CI runs its test command, its quick start runs, its links resolve, it stays short."""

import contextlib
import io
import re
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](relative/path#anchor)


def test_ci_runs_the_readme_test_command():
    ci_command = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("pip install")][0]
    assert ci_command in README


def test_readme_is_a_short_guide():
    assert len(README.splitlines()) <= 350  # measurements live in docs/results/


@pytest.mark.parametrize("page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md")),
                                  *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/results/*.md"))])
def test_relative_links_resolve(page):
    path = ROOT / page
    missing = [target for target in LINK.findall(path.read_text())
               if "://" not in target and not (path.parent / target).exists()]
    assert not missing, f"{page} links to missing files: {missing}"


@pytest.mark.slow
def test_quick_start_runs():
    """Every ```python block of the README, run as written (SmolLM2-135M, a few generate calls; a block inside a list
    item is dedented)."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.DOTALL)
    assert blocks
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for block in blocks:
            exec(compile(textwrap.dedent(block), "README.md", "exec"), {})
    printed = out.getvalue()
    assert "'ratio':" in printed and "'bytes':" in printed  # cache.memory_stats()
