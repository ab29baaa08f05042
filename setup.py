"""Everything is in pyproject.toml except one step: ship `hf_kvcache_lm_eval.pth` into site-packages, so that the
`lm_eval` command knows the `hf-kvcache` model (hf_kvcache_lm_eval_hook.py says how). A regular build puts the file at
the root of the wheel (build_lib); an editable build (PEP 660) at the root of the editable wheel (where setuptools
installs the build's library files), since the editable finder serves only modules, not .pth files."""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hf_kvcache_lm_eval.pth"
HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        target = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        self.mkpath(target)
        self.copy_file(os.path.join(HERE, PTH), os.path.join(target, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
