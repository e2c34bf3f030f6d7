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

from . import rollback
from .drafter import Draft, SuffixDrafter
from .verification import accepted_length

Pending = Tuple[mx.array, mx.array]  # (token of shape [1], logprobs of shape [1, V])


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
    drafting = num_draft_tokens > 0 and rollback.supports(cache)
    if num_draft_tokens > 0 and not drafting:
        warn_no_rollback(model, cache)
    policy = drafter.policy
    if drafting:
        policy.ensure_cost(model)
    ctx_limit = context_limit(model)
    sampler = sampler or greedy_sampler
    progress = prompt_progress_callback or (lambda *_: None)
    prompt = prompt.astype(mx.uint32)
    total = prompt.size
    # Tokens in the cache, for logits processors (as generate_step keeps them).
    history = prompt[:-1]

    def forward(inputs: mx.array) -> Pending:
        """Feed ``inputs`` (1-D) and sample the token after each position;
        logits processors run position by position over the tokens so far."""
        logits = model(inputs[None], cache=cache)[0]
        maybe_quantize_kv_cache(cache, quantized_kv_start, kv_group_size, kv_bits)
        if logits_processors:
            rows = []
            for j in range(inputs.size):
                tokens = mx.concatenate([history, inputs[: j + 1]])
                row = logits[j : j + 1]
                for processor in logits_processors:
                    row = processor(tokens, row)
                rows.append(row)
            logits = mx.concatenate(rows)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return sampler(logprobs), logprobs

    def fed(tokens: mx.array) -> None:
        nonlocal history
        if logits_processors:
            history = mx.concatenate([history, tokens])

    def room(pipelined: bool) -> int:
        """Most draft tokens the next verification may feed."""
        # Settled, the pending token is fed too.
        free = rollback.room(cache, ctx_limit) - (not pipelined)
        return int(min(num_draft_tokens, limit - emitted - 1, free))

    def replay(saved: rollback.Checkpoint, n: int, rejected: int, kept: mx.array) -> int:
        """Drop the last ``rejected`` of the ``n`` positions fed since
        ``saved``; where the cache went back to ``saved``, feed ``kept``
        (the rest) again. Returns the positions now in the cache since."""
        if rollback.undo(cache, saved, n, rejected):
            model(kept[None], cache=cache)
            return kept.size
        return n - rejected

    req = drafter.start(prompt.tolist() if draft_prompt is None else draft_prompt, draft_scope)
    emitted = 0
    # Accepted tokens in the cache past the last one yielded (a close in the
    # middle of a draft trims them), and whether the last yielded token is
    # in the cache (a close after a settled step feeds it).
    unyielded, last_in_cache, failed = 0, True, False
    with mx.stream(stream):
        try:
            if total > 1:
                # mlx-lm's prefill of all but the last token (max_tokens=0
                # yields nothing: its one step only fills the cache).
                for _ in generate_step(
                    prompt[:-1],
                    model,
                    stream,
                    max_tokens=0,
                    sampler=sampler,
                    prompt_cache=cache,
                    prefill_step_size=prefill_step_size,
                    kv_bits=kv_bits,
                    kv_group_size=kv_group_size,
                    quantized_kv_start=quantized_kv_start,
                    prompt_progress_callback=lambda done, _: progress(done, total),
                ):
                    pass
            else:
                progress(0, total)
            pending = forward(prompt[-1:])
            fed(prompt[-1:])
            mx.async_eval(*pending)
            settled = False
            plain_tic = None  # when a plain step that nothing overlaps started
            while True:
                tok, logprobs = pending
                nxt = None
                if not settled:
                    # Pipelined: queue the next forward before syncing on this one.
                    nxt = forward(tok)
                    mx.async_eval(*nxt)
                t = tok.item()
                if plain_tic is not None:
                    # Timed as verifications are, so cost(1) stays comparable.
                    policy.observe(1, time.perf_counter() - plain_tic)
                    plain_tic = None
                if emitted == 0:
                    progress(total, total)
                if not settled:
                    drafter.record()  # the plain step that gave t
                drafter.commit(req, [t])
                emitted += 1
                last_in_cache = nxt is not None
                yield t, logprobs[0], False
                if emitted >= limit:
                    break
                if emitted % 256 == 0:
                    mx.clear_cache()

                k = room(pipelined=nxt is not None) if drafting else 0
                draft = drafter.propose(req, k) if k > 0 else Draft()
                if draft:
                    dear = rollback.replays(cache, len(draft) + 1)
                    draft = draft.truncate(policy.length(draft, nxt is not None, dear))
                if not draft:
                    if nxt is None:
                        plain_tic = time.perf_counter()
                        nxt = forward(tok)
                        mx.async_eval(*nxt)
                        last_in_cache = True
                    fed(tok)
                    pending, settled = nxt, False
                    continue

                if nxt is not None:
                    # t is in the cache and nxt's token follows it: the check.
                    fed(tok)
                    first, first_lp = nxt
                    if first.item() != draft.tokens[0]:
                        drafter.record(drafted=1, accepted=0, draft=draft)
                        pending, settled = nxt, True
                        continue
                    drafter.record()  # the pipelined step that checked it
                    inputs = mx.array(draft.tokens, mx.uint32)
                else:
                    inputs = mx.array([t] + draft.tokens, mx.uint32)
                saved = rollback.checkpoint(cache)
                tic = time.perf_counter()
                out, out_lp = forward(inputs)
                targets = out.tolist()
                policy.observe(inputs.size, time.perf_counter() - tic)
                if nxt is not None:
                    targets = [draft.tokens[0]] + targets
                    out_lp = mx.concatenate([first_lp, out_lp])
                k = len(draft)
                a = accepted_length(draft.tokens, targets)
                kept = inputs[: inputs.size - (k - a)]
                # In the cache since the checkpoint: what the forward fed, or
                # after a restore, the accepted tokens fed again.
                since = replay(saved, inputs.size, k - a, kept)
                fed(kept)
                drafter.record(drafted=k, accepted=a, draft=draft)
                last_in_cache = True
                for i in range(a):
                    drafter.commit(req, [draft.tokens[i]])
                    emitted += 1
                    unyielded = a - 1 - i
                    yield draft.tokens[i], out_lp[i], True
                unyielded = 0
                pending = (mx.array([targets[a]], mx.uint32), out_lp[a : a + 1])
                settled = True
        except Exception:
            failed = True
            raise
        finally:
            # Leave exactly the yielded tokens in the cache, as generate_step
            # does, also when the caller stops in the middle of a draft.
            if unyielded and not failed:
                replay(saved, since, unyielded, kept[: kept.size - unyielded])
            elif not last_in_cache and not failed:
                forward(pending[0])
                mx.eval([c.state for c in cache])
            drafter.finish(req)
