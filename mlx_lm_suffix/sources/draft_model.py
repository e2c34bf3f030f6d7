"""A draft model beside the suffix trees: a small model of the target's
tokenizer whose greedy continuation is a row's draft where the trees have
none worth verifying (the policy chooses, :meth:`~mlx_lm_suffix.policy.
rules.Policy.model_steps`).

**In step with the target.** The draft model's caches are one more entry
at the end of the target's cache list (a ``CacheList`` of its layers'
caches), and :class:`Paired` is the target and the draft model as one
model: every forward the target runs (the prompt's prefill, a plain step, a
verification, a replay) feeds the draft model the same tokens. So the draft
model's cache holds what the target's holds: it is prefilled once, with
the prompt (a server's prompt cache keeps its prefix with the target's),
takes every committed token, and loses every rejected position to the
target's own rollback (:mod:`~mlx_lm_suffix.rollback`, for every cache
kind; one restored layer sends both models back); in a batch, its rows
join, leave, are extracted and compacted with the target's, by mlx-lm's
own batch code.

**Drafting** (:meth:`DraftModel.draft`): ``k`` greedy steps of the draft
model alone, every row of the batch at once. Settled (a row's pending token
is known), the first step feeds each row's pending token; pipelined (a
plain forward is queued), that forward fed the draft model the token just
emitted, so its logits (kept by :class:`Paired`) give the first draft
token. A draft token's estimate is the draft model's probability of it,
multiplied along the draft (cumulative, as the trees'), which the policy
calibrates as it calibrates theirs (source ``model``). The host reads the
drafts once, after the last step.

**Its drafted positions.** One sequence whose every cache layer, the
target's and the draft model's, drops positions at any time (``KVCache``
and its kinds: :func:`~mlx_lm_suffix.rollback.trims`) keeps them, as stock's
speculative decoding does (:meth:`Paired.hold`): the verification that
follows feeds the draft model none of the tokens they hold, and where it
verifies the whole draft, the last drafted token waits for the draft model's
next forward, as in stock's. So a step costs the draft model its ``k``
forwards, not one more for the verification. Rollback still drops the
same positions of both models, so the tokens the draft model lacks are the
target's last ones, fed first by its next forward; a request's end or a
consumer's stop puts both in step (:meth:`Paired.settle`). A batch keeps
them too where every layer of the draft model trims per row (attention
with no window: :class:`DraftRows`, its rows rolled back apart from the
target's). Every other cache (a recurrent or sliding-window layer of
either model, whose rollback may restore; a batch's draft model with such
layers) drops the drafted positions at once, and the verification feeds
the draft model its tokens with the target's.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..internals import Attached
from ..verification import common_prefix

#: ``guide(context) -> (token, probability) or None``: the token a draft
#: takes after ``context`` (the tokens before it) and its estimate, else the
#: draft model's own (benches script a draft model's agreement with the
#: target so: a random-weight model's probabilities say nothing).
Guide = Callable[[Sequence[int]], Optional[Tuple[int, float]]]


def cache_list_of(model: Any) -> List[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def vocabulary_problem(target: Any, draft: Any) -> Optional[str]:
    """Why ``draft`` cannot draft for ``target``: their vocabularies
    (``args.vocab_size``) differ; None where they match or either names
    none."""
    ours, theirs = (getattr(getattr(m, "args", None), "vocab_size", None) for m in (draft, target))
    if isinstance(ours, int) and isinstance(theirs, int) and ours != theirs:
        return (f"the draft model's vocabulary ({ours} tokens) is not the model's ({theirs}): "
                "a draft model needs the model's tokenizer")
    return None


class Paired:
    """A target model and its draft model as one model (see the module
    docstring): its cache list is the target's with the draft model's
    caches as one ``CacheList`` after them; a call feeds both and returns
    the target's logits, and keeps the draft model's logits at each row's
    last position, lazily, for the cache it fed (:meth:`last`: a pipelined
    draft's first token). Anything else is the target's (``args``,
    ``layers``, ...)."""

    def __init__(self, target: nn.Module, draft: nn.Module):
        self.target, self.draft = target, draft
        #: The target's entries of the cache list.
        self.target_entries = len(cache_list_of(target))
        self._last: "weakref.WeakKeyDictionary[Any, mx.array]" = weakref.WeakKeyDictionary()
        # Following lazily (:meth:`hold`), by the draft model's cache entry:
        # its drafted tokens past the target's, the next inputs, and the
        # last inputs some of which it lacks (with their position).
        self._ahead: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()
        self._expect: "weakref.WeakKeyDictionary[Any, List[int]]" = weakref.WeakKeyDictionary()
        self._fed: "weakref.WeakKeyDictionary[Any, Tuple[int, List[int]]]" = (
            weakref.WeakKeyDictionary())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def __call__(self, inputs: mx.array, cache: Optional[List[Any]] = None, **kwargs: Any
                 ) -> mx.array:
        if cache is None:
            return self.target(inputs, **kwargs)
        if not self.pairs(cache):
            raise ValueError(f"a cache of the target and its draft model has "
                             f"{self.target_entries + 1} entries, not {len(cache)}")
        logits = self.target(inputs, cache=cache[:-1], **kwargs)
        feed = self._to_feed(cache, inputs)
        if feed is None:
            self._last.pop(cache[-1], None)
        else:
            self._last[cache[-1]] = self.draft(feed, cache=list(cache[-1].caches))[:, -1]
        return logits

    def _to_feed(self, cache: List[Any], inputs: mx.array) -> Optional[mx.array]:
        """What the draft model is fed with ``inputs``, which the target was
        just fed (see :meth:`hold`): the inputs its drafted positions do not
        hold already, after the tokens it lacks; None: nothing."""
        from .. import rollback  # (imports mlx_lm, whose import patches it and imports this)

        entry = cache[-1]
        expected = self._expect.pop(entry, None)
        ahead = self._ahead.pop(entry, None)
        if ahead is None:
            missing = self.missing(cache, inputs.shape[1])
            if not missing:
                return inputs
            return mx.concatenate([mx.array([missing], inputs.dtype), inputs], axis=1)
        held = common_prefix(ahead, expected or ())
        rollback.trim(list(entry.caches), len(ahead) - held)
        if expected is not None and held >= len(expected) - 1:
            if held < len(expected):  # (its last input waits for the next forward)
                self._fed[entry] = (rollback.held(cache[:-1]) - len(expected), list(expected))
            return None
        return inputs[:, held:]

    def follows_lazily(self, cache: List[Any]) -> bool:
        """Whether the draft model keeps its drafted positions in ``cache``
        (:meth:`hold`): one sequence's cache whose every layer, the
        target's and the draft model's, drops its last positions at any
        time (as stock's speculative decoding needs of both)."""
        from .. import rollback

        return rollback.trims(cache)

    def hold(self, cache: List[Any], tokens: List[int]) -> None:
        """The draft model's cache in ``cache`` holds ``tokens`` past the
        target's (the positions it drafted, kept as stock's speculative
        decoding keeps them). The next forward on ``cache`` drops those
        its inputs do not start with (:meth:`expect` names the inputs), and
        feeds the draft model none of the inputs they hold; where they
        hold all the inputs but the last, that one waits, as in stock's,
        for the draft model's next forward, before its inputs (its
        :meth:`last` logits are then none). Rollback drops the same
        positions of both models, so the tokens the draft model lacks are
        always the target's last ones: those of the forward that left them
        out, as many as the two caches' positions differ."""
        self._ahead[cache[-1]] = list(tokens)

    def expect(self, cache: List[Any], tokens: List[int]) -> None:
        """The next forward on ``cache`` feeds ``tokens`` (see :meth:`hold`)."""
        if cache[-1] in self._ahead:
            self._expect[cache[-1]] = list(tokens)

    def missing(self, cache: List[Any], fed: int = 0) -> List[int]:
        """The tokens the target's cache holds and the draft model's lacks
        (``fed``: but the target's last ``fed`` positions, its inputs just
        fed); the draft model's next forward feeds them first (see
        :meth:`hold`)."""
        from .. import rollback

        held = self._fed.pop(cache[-1], None)
        if held is None:
            return []
        start, tokens = held
        lo = rollback.held(list(cache[-1].caches)) - start
        hi = rollback.held(cache[:-1]) - fed - start
        if not 0 <= lo <= hi <= len(tokens):
            raise RuntimeError("the draft model's cache is out of step with the model's")
        return tokens[lo:hi]

    def settle(self, cache: List[Any]) -> None:
        """Put the draft model's cache in step with the target's (a
        request's end, a consumer's stop): its drafted positions leave, the
        tokens it lacks are fed."""
        from .. import rollback

        if not self.pairs(cache):
            return
        entry = cache[-1]
        self._expect.pop(entry, None)
        ahead = self._ahead.pop(entry, None)
        if ahead:
            rollback.trim(list(entry.caches), len(ahead))
        missing = self.missing(cache)
        if missing:
            self._last[entry] = self.draft(mx.array([missing], mx.uint32),
                                           cache=list(entry.caches))[:, -1]

    def last(self, cache: List[Any]) -> Optional[mx.array]:
        """The draft model's logits after the last forward on ``cache``,
        one row a row (None: none kept)."""
        return self._last.get(cache[-1])

    def keep_rows(self, cache: List[Any], keep: List[int]) -> None:
        """A batch's rows ``keep`` stay: so do their kept logits."""
        last = self._last.get(cache[-1])
        if last is not None:
            self._last[cache[-1]] = last[mx.array(keep)] if keep else last[:0]

    def make_cache(self, max_kv_size: Optional[int] = None) -> List[Any]:
        """The cache list of both models (``max_kv_size``: as for
        ``make_prompt_cache``, of both)."""
        from mlx_lm.models.cache import CacheList, make_prompt_cache

        return (make_prompt_cache(self.target, max_kv_size)
                + [CacheList(*make_prompt_cache(self.draft, max_kv_size))])

    def pairs(self, cache: List[Any]) -> bool:
        """Whether ``cache`` is a cache list of both models (else the
        target's alone)."""
        return len(cache) == self.target_entries + 1

    def target_only(self, inputs: mx.array, cache: List[Any]) -> mx.array:
        """The target's forward alone on ``cache`` (its draft model holds
        these inputs already: :class:`DraftRows`); the draft model's kept
        logits leave."""
        self._last.pop(cache[-1], None)
        return self.target(inputs, cache=cache[:-1])

    def rows_apart(self) -> bool:
        """Whether a batch's draft model rows can roll back apart from the
        target's (:class:`DraftRows`): its every layer a ``KVCache`` (a
        ``BatchKVCache`` in a batch) and no attention window."""
        from mlx_lm.models.cache import KVCache

        from .. import internals, rollback

        found = rollback.layers(cache_list_of(self.draft))
        return (bool(found) and all(type(c) is KVCache for c in found)
                and not internals.windowed(self.draft))


class DraftRows:
    """A batch's draft model kept apart from its target
    (:meth:`Paired.rows_apart`), so that it keeps the positions it drafted
    as one sequence's does (:meth:`Paired.hold`), each row its own.

    After a draft (:meth:`DraftModel.draft`), each row's draft model holds
    ``ahead[i]`` past the target's committed tokens (the pending token and
    the drafted ones it fed; every row as many) and the verification feeds
    the target alone (:meth:`Paired.target_only`). Its commit
    (:meth:`verified`) drops from each row the positions its emitted tokens
    do not start with; the emitted tokens past them are the row's
    ``lack``, which the next draft's first forward feeds before the pending
    token. Rows lack different counts: that forward feeds them right-padded
    and the padding leaves by a swap (:func:`~mlx_lm_suffix.rollback.
    replay_rows`), as the drops do (:func:`~mlx_lm_suffix.rollback.drop_rows`),
    so the draft model's rows keep their own :class:`~mlx_lm_suffix.
    rollback.SlotOrder`. A verification that follows no draft feeds both
    models and the draft model's rows drop what the target's drop. Any
    other forward of the batch, and rows joining or read out, first put it
    in step (:meth:`catch_up`). ``held``, of :meth:`catch_up` and
    :meth:`verified`: the positions each row of the target holds (its
    tokens so far)."""

    def __init__(self) -> None:
        from .. import rollback

        self.order = rollback.SlotOrder()
        #: Per row: the tokens the draft model holds past the target's
        #: (None: none since the last draft's verification).
        self.ahead: Optional[List[List[int]]] = None
        #: Per row: the target's last tokens the draft model lacks.
        self.lack: List[List[int]] = []

    def add(self, n: int) -> None:
        """``n`` rows joined, in step."""
        self.order.rows += [None] * n
        self.lack += [[] for _ in range(n)]

    def keep(self, keep: List[int]) -> None:
        """The batch's rows ``keep`` stay."""
        self.order.keep(keep)
        self.lack = [self.lack[i] for i in keep]
        if self.ahead is not None:
            self.ahead = [self.ahead[i] for i in keep]

    def in_step(self) -> bool:
        """Whether every row holds what the target's holds, no more, no less."""
        return self.ahead is None and not any(self.lack)

    def drop_ahead(self, cache: List[Any], fed: int = 0) -> None:
        """Drop the positions drafted and not verified, or (none drafted)
        the last ``fed`` of every row: a verification's that fed both
        models, undone whole."""
        from .. import rollback

        n = len(self.ahead[0]) if self.ahead else fed
        for c in rollback.layers([cache[-1]]):
            rollback.ROWS.trim(c, n)
        self.ahead = None

    def feed(self, model: nn.Module, cache: List[Any], tokens: List[List[int]],
             held: Sequence[int]) -> mx.array:
        """Feed row ``i`` of the draft model ``tokens[i]`` (``held[i]``
        positions held after); the logits after each row's last."""
        from .. import rollback

        logits = rollback.replay_rows(model, list(cache[-1].caches), tokens, self.order, held)
        return logits[mx.arange(len(tokens)), mx.array([len(t) for t in tokens]) - 1]

    def catch_up(self, model: nn.Module, cache: List[Any], held: Sequence[int]) -> None:
        """The draft model in step with the target: drafted positions
        dropped, the tokens it lacks fed."""
        self.drop_ahead(cache)
        if any(self.lack):
            lack, self.lack = self.lack, [[] for _ in self.lack]
            self.feed(model, cache, lack, held)

    def verified(self, cache: List[Any], fed: int, emitted: List[List[int]],
                 held: Sequence[int]) -> None:
        """After a verification ``fed`` wide whose rows emitted ``emitted``
        (``held``: after them): drop what the draft model holds past them."""
        from .. import rollback

        caches = list(cache[-1].caches)
        if self.ahead is None:  # (it fed the draft model with the target)
            rollback.drop_rows(caches, [fed - len(e) for e in emitted], self.order, held)
            return
        kept = [common_prefix(a, e) for a, e in zip(self.ahead, emitted)]
        rejected = [len(a) - n for a, n in zip(self.ahead, kept)]
        self.lack = [e[n:] for e, n in zip(emitted, kept)]
        self.ahead = None
        rollback.drop_rows(caches, rejected, self.order,
                           [h - len(x) for h, x in zip(held, self.lack)])


class DraftModel:
    """A draft model as a source of a :class:`~mlx_lm_suffix.drafter.
    SuffixDrafter`: the model, its pairing with each target
    (:meth:`pair`), and its drafts (:meth:`draft`). ``guide``: see
    :data:`Guide`."""

    def __init__(self, model: nn.Module, guide: Optional[Guide] = None):
        self.model = model
        self.guide = guide
        self._pairs: Attached[Paired] = Attached()

    def pair(self, target: Any) -> Paired:
        """``target`` paired with this draft model (one pairing per target;
        a :class:`Paired` already is one)."""
        if isinstance(target, Paired):
            return target
        paired = self._pairs.get(target)
        if paired is None:
            problem = vocabulary_problem(target, self.model)
            if problem:
                raise ValueError(problem)
            paired = Paired(target, self.model)
            self._pairs.set(target, paired)
        return paired

    def prefill(self, cache: List[Any], tokens: Sequence[int], step: int = 2048) -> None:
        """Feed the draft model ``tokens`` on the draft entry of ``cache``
        (a target's cache that held them before the entry was added), in
        chunks of ``step``."""
        caches = list(cache[-1].caches)
        tokens = list(tokens)
        for i in range(0, len(tokens), step):
            self.model(mx.array(tokens[i : i + step], mx.uint32)[None], cache=caches)
            mx.eval([c.state for c in caches])

    def draft(self, paired: Paired, cache: List[Any], first: Optional[mx.array], steps: int,
              contexts: Optional[List[List[int]]] = None, rows: Optional[DraftRows] = None,
              held: Sequence[int] = ()) -> Tuple[List[List[int]], List[List[float]], float]:
        """``steps`` greedy draft tokens for every row of ``cache`` (a
        batch's, or one sequence's as a batch of one), and the draft model's
        probability of each; and the seconds it took. ``first``: each row's
        pending token (settled), or None (pipelined: the logits of the
        forward :class:`Paired` last ran on ``cache``; no drafts where it
        kept none). ``contexts``: each row's tokens so far, for the
        :data:`Guide`. ``rows``: a batch's draft model kept apart, which
        keeps the drafted positions (``held``: each row's tokens so far)."""
        from .. import rollback

        tic = time.perf_counter()
        caches = list(cache[-1].caches)
        lazy = rows is None and paired.follows_lazily(cache)
        saved = None if lazy or rows is not None else rollback.checkpoint(caches)
        fed = 0
        if rows is not None:
            rows.drop_ahead(cache)
        if first is None:
            logits = paired.last(cache)
            if logits is None:
                return [], [], 0.0
            if rows is not None and not rows.in_step():
                raise RuntimeError("the draft model's cache is out of step with the model's")
        elif rows is not None:
            x = [lack + [t] for lack, t in zip(rows.lack, first.tolist())]
            logits = rows.feed(self.model, cache, x, [h + 1 for h in held])
            rows.lack = [[] for _ in rows.lack]
            fed = 1
        else:
            missing = paired.missing(cache)
            x = first[:, None]
            if missing:
                x = mx.concatenate([mx.array([missing], x.dtype), x], axis=1)
            logits = self.model(x, cache=caches)[:, -1]
            fed = 1
        tokens, probs, own = [], [], []
        contexts = [list(c) for c in contexts] if self.guide is not None and contexts else None
        planned = self._planned(contexts, steps) if contexts is not None else None
        for j in range(steps):
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            t = mx.argmax(logprobs, axis=-1)
            p = mx.exp(mx.take_along_axis(logprobs, t[:, None], axis=-1)[:, 0])
            if planned is not None:  # (the model's own, computed as a draft's, unused)
                own += [t, p]
                t, p = planned[0][:, j], planned[1][:, j]
            elif contexts is not None:
                t, p = self._guided(t, p, contexts)
            tokens.append(t)
            probs.append(p)
            if j < steps - 1:
                logits = self.model(t[:, None], cache=caches)[:, -1]
                fed += 1
        out = mx.stack(tokens, axis=1), mx.stack(probs, axis=1)
        mx.eval(out, own)
        drafted, estimates = out[0].tolist(), out[1].tolist()
        head = [[]] * len(drafted) if first is None else [[t] for t in first.tolist()]
        if lazy:
            paired.hold(cache, head[0] + drafted[0][: steps - 1])
        elif rows is not None:
            rows.ahead = [h + d[: steps - 1] for h, d in zip(head, drafted)]
        elif fed:
            rollback.drop(caches, saved, fed)
        return drafted, estimates, time.perf_counter() - tic

    def _planned(self, contexts: List[List[int]], steps: int
                 ) -> Optional[Tuple[mx.array, mx.array]]:
        """Every row's ``steps`` tokens and estimates (rows x steps) where
        the guide names each of them, else None. Then they are known before
        the draft model's forwards run, which feed them in turn without the
        host reading each forward's result (as a draft model's own tokens
        feed its next forward); else each step's tokens are read
        (:meth:`_guided`)."""
        tokens, probs = [], []
        for context in contexts:
            context = list(context)
            for _ in range(steps):
                guided = self.guide(context)
                if guided is None:
                    return None
                context.append(guided[0])
                tokens.append(guided[0])
                probs.append(guided[1])
        shape = (len(contexts), steps)
        return mx.array(tokens, mx.uint32).reshape(shape), mx.array(probs).reshape(shape)

    def _guided(self, tokens: mx.array, probs: mx.array, contexts: List[List[int]]
                ) -> Tuple[mx.array, mx.array]:
        """Each row's token and estimate where the guide names them after
        its context (which then takes the token)."""
        out, est = tokens.tolist(), probs.tolist()
        for i, context in enumerate(contexts):
            guided = self.guide(context)
            if guided is not None:
                out[i], est[i] = guided
            context.append(out[i])
        return mx.array(out, mx.uint32), mx.array(est)
