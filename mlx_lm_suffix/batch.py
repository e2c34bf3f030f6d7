"""Batched suffix decoding on top of mlx-lm's continuous batching.

:class:`SuffixGenerationBatch` is a drop-in ``mlx_lm.generate.GenerationBatch``
that steps its rows (one per request) through
:func:`~mlx_lm_suffix.speculation.step`, and :class:`SuffixBatchGenerator` is
a ``BatchGenerator`` that uses it. Written against mlx-lm 0.32.2.

The batch is the driver of the steps (:class:`~mlx_lm_suffix.speculation.
Driver`): its plain step is stock's own ``GenerationBatch.next`` (every row
emits its pending token, the forward after them is queued, rows that finish
leave); its verification feeds every row's inputs right-padded to the
longest in one forward of shape ``(B, W)``, with each row's logits
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

Prefill is not starved: mlx-lm's ``BatchGenerator._next`` runs one
generation step, then one prefill chunk (or prompt segment) of every prompt
being processed, so each chunk waits for one step. While the generator has
such prompts, a step may take at most :data:`PREFILL_SHARE` of that chunk's
expected prefill time longer than the stock plain step (the policy's
``budget``): a prompt's prefill waits for no verification longer than that
share of itself. In the step after rows join (it emits their first tokens),
and while a budget cannot be priced (no cost curve, no prefill timed yet),
a step is the stock step alone. Requests that wait to be inserted (a
server's queue, ``requests_waiting``) are not known to the generator yet:
while there are any, steps verify nothing (a server inserts them between
its runs of steps).

Between calls a forward runs, as after stock's step: a call that read one
(a verification, a check of first tokens) queues the next step's first
forward before it returns; the next call drafts after a plain forward's
tokens, or reads the verification first (one row drafts after its pending
token, settled, and verifies both at once). A verification queued so is
undone before the rows change or a row's cache is extracted.

Invariants kept between steps (the same as stock): ``self.tokens[i]`` equals
the tokens in row ``i``'s KV cache, which are the prompt plus every emitted
token (but the positions of a verification queued between calls); the
pending token is not in the cache.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Generator, Hashable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import TokenBuffer

from . import rollback, sampling, speculation
from .drafter import SuffixDrafter
from .loop import context_limit
from .policy.rules import Policy
from .speculation import Row
from .stats import BatchDraftStats, RequestUsage

__all__ = [
    "RowOptions",
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


@dataclass
class RowOptions:
    """How one sequence of a :class:`SuffixBatchGenerator` drafts.

    Args:
        num_draft_tokens: Most tokens drafted per step; ``0`` turns drafting
            off (the response is still added to the drafter's cache).
        scope: The drafter's cache partition (see ``SuffixDrafter.start``).
        prompt: The whole prompt for the request's own suffix tree. Default:
            the tokens in the sequence's cache when generation starts, which
            is the whole prompt when ``all_tokens`` covers any cached prefix.
        usage: Counters updated in place while the sequence generates.
        use_drafter: ``False``: the sequence does not touch the drafter at
            all (no drafting, nothing cached).
        arrived: ``time.perf_counter()`` when the request arrived: the time
            it then waits while verifications run is counted in the stats.
    """

    num_draft_tokens: Optional[int] = None
    scope: Hashable = None
    prompt: Optional[Sequence[int]] = None
    usage: Optional[RequestUsage] = None
    use_drafter: bool = True
    arrived: Optional[float] = None

    def start(self, drafter: Optional[SuffixDrafter], tokens: Sequence[int], max_tokens: int) -> Row:
        """The row of a sequence with these options, whose cache holds
        ``tokens``, its drafter request started."""
        req, k = None, 0
        if drafter is not None and self.use_drafter:
            req = drafter.start(self.prompt if self.prompt is not None else tokens, scope=self.scope)
            k = drafter.num_draft_tokens if self.num_draft_tokens is None else self.num_draft_tokens
        usage = self.usage if self.usage is not None else RequestUsage()
        return Row(drafter, req, k, max_tokens, usage)


def _warn_no_batch_rollback(model: nn.Module, cache: List[Any]) -> None:
    """Warn once per model (a server makes a batch for every wave of
    requests) that its batched cache cannot roll rows back."""
    if not getattr(model, "_mlx_lm_suffix_batch_warned", False):
        object.__setattr__(model, "_mlx_lm_suffix_batch_warned", True)
        logger.warning(
            "mlx-lm-suffix: batched cache (%s) cannot roll rows back; "
            "batched requests generate without drafting.",
            ", ".join(sorted({type(c).__name__ for c in cache})),
        )


def _waited(spans: Deque[Tuple[float, float]], arrived: float) -> float:
    """The seconds since ``arrived`` that the verifications of ``spans``
    (``(start, end)`` times, oldest first) ran."""
    now, waited = time.perf_counter(), 0.0
    for start, end in reversed(spans):
        if end <= arrived:
            break
        waited += min(end, now) - max(start, arrived)
    return waited


def _can_draft(batch: "SuffixGenerationBatch") -> bool:
    """Whether the batch's rows may draft: a drafter, a row with draft
    tokens, and a cache whose rows roll back."""
    if batch.drafter is None or not any(
        row.req is not None and row.num_draft_tokens > 0 for row in batch.rows
    ):
        return False
    if not rollback.supports_batch(batch.prompt_cache):
        _warn_no_batch_rollback(batch.model, batch.prompt_cache)
        return False
    return True


def _take_back(batch: "SuffixGenerationBatch") -> None:
    """Before the rows change between calls: a verification queued by a
    paused step is undone (its positions leave the cache) and the rows'
    pending tokens stay theirs, known."""
    if batch._steps is None:  # (a step is held only after its verification)
        return
    inputs, saved = batch._verified[2], batch._verified[1]
    width = max(map(len, inputs))
    rollback.undo_rows(batch.prompt_cache, saved, width, [width] * len(inputs))
    batch._steps, batch._inflight, batch._settled, batch._left = None, None, True, None


def _stock_step(batch: "SuffixGenerationBatch") -> List[GenerationBatch.Response]:
    """Stock's step, after the rest of a step paused with its verification
    queued (a plain forward queued by the last call is the one stock's step
    reads)."""
    steps, batch._steps = batch._steps, None
    if steps is not None:
        speculation.finish(steps)
    batch.plain()
    batch._settled = batch._queued = False
    return batch._responses


def _emit(batch: "SuffixGenerationBatch", inputs: List[List[int]], accepted: List[int],
          first: List[int]) -> Tuple[List[List[int]], List[Optional[str]]]:
    """Each row's emitted tokens after a verification (its first input and
    the accepted ones, up to the one that finishes it) and its finish
    reason; the tokens go to the batch's ``tokens`` and the row. Each token
    is counted and tested in turn as ``GenerationBatch.next`` (mlx-lm
    0.32.2) tests the one it emits: ``max_tokens``, then the stop
    sequences."""
    emitted, finish = [], []
    for i, (x, a, f) in enumerate(zip(inputs, accepted, first)):
        reason, out = None, []
        for t in x[: a + 1]:
            out.append(t)
            batch._num_tokens[i] += 1
            reason = "length" if batch._num_tokens[i] >= batch.max_tokens[i] else None
            if batch._matchers[i].advance(t):
                reason = "stop"
            if reason is not None:
                break
        batch.tokens[i].extend(out)
        batch.rows[i].emit(out, drafted=len(out) - 1 + f)
        emitted.append(out)
        finish.append(reason)
    return emitted, finish


def _responses(batch: GenerationBatch, emitted: List[List[int]], finish: List[Optional[str]],
               prev_logprobs: List[mx.array], logprobs: mx.array) -> List[GenerationBatch.Response]:
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
            out.append(batch.Response(
                uid=batch.uids[i],
                token=t,
                logprobs=prev_logprobs[i] if j == 0 else drafted[j - 1],
                finish_reason=finish[i] if done else None,
                prompt_cache=batch.extract_cache(i) if done else None,
                all_tokens=batch.tokens[i] if done else None,
            ))
    return out


class SuffixGenerationBatch(GenerationBatch):
    """A ``GenerationBatch`` that verifies per-row suffix drafts in one
    forward per step (see the module docstring): the batch's driver of
    :func:`~mlx_lm_suffix.speculation.step`.

    Extra keyword arguments (all optional): ``drafter``, ``row_options``
    (``uid -> RowOptions`` for rows not yet admitted; consumed by
    :meth:`extend`), ``default_options``, ``max_context`` and ``stats``.
    """

    def __init__(
        self,
        *args: Any,
        drafter: Optional[SuffixDrafter] = None,
        row_options: Optional[Dict[int, RowOptions]] = None,
        default_options: Optional[RowOptions] = None,
        max_context: Optional[int] = None,
        stats: Optional[BatchDraftStats] = None,
        **kwargs: Any,
    ):
        self.drafter = drafter
        self.row_options = row_options if row_options is not None else {}
        self.default_options = default_options or RowOptions()
        self.max_context = max_context
        self.draft_stats = stats if stats is not None else BatchDraftStats()
        #: One row per uid, in the same order.
        self.rows: List[Row] = []
        # Between steps (see ``next``): the pending tokens are known and
        # nothing computes; the forward queued and not read ("plain",
        # "verify"); a step paused after its verification, and when that
        # call returned; whether the last call ended a step after its plain.
        self._settled = False
        self._inflight: Optional[str] = None
        self._steps: Optional[Generator[None, None, bool]] = None
        self._left: Optional[float] = None
        self._queued = False
        # Rows that left during a call, finished once its forward is queued.
        self._leaving: Optional[List[Row]] = None
        self._responses: List[GenerationBatch.Response] = []
        self._verified: Any = None
        #: ``budget(joined)``: whether a step must be stock's alone (rows
        #: ``joined`` whose first tokens are pending), else the most seconds
        #: it may take beyond a plain step (None: no limit); set by
        #: :class:`SuffixBatchGenerator`.
        self.budget: Callable[[bool], Tuple[bool, Optional[float]]] = lambda joined: (joined, None)
        #: Whether prompts are prefilled after this step (each chunk waits for
        #: it); set by :class:`SuffixBatchGenerator`.
        self.prefilling: Callable[[], bool] = lambda: False
        self._verify_spans: Deque[Tuple[float, float]] = deque(maxlen=VERIFY_SPANS)
        super().__init__(*args, **kwargs)
        # (Stock's constructor fed the prompts' last tokens: nothing emitted.)
        self._add_rows(0)

    @property
    def policy(self) -> Policy:
        return self.drafter.policy

    # ---------------------------------------------------------- row set
    def _add_rows(self, n0: int) -> None:
        for i in range(n0, len(self.uids)):
            opts = self.row_options.pop(self.uids[i], None) or self.default_options
            self.rows.append(opts.start(self.drafter, self.tokens[i], self.max_tokens[i]))
            if opts.arrived is not None:
                self.draft_stats.count_wait(_waited(self._verify_spans, opts.arrived))

    def extend(self, batch: GenerationBatch) -> None:
        _take_back(self)
        n0 = len(self.uids)
        super().extend(batch)
        self._settled = False
        if isinstance(batch, SuffixGenerationBatch):
            self.rows.extend(batch.rows)
            batch.rows = []  # now owned by self
        else:
            self._add_rows(n0)

    def filter(self, keep: List[int]) -> None:
        _take_back(self)
        kept = set(keep)
        gone = [row for i, row in enumerate(self.rows) if i not in kept]
        if self._leaving is None:
            for row in gone:
                row.finish()
        else:
            self._leaving += gone
        super().filter(keep)
        self.rows = [self.rows[i] for i in keep]

    def extract_cache(self, idx: int) -> List[Any]:
        _take_back(self)
        return super().extract_cache(idx)

    def finish_all(self) -> None:
        """Stop every row's drafter request (the rows stay in the batch)."""
        _take_back(self)
        for row in self.rows:
            row.finish()

    # ------------------------------------------------------------- steps
    def _step(self) -> Tuple[List[int], List[mx.array]]:
        # The stock single-token step: each row emits its pending token.
        tokens, logprobs = super()._step()
        if self.rows:  # (stock's constructor feeds the prompts' last tokens)
            for row, t in zip(self.rows, tokens):
                row.stepped(t)
        stats = self.draft_stats
        stats.plain_steps += 1
        stats.max_batch_size = max(stats.max_batch_size, len(tokens))
        return tokens, logprobs

    def next(self) -> List[GenerationBatch.Response]:
        self._leaving = []  # (finished once a forward is queued: not the device's wait)
        try:
            return self._step_rows()
        finally:
            leaving, self._leaving = self._leaving, None
            for row in leaving:
                row.finish()

    def _step_rows(self) -> List[GenerationBatch.Response]:
        if not self.uids:
            return []
        self._responses = []
        if self._left is not None:  # (the caller's time is not the verification's)
            tic, *rest = self._verified
            self._verified = (tic + time.perf_counter() - self._left, *rest)
            self._left = None
        if not _can_draft(self):
            return _stock_step(self)
        plain, budget = self.budget(any(row.emitted == 0 for row in self.rows))
        if plain:
            self.draft_stats.yield_steps += 1
            return _stock_step(self)
        policy = self.policy
        policy.ensure_cost(self.model)  # adaptive policy: once per drafter
        policy.ensure_width(self.model, len(self.uids))
        verified = self.draft_stats.verify_steps
        steps, self._steps = self._steps, None
        queued, self._queued = self._queued, False
        while self.uids:
            if steps is None:
                if self._responses and (self._inflight or self.prefilling()):
                    break  # (prompts prefilled after this call wait for no more)
                steps = speculation.stepping(self, self._settled, budget, queued)
                queued = False
            try:
                next(steps)
            except StopIteration as done:
                self._settled, steps = done.value, None
                continue
            if self._inflight and self._responses:
                # A forward runs while the caller handles these responses,
                # as after stock's step. A verification's step goes on in the
                # next call; after a plain forward, the next call drafts
                # (within its own budget).
                if self._inflight == "verify":
                    self._steps, self._left = steps, time.perf_counter()
                else:
                    steps.close()
                    self._settled, self._queued = False, True
                break
        if budget is not None:
            if self.draft_stats.verify_steps > verified:
                self.draft_stats.prefill_verify_steps += 1
            else:
                self.draft_stats.yield_steps += 1
        return self._responses

    # ------------------------------------------------------------ Driver
    def pending(self) -> List[int]:
        if self._inflight == "plain":
            self.draft_stats.check_steps += 1
            self._inflight = None
        return self._next_tokens.tolist()

    def plain(self) -> None:
        self._responses += super().next()
        self._inflight = "plain"

    def room(self) -> float:
        return rollback.room(self.prompt_cache, self.max_context)

    def replays(self, width: int) -> bool:
        return rollback.replays(self.prompt_cache, width)

    def verify(self, inputs: List[List[int]]) -> None:
        """One forward over every row's inputs, right-padded to the longest;
        logits processors run per position over the row's tokens so far,
        and each row samples all its positions."""
        tic = time.perf_counter()
        self._inflight = "verify"
        width = max(map(len, inputs))
        saved = rollback.checkpoint(self.prompt_cache)
        padded = mx.array([x + [0] * (width - len(x)) for x in inputs], dtype=mx.uint32)
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
        self._verified = (tic, saved, inputs, sampled, logprobs)

    def verified(self) -> List[List[int]]:
        tic, _, inputs, sampled, logprobs = self._verified
        self._inflight = None
        mx.eval(sampled, logprobs)
        width = max(map(len, inputs))
        self.policy.observe(width * len(inputs), time.perf_counter() - tic, rows=len(inputs))
        return sampled.tolist()

    def keep(self, accepted: List[int], first: List[int]) -> None:
        tic, saved, inputs, sampled, logprobs = self._verified
        B, W = len(inputs), max(map(len, inputs))
        emitted, finish = _emit(self, inputs, accepted, first)
        # Each row's cache back to the tokens it emitted.
        rejected = [W - len(e) for e in emitted]
        replayed = rollback.undo_rows(self.prompt_cache, saved, W, rejected)
        if replayed:
            rollback.replay_rows(self.model, self.prompt_cache, emitted)
            for row, e in zip(self.rows, emitted):
                row.replayed(len(e))
        self.draft_stats.count_verification(W, emitted, accepted, replayed, any(first))
        if rollback.compact(self.prompt_cache, len(self.uids), COMPACT_LEFT_PADDING):
            self.draft_stats.compactions += 1

        prev_logprobs = self._next_logprobs
        self._current_tokens = mx.array([x[0] for x in inputs], dtype=mx.uint32)
        self._current_logprobs = prev_logprobs
        self._next_tokens = sampled[mx.arange(B), mx.array(accepted)]
        self._next_logprobs = [logprobs[i, a] for i, a in enumerate(accepted)]
        responses = _responses(self, emitted, finish, prev_logprobs, logprobs)
        # Now, not later: evaluated after a forward queued on this stream
        # (the next step's, or the caller's reads while it runs), they would
        # wait for it.
        mx.eval(self._next_tokens, self._next_logprobs, [r.logprobs for r in responses])
        self._responses += responses
        keep = [i for i in range(B) if finish[i] is None]
        for i in keep:
            if self.logits_processors and self.logits_processors[i]:
                self._token_context[i] = TokenBuffer(self.tokens[i])
        if len(keep) < B:
            self.filter(keep)
        self._verify_spans.append((tic, time.perf_counter()))


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
            its :class:`RowOptions` (or ``None`` for the defaults).
        requests_waiting: Called before each step that could verify: whether
            requests wait to be inserted (a server's queue); then the step
            verifies nothing, as while a prompt waits with no budget.
        kwargs: As for ``BatchGenerator``.

    ``insert``/``insert_segments`` take an extra ``options`` argument: one
    :class:`RowOptions` (or ``None``) per sequence.
    """

    def __init__(
        self,
        model: nn.Module,
        drafter: SuffixDrafter,
        *,
        num_draft_tokens: Optional[int] = None,
        options_source: Optional[Callable[[Any, Any], Optional[RowOptions]]] = None,
        stats: Optional[BatchDraftStats] = None,
        requests_waiting: Optional[Callable[[], bool]] = None,
        **kwargs: Any,
    ):
        super().__init__(model, **kwargs)
        self.drafter = drafter
        self.options_source = options_source
        self.draft_stats = stats if stats is not None else BatchDraftStats()
        self._row_options: Dict[int, RowOptions] = {}
        batch = SuffixGenerationBatch.empty(self.model, self.sampler)
        batch.drafter = drafter
        batch.row_options = self._row_options
        batch.default_options = RowOptions(num_draft_tokens=num_draft_tokens)
        batch.max_context = context_limit(model)
        batch.draft_stats = self.draft_stats
        batch.budget = self._budget
        batch.prefilling = lambda: self._prefill_tokens() is not None
        self.requests_waiting = requests_waiting or (lambda: False)
        self._generation_batch = batch

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
        """The expected seconds of the prefill that this ``_next`` call runs
        after its generation step (:meth:`_prefill_tokens`), at the mean
        prefill time per token so far (``0.0`` before any prefill, or when
        the prompts only join the generation batch), or None without
        prompts."""
        tokens = self._prefill_tokens()
        if tokens is None:
            return None
        counters = self._counters
        return tokens * counters.prompt_time / counters.prompt_tokens if counters.prompt_tokens else 0.0

    def _prefill_tokens(self) -> Optional[int]:
        """The prompt tokens that this ``_next`` call prefills after its
        generation step, or None if it has no prompts. As mlx-lm 0.32.2's
        ``BatchGenerator._next`` decides: no prompts when the generation
        batch is full, else those being processed and the waiting ones it
        admits; the next chunk (up to ``prefill_step_size`` tokens of the
        current segment) of each, but of those down to their last token,
        which join the generation batch instead."""
        room = self.completion_batch_size - len(self._generation_batch)
        if room <= 0:
            return None
        admitted = min(
            self.prefill_batch_size - len(self._prompt_batch),
            room,
            len(self._unprocessed_sequences),
        )
        segments = [seq[0] for seq in self._currently_processing]
        segments += [self._unprocessed_sequences[i][1] for i in range(max(admitted, 0))]
        if not segments:
            return None
        return sum(
            min(len(s[0]), self.prefill_step_size)
            for s in segments
            if not (len(s) == 1 and len(s[0]) == 1)
        )

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
        options: Optional[List[Optional[RowOptions]]] = None,
    ):
        if options is None:
            options = getattr(self, "_insert_options", None)
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

    def remove(self, uids, return_prompt_caches=False):
        caches = super().remove(uids, return_prompt_caches=return_prompt_caches)
        for uid in uids:
            self._row_options.pop(uid, None)
        return caches

    def _next(self):
        try:
            return super()._next()
        except BaseException:
            # The generator is unusable now: stop every drafter request.
            self._generation_batch.finish_all()
            raise

    def close(self):
        gen = getattr(self, "_generation_batch", None)
        if isinstance(gen, SuffixGenerationBatch):
            gen.finish_all()
        super().close()
