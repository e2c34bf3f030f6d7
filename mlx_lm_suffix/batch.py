"""Batched suffix decoding on top of mlx-lm's continuous batching.

:class:`SuffixGenerationBatch` is a drop-in ``mlx_lm.generate.GenerationBatch``
whose rows (one per request) draft and verify in one forward per step, and
:class:`SuffixBatchGenerator` is a ``BatchGenerator`` that uses it. Written
against mlx-lm 0.32.2.

A step (:meth:`SuffixGenerationBatch.next`): the plain step is stock's own
``GenerationBatch.next`` (every row emits its pending token, the forward
after them is queued, rows that finish leave); the rows draft after the
tokens it fed (:func:`~mlx_lm_suffix.speculation.plan`), its sampled tokens
check each draft's first (:func:`~mlx_lm_suffix.speculation.check`), and
the confirmed drafts are verified in one forward of every row's inputs,
right-padded to the longest, shape ``(B, W)``, with each row's logits
processors and sampler run per position (:mod:`~mlx_lm_suffix.sampling`).
Each row then emits its accepted tokens one at a time and in order through
its stop sequence matcher and ``max_tokens`` count, exactly as stock does (a
row that finishes in the middle emits nothing after the finishing token,
and its returned KV cache and ``all_tokens`` end there), and every row's
cache goes back to the tokens it emitted
(:func:`~mlx_lm_suffix.rollback.undo_rows`: rejected positions, padding
included, are trimmed or rolled into its left padding; recurrent state is
restored and every row's kept tokens fed again with
:func:`~mlx_lm_suffix.rollback.replay_rows`).

Between calls a forward runs, as after stock's step: a call goes on until a
forward is queued and it has tokens to return. :class:`Phase` names where
the batch stands between two calls: the next call drafts after a queued
plain forward's tokens (``PLAIN``), reads a queued verification first
(``HELD``: one row's settled draft, verified with its pending token), or
starts with a plain step or a settled draft (``STEP``, ``SETTLED``). A
verification held so is undone before the rows change or a row's cache is
extracted.

Prefill is not starved: mlx-lm's ``BatchGenerator`` runs one generation
step, then one prefill chunk (or prompt segment) of every prompt being
processed, so each chunk waits for one step. While the generator has such
prompts, a step may take at most :data:`PREFILL_SHARE` of that chunk's
expected prefill time longer than the stock plain step (the policy's
``budget``): a prompt's prefill waits for no verification longer than that
share of itself. In the step after rows join (it emits their first tokens),
and while a budget cannot be priced (no cost curve, no prefill timed yet),
a step is the stock step alone. Requests that wait to be inserted (a
server's queue, ``requests_waiting``) are not known to the generator yet:
while there are any, steps verify nothing (a server inserts them between
its runs of steps).

Invariants kept between steps (the same as stock): ``self.tokens[i]`` equals
the tokens in row ``i``'s KV cache, which are the prompt plus every emitted
token (but the positions of a held verification); the pending token is not
in the cache.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch

from . import internals, rollback, sampling
from .drafter import SuffixDrafter
from .internals import Attached
from .loop import context_limit
from .policy.rules import Policy
from .sources import Draft
from .sources.draft_model import DraftRows, Paired
from .speculation import RequestOptions, Row, accept, check, cut, plan, settles
from .stats import BatchDraftStats

__all__ = [
    "Phase",
    "RequestOptions",
    "SuffixBatchGenerator",
    "SuffixGenerationBatch",
]

logger = logging.getLogger(__name__)

# Roll the common left padding out of the batch cache once every row has at
# least this much (a copy of the cache, so not every step).
COMPACT_LEFT_PADDING = 64
# The verifications' (start, end) times kept to time waiting requests.
VERIFY_SPANS = 1024
#: While prompts wait to be prefilled after a step, the step may take at most
#: this share of their prefill chunk's expected time longer than a plain
#: step: each chunk then waits for verification at most this share of its
#: own time, so their time to first token stays within ``1 + PREFILL_SHARE``
#: of what plain steps give, while rows already generating keep drafting.
PREFILL_SHARE = 0.2

_warned: Attached[bool] = Attached()


class Phase(enum.Enum):
    """Where a :class:`SuffixGenerationBatch` stands between two calls of
    ``next()``: what its next call starts with."""

    #: A plain step: rows joined (their first tokens are pending), or no
    #: forward is queued and no draft is settled.
    STEP = "step"
    #: Drafts after the tokens of the plain forward the last call queued
    #: (stock's state between calls).
    PLAIN = "plain"
    #: Every row's pending token is known and nothing computes (after a
    #: verification or a check of first tokens): one row drafts after its
    #: pending token, settled.
    SETTLED = "settled"
    #: Reading the verification the last call queued for one row's settled
    #: draft (its tokens were handed out while it ran).
    HELD = "held"


@dataclass
class Verification:
    """A verification forward over every row's ``inputs`` (right-padded),
    queued by :meth:`SuffixGenerationBatch.verify` and read by
    :meth:`~SuffixGenerationBatch.verified`."""

    started: float  # when it was queued (a caller's time between calls moves it)
    saved: rollback.Checkpoint  # the cache before it
    inputs: List[List[int]]
    drafts: List[Draft]
    first: int  # 1: each draft's first token was the input it fed first
    sampled: mx.array  # (B, W)
    logprobs: mx.array  # (B, W, V)
    apart: bool = False  # the target alone was fed (its draft model holds the drafts)

    @property
    def width(self) -> int:
        return max(map(len, self.inputs))


def _waited(spans: Deque[Tuple[float, float]], arrived: float) -> float:
    """The seconds since ``arrived`` that the verifications of ``spans``
    (``(start, end)`` times, oldest first) ran."""
    now, waited = time.perf_counter(), 0.0
    for start, end in reversed(spans):
        if end <= arrived:
            break
        waited += min(end, now) - max(start, arrived)
    return waited


class SuffixGenerationBatch(GenerationBatch):
    """A ``GenerationBatch`` that verifies per-row suffix drafts in one
    forward per step (see the module docstring).

    Extra keyword arguments (all optional): ``drafter``, ``row_options``
    (``uid -> RequestOptions`` for rows not yet admitted; consumed by
    :meth:`extend`), ``default_options``, ``max_context`` and ``stats``.
    """

    def __init__(
        self,
        *args: Any,
        drafter: Optional[SuffixDrafter] = None,
        row_options: Optional[Dict[int, RequestOptions]] = None,
        default_options: Optional[RequestOptions] = None,
        max_context: Optional[int] = None,
        stats: Optional[BatchDraftStats] = None,
        **kwargs: Any,
    ):
        self.drafter = drafter
        self.row_options = row_options if row_options is not None else {}
        self.default_options = default_options or RequestOptions()
        self.max_context = max_context
        self.draft_stats = stats if stats is not None else BatchDraftStats()
        #: One row per uid, in the same order.
        self.rows: List[Row] = []
        #: What the next call starts with, and the verification it reads
        #: first (HELD) with when the last call returned.
        self.phase = Phase.STEP
        self.held: Optional[Verification] = None
        self._returned = 0.0
        # When the last plain step's tokens were read, where the next plain
        # step's time is a plain step's (None: a verification, rows that
        # joined or left, or prefill came between).
        self._plain_at: Optional[float] = None
        # Rows that left during a call, finished once its forward is queued.
        self._leaving: Optional[List[Row]] = None
        #: ``budget(joined)``: whether a step must be stock's alone (rows
        #: ``joined`` whose first tokens are pending), else the most seconds
        #: it may take beyond a plain step (None: no limit); set by
        #: :class:`SuffixBatchGenerator`.
        self.budget: Callable[[bool], Tuple[bool, Optional[float]]] = lambda joined: (joined, None)
        #: Whether prompts are prefilled after this step (each chunk waits for
        #: it); set by :class:`SuffixBatchGenerator`.
        self.prefilling: Callable[[], bool] = lambda: False
        self._verify_spans: Deque[Tuple[float, float]] = deque(maxlen=VERIFY_SPANS)
        #: Where the rows hold their positions (None: rejected positions
        #: roll, see :class:`~mlx_lm_suffix.rollback.SlotOrder`).
        self.slot_order: Optional[rollback.SlotOrder] = None
        #: The draft model's rows, rolled back apart from the target's
        #: (None: with them, or no draft model).
        self.draft_rows: Optional[DraftRows] = None
        super().__init__(*args, **kwargs)
        if isinstance(self.model, Paired) and self.model.rows_apart():
            self.draft_rows = DraftRows()
        models = (self.model.target, self.model.draft) if isinstance(self.model, Paired) else (
            self.model,)
        if not any(map(internals.windowed, models)):
            self.slot_order = rollback.SlotOrder()
        # (Stock's constructor fed the prompts' last tokens: nothing emitted.)
        self._add_rows(0)

    @property
    def policy(self) -> Policy:
        return self.drafter.policy

    # ---------------------------------------------------------- row set
    def _add_rows(self, n0: int) -> None:
        paired = isinstance(self.model, Paired)
        for i in range(n0, len(self.uids)):
            opts = self.row_options.pop(self.uids[i], None) or self.default_options
            row = opts.start(self.drafter, self.tokens[i], self.max_tokens[i])
            row.model = paired and row.num_draft_tokens > 0
            row.holds = row.model and self.draft_rows is not None
            self.rows.append(row)
            if opts.arrived is not None:
                self.draft_stats.count_wait(_waited(self._verify_spans, opts.arrived))
            if self.slot_order is not None:
                self.slot_order.rows.append(None)
            if self.draft_rows is not None:
                self.draft_rows.add(1)

    def extend(self, batch: GenerationBatch) -> None:
        self._undo_held()
        self._draft_in_step()
        n0 = len(self.uids)
        if isinstance(batch, SuffixGenerationBatch):
            batch._undo_held()
            batch._draft_in_step()
        super().extend(batch)
        self.phase, self._plain_at = Phase.STEP, None
        if isinstance(batch, SuffixGenerationBatch):
            self.rows.extend(batch.rows)
            batch.rows = []  # now owned by self
            if self.slot_order is not None:
                theirs = batch.slot_order
                self.slot_order.rows += theirs.rows if theirs else [None] * (len(self.uids) - n0)
            if self.draft_rows is not None:
                theirs = batch.draft_rows
                self.draft_rows.add(len(self.uids) - n0)
                if theirs is not None:
                    self.draft_rows.order.rows[n0:] = theirs.order.rows
        else:
            self._add_rows(n0)

    def filter(self, keep: List[int]) -> None:
        self._undo_held()
        kept, self._plain_at = set(keep), None
        gone = [row for i, row in enumerate(self.rows) if i not in kept]
        if self._leaving is None:
            for row in gone:
                row.finish()
        else:
            self._leaving += gone
        super().filter(keep)
        self.rows = [self.rows[i] for i in keep]
        if self.slot_order is not None:
            self.slot_order.keep(keep)
        if self.draft_rows is not None:
            self.draft_rows.keep(keep)
        if isinstance(self.model, Paired) and self.prompt_cache:
            self.model.keep_rows(self.prompt_cache, keep)

    def extract_cache(self, idx: int) -> List[Any]:
        self._undo_held()
        self._draft_in_step()
        cache = super().extract_cache(idx)
        apart = self.draft_rows is not None
        if self.slot_order is not None:
            end = -1 if apart else len(cache)
            rollback.in_order(self.prompt_cache[:end], cache[:end], self.slot_order, idx)
        if apart:
            rollback.in_order(self.prompt_cache[-1:], cache[-1:], self.draft_rows.order, idx)
        return cache

    def finish_all(self) -> None:
        """Stop every row's drafter request (the rows stay in the batch)."""
        self._undo_held()
        for row in self.rows:
            row.finish()

    def _undo_held(self) -> None:
        """Before the rows change between calls: a held verification is
        undone (its positions leave the cache) and the rows' pending
        tokens stay theirs, known."""
        if self.held is None:
            return
        v, self.held = self.held, None
        rollback.undo_rows(self._target_cache(), v.saved, v.width, [v.width] * len(v.inputs))
        if self.draft_rows is not None:
            self.draft_rows.drop_ahead(self.prompt_cache, 0 if v.apart else v.width)
        self.phase = Phase.SETTLED

    def _target_cache(self) -> List[Any]:
        """The layers rolled back with the target's: all of them, but a
        draft model's rolled back apart (:class:`DraftRows`)."""
        return self.prompt_cache[:-1] if self.draft_rows is not None else self.prompt_cache

    def _draft_in_step(self) -> None:
        """Before a forward that feeds both models, or rows joining or read
        out: a draft model kept apart in step with the target."""
        if self.draft_rows is not None and not self.draft_rows.in_step():
            self.draft_rows.catch_up(self.model.draft, self.prompt_cache,
                                     [len(t) for t in self.tokens])

    # ------------------------------------------------------------- steps
    def next(self) -> List[GenerationBatch.Response]:
        self._leaving = []  # (finished once a forward is queued: not the device's wait)
        try:
            return self._call()
        finally:
            self._returned = time.perf_counter()
            leaving, self._leaving = self._leaving, None
            for row in leaving:
                row.finish()

    def _call(self) -> List[GenerationBatch.Response]:
        """One call's steps (see :class:`Phase`)."""
        if not self.uids:
            return []
        # The caller's time is not the forwards' queued before it.
        away = time.perf_counter() - self._returned
        if self.held is not None:
            self.held.started += away
        if self._plain_at is not None:
            self._plain_at += away
        if not self._can_draft():
            return self._stock_step()
        plain, budget = self.budget(any(row.emitted == 0 for row in self.rows))
        if plain:
            self.draft_stats.yield_steps += 1
            return self._stock_step()
        self.policy.ensure_cost(self.model)  # adaptive policy: once per drafter
        dm = self.drafter.draft_model
        self.policy.ensure_width(self.model, len(self.uids), dm.model if dm is not None else None)
        verified = self.draft_stats.verify_steps
        out = self._steps(budget)
        if budget is not None:
            if self.draft_stats.verify_steps > verified:
                self.draft_stats.prefill_verify_steps += 1
            else:
                self.draft_stats.yield_steps += 1
        return out

    def _steps(self, budget: Optional[float]) -> List[GenerationBatch.Response]:
        """Steps until a forward is queued and there are tokens to return;
        or, where prompts are prefilled after this call, until there are
        tokens (their chunks wait for no further forward)."""
        out: List[GenerationBatch.Response] = []
        stats = self.policy.stats
        while self.uids:
            if self.phase is Phase.HELD:
                v, self.held = self.held, None
                out += self._settle(v)
                continue
            if out and self.prefilling():
                break
            if self.phase is Phase.SETTLED and (len(self.rows) == 1 or self._models()):
                # One row (or rows with a draft model): draft after the
                # pending tokens and verify both now where that pays, read
                # in the next call while the caller handles this one's
                # tokens.
                since = time.perf_counter()
                pending = internals.pending_tokens(self).tolist()
                for row, p in zip(self.rows, pending):
                    row.commit_ahead(p)
                _, drafts = plan(self.rows, self, True, budget)
                if any(drafts):
                    stats.waited(time.perf_counter() - since, False)
                    v = self.verify(pending, drafts, 0)
                    if out:
                        self.phase, self.held = Phase.HELD, v
                        break
                    out += self._settle(v)
                    continue
                stats.waited(time.perf_counter() - since, False)
            if self.phase is not Phase.PLAIN:
                out += self.plain()
                self.phase = Phase.PLAIN
                break
            out += self._pipelined(budget)
        return out

    def _pipelined(self, budget: Optional[float]) -> List[GenerationBatch.Response]:
        """After a plain forward queued by the last call: the rows draft
        after the tokens it fed, its tokens check the drafts' first, and the
        confirmed ones are verified (the phase after: SETTLED, or STEP where
        no row drafted)."""
        rows, stats = self.rows, self.policy.stats
        _, drafts = plan(rows, self, False, budget)
        if not any(drafts):
            self.phase = Phase.SETTLED if settles(rows, self.policy) else Phase.STEP
            return []
        self.phase = Phase.SETTLED
        self.draft_stats.check_steps += 1
        sampled = internals.pending_tokens(self).tolist()  # (waits for the plain forward)
        since = time.perf_counter()
        stats.waited(0.0, True)
        confirmed = [check(r, d, s) for r, d, s in zip(rows, drafts, sampled)]
        if len(rows) > 1 and any(confirmed) and any(c is not d for c, d in zip(confirmed, drafts)):
            # One width for the batch: chosen again for the confirmed drafts.
            confirmed = cut(confirmed, self, False, budget)
        if not any(confirmed):
            stats.waited(time.perf_counter() - since, False)
            return []
        stats.waited(time.perf_counter() - since, False)
        return self._settle(self.verify(sampled, confirmed, 1))

    def _stock_step(self) -> List[GenerationBatch.Response]:
        """Stock's step, after reading a held verification."""
        out = []
        if self.held is not None:
            v, self.held = self.held, None
            out = self._settle(v)
        out += self.plain()
        self.phase = Phase.STEP
        return out

    def _models(self) -> bool:
        """Whether a row drafts from a draft model (a batch's settled step
        then verifies: its first tokens are its surest)."""
        return any(row.model for row in self.rows)

    def _can_draft(self) -> bool:
        """Whether the rows may draft: a drafter, a row with draft tokens,
        and a cache whose rows roll back."""
        if self.drafter is None or not any(
            row.req is not None and row.num_draft_tokens > 0 for row in self.rows
        ):
            return False
        if not rollback.supports_batch(self.prompt_cache):
            if not _warned.get(self.model):
                # Once per model: a server makes a batch for every wave of requests.
                _warned.set(self.model, True)
                logger.warning(
                    "mlx-lm-suffix: batched cache (%s) cannot roll rows back; "
                    "batched requests generate without drafting.",
                    ", ".join(sorted({type(c).__name__ for c in self.prompt_cache})),
                )
            return False
        return True

    # ------------------------------------------------------------ forwards
    def plain(self) -> List[GenerationBatch.Response]:
        """Stock's step: every row emits its pending token, the forward
        after them is queued, rows that finish leave."""
        rows = self.rows
        self._draft_in_step()
        responses = super().next()
        now = time.perf_counter()
        if self._plain_at is not None and self.drafter is not None:
            # From the last plain step's tokens to these: a plain step's
            # time, as a verification's is its forward's.
            self.policy.observe_plain(now - self._plain_at, len(rows))
        self._plain_at = None if self.prefilling() else now
        for row, r in zip(rows, responses):  # (one response a row, in order)
            row.stepped(r.token)
        stats = self.draft_stats
        stats.plain_steps += 1
        stats.max_batch_size = max(stats.max_batch_size, len(rows))
        return responses

    def room(self) -> float:
        return rollback.room(self.prompt_cache, self.max_context)

    def replays(self, width: int) -> bool:
        return rollback.replays(self.prompt_cache, width)

    def model_draft(self, steps: int, settled: bool, contexts: Optional[List[List[int]]]
                    ) -> Tuple[List[List[int]], List[List[float]], float]:
        first = internals.pending_tokens(self) if settled else None
        return self.drafter.draft_model.draft(self.model, self.prompt_cache, first, steps, contexts,
                                              self.draft_rows, [len(t) for t in self.tokens])

    def verify(self, pending: List[int], drafts: List[Draft], first: int) -> Verification:
        """Queue one forward over each row's ``[pending] + draft[first:]``,
        right-padded to the longest; logits processors run per position
        over the row's tokens so far, and each row samples all its
        positions. The rows' trees grow while it runs."""
        started, self._plain_at = time.perf_counter(), None
        inputs = [[p] + d.tokens[first:] for p, d in zip(pending, drafts)]
        width = max(map(len, inputs))
        apart = self.draft_rows is not None and self.draft_rows.ahead is not None
        if not apart:
            self._draft_in_step()
        saved = rollback.checkpoint(self._target_cache())
        padded = mx.array([x + [0] * (width - len(x)) for x in inputs], dtype=mx.uint32)
        if apart:  # (the draft model holds its drafts already)
            logits = self.model.target_only(padded, self.prompt_cache)
        else:
            logits = self.model(padded, cache=self.prompt_cache)
        if any(self.logits_processors):
            logits = mx.stack([
                sampling.process(p, mx.array(self.tokens[i] + x + [0] * (width - len(x)),
                                             mx.uint32), logits[i], len(x)) if p else logits[i]
                for i, (p, x) in enumerate(zip(self.logits_processors, inputs))
            ])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        samplers = self.samplers or [None] * len(inputs)
        sampled = mx.stack([
            sampling.sample(s or self.fallback_sampler, lp)[0] for s, lp in zip(samplers, logprobs)
        ])
        mx.async_eval(sampled, logprobs)
        for row in self.rows:
            row.grow()
        return Verification(started, saved, inputs, drafts, first, sampled, logprobs, apart)

    def _settle(self, v: Verification) -> List[GenerationBatch.Response]:
        """Read a verification: each row accepts what held, emits it, and
        its cache goes back to its emitted tokens; the responses."""
        mx.eval(v.sampled, v.logprobs)
        self.policy.observe(v.width * len(v.inputs), time.perf_counter() - v.started,
                            rows=len(v.inputs), unpaired=v.apart)
        targets = v.sampled.tolist()
        result = time.perf_counter()
        accepted = [accept(r, d, v.first, t) for r, d, t in zip(self.rows, v.drafts, targets)]
        out = self.commit(v, accepted)
        self.policy.stats.waited(time.perf_counter() - result, True)
        self.phase = Phase.SETTLED
        return out

    def commit(self, v: Verification, accepted: List[int]) -> List[GenerationBatch.Response]:
        """Row ``i`` emits its first ``1 + accepted[i]`` inputs (up to the
        one that finishes it), the rest leave its cache, and the token
        sampled after them is its pending token; rows that finish leave.
        Returns the responses of the emitted tokens."""
        B, W = len(v.inputs), v.width
        emitted, finish = [], []
        for i, (x, a, d) in enumerate(zip(v.inputs, accepted, v.drafts)):
            out, reason = [], None
            for t in x[: a + 1]:  # (each token tested as stock's step tests its one)
                out.append(t)
                reason = internals.count_token(self, i, t)
                if reason is not None:
                    break
            self.tokens[i].extend(out)
            self.rows[i].emit(out, len(out) - 1 + (v.first if d else 0), d.source)
            emitted.append(out)
            finish.append(reason)
        # Each row's cache back to the tokens it emitted.
        held = [len(t) for t in self.tokens]
        target = self._target_cache()
        replayed = rollback.undo_rows(target, v.saved, W, [W - len(e) for e in emitted],
                                      self.slot_order, held)
        if replayed:
            model = self.model.target if self.draft_rows is not None else self.model
            rollback.replay_rows(model, target, emitted, self.slot_order, held)
            for row, e in zip(self.rows, emitted):
                row.replayed(len(e))
        if self.draft_rows is not None:
            self.draft_rows.verified(self.prompt_cache, W, emitted, held)
        self.draft_stats.count_verification(W, emitted, accepted, replayed, bool(v.first))
        compacted = rollback.compact(target, len(self.uids), COMPACT_LEFT_PADDING)
        if self.draft_rows is not None:
            compacted |= rollback.compact(self.prompt_cache[-1:], len(self.uids),
                                          COMPACT_LEFT_PADDING)
        if compacted:
            self.draft_stats.compactions += 1

        before = internals.pending_logprobs(self)
        tokens = v.sampled[mx.arange(B), mx.array(accepted)]
        logprobs = [v.logprobs[i, a] for i, a in enumerate(accepted)]
        internals.set_pending(self, mx.array([x[0] for x in v.inputs], dtype=mx.uint32), before,
                              tokens, logprobs)
        responses = self._responses(emitted, finish, before, v.logprobs)
        # Now, not later: evaluated after a forward queued on this stream
        # (the next step's, or the caller's reads while it runs), they would
        # wait for it.
        mx.eval(tokens, logprobs, [r.logprobs for r in responses])
        keep = [i for i in range(B) if finish[i] is None]
        for i in keep:
            if self.logits_processors and self.logits_processors[i]:
                internals.refresh_token_context(self, i)
        if len(keep) < B:
            self.filter(keep)
        self._verify_spans.append((v.started, time.perf_counter()))
        return responses

    def _responses(self, emitted: List[List[int]], finish: List[Optional[str]],
                   before: List[mx.array], logprobs: mx.array) -> List[GenerationBatch.Response]:
        """The responses of every row's emitted tokens after a verification
        (the first one's logprobs came with it as the pending token, the
        others' from the verification), a finished row's last with its cache
        and tokens."""
        out = []
        for i, tokens in enumerate(emitted):
            n = len(tokens)  # (one split a row, not an array per index)
            drafted = mx.split(logprobs[i, : n - 1].reshape(-1), n - 1) if n > 1 else []
            for j, t in enumerate(tokens):
                done = j == n - 1 and finish[i] is not None
                out.append(self.Response(
                    uid=self.uids[i],
                    token=t,
                    logprobs=before[i] if j == 0 else drafted[j - 1],
                    finish_reason=finish[i] if done else None,
                    prompt_cache=self.extract_cache(i) if done else None,
                    all_tokens=self.tokens[i] if done else None,
                ))
        return out


class SuffixBatchGenerator(BatchGenerator):
    """A ``BatchGenerator`` that drafts with a :class:`SuffixDrafter` and
    verifies all rows' drafts in one forward per step.

    Args:
        model: The target model.
        drafter: The drafter (one per model; shared across generators).
        num_draft_tokens: Default most tokens drafted per step and row
            (default: ``drafter.num_draft_tokens``).
        options_source: Called as ``options_source(segments, all_tokens)``
            for each sequence inserted without explicit ``options``; returns
            its :class:`RequestOptions` (or ``None`` for the defaults).
        requests_waiting: Called before each step that could verify: whether
            requests wait to be inserted (a server's queue); then the step
            verifies nothing, as while a prompt waits with no budget.
        kwargs: As for ``BatchGenerator``.

    ``insert``/``insert_segments`` take an extra ``options`` argument: one
    :class:`RequestOptions` (or ``None``) per sequence.
    """

    def __init__(
        self,
        model: nn.Module,
        drafter: SuffixDrafter,
        *,
        num_draft_tokens: Optional[int] = None,
        options_source: Optional[Callable[[Any, Any], Optional[RequestOptions]]] = None,
        stats: Optional[BatchDraftStats] = None,
        requests_waiting: Optional[Callable[[], bool]] = None,
        **kwargs: Any,
    ):
        if drafter.draft_model is not None:
            if kwargs.get("max_kv_size") is not None:
                raise ValueError("max_kv_size is not supported with a draft model")
            model = drafter.draft_model.pair(model)
            drafter.policy.ensure_draft_cost(drafter.draft_model.model)
        super().__init__(model, **kwargs)
        self.drafter = drafter
        self.options_source = options_source
        self.draft_stats = stats if stats is not None else BatchDraftStats()
        self._row_options: Dict[int, RequestOptions] = {}
        self._insert_options: Optional[List[Optional[RequestOptions]]] = None
        batch = SuffixGenerationBatch.empty(self.model, self.sampler)
        batch.drafter = drafter
        batch.row_options = self._row_options
        batch.default_options = RequestOptions(num_draft_tokens=num_draft_tokens)
        batch.max_context = context_limit(model)
        batch.draft_stats = self.draft_stats
        batch.budget = self._budget
        batch.prefilling = lambda: internals.prefill_tokens(self) is not None
        self.requests_waiting = requests_waiting or (lambda: False)
        internals.set_generation_batch(self, batch)

    @property
    def generation_batch(self) -> SuffixGenerationBatch:
        """The batch of rows generating."""
        return internals.generation_batch(self)

    def _budget(self, joined: bool) -> Tuple[bool, Optional[float]]:
        """The generation batch's step budget (see the module docstring)."""
        prefill = self._prefill_ahead()
        if joined or prefill == 0.0 or (prefill is not None and not self.drafter.policy.cost_aware):
            # Rows just joined and their first tokens are pending, or prompts
            # join or are prefilled after this step and it may cost nothing
            # more, or what it may cost is unknown: the stock step (each
            # prompt segment or chunk waits for one generation step,
            # mlx-lm's BatchGenerator._next). Deterministic on every rank:
            # the budget itself only sizes rank 0's drafts.
            return True, None
        if prefill is not None:
            return False, PREFILL_SHARE * prefill
        # Requests wait to be inserted (the server's queue): their prompts
        # are not known yet, so the step may take nothing beyond a plain
        # step. Only rank 0 sees the queue; the zero budget cuts its drafts,
        # which every rank verifies.
        return False, 0.0 if self.requests_waiting() else None

    def _prefill_ahead(self) -> Optional[float]:
        """The expected seconds of the prefill that this ``next`` call runs
        after its generation step (:func:`~mlx_lm_suffix.internals.
        prefill_tokens`), at the mean prefill time per token so far (``0.0``
        before any prefill, or when the prompts only join the generation
        batch), or None without prompts."""
        tokens = internals.prefill_tokens(self)
        if tokens is None:
            return None
        rate = internals.prefill_seconds_per_token(self)
        return tokens * rate if rate is not None else 0.0

    def insert(self, prompts: List[List[int]], *args: Any, options: Any = None, **kwargs: Any):
        # Stock insert (mlx-lm 0.32.2) passes its arguments on to
        # insert_segments, which takes the options from here.
        self._insert_options = options
        try:
            return super().insert(prompts, *args, **kwargs)
        finally:
            self._insert_options = None

    def insert_segments(
        self,
        segments: List[List[List[int]]],
        max_tokens: Optional[List[int]] = None,
        caches: Optional[List[List[Any]]] = None,
        all_tokens: Optional[List[List[int]]] = None,
        samplers: Optional[List[Any]] = None,
        logits_processors: Optional[List[List[Any]]] = None,
        stop_sequences: Optional[List[Any]] = None,
        options: Optional[List[Optional[RequestOptions]]] = None,
    ):
        if options is None:
            options = self._insert_options
        if options is not None and len(options) != len(segments):
            raise ValueError(
                f"Option options must have one entry per segment: expected "
                f"{len(segments)}, got {len(options)}."
            )
        if options is None and self.options_source is not None:
            options = [
                self.options_source(seg, at)
                for seg, at in zip(segments, all_tokens or [[] for _ in segments])
            ]
        if caches is not None and isinstance(self.model, Paired):
            caches = [self._paired_cache(c, at) for c, at in
                      zip(caches, all_tokens or [[] for _ in caches])]
        uids = super().insert_segments(
            segments,
            max_tokens,
            caches,
            all_tokens,
            samplers,
            logits_processors,
            stop_sequences,
        )
        for uid, opts in zip(uids, options or []):
            if opts is not None:
                self._row_options[uid] = opts
        return uids

    def _paired_cache(self, cache: Optional[List[Any]], tokens: List[int]) -> Optional[List[Any]]:
        """A sequence's cache with the draft model's entry: a target-only
        one gets it, fed the ``tokens`` the target's holds."""
        if cache is None or self.model.pairs(cache):
            return cache
        paired = list(cache) + self.model.make_cache()[self.model.target_entries:]
        self.drafter.draft_model.prefill(paired, tokens)
        return paired

    def remove(self, uids, return_prompt_caches=False):
        caches = super().remove(uids, return_prompt_caches=return_prompt_caches)
        for uid in uids:
            self._row_options.pop(uid, None)
        return caches

    @contextlib.contextmanager
    def _abandoned_on_error(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            # The generator is unusable now: stop every drafter request.
            self.generation_batch.finish_all()
            raise

    def next(self):
        with self._abandoned_on_error():
            return super().next()

    def next_generated(self):
        with self._abandoned_on_error():
            return super().next_generated()

    def close(self):
        try:
            gen = self.generation_batch
        except AttributeError:  # (a constructor that failed: __del__ closes it)
            gen = None
        if isinstance(gen, SuffixGenerationBatch):
            gen.finish_all()
        super().close()
