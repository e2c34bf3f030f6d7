"""Undoing rejected draft positions: the one place that knows each cache kind.

After a verification that accepts ``a`` of ``k`` drafted tokens, every layer
cache must hold exactly the prompt plus the committed tokens, as if stock
mlx-lm had generated them one at a time. :data:`SINGLE` and :data:`BATCH`
map each cache class (mlx-lm 0.32.2, ``mlx_lm.models.cache``) to how its
last ``n`` positions are undone, for one sequence and for the rows of a
batch; a kind missing from the table cannot draft (the loops then generate
one token per step, as stock does).

Single sequence, three ways:

- :data:`TRIM` (``KVCache``, ``QuantizedKVCache``, ``ConcatenateKVCache``,
  ``ChunkedKVCache``): drop the last ``n`` positions.
- :data:`RESTORE` (``ArraysCache``: recurrent state, which cannot be
  trimmed): put back the state saved before the forward
  (:func:`checkpoint`; MLX arrays are immutable, so saving costs no copy).
  The accepted tokens are then no longer in the cache and are fed again.
- :data:`EITHER` (``RotatingKVCache``, a sliding window): trim while it has
  not wrapped, else restore. A window that keeps its first tokens
  (``keep``, as ``max_kv_size`` makes it) is fed only until it would wrap
  (:func:`room`): once wrapped, a multi-token update shows the later
  positions fewer of them than one-token steps do.

When any layer restores, every layer goes back to the checkpoint (the
trimming ones drop all positions fed since), so that all of them hold the
same tokens; :func:`undo` then says how many of the fed tokens to feed
again. A ``CacheList`` does this for each of its caches.

Batch (:data:`BATCH`): ``BatchKVCache`` trims, rows rejecting different
counts; a batch's ``ArraysCache`` restores, which sends every row back, to
be fed its kept tokens again in one right-padded forward (:func:`undo_rows`,
:func:`replay_rows`). ``BatchRotatingKVCache`` (sliding windows, or
``max_kv_size``, in a batch) trims like ``BatchKVCache``, also once wrapped:
a multi-token update keeps ``max_size - 1`` earlier positions plus the new
ones in time order, so at least ``max_size`` remain once a row keeps one
of them, which is all a one-token step after it attends. Where another
layer restores, it restores too (:data:`EITHER`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models import cache as _cache

TRIM, RESTORE, EITHER = "trim", "restore", "either"

#: Single-sequence cache kinds and how each undoes positions.
SINGLE: Dict[type, str] = {
    _cache.KVCache: TRIM,
    _cache.QuantizedKVCache: TRIM,
    _cache.ConcatenateKVCache: TRIM,
    _cache.ChunkedKVCache: TRIM,
    _cache.RotatingKVCache: EITHER,
    _cache.ArraysCache: RESTORE,
}


def _layers(cache: List[Any]) -> List[Any]:
    """The caches of every layer, those of a ``CacheList`` one by one."""
    out = []
    for c in cache:
        out.extend(_layers(c.caches) if type(c) is _cache.CacheList else [c])
    return out


def supports(cache: List[Any]) -> bool:
    """Whether every layer of a single-sequence cache can roll back."""
    layers = _layers(cache)
    return bool(layers) and all(type(c) in SINGLE for c in layers)


class Checkpoint(NamedTuple):
    """The states of the layers that may have to restore, by layer index."""

    states: Dict[int, Any]


def _saved(state: Any) -> Any:
    # New handles, sharing the data: an ArraysCache's layers assign into its
    # list in place, and caches update arrays in place (``left_padding -= n``,
    # ``keys[..., i] = k``), which changes every handle of the array.
    def handle(v: Any) -> Any:
        return mx.array(v) if isinstance(v, mx.array) else v

    return tuple([handle(x) for x in v] if isinstance(v, list) else handle(v) for v in state)


def checkpoint(cache: List[Any]) -> Checkpoint:
    """Save what :func:`undo` or :func:`undo_rows` needs, right before a
    forward of more than one position (no copy).

    A wrapped ``BatchRotatingKVCache`` is put in time order first, as its
    multi-token update would do (so at no extra cost): mlx-lm 0.32.2's
    ``make_mask`` builds the mask before that update, from the rotated
    buffer, and then masks one position too many of a row still holding
    left padding."""
    kinds = {**SINGLE, **BATCH}
    for c in _layers(cache):
        if type(c) is _cache.BatchRotatingKVCache:
            c._temporal_order()
    return Checkpoint(
        {i: _saved(c.state) for i, c in enumerate(_layers(cache)) if kinds[type(c)] != TRIM}
    )


def undo(cache: List[Any], saved: Checkpoint, fed: int, rejected: int) -> int:
    """Drop the last ``rejected`` of the ``fed`` positions fed since
    ``saved`` was taken. Returns how many of the fed tokens (the first ones)
    must be fed again: ``0`` when every layer could trim, else ``fed -
    rejected`` (every layer is back at the checkpoint)."""
    if rejected <= 0:
        return 0
    layers = _layers(cache)
    if all(SINGLE[type(c)] == TRIM or c.is_trimmable() for c in layers):
        for c in layers:
            _trim(c, rejected)
        return 0
    for i, c in enumerate(layers):
        if i in saved.states and (SINGLE[type(c)] == RESTORE or not c.is_trimmable()):
            c.state = _saved(saved.states[i])  # a copy: the checkpoint may serve again
        else:
            _trim(c, fed)
    return fed - rejected


def room(cache: List[Any], limit: Optional[int] = None) -> float:
    """How many more positions a cache (one sequence's, or a batch's) can
    take and still be rolled back, within the context ``limit`` (a batch:
    its longest row's)."""
    layers = _layers(cache)
    n = min(
        (c.max_size - c.offset - 1 for c in layers if type(c) is _cache.RotatingKVCache and c.keep),
        default=math.inf,
    )
    if limit is not None:
        if any(type(c) in BATCH for c in layers):
            longest = batch_length_bound(cache)
        else:
            offsets = [c.offset for c in layers if isinstance(getattr(c, "offset", None), int)]
            longest = max(offsets, default=None)
        if longest is not None:
            n = min(n, limit - longest)
    return n


def replays(cache: List[Any], n: int) -> bool:
    """Whether a rejection after feeding ``n`` more positions may cost
    feeding the kept tokens again (:func:`undo`, :func:`undo_rows`): a
    layer restores, or a single sequence's window would wrap."""
    for c in _layers(cache):
        kind = SINGLE.get(type(c)) or BATCH.get(type(c))
        if kind == RESTORE:
            return True
        if type(c) is _cache.RotatingKVCache and c.offset + n >= c.max_size:
            return True
    return False


def describe(cache: List[Any]) -> str:
    """The cache kinds that cannot roll back, for messages."""
    names = {type(c).__name__ for c in _layers(cache) if type(c) not in SINGLE}
    return ", ".join(sorted(names or {type(c).__name__ for c in cache}))


def _trim(c: Any, n: int) -> None:
    if n and c.trim(n) != n:
        raise RuntimeError(f"{type(c).__name__} trimmed fewer than {n} positions")


def plan(rejected: Sequence[int]) -> Tuple[int, List[int]]:
    """Split per-row rejections into one trim shared by all rows and each
    row's remaining count, which is rolled into its left padding."""
    if not rejected:
        return 0, []
    common = min(rejected)
    return common, [r - common for r in rejected]


#: Batch cache kinds and how each undoes positions (per row for ``TRIM``;
#: ``EITHER``: per row where every layer trims, else restore).
BATCH: Dict[type, str] = {
    _cache.BatchKVCache: TRIM,
    _cache.BatchRotatingKVCache: EITHER,
    _cache.ArraysCache: RESTORE,
}


def supports_batch(cache: List[Any]) -> bool:
    """Whether every layer of a batch cache can roll rows back."""
    layers = _layers(cache)
    return bool(layers) and all(type(c) in BATCH for c in layers)


def undo_rows(cache: List[Any], saved: Checkpoint, fed: int, rejected: Sequence[int]) -> bool:
    """Drop the last ``rejected[i]`` of the ``fed`` positions fed to row
    ``i`` since ``saved``. Returns whether every row went back to the
    checkpoint instead, so that each row's kept tokens must be fed again
    (:func:`replay_rows`).

    Where no layer restores, all rows are trimmed by the smallest count and
    each row's remaining rejected positions are rolled into its left
    padding, which the attention mask ignores (the move ``finalize`` makes
    for right-padded prompts; it copies the cache, so it is skipped when
    every row rejects the same count)."""
    if not any(rejected):
        return False
    layers = _layers(cache)
    common, extra = plan(rejected)
    if not any(BATCH[type(c)] == RESTORE for c in layers):
        for c in layers:
            _trim_rows(c, common, extra)
        return False
    for i, c in enumerate(layers):
        if i in saved.states:
            c.state = _saved(saved.states[i])  # a copy: the checkpoint may serve again
        else:
            _trim(c, fed)
    return True


def _trim_rows(c: Any, n: int, extra: Sequence[int]) -> None:
    """Trim every row of a batch cache by ``n`` and roll row ``i``'s last
    ``extra[i]`` positions into its left padding."""
    _trim(c, n)
    window = type(c) is _cache.BatchRotatingKVCache
    if window:
        # Its multi-token update left the buffer in time order; mlx-lm's next
        # one-token update sizes the window by the buffer, so drop the tail.
        c.keys, c.values = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
    if not any(extra):
        return
    if window:
        # finalize rolls each row by how far its offset then is past its
        # offset now plus ``lengths``: by ``extra``.
        c.prepare(lengths=[-e for e in extra], right_padding=list(extra))
    else:
        c.prepare(right_padding=list(extra))
    _finalize(c)


def _finalize(c: Any) -> None:
    """``c.finalize()``, a sliding window's from no left padding where its
    count went negative (a wrapped row's padding is gone; mlx-lm 0.32.2
    adds the rolled positions to the count, which then misses them)."""
    for layer in _layers([c]):
        if type(layer) is _cache.BatchRotatingKVCache:
            layer.left_padding = mx.maximum(layer.left_padding, 0)
        layer.finalize()


def replay_rows(model: Any, cache: List[Any], tokens: Sequence[Sequence[int]]) -> None:
    """Feed each row its ``tokens`` (right-padded, as mlx-lm's prompt
    processing feeds uneven chunks: ``prepare``, forward, ``finalize``)."""
    lengths = [len(t) for t in tokens]
    width = max(lengths)
    padding = [width - n for n in lengths]
    inputs = mx.array([list(t) + [0] * p for t, p in zip(tokens, padding)], dtype=mx.uint32)
    if any(padding):
        for c in cache:
            c.prepare(lengths=lengths, right_padding=padding)
    model(inputs, cache=cache)
    if any(padding):
        for c in cache:
            _finalize(c)


def kv_rows(cache: List[Any]) -> List[Any]:
    """The ``BatchKVCache`` layers of a batch cache (rolled rows leave left
    padding there)."""
    return [c for c in _layers(cache) if type(c) is _cache.BatchKVCache]


def compact(cache: List[Any], rows: int, min_padding: int) -> bool:
    """Drop the left padding every row of a batch cache shares, once it is
    at least ``min_padding`` (uneven rollbacks add it to the
    ``BatchKVCache`` layers, and their ``filter`` drops it; a copy of the
    cache, so not every step). Returns whether it did."""
    padded = kv_rows(cache)
    if not padded or min(padded[0].left_padding.tolist()) < min_padding:
        return False
    keep = list(range(rows))
    for c in cache:
        c.filter(keep)
    return True


def batch_length_bound(cache: List[Any]) -> Optional[int]:
    """A bound on the length of the longest row of a batch cache (``None``
    for a cache with no positions, e.g. recurrent state alone), read
    without waiting for the forwards queued on it: mlx-lm 0.32.2 keeps each
    row's length in ``offset``, an array that the queued forward's own
    update produces (reading it waits for that), and the filled length of
    the buffer in an int, ``BatchKVCache._idx`` (``BatchRotatingKVCache``:
    every position fed, ``_offset``)."""
    kv = kv_rows(cache)
    if kv:
        return kv[0]._idx
    windows = [c for c in _layers(cache) if type(c) is _cache.BatchRotatingKVCache]
    return windows[0]._offset if windows else None
