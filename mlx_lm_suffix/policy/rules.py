"""Draft lengths: :class:`Policy` is the only place where they are decided.

A draft costs verification time and a rejected draft is pure loss. The
adaptive policy picks, per step (and per batch), the draft length that pays
best in expectation, from

- the suffix tree's per-token probability estimates (arctic-inference returns
  cumulative probabilities: ``probs[i]`` estimates that the first ``i + 1``
  draft tokens are all right), corrected online by the acceptance actually
  seen at the same match length (:class:`Calibration`), and
- :class:`VerifyCost`, the time of one target forward by the number of tokens
  it feeds, measured for the loaded model at first use and refined online.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..stats import DraftStats
from .calibration import Calibration, ModelRate, given, given_first
from .cost import VerifyCost

#: How much faster than plain steps a batch's verification must expect to
#: commit tokens (see :func:`best_batch_lengths`).
BATCH_MARGIN = 1.2

#: How much faster than plain steps one sequence's verification must expect
#: to commit tokens (:func:`best_length`). The curve prices the forwards it
#: timed, and a verification costs more in ways it does not see (timing
#: noise, which the curve trims from above only; rollback and the tokens'
#: hand-out; on a GPU the plain step after it, which overlaps nothing): a
#: draft priced at break even loses. The margin decides only where drafts
#: gain little (a draft token costs nearly a plain step); where they gain
#: more it changes nothing (docs/choosing-defaults.md).
MARGIN = 1.05


#: After this many drafts refused for their cost in a row, one is verified
#: at 2 tokens anyway (see :class:`Policy`).
EXPLORE_AFTER = 256

#: The most share of a request's plain steps its proposals may take while
#: they find nothing (see :meth:`Policy.skips`).
OVERHEAD = 0.01

#: Plain steps whose mean time is one observation of the curve's 1-token
#: point (see :meth:`Policy.observe_plain`).
PLAIN_STEPS = 16

POLICIES = ("adaptive", "fixed")


class Policy:
    """Decides every draft length, for one sequence (:meth:`length`) and for
    the rows of a batch (:meth:`batch_lengths`), from each draft's estimates
    as :attr:`calibration` scales them and the :attr:`cost` of verifying.

    Both entry points take the state of the step: ``pipelined``, a plain
    forward over each pending token is running and will check each draft's
    first token (so a draft needs 2 tokens to gain anything); otherwise the
    pending tokens are known and nothing computes, and the lengths are those
    to verify at once together with them (``0``: take the plain step, then
    ask again, pipelined, with the same drafts).

    ``"adaptive"`` (once it has a cost curve, :attr:`cost_aware`): one
    sequence, or a batch of one row, takes the length with the best expected
    tokens per second (:func:`best_length`); a batch of more rows takes the
    one width that saves the most time (:func:`best_batch_lengths`), and
    only pipelined. ``"fixed"``: drafts as proposed.

    A point timed during a load spike can make
    every draft look too dear, and then nothing is verified that would time
    it again; so after :data:`EXPLORE_AFTER` drafts refused in a row, one is
    verified at 2 tokens (about one token's share of a forward lost, at
    worst), whose time pulls the curve's wider points down where they were
    too high (the curve grows at most proportionally).
    """

    def __init__(
        self,
        name: str = "adaptive",
        cost: Optional[VerifyCost] = None,
        stats: Optional[DraftStats] = None,
    ):
        if name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self.cost = cost
        self.calibration = Calibration()
        #: Where the drafts refused for their cost are counted (``refused``).
        self.stats = stats if stats is not None else DraftStats()
        self._refused = 0  # drafts refused for their cost in a row
        #: Host seconds of a proposal and its cut (a moving average), and
        #: the rows stepped together when one was last timed.
        self.propose_s = 0.0
        self.rows = 1
        # Plain steps' seconds not observed yet, by the rows they stepped.
        self._plain: Dict[int, List[float]] = {}
        #: The draft model's forward cost (a draft step over ``n`` rows), and
        #: how often its tokens hold, over all requests.
        self.draft_cost: Optional[VerifyCost] = None
        self.model_tokens = ModelRate()
        self._unprobed = 0.0  # plain steps' time since the draft model last ran

    @property
    def cost_aware(self) -> bool:
        """Whether lengths are cut to what pays: adaptive, with a cost curve."""
        return self.name == "adaptive" and self.cost is not None

    def ensure_cost(self, model: Any) -> None:
        """Measure ``model``'s verification cost curve once (adaptive only)."""
        if self.name == "adaptive" and self.cost is None:
            self.cost = VerifyCost.calibrate(model)

    def ensure_draft_cost(self, draft_model: Any) -> None:
        """Measure the draft model's forward cost once (a draft step is one
        forward of it; the fixed policy prices nothing)."""
        if self.name == "adaptive" and self.draft_cost is None:
            self.draft_cost = VerifyCost.calibrate(draft_model)

    def ensure_width(self, model: Any, rows: int, draft_model: Any = None) -> None:
        """Before a batch of ``rows`` chooses widths: the cost of its plain
        step measured where the curve would only extrapolate it
        (:meth:`VerifyCost.widen`), and of the draft model's step over its
        rows (``draft_model``, where it has a curve)."""
        if self.cost_aware and rows > 1:
            self.cost.widen(model, rows)
            if draft_model is not None and self.draft_cost is not None:
                self.draft_cost.widen(draft_model, rows)

    def ensure_batches(self, model: Any, most: int, draft_model: Any = None) -> None:
        """Before a server batches up to ``most`` rows (at load, so that no
        request waits for it): :meth:`ensure_width` for batches of 8, 32,
        ... rows, and ``most``: every batch of up to ``most`` rows then
        finds its plain step within twice a timed width, which is as near
        as :meth:`ensure_width` asks."""
        rows = 8
        while rows < most:
            self.ensure_width(model, rows, draft_model)
            rows *= 4
        self.ensure_width(model, most, draft_model)

    def probs(self, draft: Any) -> List[float]:
        """A :class:`~mlx_lm_suffix.drafter.Draft`'s estimates as the
        probabilities the rules take (:meth:`Calibration.scale`)."""
        return self.calibration.scale(
            draft.probs, draft.match_len, draft.source, draft.tree_len, draft.tree_match,
            getattr(draft, "trust", None),
        )

    def length(
        self, draft: Any, pipelined: bool, replay: bool = False, budget: Optional[float] = None
    ) -> int:
        """How many tokens of one sequence's ``draft`` to verify; ``replay``:
        a rejection costs feeding the accepted tokens again; ``budget``: see
        :meth:`batch_lengths`."""
        n = len(draft)
        if budget is not None and not self.cost_aware:
            return 0
        if n and self.cost_aware:
            # (A draft model's draft: its widths priced as model_steps does,
            # but where prompts wait, as the curve guesses.)
            cost = self.cost.least if draft.source == "model" and budget is None else self.cost
            chosen = best_length(self.probs(draft), cost, pipelined, replay, budget, self.wait_s)
            n = chosen if budget is not None else self._explore(chosen, n)
            n = self._credit_cut(draft, n, pipelined, replay)
        return 0 if pipelined and n < 2 else n

    def _credit_cut(self, draft: Any, n: int, pipelined: bool, replay: bool = False) -> int:
        """``n`` tokens of ``draft``, as many as its request's credit affords
        (:meth:`affordable`); a draft model's drafts and a draft of no
        request are not bound by it."""
        trust = getattr(draft, "trust", None)
        if trust is None or draft.source == "model":
            return n
        return self.affordable(n, trust.credit, pipelined, replay)

    def affordable(self, n: int, credit: float, pipelined: bool, replay: bool = False) -> int:
        """The most of ``n`` draft tokens whose verification, rejected at
        its first token, loses at most ``credit`` plain steps' time (see
        :class:`~mlx_lm_suffix.policy.calibration.RequestTrust`): it emits
        one token, as a plain step, for its forward (pipelined, over the
        draft: its first token is confirmed before; settled, over the
        pending token and the draft), the wait after it, and with
        ``replay`` the forward that feeds that token again. The forward is
        priced at the most it may cost (:meth:`VerifyCost.most`): past the
        widest forward measured, the curve is a guess, and the credit bounds
        a loss, not an expectation. A draft model's drafts are not bound
        by it: their length is chosen with the draft forwards priced and
        the request's own rate of its tokens (:meth:`model_steps`), short,
        and a request whose credit a long failed draft of the trees spent
        would otherwise verify none of them again."""
        c1 = self.cost(1)
        lost = self.wait_s + (c1 if replay else 0.0)
        lo, hi = 0, n  # (the most a forward costs grows with its tokens: halve)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.most(mid + (not pipelined)) - c1 + lost > credit * c1:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def paid(self, trust: Any, width: int, emitted: int) -> None:
        """A forward of ``width`` tokens that emitted ``emitted`` (``0,
        0``: a plain forward's token that failed a draft's check) went into
        ``trust``'s credit, as what it saved against plain steps."""
        if trust is None or not self.cost_aware:
            return
        c1 = self.cost(1)
        spent = self.cost(width) if width else 0.0
        trust.paid(emitted - (spent + self.wait_s) / c1)

    def _explore(self, chosen: int, proposed: int) -> int:
        """``chosen`` (the rule's length), or after EXPLORE_AFTER refusals in
        a row, 2 tokens of a ``proposed`` draft that has them."""
        if chosen:
            self._refused = 0
        if chosen or proposed < 2:
            return chosen
        self.stats.refused += 1
        self._refused += 1
        if self._refused <= EXPLORE_AFTER:
            return 0
        self._refused = 0
        return 2

    def batch_lengths(
        self,
        drafts: Sequence[Any],
        pipelined: bool,
        replay: bool = False,
        budget: Optional[float] = None,
    ) -> List[int]:
        """How many tokens of each row's draft to verify; ``replay``: a
        rejection costs feeding every row's kept tokens again. One row is
        one sequence (:meth:`length`); more rows verify pipelined (the plain
        forward checks each draft's first token free, a tree draft's least
        sure), or settled where a row drafts from a draft model (whose
        first token is its surest: a plain forward would only delay it).

        ``budget``: the most seconds the step may take beyond a plain step,
        because prompts wait for it (their prefill runs after it): widths
        that would take longer are not verified, nothing is explored, and
        without a cost curve nothing is verified."""
        if len(drafts) == 1:
            return [self.length(drafts[0], pipelined, replay, budget)]
        lengths = [len(d) for d in drafts]

        settled = not pipelined and any(d.source == "model" for d in drafts if d)
        if (not pipelined and not settled) or (budget is not None and not self.cost_aware):
            return [0] * len(drafts)
        if self.cost_aware and any(lengths):
            probs = [self.probs(d) for d in drafts]
            # (Every row drafting from a draft model: none waits without a
            # draft, the margin is one sequence's, as in model_steps.)
            margin = MARGIN if settled and all(drafts) else BATCH_MARGIN
            chosen = best_batch_lengths(probs, self.cost, pipelined, replay, budget, self.wait_s,
                                        margin)
            if budget is None and self._explore(max(chosen), max(lengths)) and not any(chosen):
                chosen = [min(n, 2) for n in lengths]
            lengths = chosen
        shortest = 1 if settled else 2
        return [n if n >= shortest else 0 for n in lengths]

    def model_rate(self, trust: Any = None) -> Tuple[float, float]:
        """How likely a draft model's next draft's first token, and each of
        its later ones, look (:class:`~mlx_lm_suffix.policy.calibration.
        ModelRate`): the request's own record (``trust``, a
        :class:`~mlx_lm_suffix.policy.calibration.RequestTrust`) over the
        pooled one."""
        pooled = self.model_tokens.rate()
        return trust.model_tokens.rate(pooled) if trust is not None else pooled

    def drafted(self, draft: Any) -> None:
        """A draft model drafted ``draft`` (its ``trust`` the request's):
        how likely its tokens look, for :meth:`model_rate`."""
        probs = self.probs(draft)
        if not probs:
            return
        tail = [given(p, q) for q, p in zip(probs, probs[1:])]
        self.model_tokens.add(probs[0], tail)
        if draft.trust is not None:
            draft.trust.model_tokens.add(probs[0], tail)

    def model_steps(self, rates: Sequence[Tuple[float, float]], rows: int, pipelined: bool,
                    limit: int, held: bool = False) -> int:
        """How many tokens the draft model drafts this step for the rows
        that ask it, ``rates`` their first and later tokens' expected
        estimates (:meth:`model_rate`), in a step of ``rows`` rows: the
        number ``k`` whose step commits the most tokens per second, the
        draft model's ``k`` forwards priced (a pipelined step's first draft
        token comes with the plain forward queued, which checks it, so it
        takes ``k - 1``; ``held``: the draft model keeps the positions it
        drafted, so the verification does not feed it, as the curve's
        forwards do, see :meth:`observe`); 0 where none beats plain steps by the margin
        (:data:`MARGIN`; :data:`BATCH_MARGIN` where some row of the batch
        does not ask the draft model: it waits for the wider forward, as
        :func:`best_batch_lengths` says), or the policy prices nothing (the
        fixed policy drafts ``limit``).

        Shaped so because a draft model's tokens cost a forward each before
        verification, unlike the trees' (microseconds of host work), and
        past its first its tokens' chances are much alike (a geometric
        prior: ``f * t ** (j - 1)`` for its ``j``-th token, ``f`` and ``t``
        the rates): the expected tokens a step commits are each row's
        pending token plus its accepted draft tokens, over the step's time,
        the draft forwards included; the drafts' own estimates then cut them
        as any draft (:meth:`batch_lengths`). One sequence's widths are
        priced at the least they may cost (:meth:`VerifyCost.least`), so a
        curve that knows only narrow forwards is tried wider, a step at a
        time, where that would pay: a draft model's length is bounded by
        its tokens' rate and its own forwards' cost."""
        if limit <= 0 or not rates:
            return 0
        if not self.cost_aware or self.draft_cost is None:
            return limit
        m = len(rates)
        f = sum(r[0] for r in rates) / m
        t = sum(r[1] for r in rates) / m
        plain, draft = self.cost(rows, rows=rows), self.draft_cost(rows, rows=rows)
        ref = rows / plain * (MARGIN if m == rows else BATCH_MARGIN)
        best, best_rate, expected = 0, ref, 0.0
        for k in range(1, limit + 1):
            expected += f * t ** (k - 1)
            if pipelined:  # the plain forward's token, then [first] + rest
                if k < 2:
                    continue
                width = k
                step = plain + self.cost.least(rows * k, rows=rows) + (k - 1) * draft + self.wait_s
            else:
                width = k + 1
                step = self.cost.least(rows * (k + 1), rows=rows) + k * draft + self.wait_s
            if held:
                step -= self.draft_cost(rows * width, rows=rows)
            gain = rows + m * expected  # (pipelined too: f * (1 + t + ... + t ** (k - 2)) + ...)
            if gain / step > best_rate:
                best, best_rate = k, gain / step
        return best

    def probe(self, rows: int, pipelined: bool, limit: int) -> int:
        """Draft tokens the draft model drafts anyway in a step where
        :meth:`model_steps` drafts none for the rows that ask it: 2 (the
        shortest draft a pipelined step can verify), once the step's plain
        forwards since it last ran have taken :data:`OVERHEAD` of their
        time as many times as those draft forwards cost; else 0.

        Shaped so because :meth:`model_rate` learns only from drafts the
        draft model drafted: one whose first requests made it look unlikely
        (a prior, or a draft at a request's very first token) would
        otherwise never run again, however well its tokens would hold, as
        in a batch, where its steps are priced against a dearer forward.
        A probe's drafts are cut as any (verified only where they pay); it
        costs at most ``OVERHEAD`` of the plain steps' time, and nothing
        where the fixed policy prices nothing (it drafts ``limit``)."""
        if limit < 2 or not self.cost_aware or self.draft_cost is None:
            return 0
        forwards = 1 if pipelined else 2
        spent = forwards * self.draft_cost(rows, rows=rows)
        self._unprobed += OVERHEAD * self.cost(rows, rows=rows)
        if self._unprobed < spent:
            return 0
        self._unprobed = 0.0
        return 2

    def observe_draft(self, steps: int, rows: int, seconds: float) -> None:
        """The draft model ran ``steps`` forwards over ``rows`` rows in
        ``seconds`` (counted in :attr:`stats`; a point of its cost)."""
        self.stats.model_forwards += steps
        self.stats.model_s += seconds
        if self.draft_cost is not None and steps:
            self.draft_cost.observe(rows, seconds / steps, rows=rows)

    def usable(self, draft: Any, pipelined: bool) -> float:
        """The tokens of ``draft`` a verification is expected to have
        accepted, of those it may take: its scaled estimates (:meth:`probs`)
        summed, as far as the request's credit affords (:meth:`_credit_cut`)."""
        probs = self.probs(draft)
        if probs and self.cost_aware:
            probs = probs[: self._credit_cut(draft, len(probs), pipelined)]
        return sum(probs)

    def better(self, tree: Any, usable: float, model: Any) -> Any:
        """Of a row's draft from the trees (``usable``: its :meth:`usable`)
        and from the draft model, the one expected to have more tokens
        accepted (as the policy scales their estimates); the trees' on a tie
        (they cost no forward to go on)."""
        if not model:
            return tree
        if not tree:
            return model
        return model if sum(self.probs(model)) > usable else tree

    def record(self, draft: Any, verified: int, accepted: int) -> None:
        """Learn from a verified draft: its first ``verified`` tokens were
        checked and ``accepted`` of them accepted."""
        self.calibration.update(
            draft.probs[:verified],
            accepted,
            draft.match_len,
            draft.source,
            draft.tree_len,
            draft.tree_match,
        )

    @property
    def wait_s(self) -> float:
        """The seconds the host works after reading a forward's result (a
        verification's, or a plain forward's that checks first tokens)
        before it builds the next forward: the mean of :attr:`stats`
        (``idle_s`` over ``waits``). A plain step's host work runs while the
        forward before it computes, so this is what a verification or a
        check costs beyond its forward; the rules price it
        (:func:`best_length`). (The next forward's graph, built after it,
        is not counted: on a GPU the device waits for that too, on a CPU
        backend a plain step builds its graph while nothing else computes
        either.)"""
        return self.stats.idle_s / self.stats.waits if self.stats.waits else 0.0

    def observe_host(self, seconds: float, rows: Optional[int] = None) -> None:
        """A proposal took ``seconds`` of host time: a draft's, its cut
        included, in a step of ``rows`` rows; or (``rows`` None) a walk of
        the trees that found nothing, which stands for a proposal only
        until a draft's time is known (where walks find drafts, a skip
        saves a draft's walk, cut and check, so :meth:`skips` weighs
        that)."""
        if rows is not None:
            self.rows = rows
        elif self.propose_s:
            return
        self.propose_s += (seconds - self.propose_s) * (0.1 if self.propose_s else 1.0)

    def skips(self) -> int:
        """The most steps a request whose proposals find nothing skips
        proposing between two proposals (:class:`~mlx_lm_suffix.speculation.
        Row`): as many as make a proposal's host time at most
        :data:`OVERHEAD` of the plain steps it spans, and in a batch of
        ``rows`` rows, the rows' proposals at most that share of the
        batch's plain steps (one batch step takes every row's proposal in
        turn). Proposals hold the device up where the host computes the
        forward (a CPU) or has not queued it yet, and a request whose text
        repeats nothing gains nothing from them; a skip misses at most that
        many steps of a repeat that starts. None without a cost curve (the
        fixed policy)."""
        if not self.cost_aware:
            return 0
        rows = self.rows
        return int(self.propose_s * rows / (OVERHEAD * self.cost(rows, rows=rows)))

    def observe(self, n: int, seconds: float, rows: int = 1, unpaired: bool = False) -> None:
        """A forward of ``n`` tokens over ``rows`` rows took ``seconds``.
        ``unpaired``: a forward of a target paired with a draft model
        (:class:`~mlx_lm_suffix.sources.draft_model.Paired`) that did not
        feed the draft model (it held the tokens): observed as the forward
        that feeds it too, the draft model's forward priced in, so that
        the curve prices every paired forward alike (:meth:`model_steps`
        takes it out where the draft model holds its draft)."""
        if self.cost is not None:
            if unpaired and self.draft_cost is not None:
                seconds += self.draft_cost(n, rows=rows)
            self.cost.observe(n, seconds, rows=rows)

    def observe_plain(self, seconds: float, rows: int = 1) -> None:
        """A pipelined plain step over ``rows`` rows took ``seconds`` (from
        one step's tokens to the next's): the mean of every
        :data:`PLAIN_STEPS` of them is one observation of a 1-token forward,
        or of a batch's plain step (an observation takes a few
        microseconds, as much as the rest of a plain step's own work, and
        one step's time is the noisiest). A batch's draft-model steps are
        priced against its plain step (:meth:`model_steps`, :meth:`probe`;
        so are :meth:`skips`), so both it and the verifications are learnt
        from the batch's own steps, in the same process and under the same
        load: the plain step's prior is one sequence's forward over as many
        tokens, which leaves out what a batch costs beyond it (each row's
        context, its sampling)."""
        plain = self._plain.setdefault(rows, [])
        plain.append(seconds)
        if len(plain) == PLAIN_STEPS:
            self.observe(rows, sum(plain) / PLAIN_STEPS, rows=rows)
            plain.clear()


def best_length(
    probs: Sequence[float],
    cost: Callable[[int], float],
    pipelined: bool = False,
    replay: bool = False,
    budget: Optional[float] = None,
    wait: float = 0.0,
) -> int:
    """Draft length maximising expected committed tokens per second for one
    sequence; ``0`` when no draft beats a plain step. ``probs``: cumulative
    acceptance probabilities (the trees' estimates scaled by
    :meth:`Calibration.scale`); ``cost``: a forward's seconds by its tokens
    (:class:`VerifyCost`, or its :meth:`~VerifyCost.least`).

    Not pipelined, the verifying forward feeds the last committed token plus
    the draft. Pipelined, the plain forward after the last committed token is
    already running: it checks the draft's first token for free, and only a
    draft whose first token it confirms is verified, feeding that token plus
    the rest; so a draft is worth it when its tail is, given its first token.

    ``replay``: a draft not accepted in full costs one more forward, over the
    tokens it committed (the cache went back to before the verification,
    see :func:`~mlx_lm_suffix.rollback.undo`), counted at the expected
    number of them.

    ``budget``: lengths whose step would take more than this many seconds
    beyond a plain step are not considered (pipelined, the whole verifying
    forward comes after the plain one).

    A verification must expect to commit tokens :data:`MARGIN` times as
    fast as plain steps.

    ``wait``: the seconds the device waits for the host after a forward
    whose result the host reads (:attr:`Policy.wait_s`), which plain steps
    do not cost (each is queued while the one before runs): a verification
    costs it beyond its forward, and pipelined, so does the check of a
    first token that fails; a draft is checked only when what its tail
    saves, given its first token, covers the checks that fail.
    """
    if pipelined:
        rest = None if budget is None else budget - cost(1)
        tail_probs = given_first(probs)
        tail = best_length(tail_probs, cost, replay=replay, budget=rest, wait=wait)
        if not tail:
            return 0
        gain = 1.0 + sum(tail_probs[:tail])
        saved = gain * cost(1) - _verify_s(tail, tail_probs[tail - 1], gain, cost, replay, wait)
        return tail + 1 if probs[0] * saved >= (1.0 - probs[0]) * wait else 0
    best, best_rate = 0, MARGIN / cost(1)
    gain = 1.0
    for i, p in enumerate(probs):
        gain += p
        step = _verify_s(i + 1, p, gain, cost, replay, wait)
        if budget is not None and step - cost(1) > budget:
            continue
        rate = gain / step
        if rate > best_rate:
            best, best_rate = i + 1, rate
    return best


def _verify_s(n: int, full: float, gain: float, cost: Callable[[int], float], replay: bool,
              wait: float) -> float:
    """Expected seconds of verifying the first ``n`` tokens of a draft
    after a known token (see :func:`best_length`): ``full`` the chance all
    ``n`` hold, ``gain`` the tokens it is expected to commit."""
    step = cost(n + 1) + wait
    if replay:
        step += (1.0 - full) * cost(max(1, round(gain)))
    return step


def best_batch_lengths(
    probs: List[Sequence[float]],
    cost: VerifyCost,
    pipelined: bool = False,
    replay: bool = False,
    budget: Optional[float] = None,
    wait: float = 0.0,
    margin: Optional[float] = None,
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

    With more than one row, verifying must beat plain steps by ``margin``
    (default :data:`BATCH_MARGIN`; :meth:`Policy.batch_lengths` gives
    :data:`MARGIN` where every row drafts from a draft model): the rows whose drafts fail, or that have none, wait
    for the wider forward, and the request that finishes last is the one
    that gained least (rows that gain finish early), so a verification that
    only breaks even on the batch's token count slows the batch down.

    ``replay``: unless every row's draft is accepted in full, every row is
    fed its kept tokens again in one more forward (see
    :func:`~mlx_lm_suffix.rollback.undo_rows`), counted at the rows'
    expected tokens.

    ``budget``: widths whose step would take more than this many seconds
    beyond the batch's plain step are not considered.

    ``wait``: as for :func:`best_length`; pipelined, a check in which no
    row's first token holds costs it alone."""
    width, _ = _best_width(probs, cost, pipelined, replay, budget, wait, margin)
    if pipelined:
        tails = [given_first(p) for p in probs]
        return [min(len(t), width) + 1 if width and t else 0 for t in tails]
    return [min(len(p), width) for p in probs]


def _best_width(
    probs: List[Sequence[float]],
    cost: VerifyCost,
    pipelined: bool,
    replay: bool = False,
    budget: Optional[float] = None,
    wait: float = 0.0,
    margin: Optional[float] = None,
) -> Tuple[int, float]:
    """The batch width of :func:`best_batch_lengths` (of the tails, when
    ``pipelined``) and the time it saves against plain steps (0 if none
    pays)."""
    B = len(probs)
    if B == 0:
        return 0, 0.0
    plain = cost(B)
    sunk_tokens = sunk_cost = missed = 0.0
    if pipelined:
        missed = math.prod(1.0 - p[0] for p in probs if p)  # no first token holds
        probs = [given_first(p) for p in probs]
        sunk_tokens, sunk_cost = B, plain
    # The rows' expected accepted tokens of their first k draft tokens, by k.
    accepted = list(itertools.accumulate(
        sum(column) for column in itertools.zip_longest(*probs, fillvalue=0.0)))
    margin = BATCH_MARGIN if margin is None else margin
    ref = B / plain * (margin if B > 1 else 1.0)
    best_k, best_saved = 0, 0.0
    for k in range(1, len(accepted) + 1):
        gain = sunk_tokens + B + accepted[k - 1]
        step = sunk_cost + cost(B * (k + 1), rows=B) + wait
        if replay:
            # Rows without a draft accept all of it; the others' chance.
            full = math.prod(p[min(k, len(p)) - 1] for p in probs if p)
            step += (1.0 - full) * cost(B * max(1, round((gain - sunk_tokens) / B)), rows=B)
        if budget is not None and step - plain > budget:
            continue
        # The time plain steps (by the margin) would take, less the step's:
        # positive exactly when the step commits tokens faster than them.
        saved = (1.0 - missed) * (gain / ref - step) - missed * wait
        if saved > best_saved:
            best_k, best_saved = k, saved
    return best_k, best_saved
