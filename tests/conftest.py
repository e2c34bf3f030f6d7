"""Shared fixtures: tiny random-weight models built locally, saved to a
folder and loaded through the real ``mlx_lm.load``."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """Cache root for built models: $MLX_LM_SUFFIX_HOME (reused across runs,
    the Makefile sets it) or a fresh temporary folder."""
    home = os.environ.get("MLX_LM_SUFFIX_HOME")
    return Path(home) if home else tmp_path_factory.mktemp("mlx_lm_suffix")


@pytest.fixture(scope="session")
def tiny_model_path(models_dir) -> Path:
    from mlx_lm_suffix.tools.models import ensure_model

    return ensure_model("qwen3", "tiny", cache_dir=models_dir)


@pytest.fixture(scope="session")
def tiny_llama_path(models_dir) -> Path:
    from mlx_lm_suffix.tools.models import ensure_model

    return ensure_model("llama", "tiny", cache_dir=models_dir)


@pytest.fixture(scope="session")
def tiny_family_path(models_dir):
    """``family -> path``: the tiny random-weight model of any family in
    ``mlx_lm_suffix.tools.models.FAMILIES``, built on first use."""
    from mlx_lm_suffix.tools.models import ensure_model

    return lambda family: ensure_model(family, "tiny", cache_dir=models_dir)
