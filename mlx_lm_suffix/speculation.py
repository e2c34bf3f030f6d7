"""A row's speculation, written once: how far it may draft, its proposal,
the policy's cut, the first-token check, acceptance, and its counts.

A *row* is one sequence being generated (:class:`Row`). Two drivers step
rows: the single-sequence loop (:mod:`~mlx_lm_suffix.loop`; the simulator,
:mod:`~mlx_lm_suffix.tools.simulate`, runs it with a recorded answer playing
the model) and the batch (:mod:`~mlx_lm_suffix.batch`, a row per request).
A driver owns the model, its cache and the arrays, and the order of its
forwards; this module owns the decisions, over plain ints, for one row or
many alike: :func:`propose` (each row's draft), :func:`cut` (how much of it
the policy verifies), :func:`check` (a plain forward's token against each
draft's first), :func:`accept` (how much of a verification holds).

Every row has a *pending* token: the target's choice after its last emitted
token, not emitted yet. A step is one of two kinds:

- **settled** (the pending tokens are known and nothing computes: after a
  verification or a first-token check): a row drafts after its pending
  token and, where the policy says so, verifies both in one forward of
  ``[pending] + draft``;
- **pipelined** (otherwise, and where that draft would not pay): every row
  emits its pending token and the plain forward after them is queued, as
  stock mlx-lm steps; meanwhile each row drafts after the token it emitted.
  The forward's own tokens check each draft's first token; where the policy
  says so, the confirmed drafts' rests are verified in one forward of each
  row's ``[that token] + rest`` (a row without a draft feeds its token
  alone).

Verification accepts the longest prefix equal to the sampled tokens
(:mod:`~mlx_lm_suffix.verification`); a row emits the token it fed first
and the accepted ones, and the token sampled after them is its next pending
token. A draft never reaches past what the row may still emit, nor past the
positions its cache can take and roll back (:meth:`Row.cap`).
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Hashable, List, Optional, Protocol, Sequence, Tuple

from . import ranks
from .drafter import SuffixDrafter
from .policy.calibration import RequestTrust
from .policy.rules import Policy
from .sources import Draft
from .stats import RequestUsage
from .verification import accepted_length

#: The most committed tokens (and plain steps) a row holds back from its
#: drafter (see :class:`Row`).
FLUSH = 32


@dataclass
class Backoff:
    """A row's skipped proposals: a proposal that found nothing, or a draft
    that held no further than a plain step would have gone, makes the row
    skip its next 1, 3, 7, ... proposals, up to the policy's
    :meth:`~mlx_lm_suffix.policy.rules.Policy.skips`; a draft that held
    resets that."""

    skip: int = 0  # proposals still to skip
    next: int = 0  # the skip after the next useless proposal

    def skipping(self) -> bool:
        """Whether this proposal is skipped (one skip less)."""
        if self.skip:
            self.skip -= 1
            return True
        return False

    def found(self, useful: bool, most: int) -> None:
        """A proposal found a draft that held further than a plain step
        would have gone, or did not."""
        if useful:
            self.next = 0
        else:
            self.skip = self.next
            self.next = min(2 * self.next + 1, most)


@dataclass
class Watch:
    """The last draft a row proposed, held against the tokens the row
    commits after it, verified or not: how far it holds teaches the
    request's :class:`~mlx_lm_suffix.policy.calibration.RequestTrust`, and
    while the committed tokens follow it, its rest is the row's next draft
    with no new proposal (:meth:`Row.ask`)."""

    draft: Optional[Draft] = None
    base: int = 0  # the row's committed tokens before the draft
    compared: int = 0  # its tokens compared with committed ones
    held: int = 0  # its tokens the committed ones followed
    pipelined: bool = False  # a plain forward was to check its first token

    def start(self, draft: Draft, base: int, pipelined: bool) -> None:
        self.draft, self.base, self.compared, self.held = draft, base, 0, 0
        self.pipelined = pipelined

    def following(self, committed: int) -> bool:
        """Whether the ``committed`` tokens followed the draft so far."""
        return self.draft is not None and self.held == self.compared == committed - self.base > 0

    def follow(self, tokens: Sequence[int], start: int, trust: RequestTrust) -> Optional[bool]:
        """Committed ``tokens``, the first of them the row's ``start``-th:
        ``trust`` learns from each draft token they reach. Returns None
        while the draft is still watched, else (it failed or ended) whether
        it held further than a plain step would have gone."""
        d, base = self.draft, start - self.base
        lo = i = max(self.compared, base)
        end = min(len(d), base + len(tokens))
        while i < end and d.tokens[i] == tokens[i - base]:
            i += 1
        if i < end:  # token i failed
            trust.held(d.probs, lo, i + 1, False, d.source, d.tree_len)
            self.compared = i + 1
        elif i > lo:
            trust.held(d.probs, lo, i, True, d.source, d.tree_len)
            self.compared = i
        if i > lo:
            self.held = i
        return self.drop() if i < end or self.held == len(d) else None

    def drop(self) -> Optional[bool]:
        """Done with the draft (it failed, ended, or a new one comes): None
        where no committed token reached it, else whether it held further
        than a plain step would have gone."""
        if self.draft is None:
            return None
        self.draft = None
        return self.held > self.pipelined if self.compared else None


@dataclass(eq=False)
class Row:
    """One sequence's drafting state: its drafter request (``req``; None:
    it does not use the drafter, so it drafts nothing and nothing of it is
    cached), the most tokens a draft may have (``num_draft_tokens``; 0: no
    drafting), the tokens it may emit in all (``max_tokens``), and its counts
    (``usage``), which the drafter's totals follow (one writer of both:
    :meth:`_count`).

    A row hands its committed tokens to the drafter in bulk: when it asks
    for a draft, while a verification's forward runs (:meth:`grow`), every
    :data:`FLUSH` plain steps (so that other requests in flight draft from
    them), and when it finishes (:meth:`finish`); its plain steps and host
    time go with its next counts, at the latest as often. A plain step
    itself costs a list append. The drafter's trees get the tokens only
    while a forward runs: a proposal between a forward's result and the
    next forward (settled) hands the drafter its context alone.

    Its last proposal is watched (:class:`Watch`), and proposals that find
    nothing useful are skipped for a while (:class:`Backoff`)."""

    drafter: Optional[SuffixDrafter]
    req: Optional[int]
    num_draft_tokens: int
    max_tokens: float
    usage: RequestUsage = field(default_factory=RequestUsage)
    emitted: int = 0
    #: The pending token is committed already (a settled draft follows it).
    pending_committed: bool = False
    trust: RequestTrust = field(default_factory=RequestTrust)
    watch: Watch = field(default_factory=Watch)
    backoff: Backoff = field(default_factory=Backoff)
    #: The row may draft from its drafter's draft model (its driver's cache
    #: holds the draft model's too).
    model: bool = False
    #: Its draft model keeps the positions it drafted (:meth:`~mlx_lm_suffix.
    #: sources.draft_model.Paired.hold`): a verification of its draft feeds
    #: the draft model nothing.
    holds: bool = False
    # Committed tokens, plain steps and host seconds not handed to the
    # drafter yet; whether it has tokens its trees have not.
    _tokens: List[int] = field(default_factory=list)
    _steps: int = 0
    _host: float = 0.0
    _ungrown: bool = False
    # The accepted draft tokens the last verification emitted, and their source.
    _last: Tuple[str, int] = ("tree", 0)

    # ------------------------------------------------------------ drafts
    def cap(self, room: float, settled: bool) -> int:
        """The most tokens a draft after the committed tokens may have: the
        one cap rule. A verification emits the token it feeds first (the
        pending token, settled; the draft's confirmed first token,
        pipelined) and the accepted ones, and feeds as many positions, so
        settled drafts get one less than ``num_draft_tokens`` against what
        the row may still emit and the ``room`` its cache has (positions it
        can take and roll back)."""
        ahead = 1 if settled else 0
        return int(min(self.num_draft_tokens, self.max_tokens - self.emitted - ahead, room - ahead))

    def ask(self, room: float, settled: bool) -> Tuple[Optional[Draft], int]:
        """This step's draft where the row decides it alone, or how many
        tokens to ask its sources for: ``(draft, 0)`` with the watched
        draft's rest where the committed tokens followed it and it still
        fills half the cap, or an empty draft (the cap is below
        :func:`shortest`); ``(Draft(), k)`` where the row skips asking the
        trees (a draft model may still draft ``k``); else ``(None, k)``,
        ``k`` the cap."""
        k = self.cap(room, settled)
        if self.req is None or k < shortest(settled):
            return Draft(), 0
        d = self.watch.draft
        if d is not None:
            held = self.watch.held
            if (self.watch.following(self.emitted + self.pending_committed)
                    and len(d) - held >= max(shortest(settled), k // 2)):
                return d.after(held, k), 0
            self._learn(d, self.watch.drop())
        if self.backoff.skipping():
            return Draft(), k
        return None, k

    def proposed(self, draft: Draft, seconds: float, settled: bool) -> None:
        """Its source proposed ``draft`` (empty: nothing), taking
        ``seconds`` of host time: the row watches it."""
        self._host += seconds
        draft.trust = self.trust
        if draft.tokens:
            self.watch.start(draft, self.emitted + self.pending_committed, not settled)
        else:
            self.drafter.policy.observe_host(seconds)
            self._learn(draft, False)

    def drafted(self, draft: Draft, settled: bool) -> None:
        """The row takes ``draft`` from its draft model (watched instead of
        its trees' proposal)."""
        draft.trust = self.trust
        self.watch.start(draft, self.emitted + self.pending_committed, not settled)

    def spent(self, seconds: float) -> None:
        """Host seconds of drafting for this row (its share of a cut)."""
        self._host += seconds

    def resting(self) -> bool:
        """Whether the row proposes nothing this step whatever its room: it
        does not draft (no drafter request, or no draft tokens), or it skips
        proposals and follows no draft."""
        return (self.req is None or self.num_draft_tokens <= 0
                or (self.backoff.skip > 0 and not self.model
                    and not self.watch.following(self.emitted + self.pending_committed)))

    def _learn(self, draft: Draft, useful: Optional[bool]) -> None:
        """The trees' ``draft`` was done with: the row's skips (a draft
        model's drafts cost no walk of the trees)."""
        if useful is not None and draft.source != "model":
            self.backoff.found(useful, self.drafter.policy.skips())

    # ----------------------------------------------------------- tokens
    def commit_ahead(self, token: int) -> None:
        """Commit the pending ``token`` before it is emitted."""
        if not self.pending_committed:
            self._commit([token], self.emitted)
        self.pending_committed = True

    def stepped(self, token: int) -> None:
        """A plain step emitted the pending ``token``: one forward."""
        if not self.pending_committed:
            self._commit((token,), self.emitted)
        self.pending_committed = False
        self.emitted += 1
        self._steps += 1
        if len(self._tokens) >= FLUSH or self._steps >= FLUSH:
            self.flush()
            self._count()

    def emit(self, tokens: Sequence[int], drafted: int = 0, source: str = "tree") -> None:
        """``tokens`` are emitted in order, the pending token first;
        ``drafted`` of them were accepted draft tokens from ``source``."""
        if self.pending_committed:
            self._commit(tokens[1:], self.emitted + 1)
        else:
            self._commit(tokens, self.emitted)
        self.pending_committed = False
        self.emitted += len(tokens)
        self._last = (source, drafted)
        self._count(accepted=drafted, source=source)

    def take_back(self, tokens: int, drafted: int) -> None:
        """The last ``tokens`` emitted (``drafted`` of them accepted draft
        tokens, the last verification's) were never delivered: they are
        not counted. (The drafter keeps them: they are the model's own
        continuation.)"""
        self.emitted -= tokens
        source, accepted = self._last
        self._count(accepted=-drafted, source=source, last=accepted)

    def _commit(self, tokens: Sequence[int], start: int) -> None:
        """``tokens``, the request's ``start``-th on, are committed."""
        if self.req is None or not tokens:
            return
        self._tokens.extend(tokens)
        d = self.watch.draft
        if d is not None:
            self._learn(d, self.watch.follow(tokens, start, self.trust))

    def grow(self) -> None:
        """While a forward runs: the drafter gets the committed tokens, its
        trees included."""
        if self.req is not None:
            self.flush()

    def flush(self, grow: bool = True) -> None:
        """Hand the committed tokens to the drafter (its trees get them
        unless ``grow`` is False)."""
        if self._tokens:
            self.drafter.commit(self.req, self._tokens, grow)
            self._tokens = []
            self._ungrown = not grow
        elif grow and self._ungrown:
            self.drafter.grow(self.req)
            self._ungrown = False

    def finish(self) -> None:
        """The row is done: the drafter gets the rest of it, and the request
        stops (its response stays in the global cache)."""
        if self.req is not None:
            self.flush()
            self._count()
            self.drafter.finish(self.req)
            self.req = None

    # ----------------------------------------------------------- counts
    def missed(self, draft: Draft) -> None:
        """The plain forward sampled another token than ``draft``'s first:
        a draft of one token, verified by no forward of its own."""
        self._count(drafted=1, steps=0, draft=draft, held=0)
        self._paid(0, 0)

    def verified(self, draft: Draft, first: int, accepted: int) -> None:
        """A verification forward, of ``draft`` (empty: the row fed its
        first input alone) whose first ``first`` tokens were confirmed
        before it, accepted ``accepted`` of the rest."""
        if draft:
            self._count(drafted=len(draft), steps=1, draft=draft, held=accepted + first)
            self._paid(1 + len(draft) - first, 1 + accepted)
        else:
            self._count(steps=1)

    def replayed(self, tokens: int) -> None:
        """Its cache went back and was fed ``tokens`` again."""
        self._count(steps=0, replayed=tokens)

    def _paid(self, width: int, emitted: int) -> None:
        """A forward of ``width`` tokens emitted ``emitted`` (``0, 0``: a
        check whose first token failed): the request's credit
        (:meth:`~mlx_lm_suffix.policy.rules.Policy.paid`)."""
        if self.req is not None:
            self.drafter.policy.paid(self.trust, width, emitted)

    def _count(self, steps: int = 0, drafted: int = 0, accepted: int = 0,
               draft: Optional[Draft] = None, held: Optional[int] = None,
               replayed: Optional[int] = None, source: str = "tree", last: int = 0) -> None:
        """The one writer of the row's counts and, through
        :meth:`~mlx_lm_suffix.drafter.SuffixDrafter.record`, the drafter's:
        ``steps`` target forwards (and the plain steps and host time held
        back), ``drafted`` draft tokens of ``draft`` verified of which
        ``held`` held (the policy learns from them), ``accepted`` draft
        tokens from ``source`` emitted (negative: taken back from the
        ``last`` the last verification emitted), a replay of ``replayed``
        tokens."""
        if self.req is None:
            return
        u = self.usage
        steps += self._steps
        u.steps += steps
        u.drafted += drafted
        u.accepted += accepted
        u.host_s += self._host
        if drafted:
            origin = draft.source if draft is not None else source
            u.source_drafted[origin] = u.source_drafted.get(origin, 0) + drafted
        if accepted:
            u.source_accepted[source] = u.source_accepted.get(source, 0) + accepted
        if replayed is not None:
            u.replays += 1
            u.replayed_tokens += replayed
        self.drafter.record(steps=steps, drafted=drafted, accepted=accepted, draft=draft,
                            held=held, host_s=self._host, replayed=replayed, source=source,
                            last=last)
        self._steps, self._host = 0, 0.0


@dataclass
class RequestOptions:
    """How one request drafts, on every path (the loop's
    ``suffix_generate_step(options=...)``, the batch's ``insert(options=...)``;
    a server's handler makes them, see :mod:`~mlx_lm_suffix.patches.serving`).

    Args:
        num_draft_tokens: Most tokens drafted per step (None: the
            drafter's); ``0`` turns drafting off (the response is still
            added to the drafter's cache).
        scope: The drafter's cache partition (see ``SuffixDrafter.start``).
        prompt: The whole prompt for the request's own suffix tree. Default:
            the tokens in the sequence's cache when generation starts, which
            is the whole prompt unless a cached prefix was left out.
        usage: Counters updated in place while the request generates.
        use_drafter: ``False``: the request does not touch the drafter at
            all (no drafting, nothing cached).
        arrived: ``time.perf_counter()`` when the request arrived: the time
            it then waits while verifications run is counted in a batch's
            stats.
    """

    num_draft_tokens: Optional[int] = None
    scope: Hashable = None
    prompt: Optional[Sequence[int]] = None
    usage: Optional[RequestUsage] = None
    use_drafter: bool = True
    arrived: Optional[float] = None

    def start(self, drafter: Optional[SuffixDrafter], tokens: Sequence[int], max_tokens: float
              ) -> Row:
        """The row of a request with these options whose cache holds
        ``tokens``, its drafter request started."""
        req, k = None, 0
        if drafter is not None and self.use_drafter:
            req = drafter.start(self.prompt if self.prompt is not None else tokens, self.scope)
            k = drafter.num_draft_tokens if self.num_draft_tokens is None else self.num_draft_tokens
        usage = self.usage if self.usage is not None else RequestUsage()
        return Row(drafter, req, k, max_tokens, usage)


class Driver(Protocol):
    """What the decisions ask of a driver: its policy, its cache's room,
    and its rows' draft model's drafts."""

    policy: Policy

    def room(self) -> float:
        """How many more positions every row's cache can take and roll back."""

    def replays(self, width: int) -> bool:
        """Whether a rejection after a forward ``width`` wide may cost feeding
        the kept tokens again."""

    def model_draft(self, steps: int, settled: bool, contexts: Optional[List[List[int]]]
                    ) -> Tuple[List[List[int]], List[List[float]], float]:
        """``steps`` draft tokens of the draft model for every row, their
        probabilities, and the seconds it took
        (:meth:`~mlx_lm_suffix.sources.draft_model.DraftModel.draft`: after
        each row's pending token where ``settled``, else after the token
        the queued plain forward was fed; only where rows have ``model``)."""


def shortest(settled: bool) -> int:
    """The shortest draft that can gain anything: pipelined, the plain
    forward checks the first token, so a draft needs two."""
    return 1 if settled else 2


def propose(rows: Sequence[Row], driver: Driver, settled: bool) -> Optional[List[Draft]]:
    """Each row's draft (:meth:`Row.ask`; the rows that ask the trees ask
    them in one call, and those that may draft from a draft model, where
    the policy runs it, get its drafts in one batched run:
    :func:`_model_drafts`); None where no row may draft (then the ranks of
    a distributed server share nothing). Ranks other than 0 draft nothing:
    :func:`cut` gives them rank 0's drafts."""
    def may_draft(room: float) -> bool:
        return any(r.req is not None and r.cap(room, settled) >= shortest(settled) for r in rows)

    if not may_draft(math.inf):  # (then the cache's room need not be asked)
        return None
    if resting(rows):  # (in one process: ranks decide by room)
        return [Draft() for _ in rows]
    room = driver.room()
    if not may_draft(room):
        return None
    if ranks.following():
        return [Draft() for _ in rows]
    asks = [row.ask(room, settled) for row in rows]
    asking = [i for i, (d, _) in enumerate(asks) if d is None]
    drafts = [d if d is not None else Draft() for d, _ in asks]
    if asking:
        tic = time.perf_counter()
        for i in asking:  # (the drafter's context first)
            rows[i].flush(grow=not settled)
        fresh = rows[asking[0]].drafter.drafts([rows[i].req for i in asking],
                                              [asks[i][1] for i in asking])
        took = (time.perf_counter() - tic) / len(asking)
        for i, d in zip(asking, fresh):
            rows[i].proposed(d, took, settled)
            drafts[i] = d
    model = [i for i, (d, k) in enumerate(asks) if k and rows[i].model]
    if model:
        _model_drafts(rows, drafts, model, [asks[i][1] for i in model], driver, settled)
    return drafts


def _model_drafts(rows: Sequence[Row], drafts: List[Draft], asking: List[int], caps: List[int],
                  driver: Driver, settled: bool) -> None:
    """The draft model's drafts, in place of ``drafts[i]`` for the rows
    ``asking`` (``caps``: their most tokens) where the policy prefers them
    (:meth:`~mlx_lm_suffix.policy.rules.Policy.better`): it runs for the
    rows whose trees' draft, as much of it as the request's credit affords
    (:meth:`~mlx_lm_suffix.policy.rules.Policy.usable`), is expected to
    hold fewer tokens than its own (each row's chance a model token holds,
    :meth:`~mlx_lm_suffix.policy.rules.Policy.model_rate`, over its cap),
    as many steps as
    :meth:`~mlx_lm_suffix.policy.rules.Policy.model_steps` says, or where it
    says none, now and then a probe's
    (:meth:`~mlx_lm_suffix.policy.rules.Policy.probe`; one batched run for
    every row of the driver)."""
    policy = driver.policy
    want, rates, usable = [], [], {}
    for i, k in zip(asking, caps):
        f, t = rate = policy.model_rate(rows[i].trust)
        expected = f * (k if t >= 1.0 else (1.0 - t ** k) / (1.0 - t))
        usable[i] = policy.usable(drafts[i], not settled) if drafts[i] else 0.0
        if not drafts[i] or usable[i] < expected:
            want.append(i)
            rates.append(rate)
    if not want:
        return
    cap = max(caps[asking.index(i)] for i in want)
    held = all(rows[i].holds for i in want)
    steps = policy.model_steps(rates, len(rows), not settled, cap, held) or policy.probe(
        len(rows), not settled, cap)
    if not steps:
        return
    drafter = rows[want[0]].drafter
    for i in want:
        rows[i].flush(grow=not settled)
    contexts = None
    if drafter.draft_model.guide is not None:
        contexts = [drafter.context(r.req) if r.req is not None else [] for r in rows]
    tokens, probs, seconds = driver.model_draft(steps, settled, contexts)
    if not tokens:
        return
    policy.observe_draft(steps, len(rows), seconds)
    for i in want:
        n = min(steps, caps[asking.index(i)])
        cumulative = list(itertools.accumulate(probs[i][:n], operator.mul))
        d = Draft(tokens[i][:n], cumulative, source="model", trust=rows[i].trust)
        policy.drafted(d)
        rows[i].spent(seconds / len(want))
        if policy.better(drafts[i], usable[i], d) is d:
            rows[i].drafted(d, settled)
            drafts[i] = d


def settles(rows: Sequence[Row], policy: Policy) -> bool:
    """Whether the rows' next step drafts after their pending tokens though
    this one drafted nothing: where a row may draft from a draft model and
    the policy would run it there (a draft model's first token is its
    surest; in a pipelined step the plain forward would check it, a
    forward more for the same tokens, so it drafts in settled steps only)."""
    asking = [r for r in rows if r.model and r.req is not None]
    if not asking:
        return False
    rates = [policy.model_rate(r.trust) for r in asking]
    most = max(r.num_draft_tokens for r in asking)
    return policy.model_steps(rates, len(rows), False, most, all(r.holds for r in asking)) > 0


def resting(rows: Sequence[Row]) -> bool:
    """Whether every row skips proposing this step (then, in one process,
    the step proposes and prices nothing: each row counts a skip)."""
    if ranks.group() is not None or not all(r.resting() for r in rows):
        return False
    for r in rows:
        r.backoff.skipping()
    return True


def plan(rows: Sequence[Row], driver: Driver, settled: bool, budget: Optional[float],
         proposed: Optional[List[Draft]] = None) -> Tuple[Optional[List[Draft]], List[Draft]]:
    """The rows' proposals (:func:`propose`, unless given) and the drafts
    the policy cuts from them (:func:`cut`); their host time per draft
    proposed goes to the policy (:meth:`~mlx_lm_suffix.policy.rules.Policy.
    observe_host`) and, the cut's, to the rows with drafts."""
    tic = time.perf_counter()
    if proposed is None:
        proposed = propose(rows, driver, settled)
    cutting = time.perf_counter()
    drafts = cut(proposed, driver, settled, budget, len(rows))
    n = sum(1 for d in proposed or () if d)
    if n:
        done = time.perf_counter()
        driver.policy.observe_host((done - tic) / n, len(rows))
        for row, d in zip(rows, proposed):
            if d:
                row.spent((done - cutting) / n)
    return proposed, drafts


def plan_row(row: Row, driver: Driver, settled: bool, budget: Optional[float] = None,
             proposed: Optional[Draft] = None) -> Tuple[Optional[Draft], Draft]:
    """One row's :func:`plan`: its proposal (None: it may not draft) and
    its cut draft."""
    early, drafts = plan((row,), driver, settled, budget, None if proposed is None else [proposed])
    return (None if early is None else early[0]), drafts[0]


def cut(drafts: Optional[List[Draft]], driver: Driver, settled: bool,
        budget: Optional[float] = None, rows: int = 1) -> List[Draft]:
    """The drafts of :func:`propose` cut to the lengths the policy verifies
    (``budget``: the most seconds the step may take beyond a plain step;
    ``rows``: how many, where ``drafts`` is None). Distributed: rank 0's
    cut drafts, on every rank."""
    if drafts is None:
        return [Draft() for _ in range(rows)]
    width = max(map(len, drafts), default=0)
    if width:
        replay = driver.replays(width + 1)
        lengths = driver.policy.batch_lengths(drafts, not settled, replay, budget)
        drafts = [d.truncate(n) for d, n in zip(drafts, lengths)]
    return ranks.drafts(drafts)


def check(row: Row, draft: Draft, sampled: int) -> Draft:
    """``draft`` where the plain forward sampled its first token, else an
    empty draft (a miss, counted: :meth:`Row.missed`)."""
    if draft and draft.tokens[0] != sampled:
        row.missed(draft)
        return Draft()
    return draft


def accept(row: Row, draft: Draft, first: int, targets: Sequence[int]) -> int:
    """Count a verification of ``draft`` whose first ``first`` tokens were
    confirmed before it (and fed as its first input), with ``targets`` the
    tokens sampled after each input; returns how many of the rest it
    accepts."""
    rest = draft.tokens[first:]
    a = accepted_length(rest, targets[: len(rest) + 1])
    row.verified(draft, first, a)
    return a
