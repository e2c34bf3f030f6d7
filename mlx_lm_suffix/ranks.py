"""Distributed serving: every rank verifies rank 0's drafts.

mlx-lm's distributed server (``mlx.launch ... -- mlx_lm.server``) runs the
same generation loop on every rank in lock step: rank 0 reads the requests
and shares them (``ResponseGenerator._share_object``), every rank feeds its
shard of the model, and each forward's collectives pair with the other
ranks' same forward. So every rank must run the same forwards over the same
tokens. Drafts come from rank-local state (the trees, a cache file only rank
0 reads, timings), so what drafting adds to a forward is decided on rank 0
and shared: the drafts, cut to the lengths verified (:func:`drafts`), and
whether a cost probe times one more forward (:func:`flag`). Everything else
that decides a forward follows from what is shared, from the requests, and
from the tokens the forwards sample, which are the same on every rank (stock
relies on that too): checks of first tokens, acceptance, rollback, replays,
and the widths the cost curve probes (its points are widths verified).

The shared values are summed over the ranks (``mx.distributed.all_sum``,
rank 0's values and zeros elsewhere) on the generation thread's stream, in
order with the forwards' own collectives. In a group of one, every function
returns its input and nothing is communicated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List, Optional, Sequence

import mlx.core as mx

_group: Optional[mx.distributed.Group] = None
_checked = False


def group() -> Optional[mx.distributed.Group]:
    """The distributed group of this process when it has more than one rank."""
    global _group, _checked
    if not _checked:
        g = mx.distributed.init()
        _group, _checked = (g if g.size() > 1 else None), True
    return _group


def following() -> bool:
    """Whether this process is a rank other than 0 (it drafts nothing)."""
    g = group()
    return g is not None and g.rank() != 0


def _from_leader(values: List[int], n: int, g: mx.distributed.Group) -> List[int]:
    """Rank 0's ``values`` (``n`` of them; other ranks' are ignored)."""
    mine = values if g.rank() == 0 else [0] * n
    return mx.distributed.all_sum(mx.array(mine, mx.int32), group=g).tolist()


def flag(value: bool) -> bool:
    """Rank 0's ``value``."""
    g = group()
    if g is None:
        return value
    return bool(_from_leader([int(value)], 1, g)[0])


def drafts(rows: Sequence[Any]) -> List[Any]:
    """Rank 0's drafts (:class:`~mlx_lm_suffix.drafter.Draft`), one per row
    (the rows are the same on every rank). Other ranks get their tokens, in
    their own (empty) drafts with estimates of 0: they decide nothing."""
    g = group()
    if g is None or not rows:
        return list(rows)
    lengths = _from_leader([len(d) for d in rows], len(rows), g)
    total = sum(lengths)
    tokens = _from_leader([t for d in rows for t in d.tokens], total, g) if total else []
    if g.rank() == 0:
        return list(rows)
    out, at = [], 0
    for d, n in zip(rows, lengths):
        out.append(replace(d, tokens=tokens[at : at + n], probs=[0.0] * n))
        at += n
    return out
