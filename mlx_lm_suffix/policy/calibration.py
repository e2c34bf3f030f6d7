"""Calibration of the suffix trees' probability estimates."""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Sequence, Tuple

#: Context tokens a long match has at least (:class:`Calibration`'s last
#: match length bucket: a repeated request, text the answer copied before).
LONG_MATCH = 48


class Calibration:
    """How far to trust the drafts' probability estimates, learnt online
    from verified drafts.

    The estimates are frequencies in the trees (the request's own newest
    token is held back from them, so its occurrence of the matched text does
    not count): a continuation seen once reads 1 however often text breaks
    away from it, while a draft from a match of one or two tokens
    gets a high estimate that open-ended text seldom bears out. How wrong
    they are depends mostly on how long the match was and where the draft
    came from, so each cell (``part``: the draft's first token, or the
    tokens after it given the first; ``source``: the suffix trees, or a
    copy of the prompt past the trees' draft, see
    :mod:`~mlx_lm_suffix.copying`; match length bucket) keeps the ratio of
    accepted to expected tokens and scales the estimates in it by that
    ratio, at most ``max_ratio`` times. The trees' part of a copy is
    calibrated as theirs, so copies that fail do not cut the trees' drafts
    they extend.

    The tail is calibrated step by step: each token after the first is a
    trial reached only when every token before it was accepted, expected
    with its estimate given the one before (``probs[i] / probs[i - 1]``),
    and its scaled estimate is the product of the scaled steps so far. A
    continuation known from one occurrence has steps of 1 however far it
    goes, and text breaks away at some token along it, so a ratio below 1
    makes such a draft's estimates fall with its length, as acceptance
    does; a ratio of cumulative estimates would scale every position alike,
    the 30th as the 2nd. Drafts differ, though: some continue a true repeat
    and some break soon, so each step a draft has survived is evidence that
    it is of the first kind. Its ``j``-th step (from 0) is scaled by
    ``(r * w + j) / (w + j)``: the cell's ratio ``r`` as the prior mean of
    this draft's own survival, worth ``w = draft_weight`` steps, updated by
    the ``j`` it survived (a Beta prior's posterior mean). Given its first
    token, a flat draft at ``r = 0.9`` then reads 0.9, 0.82, 0.77, ... and
    0.25 at its 64th token (``0.9 ** 63`` would be 0.001), and one at
    ``r = 0.99`` keeps 0.87 there.

    Constants: a cell starts from the ratio of its pool (its part and
    source over the short buckets, or the long bucket alone), worth
    ``prior_expected`` tokens, so a cell not verified yet is trusted as much
    as the traffic has earned; a pool starts from ``prior_ratio`` (the
    estimates as they are), except one. Short matches' tail steps start
    from ``short_tail_ratio``: an unverified continuation may break at any
    token, and where verification costs nearly a plain step per token (a
    quantized model on a CPU) only drafts whose every step is likely pay,
    so a new process does not verify long flat drafts before it has seen
    any accepted. Long matches (a repeated request, text copied before)
    are pooled apart, so the distrust short template matches teach does not
    carry over to repeats. Counts are halved once a cell has seen 500 expected
    tokens, so it keeps adapting. ``draft_weight`` must be finite
    (independent steps make a long copy's tail look as likely as its first
    tokens); its value matters little (docs/choosing-defaults.md).
    ``max_ratio`` bounds how far a streak
    of full acceptances can lift a low estimate (one of several
    continuations seen reads below 1 and may be lifted to certainty, not
    beyond)."""

    #: Upper bounds of the match length buckets (the last is open).
    BUCKETS = (2, 4, 8, 16, 32, LONG_MATCH - 1)
    #: Where a draft came from.
    SOURCES = ("tree", "copy", "model")
    #: Halve a cell's counts past this many expected tokens.
    FORGET_AFTER = 500.0

    def __init__(
        self,
        prior_expected: float = 10.0,
        prior_ratio: float = 1.0,
        max_ratio: float = 2.5,
        short_tail_ratio: float = 0.9,
        draft_weight: float = 5.0,
    ):
        self.prior_expected = prior_expected
        self.prior_ratio = prior_ratio
        self.max_ratio = max_ratio
        self.short_tail_ratio = short_tail_ratio
        self.draft_weight = draft_weight
        # Verified tokens' estimates and how many were accepted, per cell
        # (part, source, bucket) and per pool (part, source, long or short).
        self.expected: Dict[tuple, float] = {}
        self.accepted: Dict[tuple, float] = {}

    @classmethod
    def bucket(cls, match_len: int) -> int:
        return bisect.bisect_left(cls.BUCKETS, match_len)

    @classmethod
    def _pool(cls, cell: tuple) -> tuple:
        # (part, source, "long" or "short"): not a cell's key
        return cell[0], cell[1], "long" if cell[2] == len(cls.BUCKETS) else "short"

    def _ratio(self, cell: tuple) -> float:
        pool, prior = self._pool(cell), self.prior_expected
        start = self.short_tail_ratio if pool == ("tail", cell[1], "short") else self.prior_ratio
        pooled = (self.accepted.get(pool, 0.0) + prior * start) / (
            self.expected.get(pool, 0.0) + prior
        )
        ratio = (self.accepted.get(cell, 0.0) + prior * pooled) / (
            self.expected.get(cell, 0.0) + prior
        )
        return min(self.max_ratio, ratio)

    def ratio(self, match_len: int, part: str = "tail", source: str = "tree") -> float:
        """The scale of a ``part`` (``"first"`` or ``"tail"``) estimate of a
        draft from ``source`` at ``match_len``."""
        return self._ratio((part, source, self.bucket(match_len)))

    def _cells(
        self, n: int, match_len: int, source: str, tree_len: int, tree_match: int
    ) -> List[Tuple[str, int]]:
        """The (source, bucket) each of a draft's ``n`` tokens is calibrated
        in: a copy's first ``tree_len`` tokens, which the trees drafted from
        a match of ``tree_match``, as the trees'."""
        own = (source, self.bucket(match_len))
        if source != "copy" or tree_len <= 0:
            return [own] * n
        tree = ("tree", self.bucket(tree_match))
        return [tree] * min(n, tree_len) + [own] * max(0, n - tree_len)

    def scale(
        self,
        probs: Sequence[float],
        match_len: int,
        source: str = "tree",
        tree_len: int = 0,
        tree_match: int = 0,
        trust: Optional["RequestTrust"] = None,
    ) -> List[float]:
        """The (cumulative) estimates as probabilities for the policy: the
        first token's scaled by its cell's ratio, then each step's (its
        estimate given the token before) by its own cell's as the steps
        before it update it, at most 1, and multiplied along. ``source``:
        the draft's (:data:`SOURCES`); ``tree_len``, ``tree_match``: for a
        copy, how many leading tokens the trees drafted and from what
        match; ``trust``: the request's own record, which each ratio is
        taken through (:meth:`RequestTrust.ratio`)."""
        if not probs or probs[0] <= 0:
            return [0.0] * len(probs)
        cells = self._cells(len(probs), match_len, source, tree_len, tree_match)

        def ratio(part: str, cell: Tuple[str, int]) -> float:
            r = self._ratio((part, *cell))
            return r if trust is None else trust.ratio(part, cell[0], r)

        tails = {c: ratio("tail", c) for c in set(cells[1:])}  # a draft has a cell or two
        p = min(1.0, ratio("first", cells[0]) * probs[0])
        out = [p]
        w = self.draft_weight
        for j, (cell, step) in enumerate(zip(cells[1:], _steps(probs))):
            x = (tails[cell] * w + j) / (w + j) * step
            p *= x if x < 1.0 else 1.0
            out.append(p)
        return out

    def update(
        self,
        probs: Sequence[float],
        accepted: int,
        match_len: int,
        source: str = "tree",
        tree_len: int = 0,
        tree_match: int = 0,
    ) -> None:
        """Learn from a verified draft: its tokens' (unscaled) estimates, how
        many of them verification accepted, and where it came from (as for
        :meth:`scale`)."""
        if not probs:
            return
        cells = self._cells(len(probs), match_len, source, tree_len, tree_match)
        self._add(("first", *cells[0]), (probs[0],), (min(accepted, 1),))
        # The steps reached, each after a run of accepted tokens (token i's
        # is steps[i - 1]); all but a rejected last one accepted.
        steps = _steps(probs)[:accepted]
        held = [1] * len(steps)
        if steps and len(steps) == accepted:
            held[-1] = 0
        i = 0
        while i < len(steps):  # (a run of steps in one cell at a time)
            cell, j = cells[i + 1], i + 1
            while j < len(steps) and cells[j + 1] == cell:
                j += 1
            self._add(("tail", *cell), steps[i:j], held[i:j])
            i = j

    def _add(self, cell: tuple, expected: Sequence[float], accepted: Sequence[float]) -> None:
        """Tokens with these estimates, accepted or not, one after another."""
        for key in (cell, self._pool(cell)):
            e, a = self.expected.get(key, 0.0), self.accepted.get(key, 0.0)
            for x, y in zip(expected, accepted):
                e, a = e + x, a + y
                if e > self.FORGET_AFTER:
                    e, a = e * 0.5, a * 0.5
            self.expected[key], self.accepted[key] = e, a

    def ratios(self) -> Dict[str, Dict[str, Dict[str, float]]]:
        """The scales for stats: per source, part and match length bucket."""
        lows = (1,) + tuple(b + 1 for b in self.BUCKETS)
        names = [f"{lo}-{hi}" for lo, hi in zip(lows, self.BUCKETS)] + [f"{lows[-1]}+"]
        return {
            s: {
                part: {n: self.ratio(lo, part, s) for n, lo in zip(names, lows)}
                for part in ("first", "tail")
            }
            for s in self.SOURCES
        }


class RequestTrust:
    """How far one request's own drafts bear out the pooled
    :class:`Calibration`: a ratio per part and source, learnt from every
    draft the request proposes, verified or not, held against the tokens it
    then emits (:class:`~mlx_lm_suffix.speculation.Row` watches them).

    The pooled calibration learns from every request's verified drafts, so
    what it learns of a request arrives after that request has paid for it,
    and a request unlike the rest (a model that rewrites what the prompt
    holds, text the trees keep mispredicting) pays throughout. So each
    request keeps, per part (the draft's first token, or a tail step given
    the one before) and source, the tokens it accepted and the raw
    estimates it was expected to (as :meth:`Calibration.update` counts
    them), and its ratio is ``(accepted + PRIOR * pooled) / (expected +
    PRIOR)``, at most ``pooled``: the pooled ratio is the prior, worth
    :data:`PRIOR` expected token, so the request's own first draft already
    moves it down: after ``n``
    drafts whose tails failed at their first step (an estimate of about 1
    each) the tail ratio is ``pooled / (1 + n)``, and the policy verifies
    such tails only while that still pays on the cost curve (where a
    two-token forward costs 1.5 plain steps, a tail of estimate 0.95 no
    longer does after one failure; where it costs 1.1, after about nine:
    each failure then wastes a tenth of a step). Past :data:`HORIZON`
    expected tokens both counts halve, so the ratio follows the request's
    last few dozen tokens of drafts, and drafts that start to hold again
    get their ratio back within a few drafts (from the floor of a failing
    source, three drafts that hold for 8 tokens lift it past a half). A
    draft the policy did not verify is evidence too (its tokens are held
    against what the model emitted), so a source the policy stopped
    verifying is verified again once its drafts hold, at no cost of the
    device's.

    A request's own record only lowers the pooled ratio, never raises it
    (raising is the pooled calibration's, which weighs every request's
    verified drafts against a prior of ten expected tokens): the costs are
    not symmetric. Trusting a draft too little loses at most what it would
    have saved; trusting it too much loses the whole forward, and where a
    forward costs nearly a plain step a token (a quantized model on a CPU),
    one short draft that held would otherwise make a long flat one look
    certain, whose failure costs tens of plain steps.

    It also keeps the request's **credit** (``credit``, in plain steps): what
    its verifications and checks have saved against plain steps so far
    (:meth:`paid`), from :data:`ALLOWANCE`. The policy verifies no draft
    whose failure at its first token could cost more than the credit
    (:meth:`~mlx_lm_suffix.policy.rules.Policy.affordable`): estimates are
    expectations, and a request can meet its unlikely case, so a request
    risks what its drafts have saved it, and the allowance, not more. It
    starts short where verification is dear (about 4 tokens where a token
    costs nearly a plain step, a quantized model on a CPU), grows as drafts
    pay, and does not bind where verification is cheap (a GPU's 64-token
    forward costs under 2 plain steps)."""

    #: Expected tokens the pooled ratio is worth against the request's own.
    PRIOR = 1.0
    #: Halve a cell's counts past this many expected tokens.
    HORIZON = 32.0
    #: Plain steps' time a request may lose to drafts before they saved any:
    #: a few percent of a short answer's steps.
    ALLOWANCE = 4.0

    def __init__(self) -> None:
        # (part, source) -> [accepted, expected]
        self.counts: Dict[Tuple[str, str], List[float]] = {}
        self.credit = self.ALLOWANCE
        # How likely its draft model's tokens look to the policy.
        self.model_tokens = ModelRate()

    def paid(self, saved: float) -> None:
        """A verification or a check saved ``saved`` plain steps' time
        (negative: it lost)."""
        self.credit += saved

    def ratio(self, part: str, source: str, pooled: float) -> float:
        """The ratio of ``part`` estimates from ``source`` for this request,
        given the pooled calibration's ``pooled``."""
        a, e = self.counts.get((part, source), (0.0, 0.0))
        return min(pooled, (a + self.PRIOR * pooled) / (e + self.PRIOR))

    def held(self, probs: Sequence[float], start: int, end: int, ok: bool,
             source: str = "tree", tree_len: int = 0) -> None:
        """Tokens ``start`` to ``end - 1`` of a draft with these raw
        estimates, reached one after another (every token before each
        held): all held but the last, which held if ``ok``; a copy's first
        ``tree_len`` tokens came from the trees."""
        counts, last = self.counts, end - 1
        for i in range(start, end):
            src = "tree" if source == "copy" and i < tree_len else source
            if i:
                key, e = ("tail", src), given(probs[i], probs[i - 1])
            else:
                key, e = ("first", src), probs[0]
            c = counts.get(key)
            if c is None:
                c = counts[key] = [0.0, 0.0]
            c[0] += ok or i < last
            c[1] += e
            if c[1] > self.HORIZON:
                c[0], c[1] = c[0] * 0.5, c[1] * 0.5


class ModelRate:
    """How likely a draft model's next draft looks before it is drafted:
    the means of its drafts' first tokens' estimates and of their later
    tokens' (each given the token before), as the policy scales them (the
    calibration has made them accuracies), over the last :data:`HORIZON` or
    so drafts' tokens. :meth:`rate` weighs in a prior worth :data:`WEIGHT`
    tokens: a request's own record over the pooled one, the pooled one over
    :data:`PRIOR`. So the draft model runs where its drafts are expected to
    be verified and to hold, and stops running where they would not (a
    model whose drafts fail at once however sure it is, or whose tokens
    never look likely, is not run for nothing). A draft's first token and
    its later ones are kept apart as the calibration keeps them: the first
    is the one whose context the model saw least of. Until its later tokens
    are seen (a draft model that drafts one token a step shows none), they
    are expected to hold as its first tokens do: a prior below that would
    keep it drafting one token, which never shows otherwise."""

    #: The estimate of a draft model's first token before any was drafted
    #: (its later tokens': as its first tokens', see above).
    PRIOR = (0.6, None)
    #: Tokens the prior is worth.
    WEIGHT = 4.0
    HORIZON = 256.0

    def __init__(self) -> None:
        self.firsts = self.first = 0.0  # first tokens and their estimates' sum
        self.tails = self.tail = 0.0

    def add(self, first: float, tail: Sequence[float]) -> None:
        """A draft's first token's estimate, and its later tokens' (each
        given the token before)."""
        self.firsts += 1
        self.first += first
        self.tails += len(tail)
        self.tail += sum(tail)
        if self.firsts + self.tails > self.HORIZON:
            self.firsts, self.first = self.firsts * 0.5, self.first * 0.5
            self.tails, self.tail = self.tails * 0.5, self.tail * 0.5

    def rate(self, prior: Tuple[float, Optional[float]] = PRIOR) -> Tuple[float, float]:
        """The expected estimates of a draft's first token and of each
        later one (``prior``: theirs before any is seen; None for the
        later ones: the first's, as expected here)."""
        w = self.WEIGHT
        first = (self.first + w * prior[0]) / (self.firsts + w)
        tail = first if prior[1] is None else prior[1]
        return first, (self.tail + w * tail) / (self.tails + w)


def given(p: float, q: float) -> float:
    """The chance that a draft's first ``i`` tokens hold given that its
    first ``j < i`` do, from their cumulative estimates ``p`` and ``q``:
    ``p / q``, at most 1, and 0 where ``q`` is 0."""
    return (p / q if p < q else 1.0) if q > 0 else 0.0


def _steps(probs: Sequence[float]) -> List[float]:
    """Each draft token's estimate after the first, given the one before
    it (the trees' estimates are cumulative)."""
    return [given(p, q) for q, p in zip(probs, probs[1:])]


def given_first(probs: Sequence[float]) -> List[float]:
    """Probabilities of the draft tokens after the first, given that the first
    is right (the trees' estimates are cumulative)."""
    if not probs or probs[0] <= 0:
        return []
    return [given(p, probs[0]) for p in probs[1:]]
