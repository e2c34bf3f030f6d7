"""Scoring a verification's positions as stock mlx-lm scores one token a step.

A verification forward gives logits at several positions at once; stock's
steps give one each. Every position here gets what its own step would
have: the logits processors see the tokens up to it (:func:`process`), and
the sampler draws for the positions in turn, each from the random state the
draws before it left (:func:`sample`), so that the ``n``-th token of a
request is drawn with the same random state as in stock's ``n``-th step;
after the accepted ones, the state is put back to where stock's would be
(:func:`rewind`). With a seed, a request then samples stock's tokens
(wherever the wide forward's logits do not move a draw across a boundary,
as they can flip a greedy near-tie). Rows of a batch draw in turn from
one global state, as stock's batched steps do; there only the
distribution is stock's.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx

Processor = Callable[[mx.array, mx.array], mx.array]


def process(
    processors: Sequence[Processor],
    seen: mx.array,
    logits: mx.array,
    n: Optional[int] = None,
) -> mx.array:
    """``logits`` (positions x vocabulary) after ``processors``: the
    positions are the last ``logits.shape[0]`` tokens of ``seen`` (the
    tokens before them first), and position ``j`` sees ``seen`` up to its
    own token; positions from ``n`` on (padding) stay as they are."""
    width = logits.shape[0]
    n = width if n is None else n
    start = seen.size - width
    rows = []
    for j in range(width):
        # (The last position sees all of ``seen``, and one position, as a
        # plain step's, is the whole of ``logits``: neither is sliced.)
        row = logits[j : j + 1] if width > 1 else logits
        if j < n:
            tokens = seen[: start + j + 1] if j + 1 < width else seen
            for processor in processors:
                row = processor(tokens, row)
        rows.append(row)
    return rows[0] if width == 1 else mx.concatenate(rows)


def sample(sampler: Callable[[mx.array], mx.array], logprobs: mx.array
           ) -> Tuple[mx.array, Optional[List[mx.array]]]:
    """Each position's token (``logprobs``: positions x vocabulary), drawn
    in turn, and the global random state after each draw (None where the
    sampler draws nothing, as the greedy one: then all positions are
    sampled in one call)."""
    state = mx.random.state
    before = state[0]
    first = sampler(logprobs[:1])
    if state[0] is before:
        return (sampler(logprobs) if logprobs.shape[0] > 1 else first), None
    tokens, states = [first], [state[0]]
    for j in range(1, logprobs.shape[0]):
        tokens.append(sampler(logprobs[j : j + 1]))
        states.append(state[0])
    return mx.concatenate(tokens), states


def rewind(states: Optional[List[mx.array]], draws: int) -> None:
    """Put the global random state back to where it was after the first
    ``draws`` draws of :func:`sample` (nothing where it drew nothing).

    MLX sets the state only by seed, and the key of seed ``s`` is the two
    32-bit halves of ``s`` (mlx 0.32, checked by :func:`_keys_are_seeds`):
    a key read back is its seed."""
    if states is not None:
        set_key(states[draws - 1])


def set_key(key: mx.array) -> bool:
    """Make ``key`` MLX's global random key again; whether it could (where
    MLX's keys are not seeds, :func:`_keys_are_seeds`, it cannot)."""
    if not _keys_are_seeds():
        return False
    hi, lo = key.tolist()
    mx.random.seed((hi << 32) | lo)
    return True


_KEY_LAYOUT: List[bool] = []


def _keys_are_seeds() -> bool:
    if not _KEY_LAYOUT:
        s = (3 << 32) | 5
        _KEY_LAYOUT.append(mx.random.key(s).tolist() == [3, 5])
    return _KEY_LAYOUT[0]
