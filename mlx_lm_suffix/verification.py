"""Verification of drafts: which tokens a verification step commits.

Plain functions over token lists; no model, no cache (rejected positions are
undone by :mod:`~mlx_lm_suffix.rollback`). The acceptance rule is the one of mlx-lm's
``speculative_generate_step``: sample the target at every position, accept
draft tokens while they equal the sampled token, then emit the first sampled
token that differs (or the bonus token after a fully accepted draft). For a
point-mass draft this is lossless for greedy and sampled decoding alike.
"""

from __future__ import annotations

from typing import Sequence


def accepted_length(draft: Sequence[int], target: Sequence[int]) -> int:
    """Length of the longest prefix of ``draft`` that equals ``target``.

    ``target[i]`` is the token the target model chose at draft position ``i``;
    ``target`` has ``len(draft) + 1`` entries (the last one is the bonus).
    """
    if len(target) < len(draft) + 1:
        raise ValueError(
            f"target needs {len(draft) + 1} tokens for a draft of {len(draft)}, "
            f"got {len(target)}"
        )
    return common_prefix(draft, target)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
