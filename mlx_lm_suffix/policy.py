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
import time
from typing import Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)


class VerifyCost:
    """Seconds for one target forward over ``n`` tokens (all rows of a batch
    together), interpolated linearly between measured points. ``smoothing``
    is the weight :meth:`observe` gives a real step (0: the points stay as
    given)."""

    def __init__(self, points: Dict[int, float], smoothing: float = 0.1):
        if not points or 1 not in points:
            raise ValueError("VerifyCost needs at least the time of a 1-token forward")
        self.points = {int(k): float(v) for k, v in points.items()}
        self.smoothing = smoothing
        self._sizes = sorted(self.points)
        self._envelope()

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

    def __call__(self, n: int) -> float:
        sizes, pts = self._sizes, self.points
        if n <= sizes[0]:
            return pts[sizes[0]]
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            return pts[n]
        lo, hi = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])
        if lo == hi:
            return pts[lo] * n / lo
        slope = (pts[hi] - pts[lo]) / (hi - lo)
        return max(pts[lo] + slope * (n - lo), pts[sizes[0]])

    def observe(self, n: int, seconds: float) -> None:
        """Refine the nearest measured point with a real step's time."""
        near = min(self._sizes, key=lambda s: abs(s - n))
        if near != n and not (near / 2 <= n <= near * 2):
            return
        scaled = seconds * self.points[near] / max(self(n), 1e-12)
        self.points[near] += self.smoothing * (scaled - self.points[near])
        self._envelope()

    def relative(self) -> Dict[int, float]:
        """Costs relative to a one-token forward (for stats and reports)."""
        return {k: v / self.points[1] for k, v in sorted(self.points.items())}

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
        cheap forwards, the noisiest, get the most runs."""
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
            points[n] = best
        return cls(points)


class Calibration:
    """How far to trust the suffix trees' probability estimates, learnt
    online per match length (how many context tokens the draft's tree path
    matched).

    The estimates are frequencies in the trees, and the request's own
    occurrence of the matched text counts too, so a continuation seen once
    before gets about 0.5 however certain it is (repeats are accepted far
    more often than that), while a draft from a match of one or two tokens
    gets a high estimate that open-ended text seldom bears out. Each match
    length bucket keeps the ratio of accepted to expected draft tokens (from
    a prior of ``prior_ratio``, worth ``prior_expected`` tokens, forgetting
    slowly) and scales the estimates by it, at most ``max_ratio`` times."""

    #: Upper bounds of the match length buckets (the last is open).
    BUCKETS = (2, 4, 8, 16)

    def __init__(
        self, prior_expected: float = 10.0, prior_ratio: float = 1.0, max_ratio: float = 2.5
    ):
        self.max_ratio = max_ratio
        n = len(self.BUCKETS) + 1
        self.expected = [prior_expected] * n
        self.accepted = [prior_expected * prior_ratio] * n

    @classmethod
    def bucket(cls, match_len: int) -> int:
        return bisect.bisect_left(cls.BUCKETS, match_len)

    def ratio(self, match_len: int) -> float:
        b = self.bucket(match_len)
        return min(self.max_ratio, self.accepted[b] / self.expected[b])

    def scale(self, probs: Sequence[float], match_len: int) -> List[float]:
        """The estimates as probabilities for the policy (at most 1)."""
        r = self.ratio(match_len)
        return [min(1.0, r * p) for p in probs]

    def update(self, expected: float, accepted: int, match_len: int) -> None:
        b = self.bucket(match_len)
        self.expected[b] += expected
        self.accepted[b] += accepted
        if self.expected[b] > 500:  # keep adapting: forget old steps
            self.expected[b] *= 0.5
            self.accepted[b] *= 0.5

    def ratios(self) -> Dict[str, float]:
        """Each bucket's scale, keyed by its match lengths (for stats)."""
        lows = (1,) + tuple(b + 1 for b in self.BUCKETS)
        names = [f"{lo}-{hi}" for lo, hi in zip(lows, self.BUCKETS)] + [f"{lows[-1]}+"]
        return {name: self.ratio(lo) for name, lo in zip(names, lows)}


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
    the batch to maximise expected committed tokens of all rows per second;
    each row then drafts ``min(len(its draft), K)``. ``pipelined``: as for
    :func:`best_length`, each row's first token is checked for free and the
    width is chosen for the tails, given their first tokens."""
    if pipelined:
        tails = best_batch_lengths([given_first(p) for p in probs], cost)
        return [n + 1 if n else 0 for n in tails]
    B = len(probs)
    if B == 0:
        return []
    k_max = max((len(p) for p in probs), default=0)
    best_k, best_rate = 0, B / cost(B)
    for k in range(1, k_max + 1):
        gain = B + sum(expected_accepted(p, k) for p in probs)
        rate = gain / cost(B * (k + 1))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return [min(len(p), best_k) for p in probs]


def histogram(lengths: Dict[int, int]) -> Dict[str, int]:
    """Draft-length histogram with string keys (JSON)."""
    return {str(k): v for k, v in sorted(lengths.items())}
