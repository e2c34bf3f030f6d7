"""Post-import hook: patch mlx-lm modules as soon as they are imported.

Kept free of heavy imports: the ``.pth`` startup file imports it in every
Python process of the environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Optional, Sequence

# Modules whose import triggers a patch, mapped to the patch function name in
# mlx_lm_suffix.integration.
_TARGETS = {"mlx_lm.generate": "patch_generate", "mlx_lm.server": "patch_server"}


def _apply(name: str, module: Any) -> None:
    from . import integration

    getattr(integration, _TARGETS[name])(module)


class _Loader(importlib.abc.Loader):
    def __init__(self, name: str, loader: importlib.abc.Loader):
        self._name = name
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _apply(self._name, module)

    def get_code(self, fullname: str):
        # runpy (`python -m mlx_lm.server`, `python -m mlx_lm.generate`) runs
        # a module's code as __main__, which would bypass the patch: run the
        # patched module's main() instead.
        source = (
            f"import importlib as _importlib\n"
            f"_module = _importlib.import_module({fullname!r})\n"
            f"if __name__ == '__main__':\n"
            f"    _module.main()\n"
        )
        return compile(source, self._loader.get_filename(fullname), "exec")

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, is_package, get_resource_reader, ...
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Any = None
    ):
        if fullname not in _TARGETS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(fullname, spec.loader)
        return spec


def install() -> None:
    """Patch the mlx-lm modules already imported and those imported later."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    for name in _TARGETS:
        if name in sys.modules:
            _apply(name, sys.modules[name])
