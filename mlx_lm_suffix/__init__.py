"""Suffix decoding for mlx-lm.

Importing this package (or starting Python with the package installed, via
its ``.pth`` file) patches ``mlx_lm.stream_generate``, ``mlx_lm.generate``,
the ``mlx_lm.generate`` CLI and ``mlx_lm.server`` so that they accept a
:class:`SuffixDrafter` (or ``"suffix"``) as the draft model.
"""

from typing import Any

from ._hook import install

__version__ = "0.1.0"

__all__ = ["SuffixDrafter", "suffix_generate_step", "install", "__version__"]

install()


def __getattr__(name: str) -> Any:
    # Lazy: the startup hook imports this package in every Python process.
    if name == "SuffixDrafter":
        from .drafter import SuffixDrafter

        return SuffixDrafter
    if name == "suffix_generate_step":
        from .loop import suffix_generate_step

        return suffix_generate_step
    raise AttributeError(f"module 'mlx_lm_suffix' has no attribute {name!r}")
