"""Verification of drafts and rollback of rejected positions.

Plain functions: they take token lists (and, for rollback, cache objects)
and need no model. The acceptance rule is the one of mlx-lm's
``speculative_generate_step``: sample the target at every position, accept
draft tokens while they equal the sampled token, then emit the first sampled
token that differs (or the bonus token after a fully accepted draft). For a
point-mass draft this is lossless for greedy and sampled decoding alike.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

from mlx_lm.models.cache import BatchKVCache, trim_prompt_cache


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
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


def committed_tokens(draft: Sequence[int], target: Sequence[int]) -> Tuple[List[int], int]:
    """Tokens a verification step commits, and how many came from the draft.

    Returns ``(draft[:a] + [target[a]], a)`` with ``a = accepted_length``."""
    a = accepted_length(draft, target)
    return list(draft[:a]) + [int(target[a])], a


def rollback(cache: List[Any], rejected: int) -> None:
    """Drop the last ``rejected`` positions of a single-sequence cache."""
    if rejected > 0:
        trimmed = trim_prompt_cache(cache, rejected)
        if trimmed != rejected:
            raise RuntimeError(
                f"cache rollback trimmed {trimmed} of {rejected} positions"
            )


def batch_length_bound(cache: List[Any]) -> int:
    """The length of the longest row of a batch cache, read without waiting
    for the forwards queued on it: mlx-lm 0.32.2's ``BatchKVCache`` keeps
    each row's length in ``offset``, an array that the queued forward's own
    update produces (reading it waits for that), and the filled length of
    its buffer, which bounds every row's, in the int ``_idx``."""
    c = cache[0]
    idx = getattr(c, "_idx", None)
    return idx if isinstance(idx, int) else max(c.offset.tolist())


def batch_rollback_plan(rejected: Sequence[int]) -> Tuple[int, List[int]]:
    """Split per-row rejections into one trim shared by all rows and each
    row's remaining count, which is rolled into its left padding."""
    if not rejected:
        return 0, []
    common = min(rejected)
    return common, [r - common for r in rejected]


def can_rollback_batch(cache: List[Any]) -> bool:
    """Whether :func:`rollback_batch` supports every layer cache."""
    return all(type(c) is BatchKVCache for c in cache)


def rollback_batch(cache: List[Any], rejected: Sequence[int]) -> None:
    """Drop the last ``rejected[i]`` positions of row ``i`` of a batch cache.

    All rows are trimmed by the smallest count; each row's remaining rejected
    positions are rolled to the left edge of its buffer and counted as left
    padding, which the attention mask already ignores (the same move that
    ``BatchKVCache.finalize`` makes for right-padded prompts). The roll copies
    the cache, so it is skipped when every row rejects the same count.
    """
    common, extra = batch_rollback_plan(rejected)
    for c in cache:
        if common:
            c.trim(common)
        if any(extra):
            c.prepare(right_padding=list(extra))
            c.finalize()
