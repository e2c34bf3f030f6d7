"""mlx_lm_suffix's patches of mlx-lm: ``mlx_lm.generate``
(:mod:`~mlx_lm_suffix.patches.generate`) and ``mlx_lm.server``
(:mod:`~mlx_lm_suffix.patches.server`), with their command-line options in
:mod:`~mlx_lm_suffix.patches.args`.

:func:`apply` patches both modules at once, the first time either is
imported (the import hook of :mod:`mlx_lm_suffix._hook` calls it).
"""

from __future__ import annotations

import importlib
import warnings

from . import generate, server

TARGETS = ("mlx_lm.generate", "mlx_lm.server")

_applied = False


def apply() -> None:
    """Patch ``mlx_lm.generate`` and ``mlx_lm.server`` (importing the one not
    imported yet), all or nothing. Runs once per process; never raises."""
    global _applied
    if _applied:
        return
    _applied = True  # (importing mlx_lm.server below calls apply again)
    try:
        # runpy warns that `python -m mlx_lm.server` finds the module imported;
        # the import hook runs its main() instead of running it again.
        warnings.filterwarnings(
            "ignore",
            message=r"'mlx_lm\.server' found in sys\.modules after import of package",
            category=RuntimeWarning,
        )
        generate_module, server_module = (importlib.import_module(n) for n in TARGETS)
        # Every replacement is built before any is set.
        replacements = generate.patch(generate_module) + server.patch(server_module)
    except Exception as e:  # the hook must leave mlx-lm usable
        warnings.warn(
            f"mlx-lm-suffix: patching mlx-lm failed ({type(e).__name__}: {e}); "
            "mlx-lm runs stock, without suffix decoding.",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    for obj, name, value in replacements:
        setattr(obj, name, value)
