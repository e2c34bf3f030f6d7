"""The single-sequence generation loop with suffix drafting.

:func:`decode` is the loop, written once, shaped like mlx-lm's
``speculative_generate_step``: propose, forward, accept, roll back, hand
out. It steps one :class:`~mlx_lm_suffix.speculation.Row` through the
forwards of a :class:`Target`: :class:`ModelTarget` runs the model on the
request's cache (its positions scored as stock scores them,
:mod:`~mlx_lm_suffix.sampling`; rejected positions undone by
:mod:`~mlx_lm_suffix.rollback`), and the simulator's replay
(:mod:`~mlx_lm_suffix.tools.simulate`) plays a recorded answer.

:func:`suffix_generate_step` has the contract of mlx-lm's
``speculative_generate_step`` (it yields ``(token, logprobs, from_draft)``)
and takes the keyword arguments of ``generate_step``, whose prefill it runs;
it yields each token once a forward after it is queued, as stock's step
does (a verification's tokens while the next forward runs).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, List, Optional, Protocol, Tuple

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

from . import rollback, sampling
from .drafter import SuffixDrafter
from .internals import Attached
from .policy.cost import scratch_vocabulary
from .policy.rules import Policy
from .sources import Draft
from .sources.draft_model import Paired
from .speculation import RequestOptions, Row, accept, check, plan_row, resting, settles

Pending = Tuple[mx.array, mx.array]  # (token of shape [1], logprobs of shape [1, V])
Emitted = Tuple[int, mx.array, bool]  # (token, logprobs, from_draft), as yielded

#: Seconds :func:`quantized_width` may take: it tests widths in turn and
#: keeps the widest that matched when the time is up (a narrower width is
#: never unsafe, only slower). A forward over a quantized cache costs about
#: a plain step whatever its width on a GPU, where 64 widths take about a
#: second for a small model; on a CPU about a plain step a token (minutes for
#: the scan), where verifying over it gains nothing anyway.
KV_PROBE_BUDGET_S = 2.0

# What the loop knows of each model: the warnings given, and the widest
# forward over each quantized KV cache setting.
_warned: Attached[set] = Attached()
_kv_widths: Attached[dict] = Attached()


def warn_once(model: nn.Module, what: str, message: str, warn: Callable[..., None]) -> None:
    """``warn(message)`` once per model and ``what``."""
    seen = _warned.get(model)
    if seen is None:
        seen = set()
        _warned.set(model, seen)
    if what not in seen:
        seen.add(what)
        warn(message)


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


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
    widths = _kv_widths.get(model)
    if widths is None:
        widths = {}
        _kv_widths.set(model, widths)
    key = (bits, group_size, limit)
    if key in widths:
        return widths[key]
    deadline = time.perf_counter() + KV_PROBE_BUDGET_S
    vocab = scratch_vocabulary(model)
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


# ------------------------------------------------------------------ loop
class Target(Protocol):
    """The forwards :func:`decode` runs for one sequence, and its cache.
    Between steps the cache holds the prompt and every emitted token."""

    policy: Policy

    def pending(self) -> int:
        """The pending token (waiting for the forward that samples it)."""

    def plain(self) -> None:
        """The row emits its pending token (:meth:`Row.stepped`) and the
        forward after it is queued."""

    def verify(self, token: int, draft: Draft, first: int) -> None:
        """Queue one forward over the pending ``token`` and ``draft`` after
        its first ``first`` tokens (:meth:`verified` reads it; host work
        that does not need its result runs between). The row emits
        ``token`` whatever the forward finds: it may be handed out before."""

    def verified(self) -> List[int]:
        """The tokens sampled after each token :meth:`verify` fed."""

    def commit(self, accepted: int, draft: Draft, first: int) -> None:
        """After :meth:`verified`: the row emits the first ``1 + accepted``
        tokens fed (:meth:`Row.emit`: ``first`` of them a token of
        ``draft`` confirmed before, ``accepted`` accepted ones), the rest
        leave the cache, and the token sampled after them is the pending
        token."""

    def room(self) -> float:
        """How many more positions the cache can take and roll back."""

    def replays(self, width: int) -> bool:
        """Whether a rejection after a forward ``width`` wide may cost feeding
        the kept tokens again."""

    def model_draft(self, steps: int, settled: bool, contexts: Optional[List[List[int]]]
                    ) -> Tuple[List[List[int]], List[List[float]], float]:
        """The draft model's drafts (see :class:`~mlx_lm_suffix.speculation.
        Driver`)."""


def decode(target: Target, row: Row) -> Generator[None, None, None]:
    """Step ``row`` through ``target``'s forwards until it has emitted its
    ``max_tokens`` (see :mod:`~mlx_lm_suffix.speculation` for the two kinds
    of step). Pauses once each forward is queued, where the caller hands
    out what the row emitted so far (as stock's step yields its token), and
    before a plain forward that follows a settled step, where nothing
    computes (a consumer that stops there leaves no forward to take back).

    The device's idle time, from reading a forward's result to queuing the
    next, goes to the drafter's stats (:meth:`~mlx_lm_suffix.stats.
    DraftStats.waited`), which the policy prices."""
    stats = target.policy.stats
    settled = settles((row,), target.policy)
    while row.emitted < row.max_tokens:
        early = None
        if settled:
            # Draft after the pending token; verify both now where that
            # pays, else the same draft is the pipelined step's.
            since = time.perf_counter()
            pending = target.pending()
            row.commit_ahead(pending)
            early, draft = plan_row(row, target, True)
            if draft:
                yield from _verify(target, row, pending, draft, 0, since)
                continue
            stats.waited(time.perf_counter() - since, False)
            yield
        target.plain()
        yield
        if early is None and resting((row,)):
            settled = False
            continue
        _, draft = plan_row(row, target, False, proposed=early)
        if not draft:
            settled = settles((row,), target.policy)
            continue
        token = target.pending()  # (waits for the plain forward)
        since = time.perf_counter()
        stats.waited(0.0, True)
        if check(row, draft, token):
            yield from _verify(target, row, token, draft, 1, since)
        else:
            stats.waited(time.perf_counter() - since, False)
        settled = True


def _verify(target: Target, row: Row, token: int, draft: Draft, first: int, since: float
            ) -> Generator[None, None, None]:
    """Verify ``token`` and the rest of ``draft`` (``first``: whether its
    first token is ``token``, confirmed by a plain forward), pausing once
    the forward is queued and the row's trees have grown; ``since``: when
    the device last waited for the host."""
    stats = target.policy.stats
    stats.waited(time.perf_counter() - since, False)
    target.verify(token, draft, first)
    row.grow()
    yield
    targets = target.verified()
    result = time.perf_counter()
    target.commit(accept(row, draft, first, targets), draft, first)
    stats.waited(time.perf_counter() - result, True)


# ---------------------------------------------------- the model's forwards
@dataclass
class Verification:
    """A verification forward over one sequence's cache: queued by
    :meth:`ModelTarget.verify`, read by :meth:`~ModelTarget.verified`,
    committed by :meth:`~ModelTarget.commit`; then what taking back its emitted
    tokens needs (:meth:`~ModelTarget.take_back`)."""

    saved: rollback.Checkpoint  # the cache before it
    fed: List[int]
    tokens: mx.array  # ``fed``, as fed
    sampled: mx.array
    logprobs: List[mx.array]  # each position's, 1-D
    states: Optional[List[mx.array]]  # the random state after each draw
    started: float  # when it was queued (the consumer's time moves it)
    first: int  # 1: its first token is the draft's, confirmed before
    source: str  # the draft's source
    targets: Optional[List[int]] = None
    since: int = 0  # once committed: the positions the cache holds since ``saved``
    kept: Optional[mx.array] = None  # once committed: the tokens it kept


class ModelTarget:
    """The model's forwards on one request's cache (a :class:`Target`).
    ``out`` holds the emitted tokens not handed out yet, with their
    logprobs and whether they were drafted."""

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
        kv_width: int = 1,
    ):
        self.model, self.cache, self.row, self.policy = model, cache, row, policy
        self.sampler, self.processors = sampler, processors
        self.kv_quantization = kv_quantization
        self.history = history  # the tokens in the cache, for logits processors
        self.seen = history  # and the last forward's inputs after them
        self.ctx_limit = ctx_limit
        #: The widest forward over the quantized cache (see :func:`quantized_width`).
        self.kv_width = kv_width
        # The pending token and its logprobs, evaluated: the consumer reads
        # them while a forward queued after them runs (its own reads wait
        # for nothing queued on this stream).
        self.y, self.logprobs = first[0], first[1].squeeze(0)
        mx.eval(self.logprobs)
        self.out: List[Emitted] = []
        #: The verification queued and not read yet, and the last one kept.
        self.queued: Optional[Verification] = None
        self.last: Optional[Verification] = None
        # When the last plain step's token was ready (None: the next plain
        # step follows something else, so it is not timed).
        self.plain_at: Optional[float] = None
        self.ahead = False  # the pending token is handed out already

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

    def _in_cache(self, n: int) -> None:
        """The first ``n`` inputs of the last :meth:`forward` are in the
        cache now."""
        if self.processors:
            kept = self.history.size + n
            self.history = self.seen if kept == self.seen.size else self.seen[:kept]

    # ------------------------------------------------------------- Target
    def pending(self) -> int:
        self.plain_at = None
        return self.y.item()

    def plain(self) -> None:
        tok, logprobs = self.y, self.logprobs
        self.y, self.logprobs, _ = self.forward(tok, single=True)
        mx.async_eval(self.y, self.logprobs)
        t = tok.item()
        ready = time.perf_counter()
        if self.plain_at is not None:
            # From one plain step's token to the next's, the consumer's time
            # excluded (consumer_time moves plain_at past it): a plain step's
            # wall time, as a verification's is its forward's.
            self.policy.observe_plain(ready - self.plain_at)
        self.plain_at = ready
        self._in_cache(1)
        self._hand_pending((t, logprobs, False))
        self.row.stepped(t)

    def verify(self, token: int, draft: Draft, first: int) -> None:
        self.plain_at = None
        tokens = [token] + draft.tokens[first:]
        fed = mx.array(tokens, mx.uint32)
        if isinstance(self.model, Paired):  # (the draft model may hold some already)
            self.model.expect(self.cache, tokens)
        saved = rollback.checkpoint(self.cache)
        started = time.perf_counter()
        y, logprobs, states = self.forward(fed, quantize=False)
        # Each position's logprobs, 1-D (one split, not an index each), with
        # the tokens: the consumer reads them while the next forward runs.
        logprobs = mx.split(logprobs.reshape(-1), fed.size)
        mx.async_eval(y, logprobs)
        self.queued = Verification(saved, tokens, fed, y, logprobs, states, started, first,
                                   draft.source)
        # The pending token is the model's already: the consumer has it while
        # the forward runs (where a settled step drafted after it, as soon as
        # a plain step would have given it).
        self._hand_pending((token, self.logprobs, bool(first)))

    def verified(self) -> List[int]:
        v, self.queued = self.queued, None
        v.targets = v.sampled.tolist()
        self.policy.observe(v.tokens.size, time.perf_counter() - v.started,
                            unpaired=v.source == "model" and self.row.holds)
        self.last = v
        return v.targets

    def commit(self, accepted: int, draft: Draft, first: int) -> None:
        v, a = self.last, accepted
        v.kept = v.tokens[: a + 1]
        v.since = self._undo(v.saved, v.tokens.size, v.tokens.size - a - 1, v.kept)
        maybe_quantize_kv_cache(self.cache, *self.kv_quantization)
        sampling.rewind(v.states, a + 1)
        self._in_cache(a + 1)
        emitted = v.fed[: a + 1]  # (the list: reading ``kept`` would wait for an evaluation)
        self.out.extend(zip(emitted[1:], v.logprobs[:a], [True] * a))
        self.row.emit(emitted, a + first, draft.source)
        self.y, self.logprobs = mx.array([v.targets[a]], mx.uint32), v.logprobs[a]

    def _hand_pending(self, item: Emitted) -> None:
        """The pending token, fed by the forward just queued, to hand out,
        unless :meth:`hand_ahead` handed it out already."""
        if not self.ahead:
            self.out.append(item)
        self.ahead = False

    def hand_ahead(self) -> None:
        """Emit the pending token before the forward that feeds it is
        queued (:meth:`plain` or :meth:`verify` then hand it out no more):
        the first token, where the first step drafts after it, which would
        wait for the draft and the verification's forward."""
        self.out.append((self.y.item(), self.logprobs, False))
        self.ahead = True

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

    def model_draft(self, steps: int, settled: bool, contexts: Optional[List[List[int]]]
                    ) -> Tuple[List[List[int]], List[List[float]], float]:
        return self.row.drafter.draft_model.draft(self.model, self.cache,
                                                  self.y if settled else None, steps, contexts)

    # ------------------------------------------------------------ consumer
    def _undo(self, saved: rollback.Checkpoint, n: int, rejected: int, kept: mx.array) -> int:
        """Drop the last ``rejected`` of the ``n`` positions fed since
        ``saved``; where the cache went back to ``saved``, feed ``kept``
        (the rest) again. Returns the positions now in the cache since."""
        if rollback.undo(self.cache, saved, n, rejected):
            if kept.size:
                self.model(kept[None], cache=self.cache)
            self.row.replayed(kept.size)
            return kept.size
        return n - rejected

    def consumer_time(self, seconds: float) -> None:
        """The consumer held the loop for ``seconds``: not a forward's time
        (the plain step's or the queued verification's being timed)."""
        if self.plain_at is not None:
            self.plain_at += seconds
        if self.queued is not None:
            self.queued.started += seconds

    def take_back(self, unyielded: List[Emitted]) -> None:
        """The consumer stopped before the ``unyielded`` emitted tokens:
        they leave the cache (they are the last verification's) and the
        row's counts, and so does a verification queued after them: its
        every position, but its first token's where the consumer has it
        (the row emitted it). A pending token handed out ahead
        (:meth:`hand_ahead`) enters the cache, as stock's step had queued
        the forward that feeds it before it handed it out."""
        if self.ahead:
            self.plain()
        if isinstance(self.model, Paired):
            self.model.settle(self.cache)
        if self.queued is not None:
            q, self.queued = self.queued, None
            if unyielded:
                rollback.undo(self.cache, q.saved, q.tokens.size, q.tokens.size)
                unyielded = unyielded[:-1]
            else:
                self._undo(q.saved, q.tokens.size, q.tokens.size - 1, q.tokens[:1])
                self.row.emit(q.fed[:1], q.first, q.source)
        n = len(unyielded)
        if n:
            v = self.last
            self._undo(v.saved, v.since, n, v.kept[: v.kept.size - n])
            self.row.take_back(n, sum(d for _, _, d in unyielded))

    def hand_out(self) -> Generator[Emitted, None, None]:
        """Yield the emitted tokens (the consumer's time kept out of the
        forwards' timing: :meth:`consumer_time`); a consumer that stops takes back
        what it was not given (:meth:`take_back`)."""
        out, self.out = self.out, []
        for i, item in enumerate(out):
            try:
                yielded = time.perf_counter()
                yield item
            except GeneratorExit:
                self.take_back(out[i + 1 :])
                raise
            self.consumer_time(time.perf_counter() - yielded)


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
        warn_once(model, "rollback", (
            f"mlx-lm-suffix: the model's cache ({rollback.describe(cache)}) cannot be "
            "rolled back, so suffix drafting is off for it; generating one token "
            "per step as stock mlx-lm does."), _warn)
        num_draft_tokens = 0
    if num_draft_tokens == 0:
        return 0, 1
    drafter.policy.ensure_cost(model)
    if isinstance(model, Paired):
        drafter.policy.ensure_draft_cost(model.draft)
    _, group_size, bits = kv
    width = 1 if bits is None else quantized_width(model, bits, group_size, num_draft_tokens + 1)
    if bits is not None and width == 1:
        warn_once(model, "kv_bits", (
            f"mlx-lm-suffix: on this machine a forward over more than one token quantizes "
            f"keys and values (kv_bits={bits}) other than one-token steps do, which moves "
            "greedy output away from stock's: drafts are verified only until the cache is "
            "quantized (quantized_kv_start), then one token per step as stock."), _warn)
    return num_draft_tokens, width


def _paired(drafter: SuffixDrafter, model: nn.Module, cache: Optional[List[Any]],
            max_kv_size: Optional[int], prompt: mx.array, options: RequestOptions,
            num_draft_tokens: Optional[int]) -> Tuple[Any, List[Any]]:
    """The model and cache a request generates with: with the drafter's
    draft model, the target paired with it (:class:`~mlx_lm_suffix.sources.
    draft_model.Paired`) and a cache of both. A target-only ``cache`` gets
    a draft entry (the caller's list stays as it was), fed the cached prefix
    of the prompt; where that prefix is not known (``options.prompt``), the
    request drafts from the trees alone (one warning)."""
    dm = drafter.draft_model
    if dm is None or num_draft_tokens == 0:
        return model, cache if cache is not None else make_prompt_cache(model, max_kv_size)
    paired = dm.pair(model)
    if cache is None:
        return paired, paired.make_cache(max_kv_size)
    if paired.pairs(cache):
        return paired, cache
    full = options.prompt
    cached = None if full is None else list(full)[: len(full) - prompt.size]
    offset = next((c.offset for c in rollback.layers(cache) if hasattr(c, "offset")), 0)
    if cached is None and offset:
        warn_once(model, "draft prefix", (
            "mlx-lm-suffix: the prompt cache holds tokens the draft model has not seen "
            "and the whole prompt is not known (options.prompt): drafting from the "
            "suffix trees alone."), _warn)
        return model, cache
    paired_cache = list(cache) + paired.make_cache(max_kv_size)[paired.target_entries:]
    dm.prefill(paired_cache, cached or [])
    return paired, paired_cache


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
    options: Optional[RequestOptions] = None,
) -> Generator[Emitted, None, None]:
    """Generate tokens with suffix drafting and greedy (or sampled) verification.

    Args:
        prompt, model: The prompt tokens not yet in ``prompt_cache``, the model.
        drafter: The :class:`SuffixDrafter` whose caches draft the tokens.
        num_draft_tokens: Most tokens drafted per step (default: the drafter's).
        max_tokens: Tokens to generate; ``-1`` for no limit.
        options: The request's drafting options (its cache scope, its whole
            prompt where ``prompt`` is only its uncached tail, its counts;
            their ``num_draft_tokens``, where set, over the argument's).
        Other arguments: as for ``mlx_lm.generate.generate_step``.

    Yields:
        ``(token, logprobs, from_draft)``.
    """
    _check_prompt(prompt)
    limit = max_tokens if max_tokens >= 0 else math.inf
    if limit == 0:
        return
    options = options or RequestOptions()
    prompt, sampler = prompt.astype(mx.uint32), sampler or greedy_sampler
    if options.num_draft_tokens is not None:
        num_draft_tokens = options.num_draft_tokens
    model, cache = _paired(drafter, model, prompt_cache, max_kv_size, prompt, options,
                           num_draft_tokens)
    kv_quantization = (quantized_kv_start, kv_group_size, kv_bits)
    num_draft_tokens, kv_width = _draft_limit(drafter, model, cache, num_draft_tokens,
                                              kv_quantization)
    row = replace(options, num_draft_tokens=num_draft_tokens).start(drafter, prompt.tolist(), limit)
    row.model = isinstance(model, Paired) and num_draft_tokens > 0
    row.holds = row.model and model.follows_lazily(cache)
    with mx.stream(stream):
        try:
            first = _prefill(model, cache, prompt, sampler, logits_processors, kv_quantization,
                             stream, prefill_step_size, prompt_progress_callback)
            target = ModelTarget(model, cache, row, drafter.policy, sampler, logits_processors,
                                 kv_quantization, prompt, context_limit(model), first, kv_width)
            if settles((row,), drafter.policy):
                # The first token as soon as the prompt's forward gave it, not
                # after the first step's draft and verification (stock's
                # speculative decoding gives it after its first round).
                target.hand_ahead()
                yield from target.hand_out()
            cleared = 0
            for _ in decode(target, row):
                yield from target.hand_out()
                if row.emitted // 256 != cleared:
                    cleared = row.emitted // 256
                    mx.clear_cache()
            yield from target.hand_out()
        finally:
            if isinstance(model, Paired):  # (a caller's cache of both models)
                model.settle(cache)
            row.finish()
