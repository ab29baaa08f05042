"""Makes `lm_eval --model hf-kvcache` work without importing anything heavy at interpreter start.

Installed beside `hf_kvcache` with the file `hf_kvcache_lm_eval.pth` (see setup.py), which Python runs at start-up
(`site`): it calls `install()`, which puts a finder on `sys.meta_path`. The finder does nothing until some code
imports `lm_eval.api.registry`; then it lets that module load as usual and registers in its `model_registry` the
lazy placeholder "hf_kvcache.eval.lm_eval:HFKVCacheLM" under the name `hf-kvcache`. lm-eval imports that module
(and with it torch and this package) only when a run asks for `--model hf-kvcache`; importing
`hf_kvcache.eval.lm_eval` directly upgrades the placeholder to the class it names. This module imports only `sys`
and `importlib`.
"""

from __future__ import annotations

import sys
from importlib.abc import Loader, MetaPathFinder

REGISTRY_MODULE = "lm_eval.api.registry"
MODEL_NAME = "hf-kvcache"
PLACEHOLDER = "hf_kvcache.eval.lm_eval:HFKVCacheLM"  # must be `module:class` of the class that registers itself


def register(registry) -> None:
    """Register the placeholder in lm-eval's model registry (the module `lm_eval.api.registry`), unless the name is
    taken (by the class itself, when `hf_kvcache.eval.lm_eval` was imported first)."""
    models = registry.model_registry
    if MODEL_NAME not in models:
        models.register(MODEL_NAME, target=PLACEHOLDER)


class _RegisteringLoader(Loader):
    """The registry module's own loader, then `register` on the loaded module."""

    def __init__(self, loader: Loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        register(module)


class _Finder(MetaPathFinder):
    """Answers only for `lm_eval.api.registry`, once: the spec the other finders give, with a registering loader."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != REGISTRY_MODULE:
            return None
        uninstall()
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Register now if lm-eval's registry is loaded already, else when it is."""
    if REGISTRY_MODULE in sys.modules:
        register(sys.modules[REGISTRY_MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    """Take the finder off `sys.meta_path`."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
