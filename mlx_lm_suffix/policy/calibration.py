"""Calibration of the suffix trees' probability estimates."""

from __future__ import annotations

import bisect
from typing import Any, Dict, List, Sequence, Tuple

#: Context tokens a long match has at least (:class:`Calibration`'s last
#: bucket, pooled apart).
LONG_MATCH = 48


class Calibration:
    """How far to trust the drafts' probability estimates, learnt online
    from verified drafts: for a draft's first token per match length (how
    many context tokens the draft's tree path, or its prompt copy, matched),
    and for the tokens after it, given that the first is right, per match
    length and per band of their own estimate; both also per outcome of the
    request's previous verified draft (``"new"``: none yet, ``"full"``:
    accepted in full, ``"cut"``: rejected partway) and per source of the
    draft (``"tree"``: the suffix trees; ``"copy"``: the tokens of a copy
    of the prompt past the trees' draft, see :mod:`~mlx_lm_suffix.copying`,
    whose estimates are a guess; the trees' part of a copy is calibrated as
    theirs, so copies that fail do not cut the trees' drafts they extend).

    The estimates are frequencies in the trees, and the request's own
    occurrence of the matched text counts too, so a continuation seen once
    before gets about 0.5 however certain it is (repeats are accepted far
    more often than that), while a draft from a match of one or two tokens
    gets a high estimate that open-ended text seldom bears out, often flat
    after the first token (the trees know a single continuation) and seldom
    right. Where repeats branch (tool-call JSON seen before with other
    arguments), the estimates fall along the draft faster than acceptance
    does. And acceptance runs in streaks that the estimates do not see: a
    request repeating an earlier answer keeps having its drafts accepted in
    full, one writing new text keeps having them cut, and the first draft
    of an answer matches only the end of the prompt. Each cell keeps the
    ratio of accepted to expected tokens and scales the estimates in it by
    that ratio, at most ``max_ratio`` times. A cell starts from the ratio of
    its pool (its part, first or tail, over all cells of its source), worth
    ``prior_expected`` tokens, so a cell not verified yet is trusted as much
    as the traffic has earned (that ratio in turn starts from
    ``prior_ratio``); all forget slowly.

    The last bucket holds long matches (at least :data:`LONG_MATCH` context
    tokens: a repeated request, text the answer copied before) and has
    pools of its own, so the distrust that short template matches teach
    (tool-call JSON after the same chat template, drafted from another
    call's arguments) does not carry over to repeats. The pool of their
    first tokens starts from ``long_first_ratio``: the trees count the
    request's own occurrence of the context, so a continuation seen once
    elsewhere reads 0.5, and after a long match there is seldom another."""

    #: Upper bounds of the match length buckets (the last is open).
    BUCKETS = (2, 4, 8, 16, 32, LONG_MATCH - 1)
    #: Upper bounds of the bands of a later token's estimate given the first.
    BANDS = (0.25, 0.5, 0.75)
    #: Outcomes of a request's previous verified draft.
    HISTORIES = ("new", "full", "cut")
    #: Where a draft came from.
    SOURCES = ("tree", "copy")

    def __init__(
        self,
        prior_expected: float = 10.0,
        prior_ratio: float = 1.0,
        max_ratio: float = 2.5,
        long_first_ratio: float = 2.0,
    ):
        self.prior_expected = prior_expected
        self.prior_ratio = prior_ratio
        self.long_first_ratio = long_first_ratio
        self.max_ratio = max_ratio
        # Verified tokens' estimates and how many were accepted, per cell and
        # per pool (part, source, long match or not).
        self.expected: Dict[Any, float] = {}
        self.accepted: Dict[Any, float] = {}

    @classmethod
    def bucket(cls, match_len: int) -> int:
        return bisect.bisect_left(cls.BUCKETS, match_len)

    @classmethod
    def band(cls, q: float) -> int:
        return bisect.bisect_right(cls.BANDS, q)

    @staticmethod
    def outcome(drafted: int, accepted: int) -> str:
        """The history a verified draft leaves for its request's next one."""
        return "full" if accepted >= drafted else "cut"

    @classmethod
    def _pool(cls, cell: tuple) -> tuple:
        # (part, source, long match?)
        return cell[0], cell[1], cell[2] == len(cls.BUCKETS)

    def _ratio(self, cell: tuple) -> float:
        pool, prior = self._pool(cell), self.prior_expected
        part, _, long = pool
        start = self.long_first_ratio if part == "first" and long else self.prior_ratio
        pooled = (self.accepted.get(pool, 0.0) + prior * start) / (
            self.expected.get(pool, 0.0) + prior
        )
        ratio = (self.accepted.get(cell, 0.0) + prior * pooled) / (
            self.expected.get(cell, 0.0) + prior
        )
        return min(self.max_ratio, ratio)

    def ratio(
        self,
        match_len: int,
        part: str = "tail",
        q: float = 1.0,
        last: str = "new",
        source: str = "tree",
    ) -> float:
        """The scale of a ``part`` (``"first"`` or ``"tail"``) estimate at
        ``match_len`` after history ``last`` for drafts from ``source``; for
        the tail, of estimates ``q`` given the first."""
        b = self.bucket(match_len)
        if part == "first":
            return self._ratio(("first", source, b, last))
        return self._ratio(("tail", source, b, last, self.band(q)))

    def _sources(
        self, n: int, match_len: int, source: str, tree_len: int, tree_match: int
    ) -> List[Tuple[str, int]]:
        """The (source, match length bucket) each of a draft's ``n`` tokens
        is calibrated in: a copy's first ``tree_len`` tokens, which the
        trees drafted from a match of ``tree_match``, as the trees'."""
        own = (source, self.bucket(match_len))
        if source != "copy" or tree_len <= 0:
            return [own] * n
        tree = ("tree", self.bucket(tree_match))
        return [tree] * min(n, tree_len) + [own] * max(0, n - tree_len)

    def scale(
        self,
        probs: Sequence[float],
        match_len: int,
        last: str = "new",
        source: str = "tree",
        tree_len: int = 0,
        tree_match: int = 0,
    ) -> List[float]:
        """The (cumulative) estimates as probabilities for the policy: the
        first token's scaled by its cell's ratio, each later one's given the
        first (``probs[i] / probs[0]``) by its own cell's, each at most 1
        and at most the one before. ``last``: the history of the request
        (see :data:`HISTORIES`); ``source``: the draft's (:data:`SOURCES`);
        ``tree_len``, ``tree_match``: for a copy, how many leading tokens
        the trees drafted and from what match (calibrated as theirs)."""
        if not probs or probs[0] <= 0:
            return [0.0] * len(probs)
        cells = self._sources(len(probs), match_len, source, tree_len, tree_match)
        s, b = cells[0]
        first = min(1.0, self._ratio(("first", s, b, last)) * probs[0])
        ratios: Dict[tuple, float] = {}
        out, cond = [first], 1.0
        for (s, b), q in zip(cells[1:], given_first(probs)):
            cell = ("tail", s, b, last, self.band(q))
            if cell not in ratios:
                ratios[cell] = self._ratio(cell)
            cond = min(cond, ratios[cell] * q)
            out.append(first * cond)
        return out

    def update(
        self,
        probs: Sequence[float],
        accepted: int,
        match_len: int,
        last: str = "new",
        source: str = "tree",
        tree_len: int = 0,
        tree_match: int = 0,
    ) -> None:
        """Learn from a verified draft: its tokens' (unscaled) estimates, how
        many of them verification accepted, its request's history and its
        source (as for :meth:`scale`)."""
        if not probs:
            return
        cells = self._sources(len(probs), match_len, source, tree_len, tree_match)
        s, b = cells[0]
        self._add(("first", s, b, last), probs[0], min(accepted, 1))
        if accepted:
            for i, ((s, b), q) in enumerate(zip(cells[1:], given_first(probs)), 1):
                self._add(("tail", s, b, last, self.band(q)), q, int(accepted > i))

    def _add(self, cell: tuple, expected: float, accepted: float) -> None:
        for key in (cell, self._pool(cell)):
            e = self.expected.get(key, 0.0) + expected
            a = self.accepted.get(key, 0.0) + accepted
            if e > 500:  # keep adapting: forget old steps
                e, a = e * 0.5, a * 0.5
            self.expected[key], self.accepted[key] = e, a

    def ratios(self) -> Dict[str, Dict[str, Any]]:
        """The scales for stats, per source: ``first`` per history and match
        length bucket, ``tail`` per history, bucket and band of the estimate
        given the first."""
        lows = (1,) + tuple(b + 1 for b in self.BUCKETS)
        names = [f"{lo}-{hi}" for lo, hi in zip(lows, self.BUCKETS)] + [f"{lows[-1]}+"]
        bands = (0.0,) + self.BANDS
        band_names = [f"{lo:g}-{hi:g}" for lo, hi in zip(bands, self.BANDS + (1,))]
        return {
            s: {
                "first": {
                    h: {n: self.ratio(lo, "first", last=h, source=s) for n, lo in zip(names, lows)}
                    for h in self.HISTORIES
                },
                "tail": {
                    h: {
                        n: {
                            b: self.ratio(lo, "tail", q, h, s)
                            for b, q in zip(band_names, bands)
                        }
                        for n, lo in zip(names, lows)
                    }
                    for h in self.HISTORIES
                },
            }
            for s in self.SOURCES
        }


def given_first(probs: Sequence[float]) -> List[float]:
    """Probabilities of the draft tokens after the first, given that the first
    is right (the trees' estimates are cumulative)."""
    if not probs or probs[0] <= 0:
        return []
    return [min(1.0, p / probs[0]) for p in probs[1:]]
