"""Undoing rejected draft positions: the one place that knows each cache kind.

After a verification that accepts ``a`` of ``k`` drafted tokens, every layer
cache must hold exactly the prompt plus the committed tokens, as if stock
mlx-lm had generated them one at a time. :data:`SINGLE` and :data:`BATCH`
map each cache class (mlx-lm 0.32.2, ``mlx_lm.models.cache``) to how its
last ``n`` positions are undone, for one sequence and for the rows of a
batch; a kind missing from the table cannot draft (the loops then generate
one token per step, as stock does).

- Single sequence: ``KVCache``, ``QuantizedKVCache``, ``ConcatenateKVCache``
  and ``ChunkedKVCache`` trim; a ``RotatingKVCache`` trims only while it has
  not wrapped, so a draft may fill it at most up to ``max_size - 1``; a
  ``CacheList`` trims each of its caches.
- Batch: ``BatchKVCache`` trims every row by the smallest count, then rolls
  each row's remaining rejected positions into its left padding, which the
  attention mask ignores (the move ``BatchKVCache.finalize`` makes for
  right-padded prompts). The roll copies the cache, so it is skipped when
  every row rejects the same count.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from mlx_lm.models import cache as _cache


class Kind(NamedTuple):
    """How a cache class rolls back: ``room(c)``, positions that may still
    be fed and undone (``math.inf``: no bound but the context); ``undo(c,
    n)``, drop the last ``n`` (single) or row ``i``'s last ``n[i]`` (batch)."""

    room: Callable[[Any], float]
    undo: Callable[[Any, Any], None]


def _trim(c: Any, n: int) -> None:
    if c.trim(n) != n:
        raise RuntimeError(f"{type(c).__name__} trimmed fewer than {n} positions")


def _unbounded(c: Any) -> float:
    return math.inf


def _rotating_room(c: Any) -> float:
    # Trimmable only while offset < max_size.
    return c.max_size - c.offset - 1


def _list_room(c: Any) -> float:
    return min((_kind(SINGLE, x).room(x) for x in c.caches), default=math.inf)


def _list_undo(c: Any, n: int) -> None:
    for x in c.caches:
        _kind(SINGLE, x).undo(x, n)


def plan(rejected: Sequence[int]) -> Tuple[int, List[int]]:
    """Split per-row rejections into one trim shared by all rows and each
    row's remaining count, which is rolled into its left padding."""
    if not rejected:
        return 0, []
    common = min(rejected)
    return common, [r - common for r in rejected]


def _batch_kv_undo(c: Any, rejected: Sequence[int]) -> None:
    common, extra = plan(rejected)
    if common:
        _trim(c, common)
    if any(extra):
        c.prepare(right_padding=list(extra))
        c.finalize()


SINGLE: Dict[type, Kind] = {
    _cache.KVCache: Kind(_unbounded, _trim),
    _cache.QuantizedKVCache: Kind(_unbounded, _trim),
    _cache.ConcatenateKVCache: Kind(_unbounded, _trim),
    _cache.ChunkedKVCache: Kind(_unbounded, _trim),
    _cache.RotatingKVCache: Kind(_rotating_room, _trim),
    _cache.CacheList: Kind(_list_room, _list_undo),
}
BATCH: Dict[type, Kind] = {
    _cache.BatchKVCache: Kind(_unbounded, _batch_kv_undo),
}


def _kind(table: Dict[type, Kind], c: Any) -> Optional[Kind]:
    # Exact classes only: a subclass may keep its state in other ways.
    return table.get(type(c))


def _supported(table: Dict[type, Kind], cache: List[Any]) -> bool:
    def ok(c: Any) -> bool:
        if _kind(table, c) is None:
            return False
        return table is not SINGLE or type(c) is not _cache.CacheList or all(map(ok, c.caches))

    return bool(cache) and all(ok(c) for c in cache)


def supports(cache: List[Any]) -> bool:
    """Whether every layer of a single-sequence cache can roll back."""
    return _supported(SINGLE, cache)


def supports_batch(cache: List[Any]) -> bool:
    """Whether every layer of a batch cache can roll rows back."""
    return _supported(BATCH, cache)


def describe(cache: List[Any]) -> str:
    """The cache kinds that cannot roll back, for messages."""
    bad = {type(c).__name__ for c in cache if type(c) not in SINGLE and type(c) not in BATCH}
    return ", ".join(sorted(bad)) or ", ".join(sorted({type(c).__name__ for c in cache}))


def room(cache: List[Any], limit: Optional[int] = None) -> float:
    """How many more positions a single-sequence cache can be fed and still
    be rolled back, within the context ``limit``."""
    n = min(_kind(SINGLE, c).room(c) for c in cache)
    offsets = [c.offset for c in cache if isinstance(getattr(c, "offset", None), int)]
    if limit is not None and offsets:
        n = min(n, limit - max(offsets))
    return n


def trim(cache: List[Any], n: int) -> None:
    """Drop the last ``n`` positions of a single-sequence cache."""
    if n > 0:
        for c in cache:
            _kind(SINGLE, c).undo(c, n)


def trim_rows(cache: List[Any], rejected: Sequence[int]) -> None:
    """Drop the last ``rejected[i]`` positions of row ``i`` of a batch cache."""
    if any(rejected):
        for c in cache:
            _kind(BATCH, c).undo(c, rejected)


def batch_length_bound(cache: List[Any]) -> int:
    """The length of the longest row of a batch cache, read without waiting
    for the forwards queued on it: mlx-lm 0.32.2's ``BatchKVCache`` keeps
    each row's length in ``offset``, an array that the queued forward's own
    update produces (reading it waits for that), and the filled length of
    its buffer, which bounds every row's, in the int ``_idx``."""
    c = cache[0]
    idx = getattr(c, "_idx", None)
    return idx if isinstance(idx, int) else max(c.offset.tolist())
