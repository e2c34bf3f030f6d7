"""Batched suffix decoding on top of mlx-lm's continuous batching.

:class:`SuffixGenerationBatch` is a drop-in ``mlx_lm.generate.GenerationBatch``
whose :meth:`~SuffixGenerationBatch.next` verifies drafts for every row in
one forward, and :class:`SuffixBatchGenerator` is a ``BatchGenerator`` that
uses it. Written against mlx-lm 0.32.2.

One call of :meth:`~SuffixGenerationBatch.next`, for a batch of ``B`` rows:

1. The exact stock single-token step: every row emits its *pending* token
   ``p_i`` (the target's choice after its last emitted token) and the forward
   over the ``p_i`` is queued asynchronously; its samples ``s_i`` are the next
   pending tokens. Rows that finish leave the batch, as in stock.
2. While that forward runs, every row feeds ``p_i`` to its drafter and drafts
   ``d_i`` after it, capped by the row's remaining ``max_tokens``, the context
   limit and its own ``num_draft_tokens``; with the drafter's adaptive policy,
   one width for the whole batch is chosen from the drafts' probabilities and
   the measured verification cost. No draft: done, the step stayed
   pipelined.
3. Otherwise wait for the ``s_i``: a draft whose first token differs from
   ``s_i`` is dropped at no further cost. If any row's draft survives, every
   row's ``[s_i] + d_i[1:]`` is right-padded to the longest ``1 + K`` and the
   batch runs one forward of shape ``(B, 1 + K)``. Logits processors run per
   position over the row's accepted prefix, and each row samples all its
   positions.
4. Row ``i`` accepts the longest prefix ``a_i`` of ``d_i[1:]`` that equals
   the sampled tokens, emits ``[s_i] + d_i[1:1 + a_i]`` and keeps the sampled
   token after them as its next pending token. Each row's cache goes back
   to the tokens it emitted (:func:`~mlx_lm_suffix.rollback.undo_rows`: its
   rejected positions, padding included, are trimmed or rolled into its left
   padding; recurrent state is restored and every row's kept tokens fed again
   with :func:`~mlx_lm_suffix.rollback.replay_rows`).
5. Emitted tokens pass, one at a time and in order, through the row's stop
   sequence matcher and ``max_tokens`` count, exactly as stock does. A row
   that finishes in the middle of its accepted tokens emits nothing after the
   finishing token, and its returned KV cache and ``all_tokens`` are trimmed
   to the tokens it emitted.

A batch of one row is one sequence to the policy (``Policy.length``, as
in the in-process loop of :mod:`~mlx_lm_suffix.loop`): after a step that
waited for its forward (a verification, or a first-token check: the pending
token ``p`` is known and nothing is computing) it drafts after ``p`` and,
where the policy says so, feeds ``[p] + d`` in one forward instead of steps
1-4; otherwise that draft is the one step 2 uses.

Prefill is not starved: mlx-lm's ``BatchGenerator._next`` runs one
generation step, then one prefill chunk (or prompt segment) of every prompt
being processed, so each chunk waits for one step. While the generator has
such prompts, a step may take at most :data:`PREFILL_SHARE` of that chunk's
expected prefill time longer than the stock plain step (the policy's
``budget``): a prompt's prefill waits for no verification longer than that
share of itself. In the step after rows join (it emits their first tokens),
and while a budget cannot be priced (no cost curve, no prefill timed yet),
:meth:`~SuffixGenerationBatch.next` is the stock step alone. Requests that
wait to be inserted (a server's queue, ``requests_waiting``) are not known
to the generator yet: while there are any, steps verify nothing (a server
inserts them between its runs of steps).

Invariants kept between steps (the same as stock): ``self.tokens[i]`` equals
the tokens in row ``i``'s KV cache, which are the prompt plus every emitted
token; the pending token is not in the cache.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import TokenBuffer

from . import ranks, rollback
from .drafter import Draft, SuffixDrafter
from .loop import context_limit
from .stats import BatchDraftStats, RequestUsage
from .verification import accepted_length

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


class SuffixGenerationBatch(GenerationBatch):
    """A ``GenerationBatch`` that verifies per-row suffix drafts in one
    forward per step (see the module docstring).

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
        uids = kwargs.get("uids", args[1] if len(args) > 1 else [])
        self._req: List[Optional[int]] = [None] * len(uids)
        self._k: List[int] = [0] * len(uids)
        self._usage: List[Optional[RequestUsage]] = [None] * len(uids)
        # The pending tokens are known and nothing is computing (the last
        # step verified drafts, or waited for the plain forward to check them).
        self._settled = False
        # The pending tokens are committed to the drafter already.
        self._pending_committed = False
        # The seconds of prefill the generator runs after this step (None:
        # none; set by SuffixBatchGenerator), and whether rows joined whose
        # first tokens are pending (then the step is plain; see next).
        self.prefill_ahead: Callable[[], Optional[float]] = lambda: None
        # Whether requests wait to be inserted (set by SuffixBatchGenerator).
        self.requests_waiting: Callable[[], bool] = lambda: False
        self._joined = False
        self._verify_spans: Deque[Tuple[float, float]] = deque(maxlen=VERIFY_SPANS)
        super().__init__(*args, **kwargs)

    # ---------------------------------------------------------- row set
    def extend(self, batch: GenerationBatch) -> None:
        n0 = len(self.uids)
        super().extend(batch)
        self._settled = False
        self._joined = True
        if isinstance(batch, SuffixGenerationBatch):
            self._req.extend(batch._req)
            self._k.extend(batch._k)
            self._usage.extend(batch._usage)
            batch._req = [None] * len(batch._req)  # now owned by self
            return
        for i in range(n0, len(self.uids)):
            opts = self.row_options.pop(self.uids[i], None) or self.default_options
            req = None
            k = 0
            if self.drafter is not None and opts.use_drafter:
                prompt = opts.prompt if opts.prompt is not None else self.tokens[i]
                req = self.drafter.start(prompt, scope=opts.scope)
                k = opts.num_draft_tokens
                if k is None:
                    k = self.drafter.num_draft_tokens
            self._req.append(req)
            self._k.append(k)
            self._usage.append(opts.usage)
            if opts.arrived is not None:
                self._count_wait(opts.arrived)

    def _count_wait(self, arrived: float) -> None:
        """Count the time since ``arrived`` that verifications ran."""
        now, waited = time.perf_counter(), 0.0
        for start, end in reversed(self._verify_spans):
            if end <= arrived:
                break
            waited += min(end, now) - max(start, arrived)
        stats = self.draft_stats
        stats.waited_requests += 1
        stats.verify_wait_s += waited
        stats.max_verify_wait_s = max(stats.max_verify_wait_s, waited)

    def filter(self, keep: List[int]) -> None:
        kept = set(keep)
        for i, req in enumerate(self._req):
            if i not in kept and req is not None:
                self.drafter.finish(req)
        super().filter(keep)
        self._req = [self._req[i] for i in keep]
        self._k = [self._k[i] for i in keep]
        self._usage = [self._usage[i] for i in keep]

    def finish_all(self) -> None:
        """Stop every row's drafter request (the rows stay in the batch)."""
        for i, req in enumerate(self._req):
            if req is not None:
                self.drafter.finish(req)
                self._req[i] = None

    # ------------------------------------------------------------- steps
    def _record(
        self,
        drafted: Sequence[int],
        accepted: Sequence[int],
        emitted: Optional[Sequence[int]] = None,
        drafts: Optional[Sequence[Draft]] = None,
    ) -> None:
        """Count one step of every drafting row: its draft length, how many
        draft tokens verification accepted (``emitted``: how many of those
        the row emitted before finishing) and the verified ``drafts`` (their
        probability estimates and match lengths calibrate the policy)."""
        emitted = accepted if emitted is None else emitted
        plain = 0
        for i, req in enumerate(self._req):
            if req is None:
                continue
            usage = self._usage[i]
            if usage is not None:
                usage.steps += 1
                usage.drafted += drafted[i]
                usage.accepted += emitted[i]
            if drafted[i]:
                self.drafter.record(
                    drafted=drafted[i],
                    accepted=accepted[i],
                    draft=drafts[i] if drafts else None,
                )
            else:
                plain += 1
        if plain:
            self.drafter.record(steps=plain)

    def _step(self) -> Tuple[List[int], List[mx.array]]:
        # The stock single-token step; feed the emitted tokens to the drafters.
        tokens, logprobs = super()._step()
        if not self._pending_committed:
            self._commit(tokens)
        self._pending_committed = False
        zeros = [0] * len(tokens)
        self._record(zeros, zeros)
        self.draft_stats.plain_steps += 1
        self.draft_stats.max_batch_size = max(self.draft_stats.max_batch_size, len(tokens))
        return tokens, logprobs

    def _can_draft(self) -> bool:
        if self.drafter is None or not any(
            req is not None and k > 0 for req, k in zip(self._req, self._k)
        ):
            return False
        if not rollback.supports_batch(self.prompt_cache):
            # Once per model: a server makes a batch for every wave of requests.
            if not getattr(self.model, "_mlx_lm_suffix_batch_warned", False):
                object.__setattr__(self.model, "_mlx_lm_suffix_batch_warned", True)
                kinds = sorted({type(c).__name__ for c in self.prompt_cache})
                logger.warning(
                    "mlx-lm-suffix: batched cache (%s) cannot roll rows back; "
                    "batched requests generate without drafting.",
                    ", ".join(kinds),
                )
            return False
        return True

    def _commit(self, tokens: Sequence[int]) -> None:
        for req, t in zip(self._req, tokens):
            if req is not None:
                self.drafter.commit(req, [t])

    def _propose(self, ahead: int = 0) -> List[Draft]:
        """Each row's draft after its committed tokens, capped by the row's
        ``num_draft_tokens``, remaining ``max_tokens`` and the context limit.
        ``ahead``: committed tokens not emitted nor fed to the cache yet (the
        pending token, when drafting after it before its step)."""
        if ranks.following():
            return [Draft() for _ in self._req]  # rank 0's come in _cut
        context_room = None
        longest = rollback.batch_length_bound(self.prompt_cache)
        if self.max_context is not None and longest is not None:
            # Rows shorter than the longest (left padded) get less room.
            context_room = self.max_context - longest - ahead
        drafts: List[Draft] = []
        for i, (req, k) in enumerate(zip(self._req, self._k)):
            room = self.max_tokens[i] - self._num_tokens[i] - ahead
            if context_room is not None:
                room = min(room, context_room)
            k = min(k, room)
            drafts.append(self.drafter.propose(req, k) if req is not None and k > 1 else Draft())
        return drafts

    def _cut(
        self, drafts: List[Draft], pipelined: bool = True, budget: Optional[float] = None
    ) -> List[Draft]:
        """The drafts cut to the lengths the policy verifies (``pipelined``:
        after the plain step; ``budget``: seconds the step may take beyond a
        plain step)."""
        replay = rollback.replays_rows(self.prompt_cache)
        lengths = self.drafter.policy.batch_lengths(drafts, pipelined, replay, budget)
        # Distributed: every rank verifies rank 0's drafts.
        return ranks.drafts([d.truncate(n) for d, n in zip(drafts, lengths)])

    def next(self) -> List[GenerationBatch.Response]:
        if not self.uids:
            return []
        settled, self._settled = self._settled, False
        if not self._can_draft():
            return super().next()
        joined, self._joined = self._joined, False
        prefill = self.prefill_ahead()
        policy = self.drafter.policy
        if joined or prefill == 0.0 or (prefill is not None and not policy.cost_aware):
            # Rows just joined and their first tokens are pending, or prompts
            # join or are prefilled after this step and it may cost nothing
            # more, or what it may cost is unknown: the stock step (each
            # prompt segment or chunk waits for one generation step,
            # mlx-lm's BatchGenerator._next). Deterministic on every rank:
            # the budget itself only sizes rank 0's drafts (_cut).
            self.draft_stats.yield_steps += 1
            return super().next()
        budget = None if prefill is None else PREFILL_SHARE * prefill
        if budget is None and self.requests_waiting():
            # Requests wait to be inserted (the server's queue): their
            # prompts are not known yet, so the step may take nothing beyond
            # a plain step. Only rank 0 sees the queue; the zero budget
            # cuts its drafts, which every rank verifies (_cut).
            budget = 0.0
        verified = self.draft_stats.verify_steps
        responses = self._draft_step(settled, budget)
        if budget is not None:
            if self.draft_stats.verify_steps > verified:
                self.draft_stats.prefill_verify_steps += 1
            else:
                self.draft_stats.yield_steps += 1
        return responses

    def _draft_step(self, settled: bool, budget: Optional[float]) -> List[GenerationBatch.Response]:
        """One step that drafts (see the module docstring): ``settled``, the
        pending tokens are known and nothing computes; ``budget``, seconds
        the step may take beyond a plain step (None: no limit)."""
        self.drafter.policy.ensure_cost(self.model)  # adaptive policy: once per drafter
        self.drafter.policy.ensure_width(self.model, len(self.uids))
        early = None
        if settled and len(self.uids) == 1:
            # Its pending token known and nothing computing: draft after that
            # token now, and verify both in one forward where the policy says
            # so; else that draft is the one the pipelined step checks.
            pending = self._next_tokens.tolist()
            self._commit(pending)
            self._pending_committed = True
            early = self._propose(ahead=1)
            now = self._cut(early, pipelined=False, budget=budget)
            if now[0]:
                self._pending_committed = False
                return self._verify(pending, now, confirmed=False)
        # The stock pipelined step: emits the pending tokens and queues the
        # forward after them, which the drafting below overlaps. That
        # forward checks each draft's first token, so a draft needs 2 tokens
        # or more to gain anything.
        responses = super().next()
        if not self.uids or not self._can_draft():
            return responses
        drafts = self._cut(early if early is not None else self._propose(), budget=budget)
        if not any(drafts):
            return responses
        # Wait for the queued forward: its tokens check each draft's first.
        nxt = self._next_tokens.tolist()
        self._settled = True
        self.draft_stats.check_steps += 1
        for i, (d, t) in enumerate(zip(drafts, nxt)):
            if d and d.tokens[0] != t:
                self._record_miss(i, d)
                drafts[i] = Draft()
        # The width again, for the confirmed drafts alone.
        drafts = self._cut(drafts, budget=budget)
        if not any(drafts):
            return responses
        self._commit(nxt)
        return responses + self._verify(nxt, drafts)

    def _record_miss(self, i: int, draft: Draft) -> None:
        """Count a draft whose first token the plain forward rejected."""
        usage = self._usage[i]
        if usage is not None:
            usage.drafted += 1
        self.drafter.record(drafted=1, accepted=0, steps=0, draft=draft)

    def _process_logits(
        self, logits: mx.array, pending: List[int], drafts: List[List[int]]
    ) -> mx.array:
        """Apply each row's logits processors position by position, with the
        row's tokens up to and including the one fed at that position."""
        width = logits.shape[1]
        rows = []
        for i, processors in enumerate(self.logits_processors):
            if not processors:
                rows.append(logits[i])
                continue
            n0 = len(self.tokens[i])
            seq = mx.array(self.tokens[i] + [pending[i]] + drafts[i], dtype=mx.int32)
            out = []
            for j in range(width):
                row = logits[i, j : j + 1]
                if j <= len(drafts[i]):
                    context = seq[: n0 + j + 1]
                    for processor in processors:
                        row = processor(context, row)
                out.append(row)
            rows.append(mx.concatenate(out, axis=0))
        return mx.stack(rows)

    def _sample(self, logprobs: mx.array) -> mx.array:
        """Each row's sampler over all its positions (``logprobs``: ``(B, W, V)``)."""
        samplers = self.samplers or [None] * len(self.uids)
        return mx.stack([(s or self.fallback_sampler)(r) for s, r in zip(samplers, logprobs)])

    def _finish_reason(self, i: int, token: int) -> Optional[str]:
        """Count ``token`` emitted by row ``i`` and say whether it finishes
        the row: the test of ``GenerationBatch.next`` (mlx-lm 0.32.2) for
        one token, applied to each accepted token in turn."""
        self._num_tokens[i] += 1
        reason = "length" if self._num_tokens[i] >= self.max_tokens[i] else None
        return "stop" if self._matchers[i].advance(token) else reason

    def _verify(
        self, pending: List[int], checked: List[Draft], confirmed: bool = True
    ) -> List[GenerationBatch.Response]:
        """Feed every row's pending token plus its draft (right-padded) in one
        forward and emit what each row accepts. ``confirmed``: the plain
        forward confirmed the first token of each ``checked[i]`` (row ``i``'s
        whole draft, or empty), which is the pending token, so the rest is
        fed; else the whole drafts follow the pending tokens."""
        tic = time.perf_counter()
        first = 1 if confirmed else 0
        drafts = [c.tokens[first:] for c in checked]
        B, K = len(self.uids), max(len(d) for d in checked) - first
        saved = rollback.checkpoint(self.prompt_cache)
        sampled, logprobs = self._forward(pending, drafts, K)
        targets = sampled.tolist()
        accepted = [accepted_length(d, t[: len(d) + 1]) for d, t in zip(drafts, targets)]
        emitted, finish = self._emit(pending, drafts, accepted)
        # Each row's cache back to the tokens it emitted.
        rejected = [K + 1 - len(e) for e in emitted]
        replayed = rollback.undo_rows(self.prompt_cache, saved, K + 1, rejected)
        if replayed:
            rollback.replay_rows(self.model, self.prompt_cache, emitted)
        stats = self.draft_stats
        stats.verify_steps += 1
        stats.unpipelined_steps += 1 - first
        stats.replays += replayed
        stats.replayed_tokens += sum(map(len, emitted)) if replayed else 0
        stats.verify_rows += B
        stats.max_batch_size = max(stats.max_batch_size, B)
        stats.max_verify_batch_size = max(stats.max_verify_batch_size, B)
        stats.uneven_rollbacks += len(set(rejected)) > 1 and not replayed
        stats.finish_trims += sum(len(e) < 1 + a for e, a in zip(emitted, accepted))
        stats.widths[K + 1] = stats.widths.get(K + 1, 0) + 1
        self._maybe_compact()

        prev_logprobs = self._next_logprobs
        self._current_tokens = mx.array(pending, dtype=mx.uint32)
        self._current_logprobs = prev_logprobs
        self._next_tokens = sampled[mx.arange(B), mx.array(accepted)]
        self._next_logprobs = [logprobs[i, a] for i, a in enumerate(accepted)]
        # Now, not in the next step: evaluated lazily there, after the forward
        # that step queues, they would make it wait for that forward.
        mx.eval(self._next_tokens, self._next_logprobs)

        responses, keep = [], []
        for i in range(B):
            for j, t in enumerate(emitted[i]):
                last = j == len(emitted[i]) - 1
                done = last and finish[i] is not None
                responses.append(
                    self.Response(
                        uid=self.uids[i],
                        token=t,
                        logprobs=prev_logprobs[i] if j == 0 else logprobs[i, j - 1],
                        finish_reason=finish[i] if last else None,
                        prompt_cache=self.extract_cache(i) if done else None,
                        all_tokens=self.tokens[i] if done else None,
                    )
                )
            if finish[i] is None:
                keep.append(i)
                if self.logits_processors and self.logits_processors[i]:
                    self._token_context[i] = TokenBuffer(self.tokens[i])
        used = [len(e) - 1 for e in emitted]
        self._record(
            [len(c) for c in checked],
            [a + first if c else 0 for a, c in zip(accepted, checked)],
            [u + first if c else 0 for u, c in zip(used, checked)],
            checked,
        )
        if len(keep) < B:
            self.filter(keep)
        self._settled = True
        self._verify_spans.append((tic, time.perf_counter()))
        return responses

    def _forward(
        self, pending: List[int], drafts: List[List[int]], K: int
    ) -> Tuple[mx.array, mx.array]:
        """One forward over every row's pending token plus its draft, padded
        to ``1 + K``: each position's sampled token and logprobs."""
        inputs = mx.array(
            [[p] + d + [0] * (K - len(d)) for p, d in zip(pending, drafts)],
            dtype=mx.uint32,
        )
        tic = time.perf_counter()
        logits = self.model(inputs, cache=self.prompt_cache)
        if any(self.logits_processors):
            logits = self._process_logits(logits, pending, drafts)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = self._sample(logprobs)
        mx.eval(sampled, logprobs)
        self.drafter.policy.observe(inputs.size, time.perf_counter() - tic, rows=len(pending))
        return sampled, logprobs

    def _emit(
        self, pending: List[int], drafts: List[List[int]], accepted: List[int]
    ) -> Tuple[List[List[int]], List[Optional[str]]]:
        """Each row's emitted tokens (its pending token and accepted draft
        tokens, up to the one that finishes it, checked one at a time in
        order by its ``max_tokens`` and stop sequences, as stock does) and
        its finish reason; the tokens go to ``tokens`` and the drafter."""
        emitted, finish = [], []
        for i, (p, d, a) in enumerate(zip(pending, drafts, accepted)):
            reason, out = None, []
            for t in [p] + d[:a]:
                out.append(t)
                reason = self._finish_reason(i, t)
                if reason is not None:
                    break
            self.tokens[i].extend(out)
            if self._req[i] is not None and len(out) > 1:
                self.drafter.commit(self._req[i], out[1:])
            emitted.append(out)
            finish.append(reason)
        return emitted, finish

    def _maybe_compact(self) -> None:
        """Drop left padding shared by every row (uneven rollbacks add it to
        the ``BatchKVCache`` layers; their ``filter`` drops it)."""
        padded = rollback.kv_rows(self.prompt_cache)
        if padded and min(padded[0].left_padding.tolist()) >= COMPACT_LEFT_PADDING:
            keep = list(range(len(self.uids)))
            for c in self.prompt_cache:
                c.filter(keep)
            self.draft_stats.compactions += 1


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
        batch.prefill_ahead = self._prefill_ahead
        if requests_waiting is not None:
            batch.requests_waiting = requests_waiting
        self._generation_batch = batch

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
