"""Where the tools keep what they build or fetch: models, tokenizers, wheels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Root of the cache: ``cache_dir``, else ``$MLX_LM_SUFFIX_HOME``,
    else ``$XDG_CACHE_HOME/mlx_lm_suffix`` (default ``~/.cache/mlx_lm_suffix``).

    Models live in ``<root>/models/``, tokenizers in ``<root>/tokenizers/``,
    the real model's wheel in ``<root>/wheels/``.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if home := os.environ.get("MLX_LM_SUFFIX_HOME"):
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "mlx_lm_suffix"
