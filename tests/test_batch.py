"""Batched suffix decoding (``SuffixBatchGenerator``) without HTTP, token for
token against stock mlx-lm's ``batch_generate`` / ``BatchGenerator`` and
single-sequence greedy generation, on the tiny float32 model."""

import inspect
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors
from test_families import _assert_cache_is_fresh_prefill
from test_loop import WrongFirstToken, _Wrapper

from mlx_lm_suffix import internals
from mlx_lm_suffix.batch import RequestOptions, SuffixBatchGenerator
from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.speculation import Row
from mlx_lm_suffix.stats import BatchDraftStats, RequestUsage

MAX_TOKENS = 32

# Fixed-length drafting unless a test says otherwise: the adaptive policy's
# draft lengths depend on measured timings, outputs never do.


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_path):
    model, tokenizer = load(str(tiny_model_path))
    model.set_dtype(mx.float32)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(model_and_tokenizer):
    """Six prompts: repetitive ones (rows accept many tokens) and plain ones
    (few), of different lengths (different left padding in the batch)."""
    _, tokenizer = model_and_tokenizer
    text = Path(inspect.getsourcefile(inspect)).read_text()
    chunks = [text[4000 + 700 * i : 4000 + 700 * i + 40 + 60 * i] for i in range(6)]
    out = []
    for i, chunk in enumerate(chunks):
        if i % 2:
            chunk = f"Repeat:\n{chunk}\nAgain:\n{chunk}\nAgain:\n{chunk[:30]}"
        out.append(tokenizer.encode(chunk))
    return out


def _eos(tokenizer):
    return [[t] for t in tokenizer.eos_token_ids]


def _run(gen, prompts, max_tokens, after_step=None, **insert_kwargs):
    """All tokens each sequence emits (its stop token included) and its
    finishing response; checks that each uid finishes once, last.
    ``after_step()`` is called after every step."""
    uids = gen.insert(prompts, max_tokens, **insert_kwargs)
    tokens = {u: [] for u in uids}
    finished = {}
    while responses := gen.next_generated():
        if after_step is not None:
            after_step()
        for r in responses:
            assert r.uid not in finished, "response after the finishing one"
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r
    assert set(finished) == set(uids)
    return [tokens[u] for u in uids], [finished[u] for u in uids]


def _stock_run(model, tokenizer, prompts, max_tokens, stop_tokens=None, **insert_kwargs):
    gen = BatchGenerator(model, stop_tokens=stop_tokens or _eos(tokenizer))
    try:
        return _run(gen, prompts, max_tokens, **insert_kwargs)
    finally:
        gen.close()


def _suffix_gen(model, tokenizer, drafter, stop_tokens=None, **kwargs):
    return SuffixBatchGenerator(
        model, drafter, stop_tokens=stop_tokens or _eos(tokenizer), **kwargs
    )


def _strip_stop(tokens, finished):
    return [t[:-1] if f.finish_reason == "stop" else t for t, f in zip(tokens, finished)]


def test_equals_stock_batch_generate_and_warms_up(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    ref = batch_generate(
        model, tokenizer, prompts, max_tokens=MAX_TOKENS, return_token_ids=True
    ).token_ids
    drafter = SuffixDrafter(policy="fixed")
    for round_ in range(3):
        gen = _suffix_gen(model, tokenizer, drafter)
        before = drafter.snapshot()
        tokens, finished = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
        gen.close()
        assert _strip_stop(tokens, finished) == ref, f"round {round_}"
        stats = gen.draft_stats
        assert stats.verify_steps > 0
        assert stats.max_verify_batch_size == len(prompts)
        if round_ > 0:
            # Every response is in the cache now: nearly all drafts accepted.
            snap = drafter.snapshot()
            drafted = snap["drafted"] - before["drafted"]
            accepted = snap["accepted"] - before["accepted"]
            assert accepted / drafted > 0.9
    assert drafter.active_requests == 0
    assert drafter.cached_requests == 3 * len(prompts)


def test_a_forward_runs_while_the_caller_handles_a_verification(model_and_tokenizer, prompts):
    """A call that verifies returns with the next step's plain forward
    queued (as stock's step returns with its next forward queued), so the
    model computes while the caller handles the verification's tokens; the
    next call drafts after the tokens that forward was fed. Outputs stay
    stock's."""
    model, tokenizer = model_and_tokenizer
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    drafter = SuffixDrafter(policy="fixed")
    calls, forwards = [], []

    class Spy(_Wrapper):
        def __call__(self, inputs, cache=None, **kw):
            forwards.append(sys._getframe(1).f_code.co_name)  # verify, _step, or a prefill
            return self.inner(inputs, cache=cache, **kw)

    gen = _suffix_gen(Spy(model), tokenizer, drafter)
    gen.model.inner.set_dtype(mx.float32)

    def after_step():
        calls.append((forwards[:], len(gen.generation_batch)))
        forwards.clear()

    tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts), after_step=after_step)
    gen.close()
    assert tokens == ref
    verifying = [(f, rows) for f, rows in calls if "verify" in f and rows > 1]
    assert len(verifying) > 3
    for f, _ in verifying:
        assert f[-1] == "_step", f  # the plain forward after the verification


def test_a_row_left_alone_drafts_while_its_forward_runs(model_and_tokenizer, prompts, monkeypatch):
    """Two rows whose drafts' first tokens are all wrong, one finishing
    early: every plain forward runs while the rows propose (its token is
    read after a proposal made since it was queued, never first, as a
    settled step reads a token it knows), also where the other row left as
    it was queued. Outputs stay stock's."""
    model, tokenizer = model_and_tokenizer
    pair = [prompts[1], prompts[3]]
    drafter = WrongFirstToken(policy="fixed")
    _run(_suffix_gen(model, tokenizer, drafter), pair, [MAX_TOKENS] * 2)  # the repeats draft
    events = []

    class Spy(_Wrapper):
        def __call__(self, inputs, cache=None, **kw):
            events.append(sys._getframe(1).f_code.co_name)  # _step: a plain forward
            return self.inner(inputs, cache=cache, **kw)

    ask, read = Row.ask, internals.pending_tokens

    def spy_ask(self, *args, **kwargs):
        events.append("propose")
        return ask(self, *args, **kwargs)

    def spy_read(batch):
        events.append("read")
        return read(batch)

    monkeypatch.setattr(Row, "ask", spy_ask)
    monkeypatch.setattr(internals, "pending_tokens", spy_read)
    for short in range(3, 12):
        ref, _ = _stock_run(model, tokenizer, pair, [short, MAX_TOKENS])
        gen = _suffix_gen(Spy(model), tokenizer, drafter)
        events.clear()
        tokens, _ = _run(gen, pair, [short, MAX_TOKENS])
        gen.close()
        assert tokens == ref
        assert events.count("read") > 5
        unread = None  # events since the last plain forward, until its token is read
        for e in events:
            if e == "read" and unread is not None:
                assert "propose" in unread, (short, events)
                unread = None
            elif e == "_step":
                unread = []
            elif unread is not None:
                unread.append(e)


def test_rows_that_finish_leave_after_the_next_forward_is_queued(model_and_tokenizer, prompts,
                                                                  monkeypatch):
    """A row that finishes in a call is handed to the drafter (its response
    to the global tree, its request stopped) once that call's last forward
    is queued, not while the device waits for it; the drafter has every
    response at the end, and the outputs are stock's."""
    model, tokenizer = model_and_tokenizer
    lengths = [8, 14, 20, MAX_TOKENS, 11, 26]
    ref, _ = _stock_run(model, tokenizer, prompts, lengths)
    drafter = SuffixDrafter(policy="fixed", num_draft_tokens=4)
    _run(_suffix_gen(model, tokenizer, drafter), prompts, lengths)  # answers cached
    events, calls = [], []

    class Spy(_Wrapper):
        def __call__(self, inputs, cache=None, **kw):
            events.append("forward")
            return self.inner(inputs, cache=cache, **kw)

    finish = Row.finish

    def spy_finish(self):
        if self.req is not None:
            events.append("finish")
        finish(self)

    monkeypatch.setattr(Row, "finish", spy_finish)
    gen = _suffix_gen(Spy(model), tokenizer, drafter)

    def after_step():
        calls.append((events[:], len(gen.generation_batch)))
        events.clear()

    cached = drafter.cached_requests
    tokens, _ = _run(gen, prompts, lengths, after_step=after_step)
    gen.close()
    assert tokens == ref
    leaving = [e for e, rows in calls if "finish" in e and rows]
    assert leaving
    for e in leaving:
        assert "forward" not in e[e.index("finish"):], e
    assert drafter.active_requests == 0 and drafter.cached_requests == cached + len(prompts)


def test_verified_tokens_carry_their_positions_logprobs(model_and_tokenizer, prompts):
    """Every token a verification emits comes with the logprobs of the
    position that sampled it: stock's, within a forward's rounding."""
    model, tokenizer = model_and_tokenizer

    def run(gen):
        uids = gen.insert(prompts, [MAX_TOKENS] * len(prompts))
        out = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                out[r.uid].append((r.token, r.logprobs))
        gen.close()
        return [out[u] for u in uids]

    ref = run(BatchGenerator(model, stop_tokens=_eos(tokenizer)))
    drafter = SuffixDrafter(policy="fixed")
    got = run(_suffix_gen(model, tokenizer, drafter))
    assert drafter.stats.accepted > 20
    for r, g in zip(ref, got):
        assert [t for t, _ in g] == [t for t, _ in r]
        for (_, a), (_, b) in zip(r, g):
            assert a.shape == b.shape
            assert np.allclose(np.array(a), np.array(b), atol=1e-4)


def test_rows_accepting_different_counts(model_and_tokenizer, prompts):
    """A warm row (its response cached) next to cold ones: rows accept very
    different numbers of tokens in the same step and stay exact."""
    model, tokenizer = model_and_tokenizer
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    drafter = SuffixDrafter(policy="fixed")
    gen = _suffix_gen(model, tokenizer, drafter)
    _run(gen, prompts[:1], [MAX_TOKENS])  # warm row 0 only
    usages = [RequestUsage() for _ in prompts]
    tokens, _ = _run(
        gen,
        prompts,
        [MAX_TOKENS] * len(prompts),
        options=[RequestOptions(usage=u) for u in usages],
    )
    gen.close()
    assert tokens == ref
    assert gen.draft_stats.uneven_rollbacks > 0
    accepted = [u.accepted for u in usages]
    assert accepted[0] >= MAX_TOKENS - 2  # drafted from its cached response
    assert min(accepted) < accepted[0]
    assert all(u.drafted >= u.accepted for u in usages)


def test_equals_single_sequence_greedy(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    eos = set(tokenizer.eos_token_ids)
    refs = []
    for p in prompts:
        out = []
        for t, _ in generate_step(mx.array(p), model, max_tokens=MAX_TOKENS):
            out.append(t)
            if t in eos:
                break
        refs.append(out)
    drafter = SuffixDrafter(policy="fixed")
    for _ in range(2):
        gen = _suffix_gen(model, tokenizer, drafter)
        tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
        gen.close()
        assert tokens == refs


def test_caches_hold_prompt_plus_committed_and_continue(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    drafter = SuffixDrafter(policy="fixed")
    gen = _suffix_gen(model, tokenizer, drafter)
    _run(gen, prompts, [MAX_TOKENS] * len(prompts))  # warm: long accepted drafts
    tokens, finished = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
    assert gen.draft_stats.verify_steps > 0
    follow = tokenizer.encode(" and then")
    caches, histories = [], []
    for p, t, f in zip(prompts, tokens, finished):
        assert f.all_tokens == p + t
        assert all(c.offset == len(p) + len(t) for c in f.prompt_cache)
        caches.append(f.prompt_cache)
        histories.append(f.all_tokens)
    # Continue from the returned caches (suffix and stock) == from scratch.
    cont = [h + follow for h in histories]
    ref, _ = _stock_run(model, tokenizer, cont, [16] * len(cont))
    got, _ = _run(gen, [follow] * len(cont), [16] * len(cont), caches=caches, all_tokens=histories)
    gen.close()
    assert got == ref
    for c, r in zip(finished, ref):
        out = [
            t
            for t, _ in generate_step(
                mx.array(follow), model, prompt_cache=c.prompt_cache, max_tokens=len(r)
            )
        ]
        assert out[: len(r)] == r


def test_stop_sequence_inside_accepted_draft(model_and_tokenizer, prompts):
    """A stop sequence met in the middle of an accepted draft: the row emits
    nothing after it and its cache / all_tokens end at it, as stock's do."""
    model, tokenizer = model_and_tokenizer
    plain, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    # Two tokens from the middle of row 1's output, as a stop sequence.
    row = plain[1]
    stop = row[10:12]
    stops = _eos(tokenizer) + [stop]
    ref, ref_fin = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts), stops)
    assert ref_fin[1].finish_reason == "stop" and len(ref[1]) <= 12
    drafter = SuffixDrafter(policy="fixed")
    gen = _suffix_gen(model, tokenizer, drafter)
    _run(gen, prompts, [MAX_TOKENS] * len(prompts))  # cache the full outputs
    gen.close()
    gen = _suffix_gen(model, tokenizer, drafter, stop_tokens=stops)
    tokens, finished = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
    gen.close()
    # Row 1 accepted draft tokens past its stop sequence, which were dropped.
    assert gen.draft_stats.finish_trims > 0
    assert tokens == ref
    for p, t, f, rf in zip(prompts, tokens, finished, ref_fin):
        assert f.finish_reason == rf.finish_reason
        assert f.all_tokens == p + t == rf.all_tokens
        assert all(c.offset == len(p) + len(t) for c in f.prompt_cache)
    # The drafter got exactly the emitted tokens.
    assert drafter.active_requests == 0


def test_per_row_max_tokens_and_draft_options(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    max_tokens = [5, 7, 32, 1, 17, 25]
    ref, ref_fin = _stock_run(model, tokenizer, prompts, max_tokens)
    drafter = SuffixDrafter(policy="fixed")
    gen = _suffix_gen(model, tokenizer, drafter)
    _run(gen, prompts, [MAX_TOKENS] * len(prompts))
    usages = [RequestUsage() for _ in prompts]
    options = [
        RequestOptions(usage=usages[0]),
        RequestOptions(num_draft_tokens=0, usage=usages[1]),  # drafting off
        RequestOptions(num_draft_tokens=2, usage=usages[2]),
        RequestOptions(usage=usages[3]),
        RequestOptions(use_drafter=False, usage=usages[4]),  # no drafter at all
        None,
    ]
    n_cached = drafter.cached_requests
    tokens, finished = _run(gen, prompts, max_tokens, options=options)
    gen.close()
    assert tokens == ref
    assert [len(t) for t in tokens] == [len(r) for r in ref]
    assert [f.finish_reason for f in finished] == [f.finish_reason for f in ref_fin]
    assert usages[1].drafted == 0 and usages[4].drafted == 0 and usages[4].steps == 0
    assert usages[2].drafted <= 2 * usages[2].steps and usages[2].accepted > 0
    assert usages[0].accepted > 0
    assert usages[3].drafted == 0  # max_tokens 1: no room to draft
    # Every row but the one without a drafter cached its response.
    assert drafter.cached_requests == n_cached + len(prompts) - 1


def test_no_drafts_takes_the_stock_path(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    drafter = SuffixDrafter(policy="fixed")
    gen = _suffix_gen(model, tokenizer, drafter, num_draft_tokens=0)
    tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
    gen.close()
    assert tokens == ref
    assert gen.draft_stats.verify_steps == 0 and gen.draft_stats.plain_steps > 0
    assert drafter.stats.drafted == 0 and drafter.cached_requests == len(prompts)


def test_first_token_miss_costs_no_verification(model_and_tokenizer, prompts):
    """The queued plain forward checks each draft's first token: drafts it
    rejects are dropped without a verification forward."""
    model, tokenizer = model_and_tokenizer
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    drafter = WrongFirstToken(policy="fixed")
    for _ in range(2):  # the second round has every response cached
        gen = _suffix_gen(model, tokenizer, drafter)
        tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
        gen.close()
        assert tokens == ref
        assert gen.draft_stats.verify_steps == 0
    assert drafter.stats.drafted > len(prompts) and drafter.stats.accepted == 0
    # One forward per token and row, as stock.
    assert drafter.stats.steps == drafter.stats.tokens


def test_logits_processors_per_position(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    procs = [
        make_logits_processors(repetition_penalty=1.3, repetition_context_size=12)
        if i % 2 == 0
        else []
        for i in range(len(prompts))
    ]
    ref, _ = _stock_run(
        model, tokenizer, prompts, [MAX_TOKENS] * len(prompts), logits_processors=procs
    )
    drafter = SuffixDrafter(policy="fixed")
    for _ in range(2):
        gen = _suffix_gen(model, tokenizer, drafter)
        tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts), logits_processors=procs)
        gen.close()
        assert tokens == ref
    assert drafter.stats.accepted > 0


def test_rows_join_and_leave_mid_generation(model_and_tokenizer, prompts):
    model, tokenizer = model_and_tokenizer
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    drafter = SuffixDrafter(policy="fixed")
    warm = _suffix_gen(model, tokenizer, drafter)
    _run(warm, prompts[::2], [MAX_TOKENS] * 3)
    warm.close()
    gen = _suffix_gen(model, tokenizer, drafter)
    first = gen.insert(prompts[:3], [MAX_TOKENS] * 3)
    out = {}
    steps = 0
    later = None
    removed = None
    while True:
        responses = gen.next_generated()
        steps += 1
        if steps == 3:
            later = gen.insert(prompts[3:], [MAX_TOKENS] * 3)
        if steps == 4:
            removed = first[1]
            gen.remove([removed])
        if not responses and later is not None:
            break
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
    gen.close()
    for uid, r in zip(first + later, ref):
        if uid == removed:
            assert out[uid] == r[: len(out[uid])]
        else:
            assert out[uid] == r
    assert drafter.active_requests == 0


def test_rows_change_while_one_rows_verification_runs(model_and_tokenizer, prompts):
    """One row's call returns with its next verification queued (its
    tokens are handed out while that forward runs); a cache extracted, a
    prompt inserted or the row removed before the next call undoes that
    verification first: the extracted cache holds exactly the row's
    tokens, every output is stock's, and a removed row leaves nothing."""
    model, tokenizer = model_and_tokenizer
    trio = prompts[1::2]  # repetitive: the row drafts from its prompt
    ref, _ = _stock_run(model, tokenizer, trio, [MAX_TOKENS] * 3)
    drafter = SuffixDrafter(policy="fixed", num_draft_tokens=4)
    _run(_suffix_gen(model, tokenizer, drafter), trio, [MAX_TOKENS] * 3)  # answers cached

    def until_held(gen, out):
        batch = gen.generation_batch
        while responses := gen.next_generated():
            for r in responses:
                out.setdefault(r.uid, []).append(r.token)
            if batch.held is not None:
                return True
        return False

    gen = _suffix_gen(model, tokenizer, drafter)
    batch = gen.generation_batch
    [first] = gen.insert(trio[:1], [MAX_TOKENS])
    out = {}
    assert until_held(gen, out)
    cache, tokens = gen.extract_cache([first])[first]
    assert cache[0].offset == len(tokens) == len(batch.tokens[0])
    assert batch.held is None
    assert until_held(gen, out)
    later = gen.insert(trio[1:], [MAX_TOKENS] * 2)
    until_held(gen, out)
    gen.close()
    assert [out[u] for u in [first] + later] == ref

    gen = _suffix_gen(model, tokenizer, drafter)
    [only] = gen.insert(trio[:1], [MAX_TOKENS])
    out = {}
    assert until_held(gen, out)
    gen.remove([only])
    assert len(gen.generation_batch) == 0 and gen.next_generated() == []
    gen.close()
    assert out[only] == ref[0][: len(out[only])]
    assert drafter.active_requests == 0


def test_arriving_prompt_waits_for_no_verification(model_and_tokenizer, prompts):
    """A request that arrives while the batch verifies drafts gets its
    first token without waiting for another verification: while its prompt
    segments are prefilled, and in the step that emits its first token, the
    batch takes plain steps; it verifies again afterwards. Its wait behind
    the verification that was running when it arrived is in the stats."""
    model, tokenizer = model_and_tokenizer
    repeats, late = prompts[1::2], prompts[0]
    max_tokens = 3 * MAX_TOKENS
    ref, _ = _stock_run(model, tokenizer, repeats + [late], [max_tokens] * 4)
    drafter = SuffixDrafter(policy="fixed")
    warm = _suffix_gen(model, tokenizer, drafter)
    _run(warm, repeats, [max_tokens] * 3)  # the repeats' answers are cached
    warm.close()
    gen = _suffix_gen(model, tokenizer, drafter)
    stats = gen.draft_stats
    uids = gen.insert(repeats, [max_tokens] * 3)
    out = {u: [] for u in uids}

    def step():
        for r in gen.next()[1]:
            out[r.uid].append(r.token)

    while stats.verify_steps == 0:
        step()
    start, end = gen.generation_batch._verify_spans[-1]
    arrived = (start + end) / 2  # during that verification
    third = len(late) // 3
    segments = [late[:third], late[third : 2 * third], late[2 * third :]]
    (uid,) = gen.insert_segments([segments], [max_tokens], options=[RequestOptions(arrived=arrived)])
    out[uid] = []
    verified, yielded = stats.verify_steps, stats.yield_steps
    while not out[uid]:
        step()
    assert stats.verify_steps == verified  # none before its first token
    assert stats.yield_steps - yielded >= len(segments)
    while gen.generation_batch.uids:
        step()
    gen.close()
    assert stats.verify_steps > verified  # drafting went on after it
    assert [out[u] for u in uids + [uid]] == [t[:max_tokens] for t in ref]
    assert stats.waited_requests == 1
    assert stats.verify_wait_s == pytest.approx(end - arrived)
    assert sum(stats.widths.values()) == stats.verify_steps


def test_requests_waiting_to_be_inserted_get_plain_steps(model_and_tokenizer, prompts):
    """While ``requests_waiting`` says requests wait to be inserted (a
    server's queue), the batch verifies nothing, with the fixed policy and
    with the adaptive one; it verifies again once they are in; outputs
    equal stock's."""
    model, tokenizer = model_and_tokenizer
    repeats = prompts[1::2]
    max_tokens = 3 * MAX_TOKENS
    ref, _ = _stock_run(model, tokenizer, repeats, [max_tokens] * 3)
    for policy in ("fixed", "adaptive"):
        cost = VerifyCost({1: 1.0, 256: 1.05}, smoothing=0)  # nearly free
        drafter = SuffixDrafter(policy=policy, cost=cost if policy == "adaptive" else None)
        warm = _suffix_gen(model, tokenizer, drafter)
        _run(warm, repeats, [max_tokens] * 3)  # the repeats' answers are cached
        warm.close()
        waiting = [False]
        gen = _suffix_gen(model, tokenizer, drafter, requests_waiting=lambda w=waiting: w[0])
        stats = gen.draft_stats
        uids = gen.insert(repeats, [max_tokens] * 3)
        out = {u: [] for u in uids}
        steps_waiting = 0
        while gen.generation_batch.uids or not any(out.values()):
            if stats.verify_steps == 1 and not steps_waiting:
                waiting[0] = True
            verified = stats.verify_steps
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
            if waiting[0]:
                assert stats.verify_steps == verified, policy
                steps_waiting += 1
                waiting[0] = steps_waiting < 8
        gen.close()
        assert steps_waiting == 8, policy
        assert stats.verify_steps > 1, policy  # drafting went on after
        assert [out[u] for u in uids] == [t[:max_tokens] for t in ref], policy


def test_prefill_ahead_is_the_chunk_stock_prefills(model_and_tokenizer, prompts):
    """Before every step, the prompt tokens the batch expects the generator
    to prefill after it are the tokens stock's ``_next`` then prefills:
    chunks of several prompts, segments, admissions limited by the prefill
    batch, prompts down to their last token (none)."""
    model, tokenizer = model_and_tokenizer
    gen = _suffix_gen(
        model, tokenizer, SuffixDrafter(policy="fixed"), prefill_step_size=16, prefill_batch_size=2
    )
    counters = gen._counters
    late = prompts[5]
    segments = [late[:7], late[7:40], late[40:]]
    gen.insert(prompts[:3], [MAX_TOKENS] * 3)
    checked, steps = [], 0
    while steps == 0 or gen.generation_batch.uids or gen._unprocessed_sequences:
        if steps == 5:
            gen.insert_segments([segments], [MAX_TOKENS])
            gen.insert(prompts[3:5], [MAX_TOKENS] * 2)
        expected, before = internals.prefill_tokens(gen) or 0, counters.prompt_tokens
        gen.next()
        assert counters.prompt_tokens - before == expected, steps
        checked.append(expected)
        steps += 1
    gen.close()
    assert sum(checked) == counters.prompt_tokens > 0
    assert len([n for n in checked if n]) > 6  # chunks of 16 over several steps


def test_verification_while_prompts_wait_within_their_share(model_and_tokenizer, prompts, monkeypatch):
    """While prompts wait to be prefilled, the adaptive policy verifies
    only what fits in PREFILL_SHARE of their expected prefill time beyond a
    plain step: with no share nothing is verified then (drafting goes on
    after), with verification almost free it is; outputs equal stock's."""
    import mlx_lm_suffix.batch as batch_module

    model, tokenizer = model_and_tokenizer
    repeats, late = prompts[1::2], prompts[0] * 4
    max_tokens = 3 * MAX_TOKENS
    ref, _ = _stock_run(model, tokenizer, repeats + [late], [max_tokens] * 4)
    counts = {}
    for share in (0.0, 1e6):
        monkeypatch.setattr(batch_module, "PREFILL_SHARE", share)
        cost = VerifyCost({1: 1.0, 256: 1.05}, smoothing=0)  # nearly free
        drafter = SuffixDrafter(policy="adaptive", cost=cost)
        warm = _suffix_gen(model, tokenizer, drafter)
        _run(warm, repeats, [max_tokens] * 3)  # the repeats' answers are cached
        warm.close()
        gen = _suffix_gen(model, tokenizer, drafter, prefill_step_size=8)
        stats = gen.draft_stats
        uids = gen.insert(repeats, [max_tokens] * 3)
        out = {u: [] for u in uids}
        while True:
            prompt_responses, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.token)
            if len(uids) == 3 and stats.verify_steps:
                uids += gen.insert([late], [max_tokens])  # while rows verify
                out[uids[-1]] = []
            elif not prompt_responses and not responses:
                break
        gen.close()
        assert [out[u] for u in uids] == [t[:max_tokens] for t in ref]
        counts[share] = (stats.prefill_verify_steps, stats.yield_steps, stats.verify_steps)
    (none, yielded, verified), (some, _, _) = counts[0.0], counts[1e6]
    assert none == 0 and yielded >= len(late) // 8 and verified > 1
    assert some > 0


def _rows_are_fresh_prefills(model, gen, fresh=None):
    """A check, to call after every step, that a row of ``gen``'s batch (each
    in turn) holds what a fresh prefill of its tokens gives (``fresh()``: the
    empty cache; default the model's). ``check.rows``: the rows checked."""

    def check():
        batch = gen.generation_batch
        if len(batch):
            i = len(checks) % len(batch)
            what = f"row {i} at {len(batch.tokens[i])} tokens"
            cache, empty = batch.extract_cache(i), fresh() if fresh else None
            _assert_cache_is_fresh_prefill(model, cache, batch.tokens[i], what, empty)
            checks.append(i)

    checks = []
    check.rows = checks
    return check


def _window_batch_drafts(model, tokenizer, prompts, fresh=None, **kwargs):
    """Cold and warm passes of a batch of sliding windows: outputs equal
    stock batched generation's, rows roll back unevenly, and after every
    step each row's cache is a fresh prefill of its tokens."""
    gen = BatchGenerator(model, stop_tokens=_eos(tokenizer), **kwargs)
    ref, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
    gen.close()
    drafter, stats = SuffixDrafter(policy="fixed"), BatchDraftStats()
    checked = 0
    for round_ in range(2):
        gen = _suffix_gen(model, tokenizer, drafter, stats=stats, **kwargs)
        check = _rows_are_fresh_prefills(model, gen, fresh)
        tokens, finished = _run(gen, prompts, [MAX_TOKENS] * len(prompts), after_step=check)
        gen.close()
        assert tokens == ref, f"round {round_}"
        for i, (p, t, f) in enumerate(zip(prompts, tokens, finished)):
            assert f.all_tokens == p + t
            fresh_cache = fresh() if fresh else None
            what = f"round {round_}, row {i} finished"
            _assert_cache_is_fresh_prefill(model, f.prompt_cache, f.all_tokens, what, fresh_cache)
        checked += len(check.rows)
    assert checked > MAX_TOKENS // 2
    assert stats.verify_steps > 0 and stats.uneven_rollbacks > 0, stats
    assert stats.replays == 0  # windows trim
    assert drafter.stats.accepted > MAX_TOKENS


def test_rotating_batch_cache_drafts(model_and_tokenizer, prompts):
    """A rotating KV cache (max_kv_size 40, shorter than most rows) batches
    as BatchRotatingKVCache, whose rows trim also once wrapped."""
    model, tokenizer = model_and_tokenizer
    assert max(len(p) for p in prompts) + MAX_TOKENS > 40
    fresh = lambda: [RotatingKVCache(40) for _ in model.layers]  # noqa: E731 (stock batches drop keep)
    _window_batch_drafts(model, tokenizer, prompts, fresh, max_kv_size=40)


def test_sliding_window_batch_drafts(tiny_family_path, prompts):
    """gpt_oss: sliding-window layers (window 16, BatchRotatingKVCache)
    next to full attention (BatchKVCache) in one batch."""
    model, tokenizer = load(str(tiny_family_path("gpt_oss")))
    model.set_dtype(mx.float32)
    assert any(type(c) is RotatingKVCache for c in make_prompt_cache(model))
    _window_batch_drafts(model, tokenizer, prompts)


def test_sampling_runs_and_respects_lengths(model_and_tokenizer, prompts):
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = model_and_tokenizer
    drafter = SuffixDrafter(policy="fixed")
    samplers = [make_sampler(temp=0.7, top_p=0.9) if i % 2 else None for i in range(len(prompts))]
    for _ in range(2):
        gen = _suffix_gen(model, tokenizer, drafter)
        tokens, finished = _run(gen, prompts, [MAX_TOKENS] * len(prompts), samplers=samplers)
        gen.close()
        for p, t, f in zip(prompts, tokens, finished):
            assert len(t) <= MAX_TOKENS
            assert f.all_tokens == p + t
            assert all(c.offset == len(p) + len(t) for c in f.prompt_cache)
    assert drafter.stats.accepted > 0


def test_prompt_tree_uses_whole_prompt_with_cached_prefix(model_and_tokenizer, prompts):
    """With a prompt cache and all_tokens, the row's tree still gets the whole
    prompt (the tokens in its cache when generation starts)."""
    model, tokenizer = model_and_tokenizer
    p = prompts[1]
    cache = make_prompt_cache(model)
    model(mx.array(p[:-5])[None], cache=cache)
    mx.eval([c.state for c in cache])
    drafter = SuffixDrafter(max_cached_requests=0, policy="fixed")
    seen = []
    start = drafter.start

    def spy(prompt, scope=None):
        seen.append(list(prompt))
        return start(prompt, scope=scope)

    drafter.start = spy
    gen = _suffix_gen(model, tokenizer, drafter)
    _run(gen, [p[-5:]], [8], caches=[cache], all_tokens=[p[:-5]])
    gen.close()
    assert seen == [p]


def test_compacting_shared_left_padding(model_and_tokenizer, prompts, monkeypatch):
    """Uneven rollbacks grow every row's left padding; compacting it (a
    copy of the cache) keeps outputs and caches exact."""
    from mlx_lm_suffix import batch

    monkeypatch.setattr(batch, "COMPACT_LEFT_PADDING", 1)
    model, tokenizer = model_and_tokenizer
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    drafter = SuffixDrafter(policy="fixed")
    gen = _suffix_gen(model, tokenizer, drafter)
    _run(gen, prompts[::2], [MAX_TOKENS] * 3)
    tokens, finished = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
    gen.close()
    assert tokens == ref
    assert gen.draft_stats.compactions > 0
    for p, t, f in zip(prompts, tokens, finished):
        assert all(c.offset == len(p) + len(t) for c in f.prompt_cache)


def test_tokens_match_the_cache_after_every_step(model_and_tokenizer, prompts):
    """``tokens[i]`` is what row i's KV cache holds, after every step."""
    model, tokenizer = model_and_tokenizer
    drafter = SuffixDrafter(policy="fixed")
    gen = _suffix_gen(model, tokenizer, drafter)
    _run(gen, prompts[::2], [MAX_TOKENS] * 3)
    gen.insert(prompts, [MAX_TOKENS] * len(prompts))
    batch = gen.generation_batch
    checked = 0
    while gen.next_generated():
        if len(batch):
            offsets = batch.prompt_cache[0].offset.tolist()
            assert [len(t) for t in batch.tokens] == offsets
            checked += 1
    gen.close()
    assert checked > 0 and gen.draft_stats.verify_steps > 0


def test_adaptive_policy_picks_one_width_per_batch(model_and_tokenizer, prompts):
    """The adaptive policy measures the verification cost once, then cuts
    the batch's drafts to one width; outputs stay exact."""
    model, tokenizer = model_and_tokenizer
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    drafter = SuffixDrafter(policy="adaptive")
    gen = _suffix_gen(model, tokenizer, drafter)
    tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
    gen.close()
    assert tokens == ref
    assert drafter.policy.cost is not None  # measured at the first drafting step
    # Batched verification steps (the warm pass repeats every answer) teach
    # the cost of their shapes; a cheap starting curve, so that they happen
    # whatever this machine's load makes of the measured one.
    drafter = SuffixDrafter(policy="adaptive", cost=VerifyCost({1: 1.0, 256: 1.05}))
    stats = BatchDraftStats()
    for _ in range(2):
        gen = _suffix_gen(model, tokenizer, drafter, stats=stats)
        tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
        gen.close()
        assert tokens == ref
    assert stats.max_verify_batch_size > 1
    assert any(rows > 1 for rows, _ in drafter.policy.cost.batch_factors)
    assert all(f > 0 for f, _ in drafter.policy.cost.batch_factors.values())

    # With a known cost curve, not refined (timings on a loaded machine vary): cheap
    # verification drafts, verification that costs a full step per token
    # does not (uncertain drafts never pay), and outputs never change.
    lengths = {}
    for name, points in (("cheap", {1: 1.0, 256: 1.05}), ("dear", {1: 1.0, 2: 2.0})):
        d = SuffixDrafter(policy="adaptive", cost=VerifyCost(points, smoothing=0))
        for _ in range(2):
            gen = _suffix_gen(model, tokenizer, d)
            tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts))
            gen.close()
            assert tokens == ref
        lengths[name] = d.stats.drafted / max(d.stats.draft_steps, 1)
        assert d.policy.cost.points[1] > 0
    assert lengths["cheap"] > 1 and lengths["cheap"] > lengths["dear"]


def test_one_row_verifies_a_likely_draft_with_its_pending_token(model_and_tokenizer, prompts):
    """A batch of one row whose last step verified (nothing computing) feeds
    its pending token and a likely draft in one forward; the output stays
    stock's, also when ``max_tokens`` ends inside a draft and with logits
    processors, and the row's tokens are what its cache holds after every
    step."""
    model, tokenizer = model_and_tokenizer
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=12)
    for max_tokens, lp in ((MAX_TOKENS, []), (13, procs)):
        # Verification at about the cost of a plain step: a likely draft is
        # verified with the pending token, not after a plain step.
        drafter = SuffixDrafter(
            policy="adaptive", cost=VerifyCost({1: 1.0, 256: 1.05}, smoothing=0)
        )
        stats = BatchDraftStats()
        for round_ in range(2):  # the second round drafts whole answers
            for p in prompts:
                ref, _ = _stock_run(model, tokenizer, [p], [max_tokens], logits_processors=[lp])
                gen = _suffix_gen(model, tokenizer, drafter, stats=stats)
                gen.insert([p], [max_tokens], logits_processors=[lp])
                batch = gen.generation_batch
                tokens = []
                while responses := gen.next_generated():
                    tokens += [r.token for r in responses]
                    if len(batch) and batch.held is None:  # (then read first)
                        assert [len(t) for t in batch.tokens] == batch.prompt_cache[0].offset.tolist()
                gen.close()
                assert tokens == ref[0], (max_tokens, round_)
        assert drafter.stats.accepted > 0
        assert stats.unpipelined_steps > 0 and stats.max_verify_batch_size == 1


def test_recurrent_batch_drafts_and_equals_stock():
    """Mamba's batched state (ArraysCache) cannot trim rows: after a
    rejection every row goes back to the state before the verification and
    is fed its kept tokens again in one right-padded forward. Outputs equal
    stock batched generation's, over a cold and a warm pass."""
    from mlx_lm.models import mamba

    mx.random.seed(0)
    args = mamba.ModelArgs(model_type="mamba", vocab_size=64, hidden_size=32,
                           intermediate_size=64, state_size=8, num_hidden_layers=2,
                           conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4)
    model = mamba.Model(args)
    mx.eval(model.parameters())
    rng = np.random.default_rng(0)
    prompts = []
    for i in range(6):
        base = rng.integers(0, 64, size=5 + i).tolist()
        prompts.append(base * (2 + i % 3) + base[:2])
    gen = BatchGenerator(model, stop_tokens=set())
    ref, _ = _run(gen, prompts, [30] * len(prompts))
    gen.close()
    drafter, stats = SuffixDrafter(policy="fixed", num_draft_tokens=8), BatchDraftStats()
    for _ in range(2):
        gen = SuffixBatchGenerator(model, drafter, stop_tokens=set(), stats=stats)
        tokens, finished = _run(gen, prompts, [30] * len(prompts))
        gen.close()
        assert tokens == ref
        assert all(f.all_tokens == p + t for p, t, f in zip(prompts, tokens, finished))
    assert stats.verify_steps > 0 and stats.replays > 0
    assert 0 < drafter.stats.accepted < drafter.stats.drafted


def test_batched_replays_count_per_request_and_in_the_drafter(tiny_family_path, prompts):
    """On a hybrid model (Qwen3.5: recurrent layers) a batch's rejection
    sends every row back and feeds each its kept tokens again: each row
    counts that replay in its own usage, and the drafter's snapshot is the
    sum over the rows (one stats record per request on every path)."""
    model, tokenizer = load(str(tiny_family_path("qwen3_5")))
    model.set_dtype(mx.float32)
    drafter, stats = SuffixDrafter(policy="fixed", num_draft_tokens=8), BatchDraftStats()
    usages = [RequestUsage() for _ in prompts]
    gen = _suffix_gen(model, tokenizer, drafter, stats=stats)
    _run(gen, prompts, [MAX_TOKENS] * len(prompts), options=[RequestOptions(usage=u) for u in usages])
    gen.close()
    assert stats.replays > 0
    snap = drafter.snapshot()
    assert snap["replays"] == sum(u.replays for u in usages) >= stats.replays
    assert snap["replayed_tokens"] == sum(u.replayed_tokens for u in usages) == stats.replayed_tokens


def test_a_batch_learns_its_plain_step_from_its_own_steps(model_and_tokenizer, prompts,
                                                         monkeypatch):
    """A batch's plain steps teach the cost of its plain step (the shape of
    ``rows`` one-token rows), against which its verifications are priced:
    each the time from one plain step's tokens to the next's over as many
    rows, the caller's time between calls left out (here it takes an hour a
    step on the batch's clock) and no step observed across rows that left."""
    import time
    import types

    from mlx_lm_suffix import batch
    from mlx_lm_suffix.policy import rules

    model, tokenizer = model_and_tokenizer
    plain = [prompts[0], prompts[2]]  # (nothing repeats: plain steps)
    ref, _ = _stock_run(model, tokenizer, plain, [MAX_TOKENS, 2 * MAX_TOKENS])
    drafter = SuffixDrafter(policy="adaptive", cost=VerifyCost({1: 1.0, 2: 2.0, 8: 8.0}))
    skew = [0.0]
    monkeypatch.setattr(batch, "time", types.SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + skew[0]))
    seen, observe = [], drafter.policy.observe_plain
    monkeypatch.setattr(drafter.policy, "observe_plain",
                        lambda s, rows=1: (seen.append((rows, s)), observe(s, rows)))
    gen = _suffix_gen(model, tokenizer, drafter)
    left = []
    tokens, _ = _run(gen, plain, [MAX_TOKENS, 2 * MAX_TOKENS],
                     after_step=lambda: (skew.__setitem__(0, skew[0] + 3600.0),
                                         left.append(len(gen.generation_batch.rows))))
    gen.close()
    assert tokens == ref
    assert gen.draft_stats.verify_steps == 0  # (a token costs a plain step: no draft pays)
    assert all(s < 60.0 for _, s in seen), seen
    # Every step after the first over both rows, then over the one left, but
    # the first after it left.
    assert [r for r, _ in seen] == [2] * (left.count(2) - 1) + [1] * (left.count(1) - 1)
    assert len(seen) >= rules.PLAIN_STEPS
    assert (2, 1) in drafter.policy.cost.batch_factors


def test_uneven_rollbacks_swap_positions_instead_of_rolling(model_and_tokenizer, prompts):
    """Rows that reject more than the batch's common trim swap their
    rejected positions into their left padding (a few slots, not a roll of
    the cache): some row is held out of order during the run, every row read
    out after every step is a fresh prefill of its tokens, and outputs are
    stock's."""
    model, tokenizer = model_and_tokenizer
    stats = _swapping_passes(model, tokenizer, prompts, SuffixDrafter(policy="fixed"))
    assert stats.uneven_rollbacks > 0


def _swapping_passes(model, tokenizer, prompts, drafter):
    """A cold and a warm batched pass of ``prompts``: outputs equal stock's,
    every row read out after every step is a fresh prefill of its tokens,
    and some row is held out of order (a swap) during the passes. Returns
    their stats."""
    ref, _ = _stock_run(model, tokenizer, prompts, [MAX_TOKENS] * len(prompts))
    stats, swapped, checked = BatchDraftStats(), [], 0
    for _ in range(2):
        gen = _suffix_gen(model, tokenizer, drafter, stats=stats)
        check = _rows_are_fresh_prefills(model, gen)

        def after_step(gen=gen, check=check):
            swapped.append(any(r is not None for r in gen.generation_batch.slot_order.rows))
            check()

        tokens, _ = _run(gen, prompts, [MAX_TOKENS] * len(prompts), after_step=after_step)
        gen.close()
        assert tokens == ref
        checked += len(check.rows)
    assert any(swapped) and checked > MAX_TOKENS // 2
    return stats


def test_windowed_models_roll_rejected_positions(tiny_family_path):
    """A model whose configuration names an attention window keeps rolling
    (a windowed mask reads positions by slot)."""
    model, _ = load(str(tiny_family_path("gpt_oss")))
    gen = SuffixBatchGenerator(model, SuffixDrafter(policy="fixed"))
    assert gen.generation_batch.slot_order is None
    gen.close()
    model, _ = load(str(tiny_family_path("qwen3_5")))
    gen = SuffixBatchGenerator(model, SuffixDrafter(policy="fixed"))
    assert gen.generation_batch.slot_order is not None
    gen.close()


def test_a_window_named_in_a_text_config_counts():
    """A multimodal model's window is named in its ``text_config`` (a dict
    or an object), or by its layer types."""
    from types import SimpleNamespace as NS

    assert internals.windowed(NS(args=NS(text_config={"sliding_window": 512})))
    assert internals.windowed(NS(args=NS(text_config=NS(layer_types=["sliding_attention"]))))
    assert internals.windowed(NS(args={"window_size": 4}))
    assert not internals.windowed(NS(args=NS(sliding_window=None, text_config=None)))
    assert not internals.windowed(NS())


def test_a_hybrid_batch_replays_and_swaps_its_padding(tiny_family_path, prompts):
    """Qwen3.5 (recurrent layers): a rejection sends every row back and feeds
    each its kept tokens again, right-padded; the padding leaves the
    attention layers by a swap, not a roll. Every row read out after every
    step is a fresh prefill of its tokens, and outputs are stock's."""
    model, tokenizer = load(str(tiny_family_path("qwen3_5")))
    model.set_dtype(mx.float32)
    drafter = SuffixDrafter(policy="fixed", num_draft_tokens=8)
    assert _swapping_passes(model, tokenizer, prompts, drafter).replays > 0
