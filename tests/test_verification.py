"""Verification as plain functions, without a model."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_lm_suffix.verification import accepted_length


def test_accepted_length_basic():
    assert accepted_length([], [7]) == 0
    assert accepted_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accepted_length([1, 2, 3], [1, 5, 3, 4]) == 1
    assert accepted_length([1, 2, 3], [9, 2, 3, 4]) == 0
    with pytest.raises(ValueError):
        accepted_length([1, 2], [1, 2])


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
    """Whatever is drafted, committing the accepted prefix and the token
    sampled after it (the correction, or the bonus) yields exactly the
    step-by-step greedy sequence."""
    seq = list(prompt)
    for i, draft in enumerate(drafts):
        if oracle[i]:  # sometimes draft the true continuation
            draft = list(draft)
            for j in range(len(draft)):
                draft[j] = _next_token(seq + draft[:j])
        targets = [_next_token(seq + list(draft[:j])) for j in range(len(draft) + 1)]
        a = accepted_length(draft, targets)
        seq += list(draft[:a]) + [targets[a]]
    greedy = list(prompt)
    while len(greedy) < len(seq):
        greedy.append(_next_token(greedy))
    assert seq == greedy
