from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ci_runs_the_readme_test_command():
    ci_command = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("pip install")][0]
    assert ci_command in (ROOT / "README.md").read_text()
