"""Verification and rollback as plain functions, without a model."""

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlx_lm_suffix.verification import (
    accepted_length,
    batch_rollback_plan,
    committed_tokens,
    rollback,
    rollback_batch,
)


def test_accepted_length_basic():
    assert accepted_length([], [7]) == 0
    assert accepted_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_length([1, 2, 3], [1, 5, 3, 4]) == 1
    assert accepted_length([1, 2, 3], [9, 2, 3, 4]) == 0
    with pytest.raises(ValueError):
        accepted_length([1, 2], [1, 2])


def test_committed_tokens_appends_correction_or_bonus():
    assert committed_tokens([1, 2, 3], [1, 2, 9, 4]) == ([1, 2, 9], 2)
    assert committed_tokens([1, 2], [1, 2, 5]) == ([1, 2, 5], 2)


def _next_token(seq):
    """A deterministic 'greedy target': next token from the whole prefix."""
    return (sum(seq) * 31 + len(seq) * 7) % 5


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    drafts=st.lists(st.lists(st.integers(0, 4), max_size=6), min_size=1, max_size=12),
    oracle=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_verification_equals_stepwise_greedy(prompt, drafts, oracle):
    """Whatever is drafted, committing accepted prefix + correction yields
    exactly the step-by-step greedy sequence."""
    seq = list(prompt)
    for i, draft in enumerate(drafts):
        if oracle[i]:  # sometimes draft the true continuation
            draft = list(draft)
            for j in range(len(draft)):
                draft[j] = _next_token(seq + draft[:j])
        targets = [_next_token(seq + list(draft[:j])) for j in range(len(draft) + 1)]
        out, a = committed_tokens(draft, targets)
        assert out[:a] == list(draft[:a]) and len(out) == a + 1
        seq += out
    greedy = list(prompt)
    while len(greedy) < len(seq):
        greedy.append(_next_token(greedy))
    assert seq == greedy


def _kv(values):
    """A (1, 1, L, 1) array holding `values` along the sequence axis."""
    return mx.array(values, dtype=mx.float32).reshape(1, 1, -1, 1)


def test_rollback_single_cache():
    c = KVCache()
    c.update_and_fetch(_kv([1, 2, 3, 4, 5]), _kv([1, 2, 3, 4, 5]))
    rollback([c], 2)
    k, _ = c.update_and_fetch(_kv([9]), _kv([9]))
    assert k.flatten().tolist() == [1, 2, 3, 9]
    rollback([c], 0)
    assert c.offset == 4


def test_batch_rollback_plan():
    assert batch_rollback_plan([3, 1, 4]) == (1, [2, 0, 3])
    assert batch_rollback_plan([]) == (0, [])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    steps=st.lists(st.lists(st.integers(0, 5), min_size=4, max_size=4), min_size=1, max_size=4),
)
def test_rollback_batch_matches_per_row_content(lengths, steps):
    """Feed a right-padded block to every row, reject a different count per
    row, and check each row's visible cache equals its accepted tokens."""
    B = len(lengths)
    rows = [[float(100 * b + i) for i in range(n)] for b, n in enumerate(lengths)]
    width = max(lengths)
    cache = BatchKVCache([width - n for n in lengths])
    block = [[0.0] * (width - len(r)) + r for r in rows]
    x = mx.array(block).reshape(B, 1, width, 1)
    cache.update_and_fetch(x, x)
    counter = 1000.0
    for rejected in steps:
        rejected = rejected[:B]
        K = max(rejected) + 1
        new = []
        for _ in range(B):
            toks = [counter + j for j in range(K)]
            counter += K
            new.append(toks)
        x = mx.array(new).reshape(B, 1, K, 1)
        cache.update_and_fetch(x, x)
        rollback_batch([cache], rejected)
        for b in range(B):
            rows[b] += new[b][: K - rejected[b]]
        for b in range(B):
            got = cache.extract(b).keys.flatten().tolist()
            assert got == rows[b]
        # Offsets (RoPE positions) match each row's true length.
        assert cache.offset.tolist() == [len(r) for r in rows]
