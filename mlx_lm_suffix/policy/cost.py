"""Verification cost: seconds of one target forward by the tokens it feeds."""

from __future__ import annotations

import bisect
import time
from typing import Dict, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

#: The forwards timed when a model is first used (after a one-token
#: context), twice each: a probe of about five plain steps' time where
#: verification is dearest (a 2-token forward costs at most two). Past 2
#: the curve grows as its 1-2 segment does, an estimate that errs dear where
#: a forward's cost jumps from 1 token to 2 and then grows slowly, cheap
#: where it grows faster past 2 (so a request's credit prices a draft at
#: :meth:`VerifyCost.most`, a draft model's length at :meth:`VerifyCost.least`);
#: each wider
#: verification then becomes a point of its own (:meth:`VerifyCost.observe`),
#: and a batch of more rows than twice the widest point first times a forward
#: of as many tokens (:meth:`VerifyCost.widen`): its plain step, from which the
#: curve would otherwise grow at the 1-2 slope up to the batch's widths.
CALIBRATION_SIZES = (1, 2)


class VerifyCost:
    """Seconds for one target forward over ``n`` tokens: for one sequence,
    interpolated linearly between measured points; for ``rows`` sequences of
    a batch (``n`` tokens in all), a prior (:meth:`batch_prior`) times a
    factor learnt from real batched steps of the same shape (each row
    attends to its own context, and samples and runs its logits processors
    per position), or of the same widths with other rows, or 1 until one is
    seen. ``smoothing`` is the weight :meth:`observe` gives a real step once
    there are enough of them (0: nothing is learnt)."""

    def __init__(self, points: Dict[int, float], smoothing: float = 0.1):
        if not points or 1 not in points:
            raise ValueError("VerifyCost needs at least the time of a 1-token forward")
        self.points = {int(k): float(v) for k, v in points.items()}
        self.smoothing = smoothing
        self._sizes = sorted(self.points)
        # (rows, width bucket) -> [factor, steps seen]
        self.batch_factors: Dict[Tuple[int, int], List[float]] = {}
        # Forwards' costs by tokens, and batched ones by (tokens, rows), until
        # the curve changes (a cut prices every width of a draft, the curve
        # learns every few steps).
        self._costs: Dict[int, float] = {}
        self._batch_costs: Dict[Tuple[int, int], float] = {}
        self._envelope()

    def _envelope(self) -> None:
        """Keep the curve physical: a forward over more tokens never costs
        less, nor more than proportionally more (``n`` one-token forwards
        would do). Timing noise only ever adds time, so each point is lowered
        to the bound its neighbours give."""
        self._costs.clear()
        self._batch_costs.clear()
        pts, sizes = self.points, self._sizes
        for lo, hi in zip(sizes, sizes[1:]):
            pts[hi] = min(pts[hi], pts[lo] * hi / lo)
        for lo, hi in zip(reversed(sizes[:-1]), reversed(sizes[1:])):
            pts[lo] = min(pts[lo], pts[hi])

    def __call__(self, n: int, rows: int = 1) -> float:
        if rows > 1:
            known = self._batch_costs.get((n, rows))
            if known is None:
                known = self._batch_cost(n, rows)
                self._batch_costs[(n, rows)] = known
            return known
        known = self._costs.get(n)
        if known is None:
            known = self._costs[n] = self._interpolate(n)
        return known

    def most(self, n: int) -> float:
        """The most a one-sequence forward of ``n`` tokens may cost: as the
        curve up to its widest point, past it proportionally more (the
        envelope's bound; the curve's own estimate there grows as its last
        segment does, which errs cheap where a forward's cost grows with
        its tokens, as a small model's on a CPU)."""
        last = self._sizes[-1]
        return self(n) if n <= last else self.points[last] * n / last

    def least(self, n: int, rows: int = 1) -> float:
        """The least a one-sequence forward of ``n`` tokens may cost, up to
        four times the widest point: past that point, its cost (a wider
        forward never costs less); further out, the curve. A length chosen
        at this price times a forward that, past twice the widest point,
        becomes a point (:meth:`observe`), so the curve's guess past its
        widest point (which errs dear where a forward's cost jumps from 1
        token to 2 and then grows slowly) is tried a step of at most four
        times the width at a time, each try losing at most about three
        forwards of the widest point's cost. A batch's forward (``rows`` >
        1): its cost (:meth:`__call__`)."""
        last = self._sizes[-1]
        return self.points[last] if rows == 1 and last < n <= 4 * last else self(n, rows)

    def _interpolate(self, n: int) -> float:
        sizes, pts = self._sizes, self.points
        if n <= sizes[0]:
            return pts[sizes[0]]
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            return pts[n]
        if i == len(sizes):
            # Past the largest point, as the last segment grows, and at most
            # proportionally (until a step that large is seen).
            last = sizes[-1]
            prop = pts[last] * n / last
            if len(sizes) == 1:
                return prop
            prev = sizes[-2]
            return min(prop, pts[last] + (pts[last] - pts[prev]) * (n - last) / (last - prev))
        lo, hi = sizes[i - 1], sizes[i]
        return pts[lo] + (pts[hi] - pts[lo]) * (n - lo) / (hi - lo)

    def _batch_cost(self, n: int, rows: int) -> float:
        """A batched forward's cost: its shape's (:meth:`_batch_factor`),
        at most what a seen shape of as many tokens a row over more rows
        costs (a batch of fewer rows never costs more; timing noise only
        adds time, and a shape priced too dear by one noisy step would
        otherwise never run again to be timed anew)."""
        width, (_, bucket) = max(1, n // rows), self._shape(n, rows)
        cost = self.batch_prior(n, rows) * self._batch_factor((rows, bucket))
        for more, b in self.batch_factors:
            if b == bucket and more > rows:
                cost = min(cost, self.batch_prior(width * more, more) * self.batch_factors[(more, b)][0])
        return cost

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
        nearest point within a factor of two of ``n`` (with none, or where
        that is the plain step's and ``n`` is more, the step becomes a point
        of its own); for a batch, the factor of its shape (the mean of its
        first steps, then a moving average)."""
        if not self.smoothing:
            return
        if rows > 1:
            # The first step of a shape sets its factor (weight 1).
            factor = self.batch_factors.setdefault(self._shape(n, rows), [1.0, 0])
            factor[1] += 1
            factor[0] = self._average(factor[0], factor[1], seconds / self.batch_prior(n, rows))
            self._batch_costs.clear()
            return
        near = min(self._sizes, key=lambda s: abs(s - n))
        if near != n and (near == 1 or not near / 2 <= n <= near * 2):
            self.points[n] = seconds
            self._sizes = sorted(self.points)
            self._envelope()
            return
        scaled = seconds * self.points[near] / max(self(n), 1e-12)
        self.points[near] += self.smoothing * (scaled - self.points[near])
        self._envelope()

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
        context: int = 1,
        repeats: int = 2,
        min_seconds: float = 0.05,
    ) -> "VerifyCost":
        """Time forwards of ``sizes`` tokens after a ``context``-token prefix
        (which warms the kernels up) on a scratch cache: the best of at
        least ``repeats`` runs each, more (up to 20) while a size has taken
        less than ``min_seconds`` in all, so the cheap forwards, the
        noisiest, get the most runs and a slow one runs ``repeats`` times.
        The sizes take turns, a run each: a load spike spoils a run of
        each size, not every run of one (one point timed in a spike would
        price every draft too dear, and no draft would be verified to time
        it again)."""
        return cls(_time_forwards(model, sizes, context, repeats, min_seconds))

    def widen(self, model: nn.Module, n: int) -> None:
        """Where the widest point is under ``n / 2``, time a forward of ``n``
        tokens as :meth:`calibrate` does (one run) and make it a point
        (nothing, with ``smoothing`` 0: the curve is frozen)."""
        if self.smoothing and n > 2 * self._sizes[-1]:
            self.points.update(_time_forwards(model, (n,), 1, 1, 0.0))
            self._sizes = sorted(self.points)
            self._envelope()


def scratch_vocabulary(model: nn.Module) -> int:
    """How many token ids a scratch forward of ``model`` may feed: its
    ``vocab_size`` (32 where it names none)."""
    return getattr(getattr(model, "args", None), "vocab_size", 32)


def _time_forwards(
    model: nn.Module, sizes: Sequence[int], context: int, repeats: int, min_seconds: float
) -> Dict[int, float]:
    """The seconds of forwards of ``sizes`` tokens, as :meth:`VerifyCost.calibrate`
    says."""
    # Imported here: mlx_lm's import runs our patches, which import this.
    from mlx_lm.models.cache import make_prompt_cache

    from .. import ranks, rollback

    tokens = mx.arange(context + max(sizes)) % scratch_vocabulary(model)
    best = {n: float("inf") for n in sizes}
    spent = {n: 0.0 for n in sizes}
    runs = {n: 0 for n in sizes}
    cache = make_prompt_cache(model)
    model(tokens[None, :context], cache=cache)
    mx.eval([c.state for c in cache])

    def wanted(n: int) -> bool:
        return runs[n] < repeats or (spent[n] < min_seconds and runs[n] < 20)

    # Distributed: every rank times the forwards rank 0 does.
    while ranks.flag(any(wanted(n) for n in sizes)):
        for n in sizes:
            if not ranks.flag(wanted(n)):
                continue
            saved = rollback.checkpoint(cache)
            tic = time.perf_counter()
            out = model(tokens[None, context : context + n], cache=cache)
            mx.eval(out)
            took = time.perf_counter() - tic
            best[n], spent[n], runs[n] = min(best[n], took), spent[n] + took, runs[n] + 1
            rollback.undo(cache, saved, n, n)
    return best
