"""Undoing rejected draft positions: the one place that knows each cache kind.

After a verification that accepts ``a`` of ``k`` drafted tokens, every layer
cache must hold exactly the prompt plus the committed tokens, as if stock
mlx-lm had generated them one at a time. :data:`SINGLE` and :data:`BATCH`
map each cache class (mlx-lm 0.32.2, ``mlx_lm.models.cache``) to its
:class:`Kind`, one small strategy per kind with the same methods, for one
sequence and for the rows of a batch; the mlx-lm fields a kind touches are
named once, in its class. A kind missing from the table cannot draft (the
loops then generate one token per step, as stock does); a ``CacheList``
stands for its caches, each rolled back by its own kind.

Single sequence:

- :class:`Trim` (``KVCache``, ``QuantizedKVCache``, ``ConcatenateKVCache``,
  ``ChunkedKVCache``): drop the last ``n`` positions.
- :class:`Recurrent` (``ArraysCache``: recurrent state, which cannot be
  trimmed): put back the state saved before the forward
  (:func:`checkpoint`; MLX arrays are immutable, so saving costs no copy).
  The accepted tokens are then no longer in the cache and are fed again.
- :class:`Window` (``RotatingKVCache``, a sliding window): trim while it
  has not wrapped, else restore. A window that keeps its first tokens
  (``keep``, as ``max_kv_size`` makes it) is fed only until it would wrap
  (:func:`room`): once wrapped, a multi-token update shows the later
  positions fewer of them than one-token steps do.

When any layer restores, every layer goes back to the checkpoint (the
trimming ones drop all positions fed since), so that all of them hold the
same tokens; :func:`undo` then says how many of the fed tokens to feed
again.

Batch: :class:`Rows` (``BatchKVCache``) trims, rows rejecting different
counts; a batch's ``ArraysCache`` restores (:class:`Recurrent`), which
sends every row back, to be fed its kept tokens again in one right-padded
forward (:func:`undo_rows`, :func:`replay_rows`). :class:`BatchWindow`
(``BatchRotatingKVCache``: sliding windows, or ``max_kv_size``, in a batch)
trims like ``BatchKVCache``, also once wrapped: a multi-token update keeps
``max_size - 1`` earlier positions plus the new ones in time order, so at
least ``max_size`` remain once a row keeps one of them, which is all a
one-token step after it attends. Where another layer restores, it restores
too.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models import cache as _cache

from . import internals


def _saved(state: Any) -> Any:
    # New handles, sharing the data: an ArraysCache's layers assign into its
    # list in place, and caches update arrays in place (``left_padding -= n``,
    # ``keys[..., i] = k``), which changes every handle of the array.
    def handle(v: Any) -> Any:
        return mx.array(v) if isinstance(v, mx.array) else v

    return tuple([handle(x) for x in v] if isinstance(v, list) else handle(v) for v in state)


def _restore(c: Any, saved: Any) -> None:
    c.state = _saved(saved)  # a copy: the checkpoint may serve again


class Kind:
    """How the caches of one kind roll back: the protocol of every entry of
    :data:`SINGLE` and :data:`BATCH`. The defaults are those of a kind that
    can drop its last positions at any time and so saves nothing."""

    def save(self, c: Any) -> Any:
        """What to save right before a forward that may be undone (``None``:
        nothing, it will trim)."""
        return None

    def can_trim(self, c: Any) -> bool:
        """Whether it can drop its last positions now (else it goes back to
        its checkpoint)."""
        return True

    def trim(self, c: Any, n: int) -> None:
        """Drop the last ``n`` positions (of every row, in a batch)."""
        if n and c.trim(n) != n:
            raise RuntimeError(f"{type(c).__name__} trimmed fewer than {n} positions")

    def rewind(self, c: Any, saved: Any, fed: int) -> None:
        """Go back to where ``saved`` (what :meth:`save` returned) was taken,
        ``fed`` positions ago."""
        self.trim(c, fed)

    def trim_rows(self, c: Any, n: int, extra: Sequence[int]) -> None:
        """A batch: drop every row's last ``n`` positions and roll row
        ``i``'s last ``extra[i]`` into its left padding (the attention mask
        ignores it). Only where :meth:`can_trim`."""
        raise NotImplementedError(f"{type(c).__name__} has no rows to trim")

    def finalize(self, c: Any) -> None:
        """A batch: ``c.finalize()`` after ``prepare`` with right padding."""
        c.finalize()

    def room(self, c: Any) -> float:
        """How many more positions it can take and still roll back."""
        return math.inf

    def length(self, c: Any) -> Optional[int]:
        """A bound on the length of its longest sequence, read without
        waiting for a queued forward (``None``: it keeps no positions)."""
        return None

    def replays(self, c: Any, n: int) -> bool:
        """Whether undoing a forward of ``n`` more positions may restore it
        (and so feed the kept tokens again)."""
        return False


class Trim(Kind):
    """``KVCache``, ``QuantizedKVCache``, ``ConcatenateKVCache``,
    ``ChunkedKVCache``: drop the last positions."""

    # mlx-lm 0.32.2 fields: offset (positions held, an int).

    def length(self, c: Any) -> Optional[int]:
        return c.offset


class Window(Kind):
    """``RotatingKVCache``: trim while it has not wrapped, else restore; one
    that keeps its first tokens is fed only until it would wrap."""

    # mlx-lm 0.32.2 fields: offset (positions fed, an int), max_size (the
    # window), keep (first positions never evicted; max_kv_size's window).

    def save(self, c: Any) -> Any:
        return _saved(c.state)

    def can_trim(self, c: Any) -> bool:
        return c.is_trimmable()

    def rewind(self, c: Any, saved: Any, fed: int) -> None:
        if self.can_trim(c):
            self.trim(c, fed)
        else:
            _restore(c, saved)

    def room(self, c: Any) -> float:
        return c.max_size - c.offset - 1 if c.keep else math.inf

    def length(self, c: Any) -> Optional[int]:
        return c.offset

    def replays(self, c: Any, n: int) -> bool:
        return c.offset + n >= c.max_size


class Recurrent(Kind):
    """``ArraysCache`` (one sequence's or a batch's recurrent state): never
    trims; restores the state saved before the forward."""

    # mlx-lm 0.32.2 fields: none beyond ``state``.

    def save(self, c: Any) -> Any:
        return _saved(c.state)

    def can_trim(self, c: Any) -> bool:
        return False

    def rewind(self, c: Any, saved: Any, fed: int) -> None:
        _restore(c, saved)

    def replays(self, c: Any, n: int) -> bool:
        return True


class Rows(Kind):
    """``BatchKVCache``: trim every row, rolling each row's extra rejected
    positions into its left padding (the move ``finalize`` makes for
    right-padded prompts), or swapping them there (:meth:`swap_rows`)."""

    # mlx-lm 0.32.2 fields: keys, values (rows x heads x slots x dims),
    # offset and left_padding (per row, arrays); its filled length
    # (internals.filled).

    def trim_rows(self, c: Any, n: int, extra: Sequence[int]) -> None:
        self.trim(c, n)
        if any(extra):
            c.prepare(right_padding=list(extra))
            self.finalize(c)

    def swap_rows(self, c: Any, n: int, extra: Sequence[int], held: Sequence[int]) -> None:
        """As :meth:`trim_rows`, but row ``i``'s first ``extra[i]`` slots
        become its left padding, the held positions among them (``held[i]``
        it holds after) copied over its last rejected ones: a few positions
        a row move, not the cache (see :class:`SlotOrder`)."""
        self.trim(c, n)
        if c.keys is None or not any(extra):
            return
        moves = [(i, min(e, h)) for i, (e, h) in enumerate(zip(extra, held)) if e]
        rows = mx.array([i for i, m in moves for _ in range(m)])
        front = c.left_padding[rows] + mx.array([j for _, m in moves for j in range(m)])
        end = internals.filled(c)
        back = mx.array([end - m + j for _, m in moves for j in range(m)])
        c.keys[rows, :, back] = c.keys[rows, :, front]
        c.values[rows, :, back] = c.values[rows, :, front]
        moved = mx.array(list(extra))
        c.offset = c.offset - moved
        c.left_padding = c.left_padding + moved

    def put_in_order(self, c: Any, order: Sequence[int]) -> None:
        """A row read out of a batch (``c``: the ``KVCache`` its ``extract``
        made) in the order its positions were fed, ``order[j]`` the
        position its ``j``-th slot holds (slots past ``order``: in order)."""
        if c.keys is None:
            return
        slots = [0] * len(order)
        for j, k in enumerate(order):
            slots[k] = j
        take = mx.array(slots + list(range(len(order), c.keys.shape[2])))
        c.keys, c.values = c.keys[:, :, take], c.values[:, :, take]

    def length(self, c: Any) -> Optional[int]:
        return internals.filled(c)

    def padding(self, c: Any) -> int:
        """The left padding every row holds (:func:`compact`; waits for
        the forwards queued on the cache)."""
        return min(c.left_padding.tolist())


class BatchWindow(Kind):
    """``BatchRotatingKVCache``: trim every row as :class:`Rows` does, also
    once wrapped; restore where another layer restores."""

    # mlx-lm 0.32.2 fields: left_padding (per row, an array); its buffer,
    # write index and positions fed (internals: time_order,
    # cut_window_buffer, window_fed).

    def save(self, c: Any) -> Any:
        # In time order first, as its multi-token update would do (so at no
        # extra cost): make_mask builds the mask before that update, from
        # the rotated buffer, and then masks one position too many of a row
        # still holding left padding.
        internals.time_order(c)
        return _saved(c.state)

    def rewind(self, c: Any, saved: Any, fed: int) -> None:
        _restore(c, saved)

    def trim_rows(self, c: Any, n: int, extra: Sequence[int]) -> None:
        self.trim(c, n)
        # Its multi-token update left the buffer in time order; mlx-lm's next
        # one-token update sizes the window by the buffer, so drop the tail.
        internals.cut_window_buffer(c)
        if any(extra):
            # finalize rolls each row by how far its offset then is past its
            # offset now plus ``lengths``: by ``extra``.
            c.prepare(lengths=[-e for e in extra], right_padding=list(extra))
            self.finalize(c)

    def finalize(self, c: Any) -> None:
        # From no left padding where its count went negative (a wrapped row's
        # padding is gone; finalize adds the rolled positions to the count,
        # which then misses them).
        c.left_padding = mx.maximum(c.left_padding, 0)
        c.finalize()

    def length(self, c: Any) -> Optional[int]:
        return internals.window_fed(c)


TRIM, WINDOW, RECURRENT, ROWS, BATCH_WINDOW = Trim(), Window(), Recurrent(), Rows(), BatchWindow()

#: Single-sequence cache kinds.
SINGLE: Dict[type, Kind] = {
    _cache.KVCache: TRIM,
    _cache.QuantizedKVCache: TRIM,
    _cache.ConcatenateKVCache: TRIM,
    _cache.ChunkedKVCache: TRIM,
    _cache.RotatingKVCache: WINDOW,
    _cache.ArraysCache: RECURRENT,
}

#: Batch cache kinds.
BATCH: Dict[type, Kind] = {
    _cache.BatchKVCache: ROWS,
    _cache.BatchRotatingKVCache: BATCH_WINDOW,
    _cache.ArraysCache: RECURRENT,
}

_ANY: Dict[type, Kind] = {**SINGLE, **BATCH}


def layers(cache: List[Any]) -> List[Any]:
    """The caches of every layer, those of a ``CacheList`` one by one (a
    layer's, or a draft model's: :mod:`~mlx_lm_suffix.sources.
    draft_model`)."""
    out = []
    for c in cache:
        # mlx-lm 0.32.2 fields: CacheList.caches.
        out.extend(layers(c.caches) if isinstance(c, _cache.CacheList) else [c])
    return out


def _kinds(cache: List[Any], table: Dict[type, Kind]) -> List[Tuple[Any, Kind]]:
    """Every layer with its kind in ``table`` (``KeyError``: a kind it lacks)."""
    return [(c, table[type(c)]) for c in layers(cache)]


def _known(cache: List[Any]) -> List[Tuple[Any, Kind]]:
    """Every layer of a known kind, one sequence's or a batch's, with it."""
    return [(c, _ANY[type(c)]) for c in layers(cache) if type(c) in _ANY]


def supports(cache: List[Any]) -> bool:
    """Whether every layer of a single-sequence cache can roll back."""
    found = layers(cache)
    return bool(found) and all(type(c) in SINGLE for c in found)


def supports_batch(cache: List[Any]) -> bool:
    """Whether every layer of a batch cache can roll rows back."""
    found = layers(cache)
    return bool(found) and all(type(c) in BATCH for c in found)


def trims(cache: List[Any]) -> bool:
    """Whether every layer of a single-sequence cache drops its last
    positions at any time (:class:`Trim`): nothing of it is saved before a
    forward, and its positions held are one number."""
    found = layers(cache)
    return bool(found) and all(SINGLE.get(type(c)) is TRIM for c in found)


def trim(cache: List[Any], n: int) -> None:
    """Every layer of a cache that :func:`trims` drops its last ``n`` positions."""
    for c in layers(cache):
        TRIM.trim(c, n)


def held(cache: List[Any]) -> int:
    """The positions a cache that :func:`trims` holds."""
    return TRIM.length(layers(cache)[0])


class Checkpoint(NamedTuple):
    """The states of the layers that may have to restore, by layer index."""

    states: Dict[int, Any]


def checkpoint(cache: List[Any]) -> Checkpoint:
    """Save what :func:`undo` or :func:`undo_rows` needs, right before a
    forward of more than one position (no copy)."""
    saved = (kind.save(c) for c, kind in _kinds(cache, _ANY))
    return Checkpoint({i: s for i, s in enumerate(saved) if s is not None})


def _rewind(kinds: List[Tuple[Any, Kind]], saved: Checkpoint, fed: int) -> None:
    """Every layer back to the checkpoint, ``fed`` positions ago."""
    for i, (c, kind) in enumerate(kinds):
        kind.rewind(c, saved.states.get(i), fed)


def undo(cache: List[Any], saved: Checkpoint, fed: int, rejected: int) -> int:
    """Drop the last ``rejected`` of the ``fed`` positions fed since
    ``saved`` was taken. Returns how many of the fed tokens (the first ones)
    must be fed again: ``0`` when every layer could trim, else ``fed -
    rejected`` (every layer is back at the checkpoint)."""
    if rejected <= 0:
        return 0
    kinds = _kinds(cache, SINGLE)
    if all(kind.can_trim(c) for c, kind in kinds):
        for c, kind in kinds:
            kind.trim(c, rejected)
        return 0
    _rewind(kinds, saved, fed)
    return fed - rejected


def room(cache: List[Any], limit: Optional[int] = None) -> float:
    """How many more positions a cache (one sequence's, or a batch's) can
    take and still be rolled back, within the context ``limit`` (a batch:
    its longest row's, :func:`batch_length_bound`)."""
    kinds = _known(cache)
    n = min((kind.room(c) for c, kind in kinds), default=math.inf)
    if limit is not None:
        longest = batch_length_bound(cache)
        if longest is None:
            lengths = (kind.length(c) for c, kind in kinds)
            longest = max((x for x in lengths if x is not None), default=None)
        if longest is not None:
            n = min(n, limit - longest)
    return n


def replays(cache: List[Any], n: int) -> bool:
    """Whether a rejection after feeding ``n`` more positions may cost
    feeding the kept tokens again (:func:`undo`, :func:`undo_rows`): a
    layer restores, or a single sequence's window would wrap."""
    return any(kind.replays(c, n) for c, kind in _known(cache))


def describe(cache: List[Any]) -> str:
    """The cache kinds that cannot roll back, for messages."""
    names = {type(c).__name__ for c in layers(cache) if type(c) not in SINGLE}
    return ", ".join(sorted(names or {type(c).__name__ for c in cache}))


def drop(cache: List[Any], saved: Checkpoint, fed: int) -> None:
    """Drop every position fed since ``saved`` (every row's, in a batch,
    all fed as many): each layer goes back on its own (nothing of them is
    kept, so nothing is fed again)."""
    _rewind(_kinds(cache, _ANY), saved, fed)


def plan(rejected: Sequence[int]) -> Tuple[int, List[int]]:
    """Split per-row rejections into one trim shared by all rows and each
    row's remaining count, which is rolled into its left padding."""
    if not rejected:
        return 0, []
    common = min(rejected)
    return common, [r - common for r in rejected]


class SlotOrder:
    """Where the rows of a batch's ``BatchKVCache`` layers hold their
    positions, so that a row's extra rejected positions can leave it without
    a copy of the cache.

    A row holds its positions in the slots after its left padding, and the
    attention mask lets a new position attend to every one of them: their
    keys were rotated by their own positions when they were written, so
    attention does not depend on which slot holds which. So a row that
    rejects ``e`` more positions than the batch's common trim needs no roll
    (a copy of every layer's whole cache, the cost of a forward): its first
    ``e`` held slots are copied over the ``e`` rejected ones and become left
    padding (:meth:`Rows.swap_rows`; a row holding fewer positions than
    that moves all of them), and so does a replay's right padding
    (:func:`replay_rows`). Its slots are then out of the order
    they were fed, which only reading a row out of the batch needs
    (``extract``: a prompt cache trims a sequence from its end); this keeps
    each row's order, ``None`` while it is the fed order, and
    :func:`in_order` puts a row read out back in order (a copy of that row,
    as reading it out makes anyway). Models whose
    configuration names an attention window (``internals.windowed``) keep
    rolling: a windowed mask reads positions by slot."""

    def __init__(self) -> None:
        #: Per row: ``order[j]``, the position (from its first) that its
        #: ``j``-th held slot holds, up to its last swap (later slots are
        #: in order); None: all in order.
        self.rows: List[Optional[List[int]]] = []

    def swapped(self, extra: Sequence[int], held: Sequence[int]) -> None:
        """Rows whose first ``extra[i]`` held slots went to their end,
        ``held[i]`` positions held after."""
        for i, (e, n) in enumerate(zip(extra, held)):
            if e:
                order = self.rows[i] or []
                full = order + list(range(len(order), n))
                self.rows[i] = full[e:n] + full[: min(e, n)]

    def keep(self, keep: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in keep]


def in_order(cache: List[Any], row_cache: List[Any], order: SlotOrder, row: int) -> None:
    """``row_cache``, row ``row`` of the batch ``cache`` read out
    (``extract``), with every ``BatchKVCache`` layer's positions in the
    order they were fed (see :class:`SlotOrder`)."""
    slots = order.rows[row]
    if slots is None:
        return
    for (_, kind), out in zip(_kinds(cache, BATCH), layers(row_cache), strict=True):
        if kind is ROWS:
            kind.put_in_order(out, slots)


def undo_rows(cache: List[Any], saved: Checkpoint, fed: int, rejected: Sequence[int],
              order: Optional[SlotOrder] = None, held: Sequence[int] = ()) -> bool:
    """Drop the last ``rejected[i]`` of the ``fed`` positions fed to row
    ``i`` since ``saved``. Returns whether every row went back to the
    checkpoint instead, so that each row's kept tokens must be fed again
    (:func:`replay_rows`).

    Where no layer restores, all rows are trimmed by the smallest count and
    each row's remaining rejected positions leave its ``BatchKVCache``
    layers: with ``order`` (the batch's :class:`SlotOrder`; ``held[i]``: the
    positions row ``i`` holds after) swapped into its left padding, else
    rolled there (the move ``finalize`` makes for right-padded prompts: it
    copies the cache). The attention mask ignores left padding."""
    if order is not None and len(held) != len(rejected):
        raise ValueError(f"held: {len(held)} rows, rejected: {len(rejected)}")
    if not any(rejected):
        return False
    kinds = _kinds(cache, BATCH)
    if all(kind.can_trim(c) for c, kind in kinds):
        drop_rows(cache, rejected, order, held)
        return False
    _rewind(kinds, saved, fed)
    return True


def drop_rows(cache: List[Any], rejected: Sequence[int], order: Optional[SlotOrder] = None,
              held: Sequence[int] = ()) -> None:
    """Drop row ``i``'s last ``rejected[i]`` positions, where every layer of
    the batch cache can trim (:func:`undo_rows`, whose arguments these are)."""
    common, extra = plan(rejected)
    for c, kind in _kinds(cache, BATCH):
        if order is not None and kind is ROWS:
            kind.swap_rows(c, common, extra, held)
        else:
            kind.trim_rows(c, common, extra)
    if order is not None:
        order.swapped(extra, held)


def replay_rows(model: Any, cache: List[Any], tokens: Sequence[Sequence[int]],
                order: Optional[SlotOrder] = None, held: Sequence[int] = ()) -> mx.array:
    """Feed each row its ``tokens`` (right-padded, as mlx-lm's prompt
    processing feeds uneven chunks: ``prepare``, forward, ``finalize``).
    With ``order`` (and ``held``, as for :func:`undo_rows`) the padding
    leaves the ``BatchKVCache`` layers by a swap, not ``finalize``'s roll.
    Returns the model's output (its logits, lazy: each row's last token's
    at its own length)."""
    lengths = [len(t) for t in tokens]
    width = max(lengths)
    padding = [width - n for n in lengths]
    inputs = mx.array([list(t) + [0] * p for t, p in zip(tokens, padding)], dtype=mx.uint32)
    kinds = _kinds(cache, BATCH)
    swap = order is not None and any(padding)
    if any(padding):
        for c, kind in kinds:
            if not (swap and kind is ROWS):
                c.prepare(lengths=lengths, right_padding=padding)
    logits = model(inputs, cache=cache)
    if any(padding):
        for c, kind in kinds:
            if swap and kind is ROWS:
                kind.swap_rows(c, 0, padding, held)
            else:
                kind.finalize(c)
        if swap:
            order.swapped(padding, held)
    return logits


def kv_rows(cache: List[Any]) -> List[Any]:
    """The ``BatchKVCache`` layers of a batch cache (rolled rows leave left
    padding there)."""
    return [c for c in layers(cache) if BATCH.get(type(c)) is ROWS]


def compact(cache: List[Any], rows: int, min_padding: int) -> bool:
    """Drop the left padding every row of a batch cache shares, once it is
    at least ``min_padding`` (uneven rollbacks add it to the
    ``BatchKVCache`` layers, and their ``filter`` drops it; a copy of the
    cache, so not every step). Returns whether it did."""
    padded = kv_rows(cache)
    if not padded or ROWS.padding(padded[0]) < min_padding:
        return False
    keep = list(range(rows))
    for c in layers(cache):
        c.filter(keep)
    return True


def batch_length_bound(cache: List[Any]) -> Optional[int]:
    """A bound on the length of the longest row of a batch cache (``None``
    for a cache with no positions, e.g. recurrent state alone), read
    without waiting for the forwards queued on it: a ``BatchKVCache``
    layer's filled buffer, else a ``BatchRotatingKVCache``'s count of every
    position fed (:meth:`Kind.length`)."""
    found = layers(cache)
    for kind in (ROWS, BATCH_WINDOW):
        for c in found:
            if BATCH.get(type(c)) is kind:
                return kind.length(c)
    return None
