"""Rollback of rejected positions, per cache kind, without a model."""

import mlx.core as mx
from hypothesis import example, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    RotatingKVCache,
)

from mlx_lm_suffix import rollback


def _kv(values):
    """A (1, 1, L, 1) array holding `values` along the sequence axis."""
    return mx.array(values, dtype=mx.float32).reshape(1, 1, -1, 1)


def test_trim_single_cache():
    c = KVCache()
    c.update_and_fetch(_kv([1, 2, 3, 4, 5]), _kv([1, 2, 3, 4, 5]))
    saved = rollback.checkpoint([c])
    assert rollback.undo([c], saved, 5, 2) == 0  # trimmed, nothing to feed again
    k, _ = c.update_and_fetch(_kv([9]), _kv([9]))
    assert k.flatten().tolist() == [1, 2, 3, 9]
    assert rollback.undo([c], rollback.checkpoint([c]), 0, 0) == 0
    assert c.offset == 4


def test_rollback_plan():
    assert rollback.plan([3, 1, 4]) == (1, [2, 0, 3])
    assert rollback.plan([]) == (0, [])


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
        saved = rollback.checkpoint([cache])
        cache.update_and_fetch(x, x)
        assert not rollback.undo_rows([cache], saved, K, rejected)  # trimmed
        for b in range(B):
            rows[b] += new[b][: K - rejected[b]]
        for b in range(B):
            got = cache.extract(b).keys.flatten().tolist()
            assert got == rows[b]
        # Offsets (RoPE positions) match each row's true length.
        assert cache.offset.tolist() == [len(r) for r in rows]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    steps=st.lists(st.lists(st.integers(0, 5), min_size=4, max_size=4), min_size=1, max_size=5),
    read=st.integers(0, 3),
)
@example(lengths=[1, 6], steps=[[5, 0, 0, 0], [0, 5, 0, 0]], read=0)  # more rejected than held
def test_rejected_positions_swap_into_left_padding(lengths, steps, read):
    """With a :class:`~mlx_lm_suffix.rollback.SlotOrder`, each row's extra
    rejected positions leave without a roll: after every step a row's
    visible slots hold exactly its accepted tokens (in some order), its
    offset is its length, and one row read out and put back in order holds
    them in the order they were fed."""
    B = len(lengths)
    rows = [[float(100 * b + i) for i in range(n)] for b, n in enumerate(lengths)]
    width = max(lengths)
    cache = BatchKVCache([width - n for n in lengths])
    x = mx.array([[0.0] * (width - len(r)) + r for r in rows]).reshape(B, 1, width, 1)
    cache.update_and_fetch(x, x)
    order, counter = rollback.SlotOrder(), 1000.0
    order.rows = [None] * B
    for rejected in steps:
        rejected = rejected[:B]
        K = max(rejected) + 1
        new = [[counter + K * b + j for j in range(K)] for b in range(B)]
        counter += K * B
        x = mx.array(new).reshape(B, 1, K, 1)
        saved = rollback.checkpoint([cache])
        cache.update_and_fetch(x, x)
        for b in range(B):
            rows[b] += new[b][: K - rejected[b]]
        assert not rollback.undo_rows([cache], saved, K, rejected, order, [len(r) for r in rows])
        end, lp = cache._idx, cache.left_padding.tolist()
        for b in range(B):
            visible = cache.keys[b, 0, lp[b] : end, 0].tolist()
            assert sorted(visible) == sorted(rows[b]), (b, visible, rows[b])
        assert cache.offset.tolist() == [len(r) for r in rows]
    b = read % B
    row = [cache.extract(b)]
    rollback.in_order([cache], row, order, b)
    assert row[0].keys.flatten().tolist() == row[0].values.flatten().tolist() == rows[b]


class _Opaque(KVCache):
    """A kind the table does not know."""


def test_supported_kinds():
    assert rollback.supports([KVCache(), CacheList(KVCache(), ArraysCache(2))])
    assert rollback.supports([RotatingKVCache(max_size=4), ArraysCache(2)])
    assert not rollback.supports([KVCache(), _Opaque()])
    assert not rollback.supports([CacheList(KVCache(), _Opaque())])
    assert not rollback.supports([])
    assert rollback.supports_batch([BatchKVCache([0, 1])])
    assert rollback.supports_batch([BatchKVCache([0]), BatchRotatingKVCache(4, [0])])
    assert not rollback.supports_batch([KVCache()])
    # The policy counts a replay only where a layer restores.
    window = BatchRotatingKVCache(4, [0])
    assert not rollback.replays([BatchKVCache([0]), window], 16)
    assert rollback.replays([window, ArraysCache(1)], 2)
    assert rollback.describe([KVCache(), _Opaque()]) == "_Opaque"


def test_room_is_the_context_limit():
    c = RotatingKVCache(max_size=8)
    c.update_and_fetch(_kv([1, 2, 3]), _kv([1, 2, 3]))
    assert rollback.room([c]) == float("inf")  # a wrapped window restores
    assert rollback.room([KVCache(), c], limit=5) == 2
    sinks = RotatingKVCache(max_size=8, keep=4)  # max_kv_size's kind
    sinks.update_and_fetch(_kv([1, 2, 3]), _kv([1, 2, 3]))
    assert rollback.room([sinks]) == 4  # fed only until it would wrap
    assert rollback.room([ArraysCache(1), c], limit=5) == 2  # state keeps no positions
    rows = BatchKVCache([1, 0])  # a batch: its longest row's
    x = _kv([0, 1, 2, 3, 4, 5]).reshape(2, 1, 3, 1)
    rows.update_and_fetch(x, x)
    assert rollback.room([ArraysCache(1), rows], limit=5) == 2
    assert rollback.room([ArraysCache(1)], limit=5) == float("inf")


def test_compact_drops_shared_padding():
    c = BatchKVCache([2, 3])
    x = _kv(list(range(10))).reshape(2, 1, 5, 1)
    c.update_and_fetch(x, x)
    layers = [CacheList(c, ArraysCache(1))]
    assert not rollback.compact(layers, 2, 3)
    assert rollback.compact(layers, 2, 2)
    assert c.left_padding.tolist() == [0, 1]
    assert c.extract(1).keys.flatten().tolist() == [8, 9]


def test_undo_restores_what_cannot_trim():
    """A forward of 4 positions, 3 rejected: layers that trim keep the first;
    when a wrapped window or a recurrent state restores, every layer goes
    back to the checkpoint and the accepted position is fed again."""
    kv, rot = KVCache(), RotatingKVCache(max_size=5)
    for c in (kv, rot):
        c.update_and_fetch(_kv([1, 2]), _kv([1, 2]))
    saved = rollback.checkpoint([kv, rot])
    for c in (kv, rot):
        c.update_and_fetch(_kv([3, 9]), _kv([3, 9]))
    assert rollback.undo([kv, rot], saved, 2, 1) == 0  # both still trim
    assert kv.offset == rot.offset == 3
    saved = rollback.checkpoint([kv, rot])
    for c in (kv, rot):
        c.update_and_fetch(_kv([4, 5, 6, 7]), _kv([4, 5, 6, 7]))
    assert not rot.is_trimmable()
    assert rollback.undo([kv, rot], saved, 4, 3) == 1
    assert kv.offset == rot.offset == 3
    assert rot.keys_and_values()[0].flatten().tolist() == [1, 2, 3]
    s = ArraysCache(1)
    s[0] = mx.array([1.0])
    saved = rollback.checkpoint([s])
    s[0] = mx.array([2.0])
    assert rollback.undo([s], saved, 1, 1) == 0 and s[0].item() == 1.0


def _attended(c, block, window):
    """Feed ``block`` (one list of values per row) to a batch cache as keys
    and values; for every row and fed position, the sorted values its
    attention mask lets it see."""
    B, N = len(block), len(block[0])
    mask = c.make_mask(N, window_size=window)
    keys, _ = c.update_and_fetch(_kv(block).reshape(B, 1, N, 1), _kv(block).reshape(B, 1, N, 1))
    mask = mx.broadcast_to(mask, (B, 1, N, keys.shape[2])).tolist()
    seen = keys[:, 0, :, 0].tolist()
    return [
        [sorted(v for v, m in zip(seen[b], mask[b][0][j]) if m) for j in range(N)]
        for b in range(B)
    ]


class _KeysModel:
    """A model whose forward feeds its tokens to its first cache as keys and
    values, and records what each position attends."""

    def __init__(self, window, seen):
        self.window, self.seen = window, seen

    def __call__(self, inputs, cache):
        self.seen.append(_attended(cache[0], inputs.astype(mx.float32).tolist(), self.window))


def _windows(rows, n, window):
    """What stock's one-token steps attend for the last ``n`` values of each
    row: the ``window`` values up to each."""
    return [
        [sorted(r[max(0, len(r) - n + j + 1 - window) : len(r) - n + j + 1]) for j in range(n)]
        for r in rows
    ]


@settings(max_examples=60, deadline=None)
@example(lengths=[1, 6], steps=[1, [2, 0, 0, 0]], recurrent=False)  # wrapped, a row padded
@example(lengths=[2, 2], steps=[9, [0, 3, 0, 0]], recurrent=False)  # rolled, padding gone
@example(lengths=[2, 5], steps=[7, [1, 1, 0, 0]], recurrent=True)  # replays one token
@given(
    lengths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    steps=st.lists(
        st.one_of(
            st.integers(1, 12),  # this many one-token steps (stock's decoding)
            st.lists(st.integers(0, 5), min_size=4, max_size=4),  # a verification
        ),
        min_size=1,
        max_size=6,
    ),
    recurrent=st.booleans(),
)
def test_rollback_sliding_window_batch(lengths, steps, recurrent):
    """A batch of sliding windows (``BatchRotatingKVCache``, window 6; rows
    left-padded, most wrap): one-token steps and verifications of a block of
    positions rejecting a different count per row, in any order; with a
    recurrent layer next to it (``recurrent``), a rejection restores both
    and each row's kept positions are fed again, right-padded. Every
    position of every forward attends exactly the last 6 values of its row,
    as stock's one-token steps do, and each row's cache holds them."""
    W = 6
    B = len(lengths)
    rows = [[float(100 * (b + 1) + i) for i in range(n)] for b, n in enumerate(lengths)]
    width = max(lengths)
    cache = BatchRotatingKVCache(W, [width - n for n in lengths])
    layers = [cache, ArraysCache(1)] if recurrent else [cache]
    got = _attended(cache, [[-1.0] * (width - len(r)) + r for r in rows], W)
    assert [g[width - len(r) :] for g, r in zip(got, rows)] == [
        _windows([r], len(r), W)[0] for r in rows
    ]
    counter = 1000.0
    for step in steps:
        if isinstance(step, int):
            for _ in range(step):
                new = [[counter + b] for b in range(B)]
                counter += 10
                got = _attended(cache, new, W)
                rows = [r + n for r, n in zip(rows, new)]
                assert got == _windows(rows, 1, W)
            continue
        rejected = step[:B]
        K = max(rejected) + 1
        new = [[counter + 10 * j + b for j in range(K)] for b in range(B)]
        counter += 10 * K
        saved = rollback.checkpoint(layers)
        got = _attended(cache, new, W)
        assert got == _windows([r + n for r, n in zip(rows, new)], K, W)
        kept = [n[: K - x] for n, x in zip(new, rejected)]
        rows = [r + k for r, k in zip(rows, kept)]
        replayed = rollback.undo_rows(layers, saved, K, rejected)
        assert replayed == (recurrent and any(rejected))
        if replayed:
            fed = []
            rollback.replay_rows(_KeysModel(W, fed), layers, kept)
            for g, r, k in zip(fed[0], rows, kept):
                assert g[: len(k)] == _windows([r], len(k), W)[0]
        assert cache.offset.tolist() == [len(r) for r in rows]
        for b, r in enumerate(rows):
            kept = cache.extract(b).keys.flatten().tolist()
            assert len(kept) >= min(len(r), W) and kept == r[-len(kept) :]
