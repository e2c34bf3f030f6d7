"""One row's speculation, written once: how far it may draft, the policy's
cut, the first-token check, acceptance, and its counts.

A *row* is one sequence being generated. Three drivers step rows through
:func:`step`: the single-sequence loop (:mod:`~mlx_lm_suffix.loop`, one
row), the batch (:mod:`~mlx_lm_suffix.batch`, a row per request) and the
simulator (:mod:`~mlx_lm_suffix.tools.simulate`: recorded outputs and a cost
curve). A driver owns the model, its cache and the arrays (:class:`Driver`);
this module owns the decisions, over plain ints.

Every row has a *pending* token: the target's choice after its last emitted
token, not emitted yet. A step is one of two kinds:

- **settled** (the pending tokens are known and nothing computes: after a
  verification or a first-token check): a single row drafts after its
  pending token and, where the policy says so, verifies both in one forward
  of ``[pending] + draft``;
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

import math
import time
from dataclasses import dataclass, field
from typing import Generator, List, Optional, Protocol, Sequence, Tuple

from . import ranks
from .drafter import Draft, SuffixDrafter
from .policy.calibration import RequestTrust
from .policy.rules import Policy
from .stats import RequestUsage
from .verification import accepted_length

#: The most emitted tokens a row holds back from its drafter (see :class:`Row`).
FLUSH = 32


@dataclass(eq=False)
class Row:
    """One sequence's drafting state: its drafter request (``req``; None:
    it does not use the drafter, so it drafts nothing and nothing of it is
    cached), the most tokens a draft may have (``num_draft_tokens``; 0: no
    drafting), the tokens it may emit in all (``max_tokens``), and its counts
    (``usage``), which the drafter's totals follow.

    A row hands its emitted tokens to the drafter in bulk: when it walks
    the drafter's trees, while a verification's forward runs (:meth:`grow`),
    every :data:`FLUSH` plain steps (so that other requests in flight draft
    from it), and when it finishes (:meth:`finish`); its plain steps and
    host time go with its next counts (:meth:`count`), at the latest as
    often. A plain step itself costs a list append. The drafter's trees get the
    tokens only while a forward runs: a walk between a forward's result and
    the next forward (settled) hands the drafter its context alone.

    Every draft it proposes is held against the tokens it then emits,
    verified or not (:meth:`emit`): how far it held teaches the request's own
    :class:`~mlx_lm_suffix.policy.calibration.RequestTrust` (``trust``, which
    the policy's cut reads), and while the emitted tokens follow it, its rest
    is the next draft with no new walk of the trees (:meth:`propose`). A
    proposal that found nothing, or a draft that held for no token beyond
    what a plain step gives, makes the row skip its next proposals, 1, 3,
    7, ... steps up to the policy's :meth:`~mlx_lm_suffix.policy.rules.
    Policy.skips`; a draft that held resets that."""

    drafter: Optional[SuffixDrafter]
    req: Optional[int]
    num_draft_tokens: int
    max_tokens: float
    usage: RequestUsage = field(default_factory=RequestUsage)
    emitted: int = 0
    # The pending token is committed already (a settled draft comes after it).
    ahead: bool = False
    trust: RequestTrust = field(default_factory=RequestTrust)
    # Committed tokens and plain steps not handed to the drafter yet, and
    # host seconds of drafting not yet in its totals.
    _tokens: List[int] = field(default_factory=list)
    _steps: int = 0
    _ungrown: bool = False  # the drafter has tokens its trees have not
    _host: float = 0.0
    # The draft held against the committed tokens: the tokens committed
    # before it, how many it was compared with and held for, whether a plain
    # forward was to check its first token; the proposals to skip and the
    # next skip.
    _draft: Optional[Draft] = None
    _at: int = 0
    _seen: int = 0
    _held: int = 0
    _pipelined: bool = False
    _skip: int = 0
    _backoff: int = 0

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

    def propose(self, room: float, settled: bool) -> Draft:
        """The draft after the committed tokens, within :meth:`cap` (empty
        where it is below :func:`shortest`, or while the row skips): the
        rest of the last draft where the committed tokens followed it and it
        still fills half the cap, else the drafter's."""
        k = self.cap(room, settled)
        if self.req is None or k < shortest(settled):
            return Draft()
        if self._draft is not None:
            if self._following() and len(self._draft) - self._held >= max(shortest(settled), k // 2):
                return self._draft.after(self._held, k)
            self._settle_watch()
        if self._skip:
            self._skip -= 1
            return Draft()
        tic = time.perf_counter()
        self._flush(grow=not settled)
        draft = self.drafter.propose(self.req, k)
        took = time.perf_counter() - tic
        self._host += took
        draft.trust = self.trust
        if draft.tokens:
            self._draft, self._at = draft, self.emitted + self.ahead
            self._seen = self._held = 0
            self._pipelined = not settled
        else:
            self.drafter.policy.observe_host(took)
            self._found(False)
        return draft

    def _following(self) -> bool:
        """Whether the committed tokens followed the watched draft so far."""
        committed = self.emitted + self.ahead
        return self._draft is not None and self._held == self._seen == committed - self._at > 0

    def resting(self) -> bool:
        """Whether the row proposes nothing this step whatever its room: it
        does not draft (no drafter request, or no draft tokens), or it skips
        proposals and follows no draft."""
        return (self.req is None or self.num_draft_tokens <= 0
                or (self._skip > 0 and not self._following()))

    def rest(self) -> None:
        """A step that asked no row for a draft: a skip is counted."""
        if self.req is not None and self._skip:
            self._skip -= 1

    def commit_ahead(self, token: int) -> None:
        """Commit the pending ``token`` before it is emitted."""
        if not self.ahead:
            self._commit([token], self.emitted)
        self.ahead = True

    def stepped(self, token: int) -> None:
        """A plain step emitted the pending ``token``: one forward."""
        if not self.ahead:
            self._commit((token,), self.emitted)
        self.ahead = False
        self.emitted += 1
        self.usage.steps += self.req is not None
        self._steps += 1
        if len(self._tokens) >= FLUSH or self._steps >= FLUSH:
            self._flush()
            self.count(steps=0)

    def emit(self, tokens: Sequence[int], drafted: int = 0) -> None:
        """``tokens`` are emitted in order, the pending token first;
        ``drafted`` of them were accepted draft tokens."""
        if self.ahead:
            self._commit(tokens[1:], self.emitted + 1)
        else:
            self._commit(tokens, self.emitted)
        self.ahead = False
        self.emitted += len(tokens)
        self.usage.accepted += drafted

    def _commit(self, tokens: Sequence[int], start: int) -> None:
        """``tokens``, the request's ``start``-th on, are committed."""
        if self.req is None or not tokens:
            return
        self._tokens.extend(tokens)
        if self._draft is not None:
            self._watch(tokens, start)

    def grow(self) -> None:
        """While a forward runs: the drafter gets the committed tokens, its
        trees included."""
        if self.req is not None:
            self._flush()

    def _flush(self, grow: bool = True) -> None:
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
            self._flush()
            self.count(steps=0)
            self.drafter.finish(self.req)
            self.req = None

    def _watch(self, tokens: Sequence[int], start: int) -> None:
        """Hold the watched draft against committed ``tokens``, the first of
        them the request's ``start``-th; the request learns from each."""
        d, base = self._draft, start - self._at
        lo = i = max(self._seen, base)
        end = min(len(d), base + len(tokens))
        while i < end and d.tokens[i] == tokens[i - base]:
            i += 1
        if i < end:  # token i failed
            self.trust.held(d.probs, lo, i + 1, False, d.source, d.tree_len)
            self._seen = i + 1
        elif i > lo:
            self.trust.held(d.probs, lo, i, True, d.source, d.tree_len)
            self._seen = i
        if i > lo:
            self._held = i
        if i < end or self._held == len(d):
            self._settle_watch()

    def _settle_watch(self) -> None:
        """The watched draft is done with (it failed, ended, or a new one
        comes)."""
        if self._draft is None:
            return
        self._draft = None
        if self._seen:
            self._found(self._held > self._pipelined)

    def _found(self, useful: bool) -> None:
        """A proposal found a draft that held further than a plain step
        would have gone, or did not (nothing, or wrong early): the row's
        skips."""
        if useful:
            self._backoff = 0
        else:
            self._skip = self._backoff
            self._backoff = min(2 * self._backoff + 1, self.drafter.policy.skips())

    def take_back(self, tokens: int, drafted: int) -> None:
        """The last ``tokens`` emitted (``drafted`` of them accepted draft
        tokens) were never delivered: they are not counted. (The drafter
        keeps them: they are the model's own continuation.)"""
        self.emitted -= tokens
        self.usage.accepted -= drafted

    def count(self, drafted: int = 0, accepted: int = 0, steps: int = 1,
              draft: Optional[Draft] = None) -> None:
        """Count ``steps`` forwards that verified ``drafted`` tokens of
        ``draft`` and accepted ``accepted`` of them (the drafter learns from
        the draft's estimates); the drafter also gets the plain steps and
        host time not handed to it yet."""
        if self.req is None:
            return
        self.usage.steps += steps
        self.usage.drafted += drafted
        self.usage.host_s += self._host
        self.drafter.record(drafted, accepted, steps + self._steps, draft, self._host)
        self._steps, self._host = 0, 0.0

    def paid(self, width: int, emitted: int) -> None:
        """A forward of ``width`` tokens emitted ``emitted`` (``0, 0``: a
        check whose first token failed): the request's credit
        (:meth:`~mlx_lm_suffix.policy.rules.Policy.paid`)."""
        if self.req is not None:
            self.drafter.policy.paid(self.trust, width, emitted)

    def replayed(self, tokens: int) -> None:
        """Count a replay: the cache went back and was fed ``tokens`` again."""
        if self.req is None:
            return
        self.usage.replays += 1
        self.usage.replayed_tokens += tokens
        self.drafter.record_replay(tokens)


class Driver(Protocol):
    """What :func:`step` asks of a driver. ``rows`` are its rows in the
    order of every list passed in or out (a batch's shrinks as rows
    finish)."""

    rows: List[Row]
    policy: Policy

    def pending(self) -> List[int]:
        """Each row's pending token (waiting for the forward that samples it)."""

    def plain(self) -> None:
        """Each row emits its pending token (:meth:`Row.stepped`) and the
        forward after them is queued; rows that finish leave."""

    def verify(self, inputs: List[List[int]]) -> None:
        """Queue one forward over each row's ``inputs`` (:meth:`verified`
        reads it; host work that does not need its result runs between)."""

    def verified(self) -> List[List[int]]:
        """The tokens sampled after each input of the forward
        :meth:`verify` queued."""

    def keep(self, accepted: List[int], first: List[int]) -> None:
        """After :meth:`verified`: row ``i`` keeps its first ``1 + accepted[i]``
        inputs (emitted with :meth:`Row.emit`, ``first[i]`` of them a draft
        token confirmed before and ``accepted[i]`` accepted ones), the rest
        leave its cache, and the token sampled after them is its pending
        token; rows that finish leave."""

    def room(self) -> float:
        """How many more positions every row's cache can take and roll back."""

    def replays(self, width: int) -> bool:
        """Whether a rejection after a forward ``width`` wide may cost feeding
        the kept tokens again."""


def shortest(settled: bool) -> int:
    """The shortest draft that can gain anything: pipelined, the plain
    forward checks the first token, so a draft needs two."""
    return 1 if settled else 2


def propose(rows: Sequence[Row], driver: Driver, settled: bool) -> Optional[List[Draft]]:
    """Each row's draft (:meth:`Row.propose`); None where no row may draft
    (then the ranks of a distributed server share nothing). Ranks other
    than 0 draft nothing: :func:`cut` gives them rank 0's drafts."""
    def may_draft(room: float) -> bool:
        return any(r.req is not None and r.cap(room, settled) >= shortest(settled) for r in rows)

    if not may_draft(math.inf):  # (then the cache's room need not be asked)
        return None
    if _resting(rows):  # (in one process: ranks decide by room)
        return [Draft() for _ in rows]
    room = driver.room()
    if not may_draft(room):
        return None
    if ranks.following():
        return [Draft() for _ in rows]
    return [row.propose(room, settled) for row in rows]


def _resting(rows: Sequence[Row]) -> bool:
    """Whether every row skips proposing this step (then, in one process,
    the step proposes and prices nothing: each row counts a skip)."""
    if ranks.group() is not None or not all(r.resting() for r in rows):
        return False
    for r in rows:
        r.rest()
    return True


def _drafts(rows: Sequence[Row], driver: Driver, settled: bool, budget: Optional[float],
            proposed: Optional[List[Draft]] = None) -> Tuple[Optional[List[Draft]], List[Draft]]:
    """The rows' proposals (:func:`propose`, unless given) and the drafts
    the policy cuts from them (:func:`cut`); their host time per draft
    proposed goes to the policy (:meth:`~mlx_lm_suffix.policy.rules.Policy.
    observe_host`)."""
    tic = time.perf_counter()
    if proposed is None:
        proposed = propose(rows, driver, settled)
    cutting = time.perf_counter()
    drafts = cut(proposed, driver, settled, budget)
    n = sum(1 for d in proposed or () if d)
    if n:
        done = time.perf_counter()
        driver.policy.observe_host((done - tic) / n, len(rows))
        for row, d in zip(rows, proposed):
            row._host += (done - cutting) / n if d else 0.0
    return proposed, drafts


def cut(drafts: Optional[List[Draft]], driver: Driver, settled: bool,
        budget: Optional[float] = None) -> List[Draft]:
    """The drafts of :func:`propose` cut to the lengths the policy verifies
    (``budget``: the most seconds the step may take beyond a plain step).
    Distributed: rank 0's cut drafts, on every rank."""
    if drafts is None:
        return [Draft() for _ in driver.rows]
    width = max(map(len, drafts), default=0)
    if width:
        replay = driver.replays(width + 1)
        lengths = driver.policy.batch_lengths(drafts, not settled, replay, budget)
        drafts = [d.truncate(n) for d, n in zip(drafts, lengths)]
    return ranks.drafts(drafts)


def check(rows: Sequence[Row], drafts: List[Draft], sampled: Sequence[int]) -> List[Draft]:
    """The drafts whose first token the plain forward sampled; the others
    are counted as misses (drafted and rejected, with no forward of their
    own) and dropped."""
    out = []
    for row, d, s in zip(rows, drafts, sampled):
        if d and d.tokens[0] != s:
            row.count(drafted=1, steps=0, draft=d)
            row.paid(0, 0)
            d = Draft()
        out.append(d)
    return out


def accept(row: Row, draft: Draft, first: int, targets: Sequence[int]) -> int:
    """Count a verification of ``draft`` whose first ``first`` tokens were
    confirmed before it (and fed as its first input), with ``targets`` the
    tokens sampled after each input; returns how many of the rest it
    accepts."""
    rest = draft.tokens[first:]
    a = accepted_length(rest, targets[: len(rest) + 1])
    if draft:
        row.count(drafted=len(draft), accepted=a + first, draft=draft)
        row.paid(1 + len(rest), 1 + a)
    else:
        row.count()
    return a


def _verify(driver: Driver, pending: Sequence[int], drafts: List[Draft], first: int,
            idle: float) -> Generator[None, None, None]:
    """Verify the drafts (``pending``: each row's first input), pausing
    once the forward is queued and the rows' trees have grown (the driver
    may hand out what its rows emitted before); ``idle``: when the device
    last waited for the host."""
    rows = driver.rows
    inputs = [[p] + d.tokens[first:] for p, d in zip(pending, drafts)]
    _idle(driver, idle)
    driver.verify(inputs)
    for r in rows:
        r.grow()
    yield
    targets = driver.verified()
    result = time.perf_counter()
    accepted = [accept(r, d, first, t) for r, d, t in zip(rows, drafts, targets)]
    driver.keep(accepted, [first if d else 0 for d in drafts])
    _idle(driver, result, wait=True)


def _idle(driver: Driver, since: Optional[float], wait: bool = False) -> None:
    """The device has waited for the host since ``since`` (None: it has
    not): counted in the drafter's totals (``wait``: a new wait began)."""
    stats = driver.policy.stats
    stats.waits += wait
    if since is not None:
        stats.idle_s += time.perf_counter() - since


def step(driver: Driver, settled: bool, budget: Optional[float] = None) -> bool:
    """One step of the driver's rows (:func:`stepping`, run through)."""
    return finish(stepping(driver, settled, budget))


def finish(steps: Generator[None, None, bool]) -> bool:
    """Run a step (:func:`stepping`, paused or not) through; returns
    whether the rows' pending tokens are known after it."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


def stepping(driver: Driver, settled: bool, budget: Optional[float] = None,
             queued: bool = False) -> Generator[None, None, bool]:
    """One step of the driver's rows (see the module docstring), pausing
    once a forward is queued (while it runs, the driver may hand out the
    tokens its rows emitted so far, as stock's step yields its token), and
    before a plain forward that follows a settled proposal (then nothing
    computes: the last step's tokens are handed out before the forward
    that emits the next); returns whether their pending tokens are known
    after it and nothing computes. ``budget``: the most seconds the step
    may take beyond a plain step. ``queued``: the step's plain forward is
    queued already (a step the driver ended after queuing it), so it starts
    with the drafts after the tokens that forward was fed."""
    early: Optional[List[Draft]] = None
    rows = driver.rows
    if settled and len(rows) == 1:
        # Settled, one row: draft after its pending token, verify both now
        # where that pays; else the same draft is the pipelined step's.
        since = time.perf_counter()
        pending = driver.pending()
        rows[0].commit_ahead(pending[0])
        early, drafts = _drafts(rows, driver, True, budget)
        if any(drafts):
            yield from _verify(driver, pending, drafts, 0, since)
            return True
        _idle(driver, since)
        yield
    if not queued:
        driver.plain()
        yield
    if driver.rows != rows:  # rows finished: their drafts go with them
        early, rows = None, driver.rows
    elif early is None and _resting(rows):
        return False
    if not rows:
        return False
    _, drafts = _drafts(rows, driver, False, budget, early)
    if not any(drafts):
        return False
    sampled = driver.pending()
    since = time.perf_counter()
    _idle(driver, None, wait=True)
    confirmed = check(rows, drafts, sampled)
    dropped = any(c is not d for c, d in zip(confirmed, drafts))
    if len(rows) > 1 and dropped and any(confirmed):
        # One width for the batch: chosen again for the confirmed drafts.
        confirmed = cut(confirmed, driver, False, budget)
    if any(confirmed):
        yield from _verify(driver, sampled, confirmed, 1, since)
    else:
        _idle(driver, since)
    return True
