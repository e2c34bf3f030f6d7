"""The single-sequence generation loop with suffix drafting.

:func:`suffix_generate_step` has the contract of mlx-lm's
``speculative_generate_step`` (it yields ``(token, logprobs, from_draft)``)
and takes the keyword arguments of ``generate_step``, whose prefill it runs.

A step is one of two kinds. Pipelined (as mlx-lm's ``generate_step``): the
forward over the pending token is queued before the token is yielded; the
draft after that token is then checked by the forward's own next token,
and only a draft whose first token it confirms is verified, feeding the
rest. Settled (after a verification, or a check that failed, the pending
token is known and nothing computes): the draft after the pending token is
verified together with it in one forward. :class:`~mlx_lm_suffix.policy.
rules.Policy` decides each length (``0``: a plain step); verification
accepts the longest matching prefix (:mod:`~mlx_lm_suffix.verification`) and
rolls the cache back by the rejected positions (:mod:`~mlx_lm_suffix.
rollback`).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Generator, Hashable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    DEFAULT_QUANTIZED_KV_START,
    generate_step,
    generation_stream,
    maybe_quantize_kv_cache,
)
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler

from . import ranks, rollback
from .drafter import Draft, SuffixDrafter
from .verification import accepted_length

Pending = Tuple[mx.array, mx.array]  # (token of shape [1], logprobs of shape [1, V])

#: The narrowest prefill chunk whose time becomes a point of the cost curve:
#: the default draft limit, so the point lies past the widths drafts use and
#: only anchors the curve there. (A chunk computes no logits; a narrow one
#: could price below a verification of fewer tokens.)
PREFILL_POINT_TOKENS = 64


def warn_no_rollback(model: nn.Module, cache: List[Any]) -> None:
    """Warn once per model that its cache cannot roll back, so no drafting."""
    if getattr(model, "_mlx_lm_suffix_warned", False):
        return
    object.__setattr__(model, "_mlx_lm_suffix_warned", True)
    warnings.warn(
        f"mlx-lm-suffix: the model's cache ({rollback.describe(cache)}) cannot be "
        "rolled back, so suffix drafting is off for it; generating one token "
        "per step as stock mlx-lm does.",
        RuntimeWarning,
        stacklevel=3,
    )


def context_limit(model: nn.Module) -> Optional[int]:
    """The longest sequence a draft may extend to: the model's
    ``max_position_embeddings`` when it has one (``max_kv_size`` is a window,
    which rolls back like the model's own sliding windows)."""
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


@dataclass
class _Sequence:
    """What one generation carries from step to step, and the operations its
    steps share."""

    model: nn.Module
    cache: List[Any]
    drafter: SuffixDrafter
    req: int
    sampler: Sampler
    logits_processors: Optional[List[LogitsProcessor]]
    kv_quantization: Tuple[int, int, Optional[int]]  # start, group size, bits
    history: mx.array  # tokens in the cache, for logits processors
    limit: float  # tokens to generate
    num_draft_tokens: int  # 0: no drafting
    ctx_limit: Optional[int]
    emitted: int = 0

    def forward(self, inputs: mx.array) -> Pending:
        """Feed ``inputs`` (1-D) and sample the token after each position;
        logits processors run position by position over the tokens so far."""
        logits = self.model(inputs[None], cache=self.cache)[0]
        maybe_quantize_kv_cache(self.cache, *self.kv_quantization)
        if self.logits_processors:
            rows = []
            for j in range(inputs.size):
                tokens = mx.concatenate([self.history, inputs[: j + 1]])
                row = logits[j : j + 1]
                for processor in self.logits_processors:
                    row = processor(tokens, row)
                rows.append(row)
            logits = mx.concatenate(rows)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return self.sampler(logprobs), logprobs

    def queue(self, tokens: mx.array) -> Pending:
        """:meth:`forward`, evaluated asynchronously."""
        out = self.forward(tokens)
        mx.async_eval(*out)
        return out

    def fed(self, tokens: mx.array) -> None:
        """``tokens`` are in the cache now."""
        if self.logits_processors:
            self.history = mx.concatenate([self.history, tokens])

    def emit(self, token: int) -> None:
        self.drafter.commit(self.req, [token])
        self.emitted += 1

    def draft(self, pipelined: bool) -> Draft:
        """The draft to verify after the last emitted token, as long as the
        policy decides (empty: a plain step). Settled (not ``pipelined``),
        the verification feeds the pending token too."""
        if not self.num_draft_tokens:
            return Draft()
        room = rollback.room(self.cache, self.ctx_limit) - (not pipelined)
        k = int(min(self.num_draft_tokens, self.limit - self.emitted - 1, room))
        if k <= 0:
            return Draft()
        draft = Draft() if ranks.following() else self.drafter.propose(self.req, k)
        if draft:
            dear = rollback.replays(self.cache, len(draft) + 1)
            draft = draft.truncate(self.drafter.policy.length(draft, pipelined, dear))
        # Distributed: every rank verifies rank 0's draft.
        return ranks.drafts([draft])[0]

    def undo(self, saved: rollback.Checkpoint, n: int, rejected: int, kept: mx.array) -> int:
        """Drop the last ``rejected`` of the ``n`` positions fed since
        ``saved``; where the cache went back to ``saved``, feed ``kept``
        (the rest) again. Returns the positions now in the cache since."""
        if rollback.undo(self.cache, saved, n, rejected):
            self.model(kept[None], cache=self.cache)
            self.drafter.record_replay(kept.size)
            return kept.size
        return n - rejected


def _verify(
    seq: _Sequence, t: int, checked: Optional[Pending], draft: Draft
) -> Generator[Tuple[int, mx.array, bool], None, Pending]:
    """The verify step: one forward over ``draft`` and yield the tokens it
    accepts; returns the pending token after them. Pipelined (``checked``:
    the forward after ``t``, whose token confirmed the draft's first), it
    feeds the rest of the draft; settled, ``t`` and the draft. The cache
    holds exactly the yielded tokens when the caller stops in between."""
    tokens = draft.tokens if checked is not None else [t] + draft.tokens
    inputs = mx.array(tokens, mx.uint32)
    saved = rollback.checkpoint(seq.cache)
    tic = time.perf_counter()
    out, logprobs = seq.forward(inputs)
    targets = out.tolist()
    seq.drafter.policy.observe(inputs.size, time.perf_counter() - tic)
    if checked is not None:
        targets = [draft.tokens[0]] + targets
        logprobs = mx.concatenate([checked[1], logprobs])
    k = len(draft)
    a = accepted_length(draft.tokens, targets)
    kept = inputs[: inputs.size - (k - a)]
    # In the cache since the checkpoint: what the forward fed, or after a
    # restore, the accepted tokens fed again.
    since = seq.undo(saved, inputs.size, k - a, kept)
    seq.fed(kept)
    seq.drafter.record(drafted=k, accepted=a, draft=draft)
    for i in range(a):
        seq.emit(draft.tokens[i])
        try:
            yield draft.tokens[i], logprobs[i], True
        except GeneratorExit:
            unyielded = a - 1 - i
            if unyielded:
                seq.undo(saved, since, unyielded, kept[: kept.size - unyielded])
            raise
    return mx.array([targets[a]], mx.uint32), logprobs[a : a + 1]


def _prefill(
    seq: _Sequence,
    prompt: mx.array,
    stream: mx.Stream,
    prefill_step_size: int,
    progress: Optional[Callable[[int, int], None]],
) -> Pending:
    """The prompt into the cache by mlx-lm's own ``generate_step`` (with
    ``max_tokens=0`` it runs the prefill and the first step, and yields
    nothing); its sampler is wrapped to keep the first token and logprobs.

    Each prefill chunk is a forward over many tokens that generation takes
    anyway: ``generate_step`` evaluates the cache after each chunk, then
    reports progress, so the time between two reports is a chunk's forward,
    and the policy's cost curve gets a chunk of at least
    :data:`PREFILL_POINT_TOKENS` as a point (:meth:`VerifyCost.observe`):
    past the widths verified so far the curve then grows towards it instead
    of extrapolating its first segment."""
    first: List[mx.array] = []

    def sampler(logprobs: mx.array) -> mx.array:
        first[:] = [seq.sampler(logprobs), logprobs]
        return first[0]

    last: List[float] = []  # (tokens, time) of the last report

    def timed(done: int, total: int) -> None:
        now = time.perf_counter()
        # A chunk (not the last report, which follows the first step) wide
        # enough that the forward's own work dominates, as a verification's.
        if last and done - last[0] >= PREFILL_POINT_TOKENS and done < total:
            seq.drafter.policy.observe(int(done - last[0]), now - last[1])
        last[:] = [done, now]
        if progress is not None:
            progress(done, total)

    start, group_size, bits = seq.kv_quantization
    for _ in generate_step(
        prompt,
        seq.model,
        stream,
        max_tokens=0,
        sampler=sampler,
        logits_processors=seq.logits_processors,
        prompt_cache=seq.cache,
        prefill_step_size=prefill_step_size,
        kv_bits=bits,
        kv_group_size=group_size,
        quantized_kv_start=start,
        prompt_progress_callback=timed if seq.num_draft_tokens else progress,
    ):
        pass
    return first[0], first[1]


def suffix_generate_step(
    prompt: mx.array,
    model: nn.Module,
    drafter: SuffixDrafter,
    stream: mx.Stream = generation_stream,
    *,
    num_draft_tokens: Optional[int] = None,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None,
    draft_prompt: Optional[Sequence[int]] = None,
    draft_scope: Hashable = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Generate tokens with suffix drafting and greedy (or sampled) verification.

    Args:
        prompt: The prompt tokens not yet in ``prompt_cache``.
        model: The target model.
        drafter: The :class:`SuffixDrafter` whose caches draft the tokens.
        num_draft_tokens: Most tokens drafted per step (default: the
            drafter's ``num_draft_tokens``).
        max_tokens: Tokens to generate; ``-1`` for no limit.
        draft_prompt: The whole prompt for the request's own suffix tree when
            ``prompt`` is only its uncached tail (default: ``prompt``).
        draft_scope: The drafter's cache partition (e.g. a user id).
        Other arguments: as for ``mlx_lm.generate.generate_step``.

    Yields:
        ``(token, logprobs, from_draft)``.
    """
    if len(prompt) == 0:
        raise ValueError("The prompt must contain at least one token.")
    if num_draft_tokens is None:
        num_draft_tokens = drafter.num_draft_tokens
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    limit = max_tokens if max_tokens >= 0 else math.inf
    if limit == 0:
        return

    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model, max_kv_size)
    if num_draft_tokens > 0 and not rollback.supports(cache):
        warn_no_rollback(model, cache)
        num_draft_tokens = 0
    policy = drafter.policy
    if num_draft_tokens > 0:
        policy.ensure_cost(model)
    prompt = prompt.astype(mx.uint32)
    req = drafter.start(prompt.tolist() if draft_prompt is None else draft_prompt, draft_scope)
    seq = _Sequence(
        model,
        cache,
        drafter,
        req,
        sampler or greedy_sampler,
        logits_processors,
        (quantized_kv_start, kv_group_size, kv_bits),
        prompt,
        limit,
        num_draft_tokens,
        context_limit(model),
    )
    # Whether the last yielded token is in the cache (a close after a
    # settled step feeds it, as generate_step leaves it).
    in_cache, failed = True, False
    with mx.stream(stream):
        try:
            pending = _prefill(seq, prompt, stream, prefill_step_size, prompt_progress_callback)
            settled = False
            # When the token of a pipelined plain step was ready, the
            # consumer's time after it excluded.
            plain_at = None
            while True:
                tok, logprobs = pending
                # Pipelined: queue the next forward before syncing on this one.
                nxt = None if settled else seq.queue(tok)
                t = tok.item()
                ready = time.perf_counter()
                if plain_at is not None:
                    # From one token to the next of pipelined plain steps:
                    # a plain step's wall time, as a verification's is its
                    # forward's (one queued after the settled step would
                    # count two forwards on a backend that computes while
                    # queueing, as the CPU's).
                    policy.observe(1, ready - plain_at)
                    plain_at = None
                if not settled:
                    drafter.record()  # the plain step that gave t
                seq.emit(t)
                in_cache = nxt is not None
                yield t, logprobs[0], False
                consumer = time.perf_counter() - ready
                if seq.emitted >= limit:
                    break
                if seq.emitted % 256 == 0:
                    mx.clear_cache()

                draft = seq.draft(pipelined=nxt is not None)
                if not draft:  # the plain step
                    if nxt is None:
                        nxt = seq.queue(tok)
                        in_cache = True
                    else:
                        plain_at = ready + consumer
                    seq.fed(tok)
                    pending, settled = nxt, False
                    continue
                if nxt is not None:
                    # t is in the cache and nxt's token follows it: the check.
                    seq.fed(tok)
                    if nxt[0].item() != draft.tokens[0]:
                        drafter.record(drafted=1, accepted=0, draft=draft)
                        pending, settled = nxt, True
                        continue
                    drafter.record()  # the pipelined step that checked it
                in_cache = True  # the verification feeds t where nxt did not
                pending = yield from _verify(seq, t, nxt, draft)
                settled = True
        except Exception:
            failed = True
            raise
        finally:
            if not in_cache and not failed:
                seq.forward(pending[0])
                mx.eval([c.state for c in cache])
            drafter.finish(req)
