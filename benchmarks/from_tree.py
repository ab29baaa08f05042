"""`hf-kvcache` run from another checkout of this repository (a `git worktree` at an earlier commit), so that a
change can be timed against its parent at the same time on the other core (each run pairs its caches with its own
DynamicCache; the two runs share the machine's state). The package, `eval` and `kernels` are imported from the tree
given, not from the installed copy; the compiled kernels build from that tree's C sources (their build key is the
source).

    git worktree add /tmp/before 3fca6d8
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/from_tree.py /tmp/before compare --suite decode ... &
    OMP_NUM_THREADS=1 taskset -c 0 hf-kvcache compare --suite decode ...
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


class _TreeFinder:
    """Maps the package's three import roots to the folders of one checkout."""

    def __init__(self, root: Path) -> None:
        self.roots = {"hf_kvcache": root / "hf_kvcache", "hf_kvcache.eval": root / "eval",
                      "hf_kvcache.kernels": root / "kernels"}

    def find_spec(self, name: str, path=None, target=None):
        folder = self.roots.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])


def main() -> int:
    if len(sys.argv) < 3 or not (Path(sys.argv[1]) / "hf_kvcache" / "__init__.py").is_file():
        raise SystemExit("usage: python benchmarks/from_tree.py CHECKOUT hf-kvcache-arguments...: CHECKOUT must be a "
                         "checkout of this repository (a folder holding hf_kvcache/__init__.py)")
    root = Path(sys.argv[1]).resolve()
    sys.meta_path.insert(0, _TreeFinder(root))
    from hf_kvcache.cli import main as cli

    sys.argv = ["hf-kvcache", *sys.argv[2:]]
    print(f"hf_kvcache from {root}", file=sys.stderr)
    return cli()


if __name__ == "__main__":
    sys.exit(main())
