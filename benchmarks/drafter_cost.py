"""The drafter's host time per row and step, as a generation spends it (no
model): where each microsecond goes, why it grows with the rows in flight,
and what the changes issue 38 proposes would save.

    python benchmarks/drafter_cost.py [--quick] [--rows 1,8,32]
        [--cached 0,1000000,4000000] [--steps 64] [--reps 2]
        [--parts main,pieces,why,protos,overhead] [--methods C,G,H]
        [--depth 64] [--json out.json]

About 5 minutes on an idle 2-core machine (more under load); ``--quick``
(cached 0 and 200k, rows 1 and 8, 24 steps, one pass) about 20 s.

Token streams are Python standard library sources tokenized with the tiny
model's BPE tokenizer (``tools.models.get_tokenizer``). The global cache is
filled once with ``add_responses`` (800-token responses of the library's
non-test modules), in order: empty, then ~1M, then ~4M tokens. Rows are
started with a ~1,500-token prompt and stepped in turn (round robin, as a
batch does); a step is ``drafter.commit(req, [token])`` then
``drafter.propose(req, 64)``, timed alone (``perf_counter_ns``). Two kinds of
output:

- ``open``: each row continues a test module (``Lib/test``, not cached) after
  its prompt: text the cache has not seen, so most drafts fail;
- ``repeat``: each row's prompt ends with a cached response's 64 prompt
  tokens and its output is that response (a repeated request).

Every row count steps the same rows, as many as the most rows asked for (by
default 32: one row at a time is 32 groups of one, 8 rows 4 groups of 8), so
the work is the same and only the interleaving differs. Rows are discarded after a pass (their responses are
evicted, not kept), so the cache stays as filled. Draft quality: the draft's
prefix that matches the output (``acc``; one token is committed per step, so
a draft is re-proposed every step), also counted up to 16 tokens per step
(what one verification might take), and against the drafter's on the same
steps: useful drafts (2+ tokens right) missed, accepted tokens lost.

Parts (``--parts``):

- ``main``: median, p90 and p99 us per row-step for the drafter and for
  arctic-inference's own ``add_active_response`` + one ``speculate`` on the
  same data (Python list contexts, or numpy int32 views: its zero-copy path).
- ``pieces``: the drafter's code re-run with a timer between its pieces
  (commit: Python, arctic's wrapper, the prompt tree's and the global tree's
  extend, ``PromptCopy.feed``; propose: the first and the LONG_MATCH
  ``speculate``, each split into prompt tree, global tree, wrapper and list
  conversions, then the copy extension), at the fewest and the most rows.
- ``why`` (largest cache): why the cost per row grows with rows in flight: 1
  row against 32 round robin, 32 started but one stepped, 32 stepped in
  blocks of 16 steps, 1 row with the CPU caches flushed between steps, the
  garbage collector off or frozen, the request's own occurrence kept out of
  the trees (lag 1), and arctic's native calls alone.
- ``protos`` (largest and empty cache): prototypes of the changes in the
  drafter's own flow (numpy contexts, native calls, one ``speculate``, the
  last committed token held back from the trees, keeping a draft's rest,
  deferring the global tree's extend, back-off, a shorter walk, a minimum
  match, a short refill walk for repeats), alone and combined (A-J), with
  what they cost in drafts; then how holding the last token back changes the
  trees' estimates. ``--methods`` runs only some (the drafter always).
- ``overhead``: arctic call overheads on an empty tree (list against numpy).
- ``depth`` (not by default): the drafter and combinations B and D on a tree
  of ``--depth`` at the largest cache (refilled).

Timings on a shared machine are noisy: figures are pooled over ``--reps``
passes interleaved by method; the spread of the per-pass medians and the
best pass's p99 are shown (a pass preempted by other processes shows
multi-millisecond p99s).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
from arctic_inference.suffix_decoding._C import SuffixTree
from arctic_inference.suffix_decoding.cache import SuffixDecodingDraft

from mlx_lm_suffix import SuffixDrafter
from mlx_lm_suffix.copying import PromptCopy
from mlx_lm_suffix.drafter import COPY_PROB, PROMPT_TAIL_TOKENS, Draft
from mlx_lm_suffix.policy import LONG_MATCH
from mlx_lm_suffix.tools.models import get_tokenizer

K = 64
PROMPT_TOKENS = 1500
RESPONSE_TOKENS = 800
# A method: start(prompt, output) -> state; step(state, i) -> draft tokens
# (commit output[i], then propose); stop(state).
Method = Tuple[Callable, Callable, Callable]


# ---------------------------------------------------------------- token data
def stdlib_files() -> Tuple[List[Path], List[Path]]:
    """The standard library's modules (sorted): non-test ones (the cache's
    text) and test ones (the rows' text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    cache, test = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        is_test = any(p in ("test", "tests", "idle_test") for p in parts[:-1])
        (test if is_test else cache).append(path)
    return cache, test


def tokenize(paths: Sequence[Path]) -> List[List[int]]:
    tok = get_tokenizer()
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    return [e.ids for e in tok.encode_batch(texts)]


def cache_responses(paths: Sequence[Path], total: int) -> List[List[int]]:
    """``total`` tokens of the modules as responses of RESPONSE_TOKENS."""
    flat: List[int] = []
    for i in range(0, len(paths), 50):
        if len(flat) >= total:
            break
        for ids in tokenize(paths[i : i + 50]):
            flat.extend(ids)
    n = min(total, len(flat)) // RESPONSE_TOKENS
    return [flat[i * RESPONSE_TOKENS : (i + 1) * RESPONSE_TOKENS] for i in range(n)]


def held_out_streams(paths: Sequence[Path], n: int, length: int) -> List[List[int]]:
    """``n`` test modules of at least ``length`` tokens, spread over the list."""
    big = [p for p in paths if p.stat().st_size > 3 * length]
    picked = big[:: max(1, len(big) // (2 * n))][: 2 * n]
    out = [ids[:length] for ids in tokenize(picked) if len(ids) >= length]
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} test modules of {length} tokens")
    return out[:n]


def open_rows(held: List[List[int]], steps: int) -> List[Tuple[List[int], List[int]]]:
    """(prompt, output): a test module's first tokens, then its continuation."""
    return [
        (ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS : PROMPT_TOKENS + steps + K + 1]) for ids in held
    ]


def repeat_rows(
    held: List[List[int]], responses: List[List[int]], steps: int
) -> List[Tuple[List[int], List[int]]]:
    """(prompt, output): held-out text ending with a cached response's prompt
    tail, then the response (cached responses among the first quarter, so
    every filled cache holds them)."""
    stride = max(1, len(responses) // (4 * len(held)))
    out = []
    for j, ids in enumerate(held):
        r = responses[j * stride]
        out.append(
            (
                ids[: PROMPT_TOKENS - PROMPT_TAIL_TOKENS] + r[:PROMPT_TAIL_TOKENS],
                r[PROMPT_TAIL_TOKENS:],
            )
        )
    assert all(len(o) > steps for _, o in out), "responses shorter than the steps"
    return out


# ------------------------------------------------------------------- methods
def discard(drafter: SuffixDrafter, rid: int) -> None:
    """Stop a drafter's request without keeping its response."""
    req = drafter._active.pop(rid)
    cache = drafter._trees[req.scope]
    cache.stop_request(rid)
    if rid in cache.cached_requests:
        cache.evict_cached_response(rid)


def drafter_method(drafter: SuffixDrafter) -> Method:
    def start(prompt, output):
        return (drafter.start(prompt), output)

    def step(st, i):
        rid = st[0]
        drafter.commit(rid, [st[1][i]])
        return drafter.propose(rid, K).tokens

    return start, step, lambda st: discard(drafter, st[0])


_raw_ids = itertools.count(-1, -1)


def arctic_method(drafter: SuffixDrafter, use_numpy: bool) -> Method:
    """arctic's own add_active_response + one speculate, on the drafter's
    cache, started as the drafter starts a request."""
    cache = drafter._trees.open(None)
    depth, f, o, p = (
        drafter.max_tree_depth,
        drafter.max_spec_factor,
        drafter.max_spec_offset,
        drafter.min_token_prob,
    )

    def start(prompt, output):
        rid = next(_raw_ids)
        split = max(0, len(prompt) - PROMPT_TAIL_TOKENS)
        cache.start_request(rid, prompt[:split])
        cache.add_active_response(rid, prompt[split:])
        if use_numpy:
            return [rid, np.asarray(prompt + list(output), dtype=np.int32), len(prompt)]
        return [rid, list(prompt[-depth:]), output]

    if use_numpy:

        def step(st, i):
            buf, n = st[1], st[2] + i
            cache.add_active_response(st[0], buf[n : n + 1])
            d = cache.speculate(st[0], buf[n + 1 - depth : n + 1], K, f, o, p)
            return d.token_ids

    else:

        def step(st, i):
            t, ctx = st[2][i], st[1]
            cache.add_active_response(st[0], [t])
            ctx.append(t)
            if len(ctx) > 2 * depth:
                del ctx[:-depth]
            d = cache.speculate(st[0], ctx[-depth:], K, f, o, p)
            return d.token_ids

    def stop(st):
        cache.stop_request(st[0])
        cache.evict_cached_response(st[0])

    return start, step, stop


def native_method(drafter: SuffixDrafter, part: str = "both", lag: int = 0) -> Method:
    """arctic's C++ calls alone, numpy contexts, no wrapper: both trees'
    extend and speculate (``part``: ``both``, ``extend`` or ``speculate``;
    ``lag``: 1 holds the last committed token back from the trees)."""
    cache = drafter._trees.open(None)
    g = cache._global_tree
    depth, f, o, p = (
        drafter.max_tree_depth,
        drafter.max_spec_factor,
        drafter.max_spec_offset,
        drafter.min_token_prob,
    )
    ext, spec = SuffixTree.extend_ndarray, SuffixTree.speculate_ndarray
    start0, _, stop = arctic_method(drafter, True)

    def start(prompt, output):
        st = start0(prompt, output)
        return st + [cache._local_trees[st[0]], cache._req_to_seq_id[st[0]]]

    def step(st, i):
        buf, n, local = st[1], st[2] + i, st[3]
        if part != "speculate" and (i or not lag):
            ext(local, 0, buf[n - lag : n + 1 - lag])
            ext(g, st[4], buf[n - lag : n + 1 - lag])
        if part == "extend":
            return []
        ctx = buf[n + 1 - depth : n + 1]
        d1 = spec(local, ctx, K, f, o, p, False)
        d2 = spec(g, ctx, K, f, o, p, False)
        return (d1 if d1.score >= d2.score else d2).token_ids

    return start, step, stop


PIECES = (
    "c.python",  # int conversion, lock, lookups, bookkeeping of context/response/stats
    "c.wrapper",  # arctic's add_active_response around the two extends
    "c.local",  # extend of the request's prompt tree
    "c.global",  # extend of the global tree
    "c.feed",  # PromptCopy.feed
    "p.python",  # lock, lookups, context slice, knobs, Draft construction, merge
    "s1.wrapper",  # arctic's speculate: checks, better of two, from_native
    "s1.local",  # native speculate, prompt tree (incl. list -> vector)
    "s1.global",  # native speculate, global tree
    "s1.lists",  # list(d.token_ids), list(d.probs) in the drafter
    "s2.wrapper",
    "s2.local",
    "s2.global",
    "s2.lists",
    "p.copy",  # PromptCopy.propose and the copy extension
)


def pieces_method(drafter: SuffixDrafter, record: Dict[str, List[int]]) -> Method:
    """The drafter's commit + propose, re-implemented line for line with a
    timer between pieces (``record[piece]`` gets ns per step)."""
    d_start, _, d_stop = drafter_method(drafter)
    clock = time.perf_counter_ns
    rec = [record.setdefault(name, []) for name in PIECES]

    def wrapped_spec(cache, rid, context, limit, factor, offset, prob, base):
        # arctic's SuffixDecodingCache.speculate, split
        t0 = clock()
        if rid not in cache._local_trees:
            raise ValueError(rid)
        if isinstance(context, np.ndarray):
            raise TypeError("lists only")
        if len(context) > cache._max_tree_depth:
            context = context[-cache._max_tree_depth :]
        t1 = clock()
        d1 = SuffixTree.speculate(
            cache._local_trees[rid], context, limit, factor, offset, prob, False
        )
        t2 = clock()
        d2 = SuffixTree.speculate(cache._global_tree, context, limit, factor, offset, prob, False)
        t3 = clock()
        d = SuffixDecodingDraft.from_native(d1 if d1.score >= d2.score else d2)
        t4 = clock()
        rec[base].append(t1 - t0 + t4 - t3)
        rec[base + 1].append(t2 - t1)
        rec[base + 2].append(t3 - t2)
        return d, t4

    def step(st, i):
        self, req_id = drafter, st[0]
        # ---- commit (SuffixDrafter.commit)
        t0 = clock()
        tokens = [st[1][i]]
        tokens = [int(t) for t in tokens]
        with self._lock:
            req = self._active[req_id]
            cache = self._trees[req.scope]
            t1 = clock()
            # arctic's add_active_response, split
            if req_id not in cache._local_trees:
                raise ValueError(req_id)
            isinstance(tokens, np.ndarray)
            t2 = clock()
            SuffixTree.extend(cache._local_trees[req_id], 0, tokens)
            t3 = clock()
            if req_id in cache._req_to_seq_id:
                seq_id = cache._req_to_seq_id[req_id]
                t4 = clock()
                SuffixTree.extend(cache._global_tree, seq_id, tokens)
            else:
                t4 = clock()
            t5 = clock()
            req.response.extend(tokens)
            req.context.extend(tokens)
            t6 = clock()
            req.copy.feed(tokens)
            t7 = clock()
            self.stats.tokens += len(tokens)
            if len(req.context) > 2 * self.max_tree_depth:
                del req.context[: -self.max_tree_depth]
        t8 = clock()
        rec[0].append(t1 - t0 + t6 - t5 + t8 - t7)
        rec[1].append(t2 - t1 + t4 - t3)
        rec[2].append(t3 - t2)
        rec[3].append(t5 - t4)
        rec[4].append(t7 - t6)
        # ---- propose (SuffixDrafter.propose and _speculate)
        t0 = clock()
        limit = K
        py = 0
        with self._lock:
            req = self._active[req_id]
            cache, context = self._trees[req.scope], req.context[-self.max_tree_depth :]
            knobs = dict(min_token_prob=self.min_token_prob)
            py += clock() - t0
            d, t1 = wrapped_spec(
                cache,
                req_id,
                context,
                limit,
                self.max_spec_factor,
                self.max_spec_offset,
                knobs["min_token_prob"],
                6,
            )
            tokens, probs, match = list(d.token_ids), list(d.probs), int(d.match_len)
            t2 = clock()
            rec[9].append(t2 - t1)
            n = int(min(limit, LONG_MATCH * self.max_spec_factor + self.max_spec_offset))
            if n > 0 and tokens:
                far, t3 = wrapped_spec(
                    cache,
                    req_id,
                    context,
                    n,
                    float(n),
                    -float(n * (LONG_MATCH - 1)),
                    knobs["min_token_prob"],
                    10,
                )
                deep = list(far.token_ids)
                t4 = clock()
                rec[13].append(t4 - t3)
                if deep:
                    m, low = len(deep), far.probs[-1]
                    rest = tokens[m:] if tokens[:m] == deep else []
                    tokens = deep + rest
                    probs = list(far.probs) + [min(p, low) for p in probs[m : m + len(rest)]]
                    match = LONG_MATCH
                t2 = clock()
                py += t2 - t4
            else:
                for j in (10, 11, 12, 13):
                    rec[j].append(0)
            draft = Draft(tokens[:limit], probs[:limit], match)
            t3 = clock()
            py += t3 - t2
            copy, run = req.copy.propose(limit), req.copy.run
        nd = len(draft)
        if not (len(copy) <= nd or copy[:nd] != draft.tokens):
            p = draft.probs[-1] if nd else COPY_PROB
            probs = draft.probs + [p] * (len(copy) - nd)
            draft = Draft(copy, probs, max(match, run), "copy", nd, match)
        t4 = clock()
        rec[5].append(py)
        rec[14].append(t4 - t3)
        return draft.tokens

    return d_start, step, d_stop


class _Row:
    """A prototype's per-row state."""

    __slots__ = (
        "rid",
        "local",
        "seq",
        "output",
        "stream",
        "buf",
        "base",
        "ctx",
        "copy",
        "hold_l",
        "hold_g",
        "draft",
        "probs",
        "proposed",
        "fails",
        "skip",
        "interval",
    )


def proto_method(
    drafter: SuffixDrafter,
    use_numpy: bool = False,
    native: bool = False,
    second: Any = "always",
    reuse: int = 0,
    lag: int = 0,
    defer: int = 1,
    backoff: Optional[Tuple[int, int]] = None,
    ctx_len: Optional[int] = None,
    min_match: int = 1,
    refill: Optional[Tuple[int, float]] = None,
) -> Method:
    """The drafter's commit + propose with the proposed changes as options
    (all off: the drafter's drafts exactly).

    ``use_numpy``: contexts and committed tokens as views of an int32 buffer
    (arctic's zero-copy path); ``native``: arctic's C++ calls without its
    Python wrapper; ``second``: the LONG_MATCH speculate ``"always"`` (when
    the first drafts: the drafter), ``"never"``, or only when the first's
    match is at least this long and below LONG_MATCH (at LONG_MATCH or more
    the first call's draft is the second's); ``reuse``: when the committed
    token is the last draft's first, its rest is the draft if at least this
    many tokens are left (0: off); ``lag``: the last ``lag`` committed tokens
    are held back from both trees (1: the context never matches the
    request's own occurrence of itself); ``defer``: the global tree is
    extended every this many tokens (needs ``native``); ``backoff``:
    ``(after, most)``: after ``after`` failed drafts in a row (none, or a
    wrong first token), skip 1, 2, 4 ... up to ``most`` steps before the next
    walk; ``ctx_len``: context tokens walked (default the tree depth);
    ``min_match``: drafts only from matches this long (arctic's offset
    lowered so shorter matches draft nothing); ``refill``: ``(ctx, factor)``:
    where a kept rest ran short with every token right (a repeat), walk
    only ``ctx`` context tokens with ``max_spec_factor`` ``factor``."""
    if defer > 1 and not native:
        raise ValueError("defer needs native")
    cache = drafter._trees.open(None)
    g = cache._global_tree
    depth = drafter.max_tree_depth
    width = ctx_len or depth
    f, p = drafter.max_spec_factor, drafter.min_token_prob
    o = drafter.max_spec_offset - f * (min_match - 1)
    n_long = int(min(K, LONG_MATCH * f + drafter.max_spec_offset))
    long_args = (n_long, float(n_long), -float(n_long * (LONG_MATCH - 1)), p)
    ext = SuffixTree.extend_ndarray if use_numpy else SuffixTree.extend
    spec_n = SuffixTree.speculate_ndarray if use_numpy else SuffixTree.speculate
    ids = itertools.count(10**9)

    def start(prompt, output):
        r = _Row()
        r.rid = next(ids)
        split = max(0, len(prompt) - PROMPT_TAIL_TOKENS)
        cache.start_request(r.rid, prompt[:split])
        cache.add_active_response(r.rid, prompt[split:])
        r.local, r.seq = cache._local_trees[r.rid], cache._req_to_seq_id[r.rid]
        r.output = output
        r.stream = list(prompt) + list(output)
        r.buf = np.asarray(r.stream, dtype=np.int32)
        r.base = len(prompt)
        r.ctx = list(prompt[-depth:])
        r.copy = PromptCopy(prompt)
        r.hold_l = r.hold_g = 0
        r.draft, r.probs, r.proposed = [], [], False
        r.fails, r.skip, r.interval = 0, 0, 0
        return r

    def stop(r):
        cache.stop_request(r.rid)  # tokens still held back go with it
        cache.evict_cached_response(r.rid)

    def spec(r, ctx, limit, factor, offset, prob):
        if native:
            d1 = spec_n(r.local, ctx, limit, factor, offset, prob, False)
            d2 = spec_n(g, ctx, limit, factor, offset, prob, False)
            d = d1 if d1.score >= d2.score else d2
            return d.token_ids, d.probs, d.match_len
        d = cache.speculate(r.rid, ctx, limit, factor, offset, prob)
        return list(d.token_ids), list(d.probs), int(d.match_len)

    def step(r, i):
        t = r.output[i]
        n = r.base + i + 1  # tokens committed after this one
        src = r.buf if use_numpy else r.stream
        # ---- commit
        r.hold_l += 1
        r.hold_g += 1
        if native:
            if r.hold_l > lag:
                ext(r.local, 0, src[n - r.hold_l : n - lag])
                r.hold_l = lag
            if r.hold_g > lag + defer - 1:
                ext(g, r.seq, src[n - r.hold_g : n - lag])
                r.hold_g = lag
        elif r.hold_l > lag:
            cache.add_active_response(r.rid, src[n - r.hold_l : n - lag])
            r.hold_l = r.hold_g = lag
        if not use_numpy:
            r.ctx.append(t)
            if len(r.ctx) > 2 * depth:
                del r.ctx[:-depth]
        r.copy.feed((t,))
        # ---- propose
        draft = r.draft
        if backoff is not None:
            if r.proposed:
                if draft and draft[0] == t:
                    r.fails, r.interval = 0, 0
                else:
                    r.fails += 1
                    if r.fails >= backoff[0]:
                        r.interval = min(backoff[1], max(1, 2 * r.interval))
                        r.skip = r.interval
            if r.skip > 0:
                r.skip -= 1
                r.proposed, r.draft, r.probs = False, [], []
                return []
        r.proposed = True
        w, factor = width, f
        if reuse and draft and draft[0] == t:
            if len(draft) > reuse:
                r.draft, r.probs = draft[1:], r.probs[1:]  # estimates: / the first's, lazily
                return r.draft
            if refill is not None:
                w, factor = refill
        ctx = r.buf[n - w : n] if use_numpy else r.ctx[-w:]
        tokens, probs, match = spec(r, ctx, K, factor, o, p)
        if tokens and (second == "always" or (second != "never" and second <= match < LONG_MATCH)):
            deep, fprobs, _ = spec(r, ctx, *long_args)
            if deep:
                m, low = len(deep), fprobs[-1]
                rest = tokens[m:] if tokens[:m] == deep else []
                tokens = deep + rest
                probs = fprobs + [min(q, low) for q in probs[m : m + len(rest)]]
        tokens, probs = tokens[:K], probs[:K]
        copy = r.copy.propose(K)
        nd = len(tokens)
        if len(copy) > nd and copy[:nd] == tokens:
            q = probs[-1] if nd else COPY_PROB
            tokens, probs = copy, probs + [q] * (len(copy) - nd)
        r.draft, r.probs = tokens, probs
        return tokens

    return start, step, stop


# ------------------------------------------------------------------- harness
def accepted(draft: Sequence[int], output: Sequence[int], i: int) -> int:
    n = 0
    for a, b in zip(draft, output[i + 1 : i + 1 + len(draft)]):
        if a != b:
            break
        n += 1
    return n


def run_pass(
    method: Method,
    rows: List[Tuple[List[int], List[int]]],
    n_rows: int,
    steps: int,
    order: str = "rr",
    only: Optional[int] = None,
    between: Optional[Callable[[], Any]] = None,
    gc_mode: str = "on",
) -> Dict[str, Any]:
    """Step ``rows`` in groups of ``n_rows`` for ``steps`` steps each.

    ``order``: ``rr`` (round robin) or ``block:B`` (each row B steps in a
    row, then the next); ``only``: step only the first ``only`` rows of each
    group (the others started, idle); ``between``: called between steps,
    untimed; ``gc_mode``: ``on``, ``off`` (disabled) or ``freeze``. Returns
    ns per row-step (``ns``, ``(rows, steps)``, -1 where not stepped), the
    accepted tokens per step (``acc``), draft lengths, a hash of each draft,
    and the garbage collections seen (count, ms)."""
    start, step, stop = method
    clock = time.perf_counter_ns
    ns = np.full((len(rows), steps), -1, dtype=np.int64)
    acc = np.zeros((len(rows), steps), dtype=np.int32)
    lens = np.zeros((len(rows), steps), dtype=np.int32)
    hashes = np.zeros((len(rows), steps), dtype=np.int64)
    collections = [0, 0.0, 0]

    def on_gc(phase, info):
        if phase == "start":
            collections[2] = clock()
        else:
            collections[0] += 1
            collections[1] += (clock() - collections[2]) / 1e6

    gc.collect()
    if gc_mode == "off":
        gc.disable()
    elif gc_mode == "freeze":
        gc.freeze()
    gc.callbacks.append(on_gc)
    try:
        for g0 in range(0, len(rows), n_rows):
            group = list(range(g0, min(len(rows), g0 + n_rows)))
            states = [start(*rows[r]) for r in group]
            stepped = group if only is None else group[:only]
            if order == "rr":
                seq = [(j, i) for i in range(steps) for j in range(len(stepped))]
            else:
                b = int(order.split(":")[1])
                seq = [
                    (j, i)
                    for i0 in range(0, steps, b)
                    for j in range(len(stepped))
                    for i in range(i0, min(steps, i0 + b))
                ]
            for j, i in seq:
                st, r = states[j], group[j]
                if between is not None:
                    between()
                t0 = clock()
                d = step(st, i)
                t1 = clock()
                ns[r, i] = t1 - t0
                if d:
                    lens[r, i] = len(d)
                    acc[r, i] = accepted(d, rows[r][1], i)
                    hashes[r, i] = hash(tuple(d))
            for st in states:
                stop(st)
    finally:
        gc.callbacks.remove(on_gc)
        if gc_mode == "off":
            gc.enable()
        elif gc_mode == "freeze":
            gc.unfreeze()
    return {"ns": ns, "acc": acc, "lens": lens, "hash": hashes, "gc": collections[:2]}


def summary(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Pooled percentiles (us) over passes, the spread of per-pass medians,
    and draft quality (of the first pass: the drafts are the same each)."""
    pooled = np.concatenate([r["ns"][r["ns"] >= 0] for r in results]) / 1e3
    medians = [float(np.median(r["ns"][r["ns"] >= 0])) / 1e3 for r in results]
    p99s = [float(np.percentile(r["ns"][r["ns"] >= 0], 99)) / 1e3 for r in results]
    first = results[0]
    mask = first["ns"] >= 0
    return {
        "median": float(np.median(pooled)),
        "p90": float(np.percentile(pooled, 90)),
        "p99": float(np.percentile(pooled, 99)),
        "mean": float(pooled.mean()),
        "spread": (min(medians), max(medians)),
        "p99_best": min(p99s),
        "n": int(pooled.size),
        "drafted": float((first["lens"][mask] > 0).mean()),
        "hit": float((first["acc"][mask] > 0).mean()),
        "acc": float(first["acc"][mask].mean()),
        "acc16": float(np.minimum(first["acc"][mask], 16).mean()),
        "gc": [r["gc"] for r in results],
    }


def quality_vs(base: Dict[str, Any], other: Dict[str, Any]) -> Dict[str, float]:
    """What ``other``'s drafts lose against ``base``'s on the same steps:
    useful drafts (2+ tokens accepted) missed and accepted tokens lost (each
    step's counted up to 16: what one verification might take)."""
    mask = (base["ns"] >= 0) & (other["ns"] >= 0)
    a, b = base["acc"][mask], other["acc"][mask]
    useful = a >= 2
    a, b = np.minimum(a, 16), np.minimum(b, 16)
    return {
        "missed": float(((b < 2) & useful).sum() / max(1, useful.sum())),
        "lost": float(1 - b.sum() / max(1, a.sum())),
        "same": float((base["hash"][mask] == other["hash"][mask]).mean()),
    }


def fmt_row(label: str, s: Dict[str, Any], extra: str = "") -> str:
    lo, hi = s["spread"]
    return (
        f"| {label} | {s['median']:.1f} | {s['p90']:.1f} | {s['p99']:.1f} | {s['p99_best']:.1f} "
        f"| {s['mean']:.1f} "
        f"| {lo:.1f}-{hi:.1f} | {100 * s['drafted']:.0f}% | {100 * s['hit']:.0f}% "
        f"| {s['acc']:.2f} | {s['acc16']:.2f} |{extra}"
    )


HEADER = (
    "| method | median us | p90 | p99 | p99, best pass | mean | medians over passes | drafted "
    "| first right | acc/step | acc/step, at most 16 |"
)
RULE = "|---|---|---|---|---|---|---|---|---|---|---|"


def measure(
    methods: Dict[str, Callable[[], Method]],
    rows: List[Tuple[List[int], List[int]]],
    n_rows: int,
    steps: int,
    reps: int,
    **kw: Any,
) -> Dict[str, List[Dict[str, Any]]]:
    """Each method ``reps`` times, interleaved (A B C A B C)."""
    out: Dict[str, List[Dict[str, Any]]] = {name: [] for name in methods}
    for _ in range(reps):
        for name, make in methods.items():
            out[name].append(run_pass(make(), rows, n_rows, steps, **kw))
    return out


# --------------------------------------------------------------------- parts
def part_main(drafter, sets, args, report):
    print(f"\n### Per row-step: drafter against arctic's own calls ({args.label})\n")
    methods = {
        "drafter": lambda: drafter_method(drafter),
        "arctic (lists)": lambda: arctic_method(drafter, False),
        "arctic (numpy)": lambda: arctic_method(drafter, True),
    }
    for variant, rows in sets.items():
        for n_rows in args.rows:
            res = measure(methods, rows, n_rows, args.steps, args.reps)
            print(f"{args.label}, {variant}, {n_rows} rows\n\n{HEADER}\n{RULE}")
            for name, rs in res.items():
                s = summary(rs)
                report.append(
                    {
                        "part": "main",
                        "cached": args.label,
                        "variant": variant,
                        "rows": n_rows,
                        "method": name,
                        **_plain(s),
                    }
                )
                print(fmt_row(name, s))
            print()
            sys.stdout.flush()


def part_pieces(drafter, sets, args, report):
    print(f"\n### Where the drafter's time goes ({args.label}; one pass)\n")
    for variant, rows in sets.items():
        for n_rows in sorted({min(args.rows), max(args.rows)}):
            record: Dict[str, List[int]] = {}
            res = measure(
                {
                    "pieces": lambda record=record: pieces_method(drafter, record),
                    "drafter": lambda: drafter_method(drafter),
                },
                rows,
                n_rows,
                args.steps,
                1,
            )
            same = float((res["pieces"][0]["hash"] == res["drafter"][0]["hash"]).mean())
            total = summary(res["pieces"])
            plain = summary(res["drafter"])
            arr = {k: np.asarray(v) / 1e3 for k, v in record.items()}
            mean_total = sum(float(a.mean()) for a in arr.values())
            print(
                f"{args.label}, {variant}, {n_rows} rows: instrumented median {total['median']:.1f} us "
                f"(uninstrumented {plain['median']:.1f}); drafts identical to the drafter's: "
                f"{100 * same:.1f}% (ties between children of equal count may break "
                "differently once rows were evicted)\n"
            )
            print("| piece | mean us | share of mean | median us | p99 us |\n|---|---|---|---|---|")
            entry = {
                "part": "pieces",
                "cached": args.label,
                "variant": variant,
                "rows": n_rows,
                "identical": same,
                "instrumented_median": total["median"],
                "plain_median": plain["median"],
                "pieces": {},
            }
            for name in PIECES:
                a = arr[name]
                entry["pieces"][name] = {
                    "mean": float(a.mean()),
                    "median": float(np.median(a)),
                    "p99": float(np.percentile(a, 99)),
                }
                print(
                    f"| {name} | {a.mean():.2f} | {100 * a.mean() / mean_total:.0f}% "
                    f"| {np.median(a):.2f} | {np.percentile(a, 99):.1f} |"
                )
            print(f"| sum | {mean_total:.2f} | | | |\n")
            report.append(entry)
            sys.stdout.flush()


def part_why(drafter, sets, args, report):
    print(f"\n### Why the cost per row grows with rows in flight ({args.label})\n")
    flush = np.ones(6 << 20, dtype=np.uint64)  # 48 MB, beyond the 32 MB L3

    def thrash():
        flush.sum()

    big = max(args.rows)
    cases = [
        ("drafter, 1 row", dict(n_rows=1)),
        (f"drafter, {big} rows round robin", dict(n_rows=big)),
        (f"drafter, {big} rows started, 1 stepped", dict(n_rows=big, only=1)),
        (f"drafter, {big} rows in blocks of 16 steps", dict(n_rows=big, order="block:16")),
        ("drafter, 1 row, CPU caches flushed between steps", dict(n_rows=1, between=thrash)),
        (f"drafter, {big} rows, gc disabled", dict(n_rows=big, gc_mode="off")),
        (f"drafter, {big} rows, gc frozen after fill", dict(n_rows=big, gc_mode="freeze")),
    ]
    lagged = [
        ("drafter's flow, lag 1 (own occurrence not matched), 1 row", dict(n_rows=1)),
        (f"drafter's flow, lag 1, {big} rows", dict(n_rows=big)),
    ]
    natives = [
        ("native extend+speculate, 1 row", "both", dict(n_rows=1)),
        (f"native extend+speculate, {big} rows", "both", dict(n_rows=big)),
        ("native speculate only, 1 row", "speculate", dict(n_rows=1)),
        (f"native speculate only, {big} rows", "speculate", dict(n_rows=big)),
        ("native extend only, 1 row", "extend", dict(n_rows=1)),
        (f"native extend only, {big} rows", "extend", dict(n_rows=big)),
        ("native extend+speculate, 1 row, caches flushed", "both", dict(n_rows=1, between=thrash)),
        ("native extend+speculate, lag 1, 1 row", "lag", dict(n_rows=1)),
        (f"native extend+speculate, lag 1, {big} rows", "lag", dict(n_rows=big)),
    ]
    for variant, rows in sets.items():
        results: Dict[str, List[Dict[str, Any]]] = {}
        for _ in range(args.reps):
            for label, kw in cases:
                kw = dict(kw)
                n_rows = kw.pop("n_rows")
                use, steps = (
                    (rows, args.steps) if "between" not in kw else (rows[:8], min(args.steps, 32))
                )
                results.setdefault(label, []).append(
                    run_pass(drafter_method(drafter), use, n_rows, steps, **kw)
                )
            for label, kw in lagged:
                kw = dict(kw)
                n_rows = kw.pop("n_rows")
                results.setdefault(label, []).append(
                    run_pass(proto_method(drafter, lag=1), rows, n_rows, args.steps, **kw)
                )
            for label, part, kw in natives:
                kw = dict(kw)
                n_rows = kw.pop("n_rows")
                use, steps = (
                    (rows, args.steps) if "between" not in kw else (rows[:8], min(args.steps, 32))
                )
                method = (
                    native_method(drafter, "both", 1)
                    if part == "lag"
                    else native_method(drafter, part)
                )
                results.setdefault(label, []).append(run_pass(method, use, n_rows, steps, **kw))
        print(
            f"{args.label}, {variant}\n\n| case | median us | p90 | p99 | mean | medians over passes | gc collections (n, ms) per pass |\n|---|---|---|---|---|---|---|"
        )
        for label, rs in results.items():
            s = summary(rs)
            lo, hi = s["spread"]
            gcs = ", ".join(f"{n} / {ms:.1f}" for n, ms in s["gc"])
            print(
                f"| {label} | {s['median']:.1f} | {s['p90']:.1f} | {s['p99']:.1f} | {s['mean']:.1f} | {lo:.1f}-{hi:.1f} | {gcs} |"
            )
            report.append(
                {
                    "part": "why",
                    "cached": args.label,
                    "variant": variant,
                    "case": label,
                    **_plain(s),
                }
            )
        print()
        sys.stdout.flush()


def proto_table(drafter: SuffixDrafter) -> Dict[str, Callable[[], Method]]:
    """The prototypes, alone and combined (``A``..``I``)."""
    d = drafter
    a = dict(native=True, lag=1, second=16)
    b = dict(a, ctx_len=LONG_MATCH + 1)
    c = dict(b, reuse=16)
    e = dict(c, defer=16)
    g = dict(native=True, lag=1, second="never", ctx_len=32, reuse=16)
    return {
        "drafter": lambda: drafter_method(d),
        "proto, all off (= drafter)": lambda: proto_method(d),
        "numpy contexts": lambda: proto_method(d, use_numpy=True),
        "native calls (lists)": lambda: proto_method(d, native=True),
        "native calls (numpy)": lambda: proto_method(d, native=True, use_numpy=True),
        "second speculate never": lambda: proto_method(d, second="never"),
        "second only if 16 <= match < 48": lambda: proto_method(d, second=16),
        "lag 1 (last token held back)": lambda: proto_method(d, lag=1),
        "lag 1 + second never": lambda: proto_method(d, lag=1, second="never"),
        "keep the draft's rest (>= 16 left)": lambda: proto_method(d, reuse=16),
        "keep the draft's rest (>= 4 left)": lambda: proto_method(d, reuse=4),
        "defer global extend x16 (native, lag 0)": lambda: proto_method(d, native=True, defer=16),
        "back-off (after 4, up to 16)": lambda: proto_method(d, backoff=(4, 16)),
        "walk 49 context tokens": lambda: proto_method(d, ctx_len=LONG_MATCH + 1),
        "walk 32 context tokens": lambda: proto_method(d, ctx_len=32),
        "min match 3": lambda: proto_method(d, min_match=3),
        "A = native + lag 1 + second if 16..47": lambda: proto_method(d, **a),
        "B = A + walk 49": lambda: proto_method(d, **b),
        "C = B + rest >= 16": lambda: proto_method(d, **c),
        "D = C + defer global x16": lambda: proto_method(d, **e),
        "E = D + back-off (4, 16)": lambda: proto_method(d, backoff=(4, 16), **e),
        "F = D + back-off (2, 64)": lambda: proto_method(d, backoff=(2, 64), **e),
        "G = native + lag 1 + one speculate + walk 32 + rest >= 16": lambda: proto_method(d, **g),
        "H = G with walk 24": lambda: proto_method(d, **dict(g, ctx_len=24)),
        "I = H + defer global x16": lambda: proto_method(d, **dict(g, ctx_len=24, defer=16)),
        "J = G, a repeat's refill walks 16 tokens at factor 4": lambda: proto_method(
            d, refill=(16, 4.0), **g
        ),
    }


def part_protos(drafter, sets, args, report, label=None, only=None, rows_list=None):
    label = label or args.label
    print(f"\n### Prototypes ({label}): cost per row-step and drafts lost against the drafter\n")
    methods = proto_table(drafter)
    if only is not None:
        methods = {k: v for k, v in methods.items() if k in only}
    if args.methods:
        keep = ["drafter"] + args.methods.split(",")
        methods = {
            k: v for k, v in methods.items() if any(k == p or k.startswith(p + " ") for p in keep)
        }
    for variant, rows in sets.items():
        for n_rows in rows_list or [max(args.rows)]:
            res = measure(methods, rows, n_rows, args.steps, args.reps)
            base = res["drafter"][0]
            print(
                f"{label}, {variant}, {n_rows} rows\n\n{HEADER} useful drafts missed | accepted tokens lost | drafts identical |\n{RULE}---|---|---|"
            )
            for name, rs in res.items():
                s = summary(rs)
                q = quality_vs(base, rs[0])
                extra = (
                    f" {100 * q['missed']:.1f}% | {100 * q['lost']:.1f}% | {100 * q['same']:.0f}% |"
                )
                print(fmt_row(name, s, extra))
                report.append(
                    {
                        "part": "protos",
                        "cached": label,
                        "variant": variant,
                        "rows": n_rows,
                        "method": name,
                        **_plain(s),
                        **q,
                    }
                )
            print()
            sys.stdout.flush()


def part_estimates(drafter, sets, args, report):
    """How lag 1 changes the trees' estimates (untimed): the first draft
    token's estimate against how often it is right, and the expected tokens
    of the first 16 (the sum of the cumulative estimates) against those
    accepted, for the drafter and the drafter with lag 1."""
    print(f"\n### Estimates with and without the request's own occurrence ({args.label})\n")
    print(
        "| variant | flow | first-token estimate | first token right | expected of 16 "
        "| accepted of 16 |\n|---|---|---|---|---|---|"
    )
    for variant, rows in sets.items():
        use = rows[:8]
        for flow in ("drafter", "lag 1"):
            first_p, first_ok, expected, got = [], [], [], []
            if flow == "drafter":
                rids = [drafter.start(prompt) for prompt, _ in use]
            else:
                start, step, stop = proto_method(drafter, lag=1)
                states = [start(*row) for row in use]
            for i in range(args.steps):
                for j, (_, output) in enumerate(use):
                    if flow == "drafter":
                        drafter.commit(rids[j], [output[i]])
                        d = drafter.propose(rids[j], K)
                        tokens, probs = d.tokens, d.probs
                    else:
                        tokens = step(states[j], i)
                        probs = states[j].probs
                    if tokens:
                        first_p.append(probs[0])
                        first_ok.append(tokens[0] == output[i + 1])
                        expected.append(sum(probs[:16]))
                        got.append(min(16, accepted(tokens, output, i)))
            if flow == "drafter":
                for rid in rids:
                    discard(drafter, rid)
            else:
                for st in states:
                    stop(st)
            row = {
                "first_estimate": float(np.mean(first_p)),
                "first_right": float(np.mean(first_ok)),
                "expected16": float(np.mean(expected)),
                "accepted16": float(np.mean(got)),
            }
            print(
                f"| {variant} | {flow} | {row['first_estimate']:.2f} | {row['first_right']:.2f} "
                f"| {row['expected16']:.2f} | {row['accepted16']:.2f} |"
            )
            report.append(
                {"part": "estimates", "cached": args.label, "variant": variant, "flow": flow, **row}
            )
    print()


def part_overhead(report):
    print("\n### arctic call overheads (empty trees; us per call, median of 20000)\n")
    depth = 96
    tree = SuffixTree(depth)
    ctx_list = list(range(1000, 1000 + depth))
    ctx_np = np.asarray(ctx_list, dtype=np.int32)
    filled = SuffixTree(depth)
    SuffixTree.extend(filled, 0, list(range(200)))
    one_list, one_np = [5], np.asarray([5], dtype=np.int32)
    draft = SuffixTree.speculate(filled, [100, 101, 102, 103], 64, 100.0, 0.0, 0.0, False)
    cases = {
        "speculate, 96-token list (no match)": lambda: SuffixTree.speculate(
            tree, ctx_list, 64, 2.0, 0.0, 0.1, False
        ),
        "speculate_ndarray, 96 tokens (no match)": lambda: SuffixTree.speculate_ndarray(
            tree, ctx_np, 64, 2.0, 0.0, 0.1, False
        ),
        "extend, 1-token list (fresh seq each 96)": lambda: SuffixTree.extend(tree, 1, one_list),
        "extend_ndarray, 1 token": lambda: SuffixTree.extend_ndarray(tree, 2, one_np),
        "Draft.token_ids, 64 tokens": lambda: draft.token_ids,
        "Draft.probs, 64 tokens": lambda: draft.probs,
        "SuffixDecodingDraft.from_native, 64 tokens": lambda: SuffixDecodingDraft.from_native(
            draft
        ),
        "list(96 ints) slice of context": lambda: ctx_list[-96:],
        "np view ctx_np[1:96]": lambda: ctx_np[1:96],
        "PromptCopy.feed([t]) (not copying)": None,
    }
    pc = PromptCopy(list(range(1500)))
    toks = itertools.cycle([5000, 5001, 5002])
    cases["PromptCopy.feed([t]) (not copying)"] = lambda: pc.feed([next(toks)])
    print(
        f"{len(draft.token_ids)}-token draft for the conversions\n\n| call | median us |\n|---|---|"
    )
    clock = time.perf_counter_ns
    for name, fn in cases.items():
        samples = []
        for _ in range(20000):
            t0 = clock()
            fn()
            samples.append(clock() - t0)
        med = float(np.median(samples)) / 1e3
        print(f"| {name} | {med:.2f} |")
        report.append({"part": "overhead", "call": name, "median": med})
    t0, n = clock(), 0
    while n < 20000:
        clock()
        n += 1
    print(f"| (the timer itself) | {(clock() - t0) / n / 1e3:.2f} |\n")


def _plain(s: Dict[str, Any]) -> Dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in s.items()}


# ---------------------------------------------------------------------- main
def fill(drafter: SuffixDrafter, responses: List[List[int]], upto: int) -> float:
    """Add responses until the cache holds ``upto`` tokens; seconds taken."""
    t0 = time.perf_counter()
    have = drafter.cached_tokens // RESPONSE_TOKENS
    want = upto // RESPONSE_TOKENS
    drafter.add_responses((None, r) for r in responses[have:want])
    return time.perf_counter() - t0


def label_of(n: int) -> str:
    return "empty cache" if n == 0 else f"{n / 1e6:g}M cached tokens"


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="about 20 s: rows 1,8; cached 0,200k; 24 steps; one pass",
    )
    ap.add_argument(
        "--rows",
        default="1,8,32",
        help="row counts; the most of them is the number of rows stepped",
    )
    ap.add_argument("--cached", default="0,1000000,4000000", help="cached token counts, ascending")
    ap.add_argument("--steps", type=int, default=64, help="steps per row")
    ap.add_argument("--reps", type=int, default=2, help="passes per method (pooled)")
    ap.add_argument(
        "--parts",
        default="main,pieces,why,protos,overhead",
        help="main, pieces, why, protos, overhead, depth (not by default); why runs "
        "at the largest cache, protos at the largest and the empty one",
    )
    ap.add_argument(
        "--depth",
        type=int,
        default=64,
        help="the part 'depth': the drafter and prototypes B, D, H and I on a tree of this "
        "max_tree_depth at the largest cache (refilled: ~20-40 s more)",
    )
    ap.add_argument(
        "--methods",
        help="prototypes to run (names or their first word, e.g. C,D,H; the drafter always)",
    )
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.cached, args.steps, args.reps = "1,8", "0,200000", 24, 1
    args.rows = [int(x) for x in args.rows.split(",")]
    cached = [int(x) for x in args.cached.split(",")]
    parts = set(args.parts.split(","))
    report: List[Dict[str, Any]] = []

    t0 = time.perf_counter()
    cache_paths, test_paths = stdlib_files()
    responses = cache_responses(cache_paths, max(cached))
    held = held_out_streams(test_paths, max(args.rows), PROMPT_TOKENS + args.steps + K + 1)
    opened = open_rows(held, args.steps)
    repeated = repeat_rows(held, responses, args.steps) if max(cached) else []
    print(
        f"# drafter_cost: {len(responses)} responses of {RESPONSE_TOKENS} tokens, "
        f"{len(held)} rows of {PROMPT_TOKENS}-token prompts, {args.steps} steps per row, "
        f"k={K}, {args.reps} passes; data in {time.perf_counter() - t0:.1f} s"
    )
    drafter = SuffixDrafter()
    print(f"drafter config: {json.dumps(drafter.config())}")
    for n in cached:
        if not parts & {"main", "pieces", "why", "protos"}:
            break
        took = fill(drafter, responses, n)
        args.label = label_of(drafter.cached_tokens)
        print(f"\n## {args.label} ({drafter.cached_requests} responses; filled in {took:.1f} s)")
        sets = {"open": opened}
        if drafter.cached_tokens:
            sets["repeat"] = repeated
        if "main" in parts:
            part_main(drafter, sets, args, report)
        if "pieces" in parts:
            part_pieces(drafter, sets, args, report)
        extreme = n in (0, max(cached))
        if "why" in parts and n == max(cached):
            part_why(drafter, sets, args, report)
        if "protos" in parts and extreme:
            rows_list = sorted({1, max(args.rows)}) if n == 0 else None
            part_protos(drafter, sets, args, report, rows_list=rows_list)
            part_estimates(drafter, sets, args, report)
    if "overhead" in parts:
        part_overhead(report)
    if "depth" in parts and max(cached):
        keep = (
            "drafter",
            "B = A + walk 49",
            "D = C + defer global x16",
            "H = G with walk 24",
            "I = H + defer global x16",
        )
        both = {"open": opened, "repeat": repeated}
        fill(drafter, responses, max(cached))
        label = f"{label_of(drafter.cached_tokens)}, max_tree_depth {drafter.max_tree_depth}"
        print(f"\n## {label}")
        part_protos(drafter, both, args, report, label=label, only=keep)
        del drafter
        gc.collect()
        small = SuffixDrafter(max_tree_depth=args.depth)
        took = fill(small, responses, max(cached))
        label = f"{label_of(small.cached_tokens)}, max_tree_depth {args.depth}"
        print(f"\n## {label} (filled in {took:.1f} s)")
        part_protos(small, both, args, report, label=label, only=keep)
        print(
            "(drafts lost: against the drafter at the same depth; compare acc/step across depths)"
        )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
