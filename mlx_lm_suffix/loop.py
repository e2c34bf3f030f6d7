"""The single-sequence generation loop with suffix drafting.

:func:`suffix_generate_step` has the contract of mlx-lm's
``speculative_generate_step`` (it yields ``(token, logprobs, from_draft)``)
and takes the keyword arguments of ``generate_step``. Each step drafts from
the suffix trees, runs the target once over the last token plus the draft,
samples every position, accepts the longest matching prefix and rolls the KV
cache back by the rejected positions. With nothing to draft it takes the
ordinary single-token path, pipelined with ``mx.async_eval`` as mlx-lm does.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from typing import Any, Callable, Generator, Hashable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import (
    DEFAULT_QUANTIZED_KV_START,
    generation_stream,
    maybe_quantize_kv_cache,
)
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.sample_utils import LogitsProcessor, Sampler, greedy_sampler

from .drafter import SuffixDrafter
from .verification import accepted_length, rollback


def warn_untrimmable(model: nn.Module, cache: List[Any]) -> None:
    """Warn once per model that its cache cannot roll back, so no drafting."""
    if getattr(model, "_mlx_lm_suffix_warned", False):
        return
    object.__setattr__(model, "_mlx_lm_suffix_warned", True)
    kinds = sorted({type(c).__name__ for c in cache if not c.is_trimmable()})
    warnings.warn(
        f"mlx-lm-suffix: the model's KV cache ({', '.join(kinds)}) cannot be "
        "rolled back, so suffix drafting is off for it; generating one token "
        "per step as stock mlx-lm does.",
        RuntimeWarning,
        stacklevel=3,
    )


def context_limit(model: nn.Module, max_kv_size: Optional[int] = None) -> Optional[int]:
    """The longest sequence a draft may extend to: ``max_kv_size`` when given,
    else the model's ``max_position_embeddings`` when it has one."""
    if max_kv_size is not None:
        return max_kv_size
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


def draft_room(cache: List[Any], limit: Optional[int]) -> float:
    """How many more positions can be fed to ``cache`` and still be rolled
    back, within the context ``limit``."""
    room = math.inf
    for c in cache:
        offset = getattr(c, "offset", None)
        if not isinstance(offset, int):
            continue
        if limit is not None:
            room = min(room, limit - offset)
        max_size = getattr(c, "max_size", None)
        if isinstance(max_size, int):
            # A rotating cache stays trimmable only while offset < max_size.
            room = min(room, max_size - offset - 1)
    return room


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

    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    can_draft = num_draft_tokens > 0 and can_trim_prompt_cache(prompt_cache)
    if num_draft_tokens > 0 and not can_draft:
        warn_untrimmable(model, prompt_cache)
    if can_draft:
        drafter.ensure_cost(model)
    ctx_limit = context_limit(model, max_kv_size)

    sampler = sampler or greedy_sampler
    quantize_cache_fn = functools.partial(
        maybe_quantize_kv_cache,
        quantized_kv_start=quantized_kv_start,
        kv_group_size=kv_group_size,
        kv_bits=kv_bits,
    )
    progress = prompt_progress_callback or (lambda *_: None)
    prompt = prompt.astype(mx.uint32)
    # Tokens in the cache, for logits processors (as generate_step keeps them).
    history = prompt[:0]

    def forward(inputs: mx.array) -> Tuple[mx.array, mx.array]:
        """Feed ``inputs`` (1-D) and sample the token after each position."""
        logits = model(inputs[None], cache=prompt_cache)[0]
        quantize_cache_fn(prompt_cache)
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

    def extend_history(tokens: mx.array) -> None:
        nonlocal history
        if logits_processors:
            history = mx.concatenate([history, tokens])

    req = drafter.start(
        prompt.tolist() if draft_prompt is None else draft_prompt, scope=draft_scope
    )
    last_in_cache = True
    unyielded = 0
    failed = False
    with mx.stream(stream):
        try:
            # Prefill all but the last prompt token.
            total = prompt.size
            progress(0, total)
            done = 0
            while total - done > 1:
                n = min(prefill_step_size, total - done - 1)
                model(prompt[done : done + n][None], cache=prompt_cache)
                quantize_cache_fn(prompt_cache)
                mx.eval([c.state for c in prompt_cache])
                extend_history(prompt[done : done + n])
                done += n
                progress(done, total)
                mx.clear_cache()

            y = prompt[done:]
            pending = forward(y)
            extend_history(y)
            mx.async_eval(*pending)
            pending_is_plain = True
            spec_mode = False
            plain_tic = None  # when a plain step that nothing overlaps started
            n = 0
            while True:
                tok, logprobs = pending
                # Plain mode: start the next step before syncing on this one.
                nxt = None
                if not spec_mode:
                    nxt = forward(tok)
                    mx.async_eval(*nxt)
                t = tok.item()
                if plain_tic is not None and drafter.cost is not None:
                    # Timed as verification steps are, so cost(1) stays
                    # comparable with the points those refine.
                    drafter.cost.observe(1, time.perf_counter() - plain_tic)
                plain_tic = None
                if n == 0:
                    progress(total, total)
                if pending_is_plain:
                    drafter.record()
                drafter.commit(req, [t])
                n += 1
                last_in_cache = nxt is not None
                yield t, logprobs[0], False
                if n >= limit:
                    break
                if n % 256 == 0:
                    mx.clear_cache()

                k = 0
                if can_draft:
                    room = draft_room(prompt_cache, ctx_limit) - (nxt is None)
                    k = int(min(num_draft_tokens, limit - n - 1, room))
                # Pipelined: the forward feeds only the draft (t is in the cache).
                proposal = drafter.draft(req, k, pipelined=nxt is not None) if k > 0 else None
                draft = proposal.tokens if proposal else []
                if not draft:
                    spec_mode = False
                    if nxt is None:
                        plain_tic = time.perf_counter()
                        nxt = forward(tok)
                        mx.async_eval(*nxt)
                        last_in_cache = True
                    if logits_processors:
                        extend_history(tok)
                    pending, pending_is_plain = nxt, True
                    continue

                spec_mode = True
                k = len(draft)
                if nxt is not None:
                    # t is in the cache already and nxt is the target's token
                    # after it: check the first draft token for free.
                    extend_history(tok)
                    first, first_lp = nxt
                    if first.item() != draft[0]:
                        # A plain step after all. The adaptive policy drafts
                        # after its (known) token next and verifies both in
                        # one forward where that pays, rather than wait for
                        # another plain step to check the draft's first token;
                        # fixed drafting pipelines the next step.
                        drafter.record(drafted=1, accepted=0, draft=proposal, req_id=req)
                        pending, pending_is_plain = nxt, False
                        spec_mode = drafter.cost_aware
                        continue
                    inputs = mx.array(draft, mx.uint32)
                    tic = time.perf_counter()
                    out, out_lp = forward(inputs)
                    targets = [draft[0]] + out.tolist()
                    all_lp = mx.concatenate([first_lp, out_lp])
                    drafter.record()  # the pipelined step that checked draft[0]
                else:
                    inputs = mx.array([t] + draft, mx.uint32)
                    tic = time.perf_counter()
                    out, all_lp = forward(inputs)
                    targets = out.tolist()
                if drafter.cost is not None:
                    drafter.cost.observe(inputs.size, time.perf_counter() - tic)
                a = accepted_length(draft, targets)
                rollback(prompt_cache, k - a)
                kept = inputs.size - (k - a)
                extend_history(inputs[:kept])
                drafter.record(drafted=k, accepted=a, draft=proposal, req_id=req)
                last_in_cache = True
                for i in range(a):
                    drafter.commit(req, [draft[i]])
                    n += 1
                    unyielded = a - 1 - i  # accepted tokens in the cache after it
                    yield draft[i], all_lp[i], True
                unyielded = 0
                pending = (mx.array([targets[a]], mx.uint32), all_lp[a : a + 1])
                pending_is_plain = False
        except Exception:
            failed = True
            raise
        finally:
            # Leave exactly the yielded tokens in the cache, as generate_step
            # does, also when the caller stops in the middle of a draft.
            if unyielded and not failed:
                rollback(prompt_cache, unyielded)
            elif not last_in_cache and not failed:
                forward(pending[0])
                mx.eval([c.state for c in prompt_cache])
            drafter.finish(req)
