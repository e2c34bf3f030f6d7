"""Suffix decoding through the single-sequence loop and the patched
``mlx_lm.stream_generate`` / ``mlx_lm.generate``, token for token against
stock mlx-lm on tiny float32 models loaded with the real ``mlx_lm.load``."""

import inspect
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models import mamba
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors, make_sampler

import mlx_lm_suffix
from mlx_lm_suffix import SuffixDrafter, suffix_generate_step
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.sources import Draft


def _prompts(tokenizer, n=20):
    """Prompts from real text on any machine (this stdlib's sources), half of
    them highly repetitive so most tokens get drafted.

    Tests that count drafts or need drafts verified use fixed-length drafting:
    the adaptive policy's lengths depend on timings measured on this (shared)
    machine, outputs never do."""
    text = Path(inspect.getsourcefile(inspect)).read_text()
    prompts = []
    for i in range(n):
        chunk = text[3000 + 1500 * i : 3000 + 1500 * i + 300]
        if i % 2:
            chunk = f"Repeat this exactly:\n{chunk}\nAgain:\n{chunk}\nAgain:\n{chunk[:80]}"
        prompts.append(tokenizer.encode(chunk))
    return prompts


def _stock(model, prompt, **kw):
    return [t for t, _ in generate_step(mx.array(prompt), model, **kw)]


def _suffix(model, prompt, drafter, **kw):
    out = list(suffix_generate_step(mx.array(prompt), model, drafter, **kw))
    return [t for t, _, _ in out], sum(f for _, _, f in out)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_and_tokenizer(request, tiny_model_path, tiny_llama_path):
    path = tiny_model_path if request.param == "qwen3" else tiny_llama_path
    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)
    return model, tokenizer


def test_greedy_equals_stock_on_20_prompts(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    drafter = SuffixDrafter(num_draft_tokens=12, policy="fixed")
    drafted = total = 0
    for prompt in _prompts(tokenizer):
        ref = _stock(model, prompt, max_tokens=48)
        out, n_draft = _suffix(model, prompt, drafter, max_tokens=48)
        assert out == ref
        drafted += n_draft
        total += len(out)
    stats = drafter.snapshot()
    # The loop really verified drafts: many tokens came from them.
    assert drafted / total > 0.1 and drafted > 100, stats
    assert stats["accepted"] == drafted and stats["tokens"] == total
    assert stats["active_requests"] == 0 and stats["cached_requests"] == 20


def test_adaptive_policy_output_is_stock(model_and_tokenizer):
    """The default policy: the cost curve measured here (whatever it says),
    then known curves: cheap verification drafts long, verification that
    costs a full step per token drafts nothing uncertain; outputs never move."""
    model, tokenizer = model_and_tokenizer
    prompts = _prompts(tokenizer, 6)
    refs = [_stock(model, p, max_tokens=40) for p in prompts]
    measured = SuffixDrafter()
    cheap = SuffixDrafter(cost=VerifyCost({1: 1.0, 64: 1.05}, smoothing=0))
    dear = SuffixDrafter(cost=VerifyCost({1: 1.0, 2: 2.0}, smoothing=0))
    for drafter in (measured, cheap, dear):
        for _ in range(2):  # the repeat drafts from the first responses
            assert [_suffix(model, p, drafter, max_tokens=40)[0] for p in prompts] == refs
    assert measured.policy.cost is not None and measured.policy.cost.points[1] > 0
    per_step = [d.stats.drafted / max(d.stats.draft_steps, 1) for d in (cheap, dear)]
    assert cheap.stats.accepted > 50 and per_step[0] > 2 * per_step[1]


def test_stream_generate_accepts_drafter_and_suffix(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    stock = list(stream_generate(model, tokenizer, prompt, max_tokens=40))
    drafter = SuffixDrafter(policy="fixed")
    ours = list(stream_generate(model, tokenizer, prompt, max_tokens=40, draft_model=drafter))
    assert [r.token for r in ours] == [r.token for r in stock]
    # The repeat drafts from the first response.
    accepted_before = drafter.stats.accepted
    ours = list(stream_generate(model, tokenizer, prompt, max_tokens=40, draft_model=drafter))
    assert [r.token for r in ours] == [r.token for r in stock]
    assert "".join(r.text for r in ours) == "".join(r.text for r in stock)
    assert ours[-1].finish_reason == stock[-1].finish_reason
    assert any(r.from_draft for r in ours) and not any(r.from_draft for r in stock)
    assert sum(r.from_draft for r in ours) == drafter.stats.accepted - accepted_before

    # draft_model="suffix": one drafter per model whose cache persists.
    text1 = mlx_lm_suffix_generate(model, tokenizer, prompt, "suffix")
    text2 = mlx_lm_suffix_generate(model, tokenizer, prompt, "suffix")
    assert text1 == text2 == "".join(r.text for r in stock)
    from mlx_lm_suffix.patches.generate import drafter_for

    assert drafter_for(model).snapshot()["cached_requests"] == 2
    with pytest.raises(ValueError, match="Unknown draft_model"):
        list(stream_generate(model, tokenizer, prompt, max_tokens=4, draft_model="suffixx"))


def mlx_lm_suffix_generate(model, tokenizer, prompt, draft_model):
    import mlx_lm

    return mlx_lm.generate(model, tokenizer, prompt, max_tokens=40, draft_model=draft_model)


class _Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    @property
    def layers(self):
        return self.inner.layers

    @property
    def args(self):
        return self.inner.args


def test_exact_max_tokens_and_caps(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    calls = []

    class Spy(_Wrapper):
        def __call__(self, inputs, cache=None, **kw):
            calls.append((cache[0].offset, inputs.shape[1]))
            return self.inner(inputs, cache=cache, **kw)

    drafter = SuffixDrafter(num_draft_tokens=16, policy="fixed")
    for max_tokens in (1, 2, 7, 33):
        out, _ = _suffix(model, prompt, drafter, max_tokens=max_tokens)
        assert len(out) == max_tokens
        assert out == _stock(model, prompt, max_tokens=max_tokens)
    # A draft never goes past max_tokens: no forward feeds more tokens than
    # can still be emitted.
    calls.clear()
    out, _ = _suffix(Spy(model), prompt, drafter, max_tokens=20)
    assert len(out) == 20
    emitted_before = 0
    for offset, n in calls[1:]:
        emitted_before = offset - len(prompt) + 1
        assert n <= 20 - emitted_before + 1

    # max_kv_size (a window that keeps its first 4 tokens, where the model
    # makes no cache of its own): drafts stop before the window would wrap;
    # output as stock.
    kv = len(prompt) + 12
    cache = make_prompt_cache(model, max_kv_size=kv)
    calls.clear()
    out, _ = _suffix(Spy(model), prompt, drafter, max_tokens=30, max_kv_size=kv,
                     prompt_cache=cache)
    assert out == _stock(model, prompt, max_tokens=30, max_kv_size=kv)
    if isinstance(cache[0], RotatingKVCache):
        assert all(off + n <= kv for off, n in calls[1:] if n > 1)
    assert any(n > 1 for _, n in calls[1:])


def test_context_limit_from_max_position_embeddings(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1][:60]
    limit = len(prompt) + 10
    old = model.args.max_position_embeddings
    model.args.max_position_embeddings = limit
    seen = []
    orig_call = type(model).__call__

    try:
        def spy(self, inputs, cache=None, **kw):
            seen.append(cache[0].offset + inputs.shape[1])
            return orig_call(self, inputs, cache=cache, **kw)

        type(model).__call__ = spy
        out, _ = _suffix(model, prompt, SuffixDrafter(policy="fixed"), max_tokens=30)
    finally:
        type(model).__call__ = orig_call
        model.args.max_position_embeddings = old
    assert len(out) == 30
    # Multi-token (draft) forwards never reach past the limit; single steps
    # go on as in stock mlx-lm.
    assert max(seen[1:]) > limit
    assert all(end <= limit or n == 1 for end, n in zip(seen[1:], [1] * len(seen)))


def test_eos_and_stop_as_stock(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 4)[3]
    stock = list(stream_generate(model, tokenizer, prompt, max_tokens=40))
    eos = stock[12].token
    tokenizer.add_eos_token(str(eos))
    try:
        ref = list(stream_generate(model, tokenizer, prompt, max_tokens=40))
        ours = list(
            stream_generate(model, tokenizer, prompt, max_tokens=40, draft_model=SuffixDrafter())
        )
    finally:
        tokenizer._eos_token_ids.discard(eos)
    assert [r.token for r in ours] == [r.token for r in ref]
    assert ours[-1].finish_reason == ref[-1].finish_reason == "stop"
    assert "".join(r.text for r in ours) == "".join(r.text for r in ref)


def test_lifecycle_close_exception_and_repeat(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    drafter = SuffixDrafter(policy="fixed")

    gen = suffix_generate_step(mx.array(prompt), model, drafter, max_tokens=50)
    for _ in range(5):
        next(gen)
    assert drafter.active_requests == 1
    gen.close()
    assert drafter.active_requests == 0

    class Boom(_Wrapper):
        n = 0

        def __call__(self, *a, **kw):
            self.n += 1
            if self.n == 6:
                raise RuntimeError("boom")
            return self.inner(*a, **kw)

    with pytest.raises(RuntimeError, match="boom"):
        list(suffix_generate_step(mx.array(prompt), Boom(model), drafter, max_tokens=50))
    assert drafter.active_requests == 0

    # A repeat drafts from the first response, its final tokens included.
    first, _ = _suffix(model, prompt, drafter, max_tokens=40)
    before = drafter.stats.as_dict()
    steps = list(suffix_generate_step(mx.array(prompt), model, drafter, max_tokens=40))
    after = drafter.stats.as_dict()
    assert [t for t, _, _ in steps] == first
    drafted = after["drafted"] - before["drafted"]
    accepted = after["accepted"] - before["accepted"]
    assert accepted / drafted > 0.9
    assert steps[-2][2]  # the second-to-last token was drafted
    assert drafter.active_requests == 0


class WrongFirstToken(SuffixDrafter):
    """Drafts the suffix trees' continuation with a wrong first token."""

    def propose(self, req_id, max_tokens=None):
        d = super().propose(req_id, max_tokens)
        if d.tokens:
            d.tokens[0] += 1
        return d


def test_first_token_misses_are_exact(model_and_tokenizer):
    """Every draft's first token is wrong: the plain forward rejects each
    pipelined draft, the settled step after it verifies the token it gave
    with a draft that is rejected again; the output stays stock's, nothing
    is accepted, and every forward still gives a token."""
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    drafter = WrongFirstToken(policy="fixed")
    _suffix(model, prompt, drafter, max_tokens=40)  # the repeat drafts from it
    yielded, calls = [], []

    class Spy(_Wrapper):
        def __call__(self, inputs, cache=None, **kw):
            calls.append((inputs.shape[1], len(yielded)))
            return self.inner(inputs, cache=cache, **kw)

    drafted = drafter.stats.drafted
    for t, _, _ in suffix_generate_step(mx.array(prompt), Spy(model), drafter, max_tokens=40):
        yielded.append(t)
    assert yielded == _stock(model, prompt, max_tokens=40)
    assert drafter.stats.drafted - drafted > 5 and drafter.stats.accepted == 0
    # After mlx-lm's prefill (the chunk, then its last token alone): each
    # forward, plain or a rejected verification, gives one token (the last
    # one pipelined past the end).
    decode = calls[2:]
    assert len(decode) <= 41 and any(w > 1 for w, _ in decode)


class OnceWrongFirstToken(SuffixDrafter):
    """Drafts normally, except that the first draft's first token is wrong
    (the first draft of a request is a pipelined one)."""

    missed = False

    def propose(self, req_id, max_tokens=None):
        d = super().propose(req_id, max_tokens)
        if d.tokens and not self.missed:
            self.missed = True
            d.tokens[0] += 1
        return d


def _forwards_after_a_miss(model, prompt, policy):
    """(tokens fed, tokens yielded before) of each target call of a repeat
    whose first pipelined draft's first token is wrong."""
    drafter = OnceWrongFirstToken(policy=policy, cost=VerifyCost({1: 1.0, 64: 1.05}, smoothing=0))
    _suffix(model, prompt, drafter, max_tokens=40)  # the repeat drafts from it
    drafter.missed = False
    yielded, calls = [], []

    class Spy(_Wrapper):
        def __call__(self, inputs, cache=None, **kw):
            calls.append((inputs.shape[1], len(yielded)))
            return self.inner(inputs, cache=cache, **kw)

    for t, _, _ in suffix_generate_step(mx.array(prompt), Spy(model), drafter, max_tokens=40):
        yielded.append(t)
    assert drafter.missed
    return yielded, calls


def test_a_verifications_tokens_are_yielded_while_the_next_one_runs(model_and_tokenizer):
    """As stock's step yields a token once the forward after it is queued,
    a verification's tokens are yielded once the next forward is queued
    (the consumer's work overlaps it), and no later: when a forward is
    queued, the consumer lacks at most the last verification's tokens of
    those in the cache, and none when it is a plain one. Outputs are
    stock's."""
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    ref = _stock(model, prompt, max_tokens=40)
    drafter = SuffixDrafter(policy="fixed")
    _suffix(model, prompt, drafter, max_tokens=40)  # the repeat drafts from it
    yielded, calls = [], []

    class Spy(_Wrapper):
        def __call__(self, inputs, cache=None, **kw):
            calls.append((inputs.shape[1], cache[0].offset - len(prompt) - len(yielded)))
            return self.inner(inputs, cache=cache, **kw)

    gen = suffix_generate_step(mx.array(prompt), Spy(model), drafter, max_tokens=40,
                               num_draft_tokens=4)
    for t, _, _ in gen:
        yielded.append(t)
    assert yielded == ref
    steps = calls[2:]  # (after mlx-lm's prefill)
    assert sum(width > 1 for width, _ in steps) > 4, calls
    assert max(behind for _, behind in steps) > 0, calls
    assert all(behind <= (5 if width > 1 else 0) for width, behind in steps), calls


def test_the_consumers_time_is_not_a_forwards(model_and_tokenizer, monkeypatch):
    """Tokens are yielded while forwards run (plain steps' and
    verifications'), but the time the consumer holds the loop is not theirs:
    with a consumer that takes an hour a token (on the loop's clock), every
    forward the policy learns from took milliseconds."""
    import time
    import types

    from mlx_lm_suffix import loop

    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    drafter = SuffixDrafter(cost=VerifyCost({1: 1e-3, 2: 1.2e-3, 64: 8e-3}))
    _suffix(model, prompt, drafter, max_tokens=40)  # the repeat drafts from it
    skew = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + skew[0])
    monkeypatch.setattr(loop, "time", clock)
    seen, observe = [], drafter.policy.observe
    monkeypatch.setattr(drafter.policy, "observe", lambda n, s, **kw: (seen.append((n, s)),
                                                                       observe(n, s, **kw)))
    for _ in suffix_generate_step(mx.array(prompt), model, drafter, max_tokens=40):
        skew[0] += 3600.0
    # (One verification may take the whole cached answer; it is queued
    # while the tokens before it are handed out.)
    assert any(n > 1 for n, _ in seen) and all(s < 1.0 for _, s in seen), seen


def test_adaptive_verifies_the_missed_token_with_the_next_draft(model_and_tokenizer):
    """After the plain forward rejects a pipelined draft, the token it gave is
    known: the loop drafts after it and verifies both in one forward."""
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    ref = _stock(model, prompt, max_tokens=40)
    for policy in ("adaptive", "fixed"):
        yielded, calls = _forwards_after_a_miss(model, prompt, policy)
        assert yielded == ref
        # mlx-lm's prefill (all but the last prompt token, then that token
        # alone), the plain forward of token 0 (which rejects the draft after
        # it), then token 1 (the rejected draft's place) and a draft in one
        # forward, once token 0 is yielded (token 1 comes with the draft's).
        assert calls[0] == (len(prompt) - 1, 0) and calls[1:3] == [(1, 0), (1, 0)]
        assert calls[3][0] > 1 and calls[3][1] == 1


def test_cache_holds_exactly_prompt_plus_yielded_tokens(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    # Where a run of accepted draft tokens starts (a repeat drafts long runs):
    # stopping there leaves accepted tokens in the cache that were never
    # yielded, which closing must drop.
    warm = SuffixDrafter(policy="fixed")
    _suffix(model, prompt, warm, max_tokens=40)
    flags = [f for _, _, f in suffix_generate_step(mx.array(prompt), model, warm, max_tokens=40)]
    mid_draft = next(i + 1 for i in range(39) if flags[i] and flags[i + 1])
    # Cold at a few places, warm mid-draft; and warm with 4-token drafts at
    # every place (their verifications follow one another, and each one's
    # tokens are yielded while the next one's forward is queued: stopping
    # there takes back that forward too).
    cases = [(k, None, 64) for k in (3, 17, 40)] + [(mid_draft, warm, 64)]
    cases += [(k, warm, 4) for k in range(1, 41)]
    for stop_after, drafter, k in cases:
        cache = [KVCache() for _ in model.layers]
        gen = suffix_generate_step(
            mx.array(prompt), model, drafter or SuffixDrafter(policy="fixed"), max_tokens=40,
            prompt_cache=cache, num_draft_tokens=k,
        )
        toks = [t for t, _, _ in (next(gen) for _ in range(stop_after))]
        gen.close()
        assert cache[0].offset == len(prompt) + len(toks)
        # Its contents are those of a fresh prefill of prompt + tokens.
        fresh = [KVCache() for _ in model.layers]
        model(mx.array(prompt + toks)[None], cache=fresh)
        n = fresh[0].offset
        for c, f in zip(cache, fresh):
            assert mx.allclose(c.keys[..., :n, :], f.keys[..., :n, :], atol=1e-4).item()


def test_the_first_token_comes_before_any_verification(model_and_tokenizer):
    """As stock's, the first token is yielded once the forward after it is
    queued: no draft is checked or verified before the consumer has it (a
    warm drafter drafts the whole answer from the first step on)."""
    model, tokenizer = model_and_tokenizer
    prompt = mx.array(_prompts(tokenizer, 2)[1])
    drafter = SuffixDrafter(policy="fixed")
    _suffix(model, prompt.tolist(), drafter, max_tokens=40)
    stock, ours = make_prompt_cache(model), make_prompt_cache(model)
    next(generate_step(prompt, model, max_tokens=40, prompt_cache=stock))
    gen = suffix_generate_step(prompt, model, drafter, max_tokens=40, prompt_cache=ours)
    before = drafter.stats.drafted
    next(gen)
    assert ours[0].offset == stock[0].offset == prompt.size + 1
    assert drafter.stats.drafted == before
    assert sum(f for *_, f in gen) > 20  # the rest came drafted


def test_logits_processors_greedy_as_stock(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    procs = make_logits_processors(repetition_penalty=1.3, repetition_context_size=30)
    for prompt in _prompts(tokenizer, 6)[1::2]:
        ref = _stock(model, prompt, max_tokens=40, logits_processors=procs)
        drafter = SuffixDrafter(policy="fixed")
        out, _ = _suffix(model, prompt, drafter, max_tokens=40, logits_processors=procs)
        assert out == ref


class _Bigram(nn.Module):
    """A fake target with a known distribution: logits depend on the last
    token only; a real KVCache keeps rollback honest."""

    def __init__(self, logits):
        super().__init__()
        self.table = logits
        self.layers = [None]

    def __call__(self, inputs, cache=None):
        x = mx.zeros((1, 1, inputs.shape[1], 1))
        cache[0].update_and_fetch(x, x)
        return self.table[inputs]


class _FixedDrafter(SuffixDrafter):
    def propose(self, req_id, max_tokens=None):
        return Draft([1, 2, 3][:max_tokens], [1.0] * 3)


def test_sampling_distribution_matches_target():
    V = 4
    rng = np.random.default_rng(0)
    table = mx.array(rng.normal(size=(V, V)).astype(np.float32) * 1.5)
    model = _Bigram(table)
    mx.random.seed(0)
    sampler = make_sampler(temp=1.0)
    drafter = _FixedDrafter(num_draft_tokens=3, policy="fixed")
    counts = np.zeros((V, V))
    for _ in range(1500):
        cache = [KVCache()]
        out = list(suffix_generate_step(mx.array([0]), model, drafter, max_tokens=4,
                                        sampler=sampler, prompt_cache=cache))
        counts[out[1][0], out[2][0]] += 1
    probs = np.exp(np.array(table) - np.log(np.exp(np.array(table)).sum(-1, keepdims=True)))
    # Second and third tokens: joint counts vs P(x2|x1) P(x3|x2) summed over x1.
    p1 = probs[0]
    expected_x2 = p1 @ probs  # distribution of x2
    joint = expected_x2[:, None] * probs
    chi2 = ((counts - 1500 * joint) ** 2 / (1500 * joint)).sum()
    assert chi2 < 37.7  # chi-square, 15 dof, p = 0.001
    assert drafter.stats.accepted > 0  # drafts were really accepted while sampling


def test_recurrent_model_drafts_and_equals_stock():
    """Mamba's state (ArraysCache) cannot be trimmed: a rejection restores it
    and feeds the accepted tokens again; the output stays stock's."""
    mx.random.seed(0)
    args = mamba.ModelArgs(model_type="mamba", vocab_size=64, hidden_size=32,
                           intermediate_size=64, state_size=8, num_hidden_layers=2,
                           conv_kernel=4, use_bias=False, use_conv_bias=True,
                           time_step_rank=4)
    model = mamba.Model(args)
    mx.eval(model.parameters())
    drafter = SuffixDrafter(policy="fixed", num_draft_tokens=8)
    for prompt in ([1, 2, 3, 4] * 6, [5, 9, 9, 2, 7] * 5 + [5]):
        ref = _stock(model, prompt, max_tokens=30)
        out, drafted = _suffix(model, prompt, drafter, max_tokens=30)
        assert out == ref and drafted > 0
    assert drafter.stats.accepted < drafter.stats.drafted  # some were rejected


class _OpaqueCache(KVCache):
    """A cache kind the rollback table does not know."""


class _Opaque(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner = model

    @property
    def layers(self):
        return self.inner.layers

    def make_cache(self):
        return [_OpaqueCache() for _ in self.inner.layers]

    def __call__(self, inputs, cache=None, **kw):
        return self.inner(inputs, cache=cache, **kw)


def test_unknown_cache_kind_falls_back_and_warns_once(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    model = _Opaque(model)
    prompt = _prompts(tokenizer, 2)[1]
    ref = _stock(model, prompt, max_tokens=20)
    drafter = SuffixDrafter()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out1, d1 = _suffix(model, prompt, drafter, max_tokens=20)
        out2, d2 = _suffix(model, prompt, drafter, max_tokens=20)
    msgs = [x for x in w if "cannot be rolled back" in str(x.message)]
    assert len(msgs) == 1 and "_OpaqueCache" in str(msgs[0].message)
    assert out1 == out2 == ref and d1 == d2 == 0
    assert drafter.active_requests == 0


def test_package_exports():
    assert mlx_lm_suffix.SuffixDrafter is SuffixDrafter
    with pytest.raises(AttributeError):
        mlx_lm_suffix.nope  # noqa: B018


def test_logits_processors_see_the_whole_context(model_and_tokenizer):
    """Each logits processor call gets the prompt plus every token before the
    position it scores, as stock generate_step gives it (a processor that
    reads the context, like the bench's scripted one, depends on it)."""
    model, tokenizer = model_and_tokenizer
    prompt = _prompts(tokenizer, 2)[1]
    seen = []

    def record(tokens, logits):
        seen.append(tokens.tolist())
        return logits

    drafter = SuffixDrafter(policy="fixed")
    _suffix(model, prompt, drafter, max_tokens=24)  # the repeat drafts from it
    seen.clear()
    out, drafted = _suffix(model, prompt, drafter, max_tokens=24, logits_processors=[record])
    assert drafted > 0
    full = prompt + out
    assert seen and all(len(s) >= len(prompt) and s == full[: len(s)] for s in seen)
    assert {len(s) for s in seen} >= set(range(len(prompt), len(full)))


def test_a_plain_step_is_timed_as_one_forward(model_and_tokenizer):
    # Where the backend computes while a forward is queued (as the CPU's;
    # here: a sleep per forward, whatever its width), a plain step queued
    # after a verification overlaps nothing: timing it up to the next token
    # would count the next forward too (2 sleeps). The learnt plain step
    # must stay one forward's time.
    import statistics
    import time

    model, tokenizer = model_and_tokenizer
    nap = 0.04

    class Slow:
        def __call__(self, *args, **kwargs):
            time.sleep(nap)
            return model(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(model, name)

    drafter = SuffixDrafter(policy="fixed", cost=VerifyCost({1: nap}))
    plain = []
    observe = drafter.policy.observe_plain
    drafter.policy.observe_plain = lambda s: (plain.append(s), observe(s))
    for prompt in _prompts(tokenizer, 6)[1::2]:
        _, drafted = _suffix(Slow(), prompt, drafter, max_tokens=64)
        assert drafted > 0
    assert len(plain) >= 5 and statistics.median(plain) < 1.6 * nap


def test_prefill_chunks_are_no_cost_points(model_and_tokenizer):
    # A prefill chunk's tokens cost less each than a narrow verification's:
    # a curve interpolated towards one priced the widths drafts use too low
    # (a 4-bit model here: 19 tokens at 13 plain steps where they cost 17).
    # So the curve holds the probe's sizes and what was verified, and the
    # progress reports stay stock's.
    model, tokenizer = model_and_tokenizer
    text = Path(inspect.getsourcefile(inspect)).read_text()[5000:9000]
    prompt = tokenizer.encode(text)[:300]
    step = 128
    stock_reports, reports = [], []
    ref = _stock(model, prompt, max_tokens=8, prefill_step_size=step,
                 prompt_progress_callback=lambda *a: stock_reports.append(a))
    drafter = SuffixDrafter()  # adaptive: the probe times 1 and 2 tokens
    out, _ = _suffix(model, prompt, drafter, max_tokens=8, prefill_step_size=step,
                     prompt_progress_callback=lambda *a: reports.append(a))
    assert out == ref and reports == stock_reports
    assert step not in drafter.policy.cost.points
    # A draft of n tokens is verified n wide (pipelined: its confirmed first
    # token fed first) or n + 1 (settled: the pending token fed first).
    widths = {w for n in drafter.stats.lengths for w in (n, n + 1)}
    assert set(drafter.policy.cost.points) <= {1, 2} | widths


def test_quantized_width_probe_keeps_within_its_budget(models_dir, monkeypatch):
    """The probe of forward widths over a quantized KV cache tests widths
    from 2 up and keeps the widest matched when its time is up: with
    reference BLAS (this process) every width matches, so with no time it
    keeps 2 and with its default budget the whole range of a small model.
    (The scan once ran to the end whatever it cost: 205 s on the real f32
    SmolLM2 here at 65 tokens, each w-token forward over the quantized
    cache costing w plain steps.)"""
    from mlx_lm_suffix import loop
    from mlx_lm_suffix.tools.models import ensure_model

    path = str(ensure_model("qwen3", "mini", cache_dir=models_dir))  # head_dim 32 or more
    model, _ = load(path)
    assert loop.quantized_width(model, 8, 32, 9) == 9  # cached per model and setting
    model, _ = load(path)  # a fresh model: nothing cached
    monkeypatch.setattr(loop, "KV_PROBE_BUDGET_S", 0.0)
    assert loop.quantized_width(model, 8, 32, 9) == 2


def test_negative_prompt_ids_are_refused(model_and_tokenizer):
    """A negative token id in the prompt gets a ValueError (it crashed the
    process: cast to an unsigned id it indexed past the vocabulary; stock's
    embedding wraps it around). Valid ids still generate as stock."""
    model, tokenizer = model_and_tokenizer
    for ids in ([-1], [5, -3], [1, 2, 3, -1, 4]):
        with pytest.raises(ValueError, match="non-negative"):
            next(stream_generate(model, tokenizer, ids, max_tokens=4, draft_model=SuffixDrafter()))
    ok = [r.token for r in stream_generate(model, tokenizer, [5, 6], max_tokens=4,
                                           draft_model=SuffixDrafter())]
    assert ok == [r.token for r in stream_generate(model, tokenizer, [5, 6], max_tokens=4)]
