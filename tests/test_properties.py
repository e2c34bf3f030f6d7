"""Property-based tests (hypothesis) of the batched verification loop and the
drafter lifecycle, driving the real :class:`SuffixBatchGenerator` (real
``BatchKVCache``, real rollback) with a deterministic fake model whose next
token depends on every token in its KV cache: a rollback that keeps or drops
the wrong positions changes the output.

(``test_verification.py`` covers the acceptance rule and ``rollback_batch``
alone; these tests run whole generations.)
"""

import itertools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import KVCache
from mlx_lm.sample_utils import make_sampler

from mlx_lm_suffix.batch import RequestOptions, SuffixBatchGenerator
from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.sources import Draft
from mlx_lm_suffix.stats import BatchDraftStats

V = 50


class CacheModel(nn.Module):
    """next = (a * sum(tokens in cache) + b * count + c) % V, per position;
    the tokens are the cache's keys, left padding excluded."""

    def __init__(self, a, b, c, vocab=V):
        super().__init__()
        self.abc, self.vocab = (a, b, c), vocab

    def make_cache(self):
        return [KVCache()]

    def __call__(self, inputs, cache=None, **kwargs):
        nxt = self.next_tokens(inputs, cache)
        return mx.where(mx.arange(V)[None, None, :] == nxt[..., None], 100.0, 0.0)

    def next_tokens(self, inputs, cache):
        """The next token at each position, ``(B, L)``."""
        B, L = inputs.shape
        x = inputs.astype(mx.float32).reshape(B, 1, L, 1)
        keys, _ = cache[0].update_and_fetch(x, x)
        T = keys.shape[2]
        k = keys.reshape(B, T)
        lp = getattr(cache[0], "left_padding", None)
        lp = mx.zeros((B,), mx.int32) if lp is None else lp
        t = mx.arange(T)
        end = T - L + mx.arange(L)
        mask = (t[None, None, :] >= lp[:, None, None]) & (t[None, None, :] <= end[None, :, None])
        s = (mask * k[:, None, :]).sum(-1)
        n = mask.sum(-1)
        a, b, c = self.abc
        return ((a * s + b * n + c) % self.vocab).astype(mx.int32)


def reference(abc, prompt, n, vocab=V):
    a, b, c = abc
    seq = list(prompt)
    out = []
    for _ in range(n):
        t = (a * sum(seq) + b * len(seq) + c) % vocab
        out.append(t)
        seq.append(t)
    return out


class PlannedDrafter(SuffixDrafter):
    """The real drafter's lifecycle; drafts: the true continuation for a
    chosen number of tokens, then wrong tokens (per row and step)."""

    def __init__(self, abc, plans, **kw):
        super().__init__(policy="fixed", **kw)
        self.abc, self.plans, self.seqs, self.ids = abc, plans, {}, []
        self.planned = 0  # drafts made from the plans

    def start(self, prompt, scope=None):
        req = super().start(prompt, scope)
        self.ids.append(req)
        self.seqs[req] = [list(prompt), self.plans[len(self.ids) - 1 :] or [(0, 0)]]
        return req

    def commit(self, req, tokens, grow=True):
        super().commit(req, tokens, grow)
        self.seqs[req][0].extend(int(t) for t in tokens)

    def propose(self, req, max_tokens=None):
        seq, plan = self.seqs[req]
        right, wrong = plan[len(seq) % len(plan)]
        true = reference(self.abc, seq, right + 1)
        tokens = true[:right] + [(true[right] + 1 + i) % V for i in range(wrong)]
        limit = self.num_draft_tokens if max_tokens is None else max_tokens
        tokens = tokens[:limit]
        self.planned += bool(tokens)
        return Draft(tokens, [0.9] * len(tokens))


abc_st = st.tuples(st.integers(1, 7), st.integers(0, 5), st.integers(0, V - 1))
prompt_st = st.lists(st.integers(0, V - 1), min_size=1, max_size=12)
plan_st = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=6)


def _generate(model, drafter, prompts, max_tokens, num_draft, stats=None):
    gen = SuffixBatchGenerator(model, drafter, num_draft_tokens=num_draft, stats=stats,
                               completion_batch_size=len(prompts), prefill_batch_size=8)
    uids = gen.insert(prompts, max_tokens=max_tokens)
    out = {u: [] for u in uids}
    for _ in range(10_000):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
        if all(len(out[u]) >= m for u, m in zip(uids, max_tokens)):
            break
    gen.close()
    return [out[u] for u in uids]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(abc=abc_st, prompts=st.lists(prompt_st, min_size=1, max_size=4),
       plans=st.lists(plan_st, min_size=4, max_size=4),
       lengths=st.lists(st.integers(1, 24), min_size=4, max_size=4),
       num_draft=st.integers(1, 8))
def test_batched_verification_equals_stepwise_greedy(abc, prompts, plans, lengths, num_draft):
    """Single rows and batches whose rows accept different counts (uneven
    rollbacks) commit exactly the step-by-step greedy sequence."""
    model = CacheModel(*abc)
    drafter = PlannedDrafter(abc, [p for plan in plans for p in plan])
    lengths = lengths[: len(prompts)]
    got = _generate(model, drafter, prompts, lengths, num_draft)
    assert got == [reference(abc, p, n) for p, n in zip(prompts, lengths)]
    assert drafter.active_requests == 0
    assert len(set(drafter.ids)) == len(drafter.ids)


def test_planned_drafts_reach_the_batch():
    """The planned drafts are what the batch verifies: rows accept different
    counts (uneven rollbacks) and the output is still the greedy sequence."""
    abc = (3, 2, 1)
    model = CacheModel(*abc)
    # Per row: (right, wrong) tokens drafted, by position.
    drafter = PlannedDrafter(abc, [(5, 0), (2, 2), (0, 3), (4, 1)])
    prompts, lengths, stats = [[1, 2], [3], [4, 5, 6], [7, 1]], [20, 17, 12, 9], BatchDraftStats()
    got = _generate(model, drafter, prompts, lengths, 6, stats)
    assert got == [reference(abc, p, n) for p, n in zip(prompts, lengths)]
    assert drafter.planned > 0 and stats.verify_steps > 0 and stats.uneven_rollbacks > 0
    assert 0 < drafter.stats.accepted < drafter.stats.drafted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(abc=abc_st, data=st.data())
def test_drafter_lifecycle_under_random_interleavings(abc, data):
    """Random inserts (with and without the drafter), steps and removals
    through the batch generator's extend / filter / remove paths, then
    close: no drafter request stays active and no id is reused. Rows that
    finish generate the greedy sequence."""
    model = CacheModel(*abc)
    drafter = PlannedDrafter(abc, data.draw(plan_st))
    gen = SuffixBatchGenerator(model, drafter, num_draft_tokens=4,
                               completion_batch_size=3, prefill_batch_size=2)
    live, prompts, out, finished = [], {}, {}, set()
    for _ in range(data.draw(st.integers(1, 25))):
        op = data.draw(st.sampled_from(["insert", "step", "step", "remove"]))
        if op == "insert":
            p = data.draw(prompt_st)
            m = data.draw(st.integers(1, 12))
            opts = data.draw(st.sampled_from([None, RequestOptions(use_drafter=False),
                                              RequestOptions(num_draft_tokens=0)]))
            (u,) = gen.insert([p], max_tokens=[m], options=[opts])
            live.append(u)
            prompts[u], out[u] = (p, m), []
        elif op == "step":
            _, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    finished.add(r.uid)
                    live.remove(r.uid)
        elif live:
            u = data.draw(st.sampled_from(live))
            gen.remove([u])
            live.remove(u)
        assert drafter.active_requests <= len(live)
    gen.close()
    assert drafter.active_requests == 0
    assert len(set(drafter.ids)) == len(drafter.ids)
    for u in finished:
        p, m = prompts[u]
        assert out[u] == reference(abc, p, m)


class SampledCacheModel(CacheModel):
    """Logits ``table[h]`` where ``h`` is :class:`CacheModel`'s next token: a
    known distribution that depends on every token in the KV cache."""

    def __init__(self, abc, table):
        super().__init__(*abc, vocab=table.shape[0])
        self.table = table

    def __call__(self, inputs, cache=None, **kwargs):
        return self.table[self.next_tokens(inputs, cache)]


class ModeDrafter(PlannedDrafter):
    """Drafts the model's most likely continuation (accepted often, not
    always: rows accept different counts)."""

    def __init__(self, abc, table, **kw):
        super().__init__(abc, [(0, 0)], **kw)
        self.mode = np.array(table).argmax(-1)
        self.vocab = table.shape[0]

    def propose(self, req, max_tokens=None):
        seq = list(self.seqs[req][0])
        limit = self.num_draft_tokens if max_tokens is None else max_tokens
        tokens = []
        for _ in range(limit):
            tokens.append(int(self.mode[reference(self.abc, seq + tokens, 1, self.vocab)[0]]))
        return Draft(tokens, [0.9] * len(tokens))


def test_batched_sampling_matches_the_model_distribution():
    """Sampling at temperature 1 through SuffixBatchGenerator, rows of a
    batch verifying drafts and rolling back different counts: the joint
    distributions of the first three and of the next three tokens (those
    after a rollback) are the model's (chi-square over 27 cells, 26 dof)."""
    abc, prompt, vocab, rows, rounds = (2, 1, 1), [1, 2], 3, 128, 12
    table = mx.array(np.random.default_rng(0).normal(size=(vocab, vocab)).astype(np.float32))
    probs = np.array(mx.softmax(table, axis=-1))
    joint = np.zeros((vocab,) * 6)  # of the first six tokens
    for path in itertools.product(range(vocab), repeat=6):
        joint[path] = np.prod([probs[reference(abc, prompt + list(path[:j]), 1, vocab)[0], x]
                               for j, x in enumerate(path)])
    model = SampledCacheModel(abc, table)
    drafter = ModeDrafter(abc, table)
    stats = BatchDraftStats()
    mx.random.seed(0)
    counts = np.zeros_like(joint)
    for _ in range(rounds):
        gen = SuffixBatchGenerator(model, drafter, num_draft_tokens=3, stats=stats,
                                   sampler=make_sampler(temp=1.0),
                                   completion_batch_size=rows, prefill_batch_size=rows)
        uids = gen.insert([prompt] * rows, max_tokens=[6] * rows)
        out = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid].append(r.token)
        gen.close()
        for u in uids:
            counts[tuple(out[u])] += 1
    n = rows * rounds
    for axes in ((3, 4, 5), (0, 1, 2)):  # summed out: the last three, the first three
        p, c = joint.sum(axes), counts.sum(axes)
        assert n * p.min() > 5  # the chi-square approximation holds
        chi2 = ((c - n * p) ** 2 / (n * p)).sum()
        assert chi2 < 54.05, (axes, chi2, c, n * p)  # 26 dof, p = 0.001
    # Drafts were verified while sampling, rows accepting different counts.
    assert stats.verify_steps > 0 and stats.uneven_rollbacks > 0
    assert 0 < drafter.stats.accepted < drafter.stats.drafted
