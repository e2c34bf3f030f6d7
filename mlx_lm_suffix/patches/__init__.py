"""mlx_lm_suffix's patches of mlx-lm: ``mlx_lm.generate``
(:mod:`~mlx_lm_suffix.patches.generate`) and ``mlx_lm.server``
(:mod:`~mlx_lm_suffix.patches.server`), with their command-line options in
:mod:`~mlx_lm_suffix.patches.args`.

:func:`apply` patches both modules at once, the first time either is
imported (the import hook of :mod:`mlx_lm_suffix._hook` calls it), after
:func:`~mlx_lm_suffix.patches.compat.missing` found everything they rely on.
"""

from __future__ import annotations

import importlib
import logging
import warnings

from . import compat, generate, server

TARGETS = ("mlx_lm.generate", "mlx_lm.server")

logger = logging.getLogger("mlx_lm_suffix")

_applied = False


def apply() -> None:
    """Patch ``mlx_lm.generate`` and ``mlx_lm.server`` (importing the one not
    imported yet) for suffix decoding, all or nothing. Runs once per
    process; never raises.

    Where mlx-lm lacks anything the patches rely on (:func:`compat.missing`),
    it stays stock: one warning names its version and what it lacks, and
    the only change is that suffix drafting (``--suffix-draft``, ``--draft
    suffix``, a ``SuffixDrafter`` or ``"suffix"`` as draft model), which
    stock cannot serve, gets a one-line error naming the supported versions.
    """
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
        modules = [importlib.import_module(name) for name in TARGETS]
        missing = compat.missing()
        # Every replacement is built before any is set.
        if missing:
            logger.warning("%s", compat.warning(missing))
            replacements = generate.refuse(modules[0], missing) + server.refuse(modules[1], missing)
        else:
            replacements = generate.patch(modules[0]) + server.patch(modules[1])
    except Exception as e:  # the hook must leave mlx-lm usable
        logger.warning(
            "mlx-lm-suffix: patching mlx-lm failed (%s: %s); mlx-lm runs stock, "
            "without suffix decoding.",
            type(e).__name__,
            e,
        )
        return
    for obj, name, value in replacements:
        setattr(obj, name, value)
