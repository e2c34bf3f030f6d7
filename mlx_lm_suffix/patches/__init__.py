"""mlx_lm_suffix's patches of mlx-lm, declared as data: ``mlx_lm.generate``
(:mod:`~mlx_lm_suffix.patches.generate`) and ``mlx_lm.server``
(:mod:`~mlx_lm_suffix.patches.server`), with their command-line options in
:mod:`~mlx_lm_suffix.patches.args`. Each is a list of
:class:`~mlx_lm_suffix.patches.compat.Patch` (target, attribute, a named
replacement, the mlx-lm versions it relies on); :func:`apply` applies them
all, or, where mlx-lm lacks what they rely on, the refusals, all or nothing,
the first time either module is imported (the import hook of
:mod:`mlx_lm_suffix._hook` calls it).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import sys
import warnings
from typing import Any, List, Sequence, Tuple

from . import compat, generate, server

TARGETS = ("mlx_lm.generate", "mlx_lm.server")
PATCHES: List[compat.Patch] = generate.PATCHES + server.PATCHES
REFUSALS: List[compat.Patch] = generate.REFUSALS + server.REFUSALS

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
    stock cannot serve, gets a one-line error naming the supported versions
    (:data:`REFUSALS`).
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
        for name in TARGETS:
            importlib.import_module(name)
        missing = compat.missing(PATCHES)
        if missing:
            logger.warning("%s", compat.warning(missing))
            compat.MISSING[:] = missing
        # Every target is found before anything is set.
        found = _resolve(REFUSALS if missing else PATCHES)
    except Exception as e:  # the hook must leave mlx-lm usable
        logger.warning(
            "mlx-lm-suffix: patching mlx-lm failed (%s: %s); mlx-lm runs stock, "
            "without suffix decoding.",
            type(e).__name__,
            e,
        )
        return
    for owner, patch, old in found:
        _set(owner, patch.name, patch.new, old)


def _resolve(patches: Sequence[compat.Patch]) -> List[Tuple[Any, compat.Patch, Any]]:
    """Each patch's owner (module or class) and what it replaces; a required
    patch whose target is missing raises, a patch not required is left out."""
    out = []
    for p in patches:
        module, _, qualname = p.target.partition(":")
        owner: Any = sys.modules[module]
        for part in filter(None, qualname.split(".")):
            owner = getattr(owner, part)
        if not hasattr(owner, p.name):
            if p.required:
                raise AttributeError(f"{p.target} has no {p.name}")
            continue
        out.append((owner, p, getattr(owner, p.name)))
    return out


def _set(owner: Any, name: str, new: Any, old: Any) -> None:
    """``owner.name = new``, ``new`` a wrapper of ``old`` (a function looks
    like it; :func:`compat.original` reaches it). A package that bound
    ``old`` by name (``from .generate import stream_generate``) gets
    ``new`` too."""
    if inspect.isfunction(new):
        if inspect.isfunction(old):
            functools.update_wrapper(new, old)
        new.__wrapped__ = old
    setattr(owner, name, new)
    package = sys.modules.get(getattr(owner, "__name__", "").rpartition(".")[0])
    if package is not None and getattr(package, name, None) is old:
        setattr(package, name, new)
