"""Cost-aware draft lengths.

A draft costs verification time and a rejected draft is pure loss. The policy
picks, per step (and per batch), the draft length that maximises the expected
number of committed tokens per unit of time, from

- the suffix tree's per-token probability estimates (arctic-inference returns
  cumulative probabilities: ``probs[i]`` estimates that the first ``i + 1``
  draft tokens are all right), corrected online by the acceptance actually
  seen at the same match length (:class:`Calibration`), and
- :class:`VerifyCost`, the time of one target forward by the number of tokens
  it feeds, measured for the loaded model at first use and refined online.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import Any, Dict, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: How much faster than plain steps a batch's verification must expect to
#: commit tokens (see :func:`best_batch_lengths`).
BATCH_MARGIN = 1.2
#: Context tokens a long match has at least (:class:`Calibration`'s last
#: bucket, pooled apart).
LONG_MATCH = 48


class VerifyCost:
    """Seconds for one target forward over ``n`` tokens: for one sequence,
    interpolated linearly between measured points; for ``rows`` sequences of
    a batch (``n`` tokens in all), a prior (:meth:`batch_prior`) times a
    factor learnt from real batched steps of the same shape (each row
    attends to its own context, and samples and runs its logits processors
    per position), or of the same widths with other rows, or 1 until one is
    seen. ``smoothing`` is the weight :meth:`observe` gives a real step once
    there are enough of them (0: nothing is learnt).

    ``check``: the seconds a batch step loses when it waits for its queued
    plain forward to check drafts' first tokens, learnt by
    :meth:`observe_check` (0 until a check is seen; see :func:`check_pays`)."""

    def __init__(self, points: Dict[int, float], smoothing: float = 0.1):
        if not points or 1 not in points:
            raise ValueError("VerifyCost needs at least the time of a 1-token forward")
        self.points = {int(k): float(v) for k, v in points.items()}
        self.smoothing = smoothing
        self._sizes = sorted(self.points)
        self._envelope()
        # (rows, width bucket) -> [factor, steps seen]
        self.batch_factors: Dict[Tuple[int, int], List[float]] = {}
        self.check = 0.0
        self._checks_seen = 0

    def _envelope(self) -> None:
        """Keep the curve physical: a forward over more tokens never costs
        less, nor more than proportionally more (``n`` one-token forwards
        would do). Timing noise only ever adds time, so each point is lowered
        to the bound its neighbours give."""
        pts, sizes = self.points, self._sizes
        for lo, hi in zip(sizes, sizes[1:]):
            pts[hi] = min(pts[hi], pts[lo] * hi / lo)
        for lo, hi in zip(reversed(sizes[:-1]), reversed(sizes[1:])):
            pts[lo] = min(pts[lo], pts[hi])

    def __call__(self, n: int, rows: int = 1) -> float:
        if rows > 1:
            return self.batch_prior(n, rows) * self._batch_factor(self._shape(n, rows))
        sizes, pts = self._sizes, self.points
        if n <= sizes[0]:
            return pts[sizes[0]]
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            return pts[n]
        if i == len(sizes):
            # Past the largest point, growth is at most proportional; assume
            # it (a forward that large is compute-bound on most machines).
            return pts[sizes[-1]] * n / sizes[-1]
        lo, hi = sizes[i - 1], sizes[i]
        return pts[lo] + (pts[hi] - pts[lo]) * (n - lo) / (hi - lo)

    def batch_prior(self, n: int, rows: int) -> float:
        """A batched forward of ``n`` tokens over ``rows`` rows, before its
        shape's factor: at least one sequence's forward over the ``n``
        tokens (the same weights' work), and at least the plain step of the
        batch (``rows`` tokens) made as much dearer as one sequence's
        forward gets from 1 token to the rows' width (each row's positions
        attend to its own context)."""
        width = max(1, n // rows)
        return max(self(n), self(rows) * self(width) / self(1))

    def _batch_factor(self, shape: Tuple[int, int]) -> float:
        """The factor of ``shape``, or, not seen yet, of the seen shape of
        the same widths with the nearest number of rows, or 1 (the prior):
        the factor is per-row work at each position, which weighs less the
        wider the rows, so other widths' factors do not carry over."""
        if shape in self.batch_factors:
            return self.batch_factors[shape][0]
        rows, bucket = shape
        same = [s for s in self.batch_factors if s[1] == bucket]
        if not same:
            return 1.0
        return self.batch_factors[min(same, key=lambda s: abs(s[0] - rows))][0]

    @staticmethod
    def _shape(n: int, rows: int) -> Tuple[int, int]:
        # Widths (tokens per row) in power-of-two buckets: 1, 2-3, 4-7, ...
        return rows, max(1, n // rows).bit_length()

    def observe(self, n: int, seconds: float, rows: int = 1) -> None:
        """Learn from a real step's time: for one sequence, refine the
        nearest measured point (a step larger than any point adds one at the
        next power of two, from its own time); for a batch, the factor of
        its shape (the mean of its first steps, then a moving average)."""
        if not self.smoothing:
            return
        if rows > 1:
            # The first step of a shape sets its factor (weight 1).
            factor = self.batch_factors.setdefault(self._shape(n, rows), [1.0, 0])
            factor[1] += 1
            factor[0] = self._average(factor[0], factor[1], seconds / self.batch_prior(n, rows))
            return
        if n > self._sizes[-1]:
            size = 1 << (n - 1).bit_length()
            if size not in self.points:
                self.points[size] = seconds * size / n
                self._sizes = sorted(self.points)
                self._envelope()
                return
        near = min(self._sizes, key=lambda s: abs(s - n))
        if near != n and not (near / 2 <= n <= near * 2):
            return
        scaled = seconds * self.points[near] / max(self(n), 1e-12)
        self.points[near] += self.smoothing * (scaled - self.points[near])
        self._envelope()

    def observe_check(self, wait: float, host: float) -> None:
        """Learn what a check of drafts' first tokens cost a batch step: it
        waited ``wait`` seconds for the queued plain forward, and the host
        work until the next forward was queued (``host`` seconds: the
        step's own, the caller's, the next step's graph) then followed that
        forward instead of overlapping it. The step lost at most the smaller
        of the two: on a GPU, where the wait is most of the forward, the
        host work; on a CPU backend, whose forward mostly runs before
        ``mx.async_eval`` returns, the wait. The mean of the first checks,
        then a moving average."""
        if not self.smoothing:
            return
        self._checks_seen += 1
        self.check = self._average(self.check, self._checks_seen, min(wait, host))

    def _average(self, mean: float, seen: int, sample: float) -> float:
        """``mean`` updated with the ``seen``-th sample: the plain mean of the
        first samples, then a moving average of weight ``smoothing``."""
        return mean + max(self.smoothing, 1.0 / seen) * (sample - mean)

    def relative(self) -> Dict[int, float]:
        """Costs relative to a one-token forward (for stats and reports)."""
        return {k: v / self.points[1] for k, v in sorted(self.points.items())}

    def batch_relative(self) -> Dict[str, float]:
        """The learnt batch factors (for stats), keyed ``"<rows>x<widths>"``."""
        names = {}
        for (rows, bucket), (factor, _) in sorted(self.batch_factors.items()):
            lo, hi = 1 << (bucket - 1), (1 << bucket) - 1
            names[f"{rows}x{lo}" if lo == hi else f"{rows}x{lo}-{hi}"] = factor
        return names

    @classmethod
    def calibrate(
        cls,
        model: nn.Module,
        sizes: Sequence[int] = CALIBRATION_SIZES,
        context: int = 128,
        repeats: int = 2,
        min_seconds: float = 0.05,
    ) -> "VerifyCost":
        """Time forwards of ``sizes`` tokens after a ``context``-token prefix
        on a scratch cache: the best of at least ``repeats`` runs each, more
        (up to 20) while a size has taken less than ``min_seconds``, so the
        cheap forwards, the noisiest, get the most runs; a forward slower than
        ten times ``min_seconds`` gets one (its noise is small next to it)."""
        # Imported here: mlx_lm's import runs our patches, which import this.
        from mlx_lm.models.cache import make_prompt_cache

        vocab = getattr(getattr(model, "args", None), "vocab_size", 32)
        tokens = mx.arange(context + max(sizes)) % vocab
        points = {}
        cache = make_prompt_cache(model)
        model(tokens[None, :context], cache=cache)
        mx.eval([c.state for c in cache])
        for n in sizes:
            best, spent, runs = float("inf"), 0.0, 0
            # The first run warms up the kernels.
            while runs <= repeats or (spent < min_seconds and runs <= 20):
                tic = time.perf_counter()
                out = model(tokens[None, context : context + n], cache=cache)
                mx.eval(out)
                took = time.perf_counter() - tic
                if runs:
                    best, spent = min(best, took), spent + took
                runs += 1
                for c in cache:
                    c.trim(n)
                if runs == 2 and took > 10 * min_seconds:
                    break
            points[n] = best
        return cls(points)


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


def expected_accepted(probs: Sequence[float], length: int) -> float:
    """Expected accepted tokens of the first ``length`` draft tokens."""
    return sum(probs[:length])


def given_first(probs: Sequence[float]) -> List[float]:
    """Probabilities of the draft tokens after the first, given that the first
    is right (the trees' estimates are cumulative)."""
    if not probs or probs[0] <= 0:
        return []
    return [min(1.0, p / probs[0]) for p in probs[1:]]


def best_length(probs: Sequence[float], cost: VerifyCost, pipelined: bool = False) -> int:
    """Draft length maximising expected committed tokens per second for one
    sequence; ``0`` when no draft beats a plain step. ``probs``: cumulative
    acceptance probabilities (the trees' estimates scaled by
    :meth:`Calibration.scale`).

    Not pipelined, the verifying forward feeds the last committed token plus
    the draft. Pipelined, the plain forward after the last committed token is
    already running: it checks the draft's first token for free, and only a
    draft whose first token it confirms is verified, feeding that token plus
    the rest; so a draft is worth it when its tail is, given its first token.
    """
    if pipelined:
        tail = best_length(given_first(probs), cost)
        return tail + 1 if tail else 0
    best, best_rate = 0, 1.0 / cost(1)
    gain = 1.0
    for i, p in enumerate(probs):
        gain += p
        rate = gain / cost(i + 2)
        if rate > best_rate:
            best, best_rate = i + 1, rate
    return best


def best_batch_lengths(
    probs: List[Sequence[float]], cost: VerifyCost, pipelined: bool = False
) -> List[int]:
    """Draft lengths for the rows of a batch whose forward feeds every row's
    last committed token plus its draft. The longest row sets the forward's
    shape (every row is padded to ``1 + K``), so one width ``K`` is chosen for
    the batch from the expected committed tokens of all rows and the step's
    time (below); each row then drafts ``min(len(its draft), K)``.

    ``pipelined``: the batch's plain forward over every row's pending token
    is running, checks each row's first draft token for free, and the
    verification follows it in the same step. So the width is chosen for the
    tails, given their first tokens, and for the whole step (the plain
    forward's tokens and time included): a verification pays when it
    commits tokens faster than plain steps do.

    Of the widths that pay, the one that saves the most time against plain
    steps is taken, not the one with the best rate: a row whose draft is cut
    needs another whole batch step for the rest, so the width with the best
    rate of this step alone (often the shortest row's draft) can take more
    steps in all.

    With more than one row, verifying must beat plain steps by
    ``BATCH_MARGIN``: the rows whose drafts fail, or that have none, wait
    for the wider forward, and the request that finishes last is the one
    that gained least (rows that gain finish early), so a verification that
    only breaks even on the batch's token count slows the batch down."""
    width, _ = _best_width(probs, cost, pipelined)
    if pipelined:
        tails = [given_first(p) for p in probs]
        return [min(len(t), width) + 1 if width and t else 0 for t in tails]
    return [min(len(p), width) for p in probs]


def _best_width(
    probs: List[Sequence[float]], cost: VerifyCost, pipelined: bool
) -> Tuple[int, float]:
    """The batch width of :func:`best_batch_lengths` (of the tails, when
    ``pipelined``) and the time it saves against plain steps (0 if none
    pays)."""
    B = len(probs)
    if B == 0:
        return 0, 0.0
    plain = cost(B)
    sunk_tokens = sunk_cost = 0.0
    if pipelined:
        probs = [given_first(p) for p in probs]
        sunk_tokens, sunk_cost = B, plain
    k_max = max((len(p) for p in probs), default=0)
    # Each row's expected accepted tokens of its first k draft tokens, by k.
    sums = [list(itertools.accumulate(p)) for p in probs if p]
    ref = B / plain * (BATCH_MARGIN if B > 1 else 1.0)
    best_k, best_saved = 0, 0.0
    for k in range(1, k_max + 1):
        gain = sunk_tokens + B + sum(c[min(k, len(c)) - 1] for c in sums)
        step = sunk_cost + cost(B * (k + 1), rows=B)
        # The time plain steps (by the margin) would take, less the step's:
        # positive exactly when the step commits tokens faster than them.
        saved = gain / ref - step
        if saved > best_saved:
            best_k, best_saved = k, saved
    return best_k, best_saved


def check_pays(
    probs: List[Sequence[float]], lengths: Sequence[int], cost: VerifyCost
) -> bool:
    """Whether the rows' drafts, cut to ``lengths`` by
    :func:`best_batch_lengths` (pipelined), are worth checking: checking
    costs about ``cost.check`` (the step waits for its queued plain forward,
    see :meth:`VerifyCost.observe_check`), while the verification after it
    saves time only for the rows whose first token that forward confirms.
    So the time it would save with every first token confirmed, weighted by
    the share of its expected tokens whose rows' first tokens are right
    (``probs[i][0]``), must exceed ``cost.check``."""
    if not any(lengths):
        return False
    if cost.check <= 0:
        return True
    width, saved = _best_width(probs, cost, pipelined=True)
    gains = [
        (p[0], 1 + expected_accepted(given_first(p), width))
        for p, n in zip(probs, lengths)
        if n
    ]
    confirmed = sum(p0 * g for p0, g in gains) / sum(g for _, g in gains)
    return saved * confirmed > cost.check


def unpipelined_length(probs: Sequence[float], cost: VerifyCost) -> int:
    """For one sequence whose next token is known and whose cache is idle
    (its last step verified a draft, or synced to check one): the draft
    length to verify in one forward together with that token, or ``0`` to
    take the pipelined way (a plain step over the token, which checks the
    draft's first token, then the rest if it was right; see
    :func:`best_batch_lengths`) because that saves more time in
    expectation. Verifying at once saves the plain step when the draft's
    first token is right and wastes the draft's positions when it is not,
    so it is for drafts whose first token is likely."""
    if not probs:
        return 0
    now, saved_now = _best_width([probs], cost, pipelined=False)
    _, saved_after = _best_width([probs], cost, pipelined=True)
    return now if now and saved_now > probs[0] * saved_after else 0


def histogram(lengths: Dict[int, int]) -> Dict[str, int]:
    """Draft-length histogram with string keys (JSON)."""
    return {str(k): v for k, v in sorted(lengths.items())}
