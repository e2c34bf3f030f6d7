"""Post-import hook: patch mlx-lm modules as soon as they are imported.

Kept free of heavy imports: the ``.pth`` startup file imports it in every
Python process of the environment.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from typing import Any, Optional, Sequence, Set

# Modules whose import triggers mlx_lm_suffix.patches.apply().
_TARGETS = ("mlx_lm.generate", "mlx_lm.server")
# Targets being executed: patching waits until none is half imported.
_executing: Set[str] = set()


def _apply() -> None:
    if _executing:
        return  # the target being executed calls again once it is imported
    try:
        from . import patches

        patches.apply()
    except Exception as e:  # an import must never fail because of the hook
        logging.getLogger("mlx_lm_suffix").warning(
            "mlx-lm-suffix: could not patch mlx-lm (%s: %s); mlx-lm runs stock, "
            "without suffix decoding.",
            type(e).__name__,
            e,
        )


class _Loader(importlib.abc.Loader):
    def __init__(self, name: str, loader: importlib.abc.Loader):
        self._name = name
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        _executing.add(self._name)
        try:
            self._loader.exec_module(module)
        finally:
            _executing.discard(self._name)
        _apply()

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
    if any(name in sys.modules for name in _TARGETS):
        _apply()
