"""Drafting from suffix trees: the lifecycle of each request (start,
commit, propose, finish) and the drafter's counters.

One :class:`SuffixDrafter` owns the suffix trees (:mod:`~mlx_lm_suffix.
sources.trees`: one arctic-inference cache per isolation scope, a single one
unless a server partitions the cache per user, and the earlier responses it
keeps). Each active request drafts from its own prompt and output so far and
from the global tree of earlier responses, and extends drafts with its
prompt where its output copies the prompt (:mod:`~mlx_lm_suffix.sources.
prompt_copy`). How much of a draft is verified is the policy's
(:class:`~mlx_lm_suffix.policy.rules.Policy`), not the drafter's.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

from .policy import VerifyCost
from .policy.rules import Policy
from .sources import Draft
from .sources.draft_model import DraftModel
from .sources.prompt_copy import PromptCopy
from .sources.trees import SuffixTrees
from .stats import DraftStats

DEFAULT_NUM_DRAFT_TOKENS = 64
DEFAULT_MAX_TREE_DEPTH = 96
DEFAULT_MAX_CACHED_REQUESTS = 10_000
DEFAULT_MAX_CACHED_TOKENS = 4_000_000
DEFAULT_MAX_SPEC_FACTOR = 2.0
DEFAULT_MAX_SPEC_OFFSET = 0.0
DEFAULT_MIN_TOKEN_PROB = 0.1

# A cached response keeps this many prompt tokens before it, so that a later
# request whose prompt ends the same way drafts the response from its first
# token (a repeated request, the same tool call after the same template).
# More than a chat template's tail: a repeated request then matches much
# longer than requests that share only the template, and the policy learns
# the two apart (Calibration's match length buckets).
PROMPT_TAIL_TOKENS = 64
# The estimate of a prompt copy's tokens where the trees draft nothing: a
# continuation seen once, as the trees rate one.
COPY_PROB = 1.0


class _Private:
    def __repr__(self) -> str:
        return "PRIVATE"

    def __reduce__(self) -> str:
        return "PRIVATE"  # (unpickled: the one PRIVATE, on every rank)


#: The scope of a request that shares nothing with other requests: it drafts
#: from its own prompt and output only, and no part of it is cached.
PRIVATE: Hashable = _Private()


@dataclass
class _Request:
    scope: Hashable
    context: List[int]  # the last max_tree_depth tokens, to match in the trees
    copy: PromptCopy
    response: List[int]  # what the global tree gets: the prompt's tail, then the output
    planted: int  # how many of them the trees have

    def unplanted(self) -> List[int]:
        """The response's tokens the trees lack but its newest, now theirs."""
        newest, start = len(self.response) - 1, self.planted
        self.planted = max(start, newest)
        return self.response[start:newest]


def _positive_int(name: str, value: Any, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def _number(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not lo <= value <= hi:  # also NaN
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
    return float(value)


class SuffixDrafter:
    """Drafts continuations from suffix trees of the prompt and of earlier
    responses (SuffixDecoding, arXiv 2411.04975).

    Pass an instance as ``draft_model`` to ``mlx_lm.stream_generate`` or
    ``mlx_lm.generate``. Reuse the instance across calls: finished responses
    stay in its global cache and later requests draft from them.

    Args:
        num_draft_tokens: Most tokens drafted per step.
        max_tree_depth: Depth of the suffix trees; also the longest context
            matched. A draft is at most about ``depth * f / (1 + f)`` tokens
            long, with ``f = max_spec_factor``.
        max_cached_requests: Responses kept in the global cache. ``0``
            disables the global cache: no request drafts from another's
            prompt or response, in flight or finished.
        max_cached_tokens: Total tokens of cached responses kept (each with
            the prompt tokens kept before it); ``0`` disables the global
            cache as above. A response longer than this is not kept. Past
            either bound, the scope holding the most (tokens, or responses)
            loses its oldest response (ties: the oldest of them): one scope's
            responses evict another's only while that one holds more.
        max_spec_factor, max_spec_offset: The trees' draft is at most
            ``match_length * max_spec_factor + max_spec_offset`` tokens
            (a prompt copy that extends it is capped by ``num_draft_tokens``).
        min_token_prob: Stop a draft at the first token whose estimated
            probability is below this.
        policy: ``"adaptive"`` (default) picks each draft's length from the
            trees' probability estimates and the measured cost of verifying
            ``k`` tokens; ``"fixed"`` drafts as long as the trees allow (see
            :class:`~mlx_lm_suffix.policy.rules.Policy`, kept as
            :attr:`policy`). ``num_draft_tokens`` and the tree knobs are hard
            limits either way.
        cost: A :class:`~mlx_lm_suffix.policy.VerifyCost` to use instead of
            measuring one for the model at first use.
        draft_model: A small model with the target's tokenizer (or a
            :class:`~mlx_lm_suffix.sources.draft_model.DraftModel`): where
            the trees have no draft worth verifying, its greedy continuation
            is the draft (see :mod:`~mlx_lm_suffix.sources.draft_model`);
            the policy decides which source each row drafts from, and how
            many tokens the model drafts
            (:meth:`~mlx_lm_suffix.policy.rules.Policy.model_steps`).
    """

    def __init__(
        self,
        *,
        num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
        max_tree_depth: int = DEFAULT_MAX_TREE_DEPTH,
        max_cached_requests: int = DEFAULT_MAX_CACHED_REQUESTS,
        max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS,
        max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
        max_spec_offset: float = DEFAULT_MAX_SPEC_OFFSET,
        min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
        policy: str = "adaptive",
        cost: Optional[VerifyCost] = None,
        draft_model: Any = None,
    ):
        self.num_draft_tokens = _positive_int("num_draft_tokens", num_draft_tokens, True)
        self.max_tree_depth = _positive_int("max_tree_depth", max_tree_depth)
        self.max_cached_requests = _positive_int("max_cached_requests", max_cached_requests, True)
        self.max_cached_tokens = _positive_int("max_cached_tokens", max_cached_tokens, True)
        # Bounded so that a draft's length, match * factor + offset, stays an
        # int32 in arctic's trees (the longest match is max_tree_depth).
        self.max_spec_factor = _number("max_spec_factor", max_spec_factor, 0.0, 1e6)
        self.max_spec_offset = _number("max_spec_offset", max_spec_offset, -1e9, 1e9)
        self.min_token_prob = _number("min_token_prob", min_token_prob, 0.0, 1.0)
        if cost is not None and not isinstance(cost, VerifyCost):
            raise ValueError(f"cost must be a VerifyCost or None, got {cost!r}")
        self.stats = DraftStats()
        self.policy = Policy(policy, cost, self.stats)
        if draft_model is not None and not isinstance(draft_model, DraftModel):
            if not callable(draft_model) or not hasattr(draft_model, "layers"):
                raise ValueError(f"draft_model must be an mlx-lm model, got {draft_model!r}")
            draft_model = DraftModel(draft_model)
        #: The draft model source (None: the trees alone).
        self.draft_model: Optional[DraftModel] = draft_model
        self._lock = threading.RLock()
        self._ids = itertools.count()
        self._trees = SuffixTrees(
            self.max_tree_depth, self.max_cached_requests, self.max_cached_tokens, PRIVATE
        )
        self._active: Dict[int, _Request] = {}

    # ------------------------------------------------------------------ state
    @property
    def active_requests(self) -> int:
        return len(self._active)

    @property
    def cached_requests(self) -> int:
        return len(self._trees.kept)

    @property
    def cached_tokens(self) -> int:
        return self._trees.kept.tokens

    def config(self) -> Dict[str, Any]:
        """The drafter's knobs as a dict (JSON-serialisable; a drafter made
        with them has the same knobs, but no draft model)."""
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "max_tree_depth": self.max_tree_depth,
            "max_cached_requests": self.max_cached_requests,
            "max_cached_tokens": self.max_cached_tokens,
            "max_spec_factor": self.max_spec_factor,
            "max_spec_offset": self.max_spec_offset,
            "min_token_prob": self.min_token_prob,
            "policy": self.policy.name,
        }

    def snapshot(self) -> Dict[str, Any]:
        """Stats plus cache occupancy, for logs and the server's stats endpoint."""
        with self._lock:
            d = self.stats.as_dict()
            cost = self.policy.cost
            d.update(
                probability_scale=self.policy.calibration.ratios(),
                verify_cost=cost.relative() if cost is not None else None,
                batch_cost_factors=cost.batch_relative() if cost is not None else None,
                active_requests=self.active_requests,
                cached_requests=self.cached_requests,
                cached_tokens=self.cached_tokens,
                tree_responses=self._trees.tree_responses(),
            )
            return d

    # -------------------------------------------------------------- lifecycle
    def start(self, prompt: Sequence[int], scope: Hashable = None) -> int:
        """Start a request: its prompt becomes the request's own suffix tree
        (its last :data:`PROMPT_TAIL_TOKENS` tokens the global tree's too).

        Returns a fresh request id (ids are never reused). ``scope`` selects
        the global cache the request drafts from and adds its response to
        (:data:`PRIVATE`: none).
        """
        prompt = [int(t) for t in prompt]
        split = max(0, len(prompt) - PROMPT_TAIL_TOKENS)
        copy = PromptCopy(prompt)
        with self._lock:
            req_id = next(self._ids)
            # The newest token is held back (see commit).
            self._trees.start(req_id, scope, prompt[:split], prompt[split:-1])
            self._active[req_id] = _Request(
                scope, prompt[-self.max_tree_depth :], copy, prompt[split:],
                max(0, len(prompt) - split - 1),
            )
            self.stats.requests += 1
            return req_id

    def commit(self, req_id: int, tokens: Sequence[int], grow: bool = True) -> None:
        """Feed committed (emitted) tokens to the request: drafts continue
        them at once; the trees get them now, or with ``grow=False`` at the
        next :meth:`grow` (inserting them is the larger part of the work,
        which a caller may do while a forward runs).

        The trees get every token of the request but its newest: the newest
        occurs in them only once it is followed, so the context never
        matches its own occurrence. (That match would make a walk of the
        trees run through every context length, and count the request's own
        occurrence in each estimate, halving a continuation seen once.)"""
        if not tokens:
            return
        tokens = list(map(int, tokens))
        with self._lock:
            req = self._active[req_id]
            req.response.extend(tokens)
            req.context.extend(tokens)
            req.copy.feed(tokens)
            self.stats.tokens += len(tokens)
            del req.context[: -self.max_tree_depth]
            if grow:
                self._trees.extend(req_id, req.scope, req.unplanted())

    def grow(self, req_id: int) -> None:
        """The trees get the request's tokens committed with ``grow=False``."""
        with self._lock:
            req = self._active.get(req_id)
            if req is not None:
                self._trees.extend(req_id, req.scope, req.unplanted())

    def propose(self, req_id: int, max_tokens: Optional[int] = None) -> Draft:
        """The draft of up to ``max_tokens`` (default ``num_draft_tokens``)
        tokens after the request's committed tokens, before any length
        policy: the trees' best (one walk of the request's own tree and the
        global tree), extended by the prompt's continuation where the
        output is copying the prompt (:mod:`~mlx_lm_suffix.copying`) and
        that continuation starts with the trees' draft (or the trees have
        none). A copy's estimates are the trees' as far as they draft, then
        the last of them (:data:`COPY_PROB` where the trees have none); its
        match length is the longer of the trees' match and the copy's run
        (:mod:`~mlx_lm_suffix.sources.prompt_copy`)."""
        limit = self.num_draft_tokens if max_tokens is None else max_tokens
        if limit <= 0:
            return Draft()
        with self._lock:
            req = self._active[req_id]
            tokens, probs, match = self._trees.draft(
                req_id, req.scope, req.context, limit,
                self.max_spec_factor, self.max_spec_offset, self.min_token_prob,
            )
            copy, run = req.copy.propose(limit), req.copy.run
        n = len(tokens)
        if len(copy) <= n or copy[:n] != tokens:
            return Draft(tokens, probs, match)  # (the trees draft at most ``limit``)
        p = probs[-1] if n else COPY_PROB
        return Draft(copy, probs + [p] * (len(copy) - n), max(match, run), "copy", n, match)

    def finish(self, req_id: int) -> None:
        """Stop a request. Its response stays in the global cache until evicted.

        Safe to call more than once."""
        with self._lock:
            req = self._active.pop(req_id, None)
            if req is None:
                return
            self._trees.extend(req_id, req.scope, req.response[req.planted :])
            self._trees[req.scope].stop_request(req_id)
            self.stats.evictions += self._trees.keep(req_id, req.scope, req.response)

    def context(self, req_id: int) -> List[int]:
        """The request's tokens the drafter holds (the prompt's last
        :data:`PROMPT_TAIL_TOKENS` and every committed token; not a copy)."""
        return self._active[req_id].response

    def drafts(self, reqs: Sequence[int], limits: Sequence[int]) -> List[Draft]:
        """Each request's draft (:meth:`propose`) of at most ``limits[i]``
        tokens: the drafter as a :class:`~mlx_lm_suffix.sources.Source`."""
        return [self.propose(r, k) for r, k in zip(reqs, limits)]

    def record(self, steps: int = 0, drafted: int = 0, accepted: int = 0,
               draft: Optional[Draft] = None, held: Optional[int] = None, host_s: float = 0.0,
               replayed: Optional[int] = None, source: str = "tree", last: int = 0) -> None:
        """Count ``steps`` target forwards; ``drafted`` tokens of ``draft``
        verified, of which ``held`` held (the policy learns from their
        estimates); ``accepted`` draft tokens from ``source`` emitted
        (negative: taken back of the ``last`` a verification emitted);
        ``host_s`` seconds of drafting and pricing; a replay of
        ``replayed`` tokens. (Committed tokens are counted by
        :meth:`commit`.)"""
        with self._lock:
            self.stats.count(steps, drafted, accepted, draft, host_s, replayed, source, last)
            if drafted and draft is not None and held is not None:
                self.policy.record(draft, drafted, held)

    # ------------------------------------------------------------ persistence
    def add_responses(self, responses: Iterable[Tuple[Hashable, Sequence[int]]]) -> int:
        """Add finished responses (``(scope, tokens)`` pairs) to the global
        cache, e.g. from a file. Returns how many were added."""
        n = 0
        with self._lock:
            for scope, tokens in responses:
                self.stats.evictions += self._trees.add(next(self._ids), scope,
                                                        [int(t) for t in tokens])
                n += 1
        return n

    def cached_responses(self) -> List[Tuple[Hashable, List[int]]]:
        """The cached responses, oldest first. The token lists are the
        drafter's own (not copied, so this is quick under the lock): read
        them, never change them."""
        with self._lock:
            return self._trees.kept.responses()
