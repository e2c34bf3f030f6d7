"""The single-sequence generation loop with suffix drafting.

:func:`suffix_generate_step` has the contract of mlx-lm's
``speculative_generate_step`` (it yields ``(token, logprobs, from_draft)``)
and takes the keyword arguments of ``generate_step``, whose prefill it runs.
It steps one row through :func:`~mlx_lm_suffix.speculation.stepping`,
yielding each token once a forward after it is queued, as stock's step
does (a verification's tokens while the next forward runs);
:class:`_Single` is its driver: the model's forwards on the request's cache,
its positions scored as stock scores them (:mod:`~mlx_lm_suffix.sampling`),
rejected positions undone by :mod:`~mlx_lm_suffix.rollback`.
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

from . import rollback, sampling, speculation
from .drafter import SuffixDrafter
from .policy.rules import Policy
from .speculation import Row
from .stats import RequestUsage

Pending = Tuple[mx.array, mx.array]  # (token of shape [1], logprobs of shape [1, V])

#: Seconds :func:`quantized_width` may take: it tests widths in turn and
#: keeps the widest that matched when the time is up (a narrower width is
#: never unsafe, only slower). A forward over a quantized cache costs about
#: a plain step whatever its width on a GPU, where 64 widths take about a
#: second for a small model; on a CPU about a plain step a token (minutes for
#: the scan), where verifying over it gains nothing anyway.
KV_PROBE_BUDGET_S = 2.0

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


def quantized_width(model: nn.Module, bits: int, group_size: int, limit: int) -> int:
    """The widest forward, up to ``limit`` tokens, that writes the same
    quantized keys and values into a ``bits``/``group_size`` KV cache as
    one-token steps, bit for bit, on this machine (1: none wider); measured
    once per model and setting, on scratch caches.

    A wide forward computes keys and values in other kernels than one-token
    steps, so they differ in the last bits; quantizing them moves a value
    near a bin's edge into the next bin and shifts its group's scale, and
    every later token attends to that: logits move by tenths, not by
    rounding, and greedy output leaves stock's. Only forwards that quantize
    to the same entries keep a quantized cache stock's (with OpenBLAS none
    does; with reference BLAS, any). Widths are tested from 2 up for at most
    :data:`KV_PROBE_BUDGET_S` (width 2 always)."""
    widths = model.__dict__.setdefault("_mlx_lm_suffix_kv_widths", {})
    key = (bits, group_size, limit)
    if key in widths:
        return widths[key]
    deadline = time.perf_counter() + KV_PROBE_BUDGET_S
    vocab = getattr(getattr(model, "args", None), "vocab_size", 32)
    context, tokens = mx.arange(64) % vocab, (mx.arange(limit) * 7919 + 3) % vocab

    def scratch() -> List[Any]:
        cache = make_prompt_cache(model)
        model(context[None], cache=cache)
        maybe_quantize_kv_cache(cache, 0, group_size, bits)
        return cache

    def entries(cache: List[Any], n: int) -> List[mx.array]:
        # Each quantized layer's codes, scales and biases up to position n
        # (mlx-lm 0.32.2: QuantizedKVCache.keys and .values are such tuples).
        return [a[..., :n, :] for c in cache if hasattr(c, "bits")
                for part in (c.keys, c.values) for a in part]

    ref, cache, width, stepped = scratch(), scratch(), 1, 0
    for w in range(2, limit + 1):
        for i in range(stepped, w):  # the reference: one-token steps as far
            model(tokens[None, i : i + 1], cache=ref)
        stepped = w
        saved = rollback.checkpoint(cache)
        model(tokens[None, :w], cache=cache)
        n = context.size + w
        same = all(mx.array_equal(a, b).item() for a, b in zip(entries(cache, n), entries(ref, n)))
        rollback.undo(cache, saved, w, w)
        if not same:
            break
        width = w
        if time.perf_counter() > deadline:
            break
    widths[key] = width
    return width


def context_limit(model: nn.Module) -> Optional[int]:
    """The longest sequence a draft may extend to: the model's
    ``max_position_embeddings`` when it has one (``max_kv_size`` is a window,
    which rolls back like the model's own sliding windows)."""
    args = getattr(model, "args", None)
    return getattr(args, "max_position_embeddings", None)


class _Single:
    """The driver of one sequence (:class:`~mlx_lm_suffix.speculation.
    Driver`). Between steps the cache holds the prompt and every emitted
    token, as stock's does; ``out`` holds the emitted tokens not yielded
    yet, with their logprobs and whether they were drafted."""

    def __init__(
        self,
        model: nn.Module,
        cache: List[Any],
        row: Row,
        policy: Policy,
        sampler: Sampler,
        processors: Optional[List[LogitsProcessor]],
        kv_quantization: Tuple[int, int, Optional[int]],  # start, group size, bits
        history: mx.array,
        ctx_limit: Optional[int],
        first: Pending,
    ):
        self.model, self.cache, self.policy = model, cache, policy
        self.rows = [row]
        self.sampler, self.processors = sampler, processors
        self.kv_quantization = kv_quantization
        self.history = history  # the tokens in the cache, for logits processors
        self.seen = history  # and the last forward's inputs after them
        self.ctx_limit = ctx_limit
        #: The widest forward over the quantized cache (see :func:`quantized_width`).
        self.kv_width = 1
        # The pending token and its logprobs, evaluated: the consumer reads
        # them while a forward queued after them runs (its own reads wait
        # for nothing queued on this stream).
        self.y, self.logprobs = first[0], first[1].squeeze(0)
        mx.eval(self.logprobs)
        self.out: List[Tuple[int, mx.array, bool]] = []
        # The last verification: until keep(), what it fed and sampled;
        # after, what taking back its emitted tokens needs.
        self._verified: Any = None
        # When the last plain step's token was ready (None: the next plain
        # step follows something else, so it is not timed); when the
        # verification queued and not read yet was built, and what reading
        # it or taking it back needs.
        self.plain_at: Optional[float] = None
        self.verify_at: Optional[float] = None
        self._queued: Any = None

    def forward(self, inputs: mx.array, quantize: bool = True, single: bool = False
                ) -> Tuple[mx.array, mx.array, Any]:
        """Feed ``inputs`` (1-D): each position's sampled token and
        logprobs, scored as stock's steps score them, and the random states
        of the draws (:func:`~mlx_lm_suffix.sampling.sample`; ``single``:
        one position, one draw, as stock's step). ``quantize``: quantize the
        KV cache where stock would now (a verification does it once its
        rejected positions are gone)."""
        logits = self.model(inputs[None], cache=self.cache).squeeze(0)  # (cheaper than [0])
        if quantize:
            maybe_quantize_kv_cache(self.cache, *self.kv_quantization)
        if self.processors:
            self.seen = mx.concatenate([self.history, inputs])
            logits = sampling.process(self.processors, self.seen, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if single:  # (logprobs 1-D: evaluated with the token)
            return self.sampler(logprobs), logprobs.squeeze(0), None
        y, states = sampling.sample(self.sampler, logprobs)
        return y, logprobs, states

    def fed(self, n: int) -> None:
        """The first ``n`` inputs of the last :meth:`forward` are in the
        cache now."""
        if self.processors:
            kept = self.history.size + n
            self.history = self.seen if kept == self.seen.size else self.seen[:kept]

    # ------------------------------------------------------------- Driver
    def pending(self) -> List[int]:
        self.plain_at = None
        return [self.y.item()]

    def plain(self) -> None:
        tok, logprobs = self.y, self.logprobs
        self.y, self.logprobs, _ = self.forward(tok, single=True)
        mx.async_eval(self.y, self.logprobs)
        t = tok.item()
        ready = time.perf_counter()
        if self.plain_at is not None:
            # From one plain step's token to the next's, the consumer's time
            # excluded (the generator moves plain_at past it): a plain
            # step's wall time, as a verification's is its forward's.
            self.policy.observe_plain(ready - self.plain_at)
        self.plain_at = ready
        self.fed(1)
        self.out.append((t, logprobs, False))
        self.rows[0].stepped(t)

    def verify(self, inputs: List[List[int]]) -> None:
        self.plain_at = None
        tokens = mx.array(inputs[0], mx.uint32)
        saved = rollback.checkpoint(self.cache)
        self.verify_at = time.perf_counter()
        y, logprobs, states = self.forward(tokens, quantize=False)
        # Each position's logprobs, 1-D (one split, not an index each), with
        # the tokens: the consumer reads them while the next forward runs.
        logprobs = mx.split(logprobs.reshape(-1), tokens.size)
        mx.async_eval(y, logprobs)
        self._queued = (saved, tokens, inputs[0], y, logprobs, states)

    def verified(self) -> List[List[int]]:
        saved, tokens, fed, y, logprobs, states = self._queued
        targets = y.tolist()
        self.policy.observe(tokens.size, time.perf_counter() - self.verify_at)
        self._queued = self.verify_at = None
        self._verified = (saved, tokens, fed, logprobs, targets, states)
        return [targets]

    def keep(self, accepted: List[int], first: List[int]) -> None:
        a, first = accepted[0], first[0]
        saved, tokens, fed, logprobs, targets, states = self._verified
        kept = tokens[: a + 1]
        since = self._undo(saved, tokens.size, tokens.size - a - 1, kept)
        maybe_quantize_kv_cache(self.cache, *self.kv_quantization)
        sampling.rewind(states, a + 1)
        self.fed(a + 1)
        emitted = fed[: a + 1]  # (the list: reading ``kept`` would wait for an evaluation)
        self.out.append((emitted[0], self.logprobs, bool(first)))
        self.out.extend(zip(emitted[1:], logprobs[:a], [True] * a))
        self.rows[0].emit(emitted, drafted=a + first)
        self.y, self.logprobs = mx.array([targets[a]], mx.uint32), logprobs[a]
        self._verified = (saved, since, kept)

    def room(self) -> float:
        n = rollback.room(self.cache, self.ctx_limit)
        start, _, bits = self.kv_quantization
        if bits is None:
            return n
        # A quantized KV cache takes forwards only as wide as quantize as
        # one-token steps do; one not yet quantized, none past the position
        # where stock converts it (a forward's later positions would see
        # float keys that stock's saw quantized).
        for c in self.cache:
            if hasattr(c, "bits"):
                n = min(n, self.kv_width)
            elif hasattr(c, "to_quantized"):
                n = min(n, max(0, start - c.offset))
        return n

    def replays(self, width: int) -> bool:
        return rollback.replays(self.cache, width)

    # --------------------------------------------------------------------
    def _undo(self, saved: rollback.Checkpoint, n: int, rejected: int, kept: mx.array) -> int:
        """Drop the last ``rejected`` of the ``n`` positions fed since
        ``saved``; where the cache went back to ``saved``, feed ``kept``
        (the rest) again. Returns the positions now in the cache since."""
        if rollback.undo(self.cache, saved, n, rejected):
            if kept.size:
                self.model(kept[None], cache=self.cache)
            self.rows[0].replayed(kept.size)
            return kept.size
        return n - rejected

    def away(self, seconds: float) -> None:
        """The consumer held the loop for ``seconds``: not a forward's time
        (the plain step's or the queued verification's being timed)."""
        if self.plain_at is not None:
            self.plain_at += seconds
        if self.verify_at is not None:
            self.verify_at += seconds

    def take_back(self, unyielded: List[Tuple[int, mx.array, bool]]) -> None:
        """The consumer stopped before the ``unyielded`` emitted tokens:
        they leave the cache (they are the last verification's) and the
        row's counts, and so does a verification queued after them (its
        every position)."""
        if self._queued is not None:
            saved, tokens = self._queued[:2]
            rollback.undo(self.cache, saved, tokens.size, tokens.size)
            self._queued = None
        n = len(unyielded)
        if n:
            saved, since, kept = self._verified
            self._undo(saved, since, n, kept[: kept.size - n])
            self.rows[0].take_back(n, sum(d for _, _, d in unyielded))


def _prefill(
    model: nn.Module,
    cache: List[Any],
    prompt: mx.array,
    sampler: Sampler,
    processors: Optional[List[LogitsProcessor]],
    kv_quantization: Tuple[int, int, Optional[int]],
    stream: mx.Stream,
    prefill_step_size: int,
    progress: Optional[Callable[[int, int], None]],
) -> Pending:
    """The prompt into the cache by mlx-lm's own ``generate_step`` (with
    ``max_tokens=0`` it runs the prefill and the first step, and yields
    nothing); its sampler is wrapped to keep the first token and logprobs.
    (Its chunks' times are not cost points: a chunk's tokens cost less each
    than a narrow verification's, and the cost curve interpolated towards
    one priced the widths drafts use too low: see ``docs/design.md``.)"""
    first: List[mx.array] = []

    def keep_first(logprobs: mx.array) -> mx.array:
        first[:] = [sampler(logprobs), logprobs]
        return first[0]

    start, group_size, bits = kv_quantization
    for _ in generate_step(
        prompt,
        model,
        stream,
        max_tokens=0,
        sampler=keep_first,
        logits_processors=processors,
        prompt_cache=cache,
        prefill_step_size=prefill_step_size,
        kv_bits=bits,
        kv_group_size=group_size,
        quantized_kv_start=start,
        prompt_progress_callback=progress,
    ):
        pass
    return first[0], first[1]


def _draft_limit(drafter: SuffixDrafter, model: nn.Module, cache: List[Any],
                 num_draft_tokens: Optional[int], kv: Tuple[int, int, Optional[int]]
                 ) -> Tuple[int, int]:
    """A request's most draft tokens a step: ``num_draft_tokens`` (default:
    the drafter's), or 0 where its cache cannot roll back (one warning);
    the first that drafts measures the verification cost. And, with ``kv``
    (start, group size, bits) quantizing the cache, the widest forward over
    it (:func:`quantized_width`; 1, with one warning: none)."""
    if num_draft_tokens is None:
        num_draft_tokens = drafter.num_draft_tokens
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    if num_draft_tokens > 0 and not rollback.supports(cache):
        warn_no_rollback(model, cache)
        num_draft_tokens = 0
    if num_draft_tokens == 0:
        return 0, 1
    drafter.policy.ensure_cost(model)
    _, group_size, bits = kv
    width = 1 if bits is None else quantized_width(model, bits, group_size, num_draft_tokens + 1)
    if bits is not None and width == 1 and not getattr(model, "_mlx_lm_suffix_kv_warned", False):
        object.__setattr__(model, "_mlx_lm_suffix_kv_warned", True)
        warnings.warn(
            f"mlx-lm-suffix: on this machine a forward over more than one token quantizes "
            f"keys and values (kv_bits={bits}) other than one-token steps do, which moves "
            "greedy output away from stock's: drafts are verified only until the cache is "
            "quantized (quantized_kv_start), then one token per step as stock.",
            RuntimeWarning,
            stacklevel=3,
        )
    return num_draft_tokens, width


def _run(driver: _Single, limit: float) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Step the driver's row until it has emitted ``limit`` tokens, yielding
    the emitted tokens at the steps' pauses
    (:func:`~mlx_lm_suffix.speculation.stepping`): a plain step's token once
    the forward after it is queued, as stock's step does, and a
    verification's tokens once the next forward is (or, where the next step
    drafts nothing, before its plain forward); the last ones at the end. A
    consumer that stops takes back what it was not given
    (:meth:`_Single.take_back`)."""
    row, settled = driver.rows[0], False
    while row.emitted < limit:
        before = row.emitted
        steps = speculation.stepping(driver, settled)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                settled = done.value
                break
            yield from _hand_out(driver)
        if before // 256 != row.emitted // 256:
            mx.clear_cache()
    yield from _hand_out(driver)


def _hand_out(driver: _Single) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield the driver's emitted tokens (the consumer's time kept out of
    the forwards' timing: :meth:`_Single.away`)."""
    out, driver.out = driver.out, []
    for i, item in enumerate(out):
        try:
            yielded = time.perf_counter()
            yield item
        except GeneratorExit:
            driver.take_back(out[i + 1 :])
            raise
        driver.away(time.perf_counter() - yielded)


def _check_prompt(prompt: mx.array) -> None:
    """Refuse an empty prompt, and negative token ids (stock's embedding
    wraps them around; cast to unsigned ids for the cache and the trees,
    they index past the vocabulary)."""
    if len(prompt) == 0:
        raise ValueError("The prompt must contain at least one token.")
    if prompt.dtype not in (mx.uint32, mx.uint64) and mx.min(prompt).item() < 0:
        raise ValueError("The prompt's token ids must be non-negative.")


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
    draft_usage: Optional[RequestUsage] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Generate tokens with suffix drafting and greedy (or sampled) verification.

    Args:
        prompt, model: The prompt tokens not yet in ``prompt_cache``, the model.
        drafter: The :class:`SuffixDrafter` whose caches draft the tokens.
        num_draft_tokens: Most tokens drafted per step (default: the drafter's).
        max_tokens: Tokens to generate; ``-1`` for no limit.
        draft_prompt: The whole prompt for the request's own suffix tree when
            ``prompt`` is only its uncached tail (default: ``prompt``).
        draft_scope, draft_usage: The drafter's cache partition (e.g. a user
            id); the request's counts, updated as it generates.
        Other arguments: as for ``mlx_lm.generate.generate_step``.

    Yields:
        ``(token, logprobs, from_draft)``.
    """
    _check_prompt(prompt)
    limit = max_tokens if max_tokens >= 0 else math.inf
    if limit == 0:
        return
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model, max_kv_size)
    kv_quantization = (quantized_kv_start, kv_group_size, kv_bits)
    num_draft_tokens, kv_width = _draft_limit(drafter, model, cache, num_draft_tokens,
                                              kv_quantization)
    prompt, sampler = prompt.astype(mx.uint32), sampler or greedy_sampler
    req = drafter.start(prompt.tolist() if draft_prompt is None else draft_prompt, draft_scope)
    row = Row(drafter, req, num_draft_tokens, limit, draft_usage or RequestUsage())
    with mx.stream(stream):
        try:
            first = _prefill(model, cache, prompt, sampler, logits_processors, kv_quantization,
                             stream, prefill_step_size, prompt_progress_callback)
            driver = _Single(model, cache, row, drafter.policy, sampler, logits_processors,
                             kv_quantization, prompt, context_limit(model), first)
            driver.kv_width = kv_width
            yield from _run(driver, limit)
        finally:
            row.finish()
