"""What a built wheel holds: every package folder of the source tree is declared in pyproject.toml (setuptools does
not find them itself here: `packages` is an explicit list, with `kernels/` and `eval/` mapped under `hf_kvcache`)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_every_package_folder_is_declared():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: Path(path) for name, path in setup["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == set(setup["packages"]), "add the missing package names to [tool.setuptools] packages"
