"""Suffix decoding on the model families whose caches do not all trim: sliding
windows (``RotatingKVCache``), recurrent state (``ArraysCache``) next to
attention, and both in one layer (``CacheList``).

Each family's tiny model is built by ``mlx_lm_suffix.tools.models``, saved,
and loaded through the real ``mlx_lm.load``, in float32. Greedy output must
be stock mlx-lm's token for token, and the prompt cache afterwards (also
after an early close, in the middle of a draft) must hold what a fresh
prefill of prompt + yielded tokens gives; sampling must keep the model's
distribution. Drafts use fixed lengths, so the counts do not depend on
timings.
"""

from __future__ import annotations

import inspect
import itertools
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.sample_utils import make_sampler

from mlx_lm_suffix import SuffixDrafter, suffix_generate_step
from mlx_lm_suffix.batch import SuffixBatchGenerator
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.sources import Draft
from mlx_lm_suffix.speculation import RequestOptions
from mlx_lm_suffix.tools.models import FAMILIES, SLIDING_WINDOW

#: Every family but the all-KVCache ones (tests/test_loop.py covers those).
ROLLBACK_FAMILIES = [f for f in FAMILIES if f not in ("qwen3", "llama")]
MAX_TOKENS = 32
WINDOW = SLIDING_WINDOW["tiny"]
# float32 states after a few dozen steps, one token at a time or in one
# forward, are equal up to rounding (at most 4e-6 apart here).
ATOL, RTOL = 1e-4, 1e-3


class _Perturbing(SuffixDrafter):
    """A suffix drafter that, while ``perturb`` is set, changes the middle
    token of every other draft, so verification accepts part of it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.perturb, self._n = False, 0

    def propose(self, req_id: int, max_tokens: Optional[int] = None) -> Draft:
        d = super().propose(req_id, max_tokens)
        if self.perturb and len(d.tokens) > 1:
            self._n += 1
            if self._n % 2:
                d.tokens[len(d.tokens) // 2] ^= 1
        return d


@pytest.fixture(scope="module", params=ROLLBACK_FAMILIES)
def family(request, tiny_family_path) -> Tuple[str, Any, Any]:
    model, tokenizer = load(str(tiny_family_path(request.param)))
    model.set_dtype(mx.float32)
    return request.param, model, tokenizer


def _prompts(tokenizer: Any, n: int = 8) -> List[List[int]]:
    """Prompts of 40-120 tokens (longer than the sliding window) from this
    stdlib's sources, half of them repetitive, and two short ones (shorter
    than the window, which generation then overflows)."""
    text = Path(inspect.getsourcefile(inspect)).read_text()
    prompts = []
    for i in range(n):
        chunk = text[2000 + 1700 * i : 2000 + 1700 * i + 220]
        if i % 2:
            chunk = f"Repeat this exactly:\n{chunk[:120]}\nAgain:\n{chunk[:120]}\nAgain:\n{chunk[:40]}"
        prompts.append(tokenizer.encode(chunk))
    prompts += [tokenizer.encode("def f(x):"), tokenizer.encode("a = b = a = b")]
    assert all(len(p) > WINDOW for p in prompts[:n]) and all(len(p) < WINDOW for p in prompts[n:])
    return prompts


def _layers(cache: Sequence[Any]) -> Iterator[Any]:
    for c in cache:
        if isinstance(c, CacheList):
            yield from _layers(c.caches)
        else:
            yield c


def _contents(c: Any) -> Tuple[int, List[mx.array]]:
    """(position, arrays) of a layer cache: all that later steps read."""
    if isinstance(c, RotatingKVCache):
        # In temporal order; the next step reads the last max_size - 1.
        n = min(c.offset, c.max_size - 1)
        return c.offset, [c._temporal_order(v)[..., -n:, :] for v in (c.keys, c.values)]
    if isinstance(c, KVCache):
        return c.offset, [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    if isinstance(c, ArraysCache):
        assert c.lengths is None and c.left_padding is None
        return -1, [a for a in c.cache if a is not None]
    raise AssertionError(f"unexpected cache kind {type(c).__name__}")


def _assert_cache_is_fresh_prefill(
    model: Any, cache: List[Any], tokens: List[int], what: str, fresh: Optional[List[Any]] = None
) -> None:
    """``cache`` holds what one forward over ``tokens`` from an empty cache
    (``fresh``, default the model's) gives: the same positions, allclose
    keys/values and recurrent states, and the same next-token logits for a
    probe token."""
    fresh = make_prompt_cache(model) if fresh is None else fresh
    model(mx.array(tokens)[None], cache=fresh)
    for i, (c, f) in enumerate(zip(_layers(cache), _layers(fresh), strict=True)):
        assert type(c) is type(f), what
        (pos, got), (want_pos, want) = _contents(c), _contents(f)
        assert pos == want_pos, f"{what}: layer {i} ({type(c).__name__}) at {pos}, not {want_pos}"
        assert len(got) == len(want), f"{what}: layer {i} ({type(c).__name__})"
        for a, b in zip(got, want):
            assert a.shape == b.shape, f"{what}: layer {i} ({type(c).__name__}) {a.shape} != {b.shape}"
            err = mx.abs(a - b).max().item()
            assert mx.allclose(a, b, atol=ATOL, rtol=RTOL).item(), (
                f"{what}: layer {i} ({type(c).__name__}) differs from a fresh prefill by {err:.2e}"
            )
    probe = mx.array([[tokens[-1]]])
    got, want = model(probe, cache=cache), model(probe, cache=fresh)
    assert mx.allclose(got, want, atol=ATOL, rtol=RTOL).item(), f"{what}: next-token logits differ"


def _run(
    model: Any,
    tokenizer: Any,
    prompt: List[int],
    max_tokens: int,
    drafter: Optional[SuffixDrafter] = None,
    stop: Optional[int] = None,
    cache: Optional[List[Any]] = None,
) -> Tuple[List[int], List[bool]]:
    """Tokens and from_draft flags of ``stream_generate``; with ``stop``,
    closed at the first token not from a draft after ``stop`` tokens."""
    gen = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, draft_model=drafter, prompt_cache=cache)
    out = []
    for r in gen:
        out.append((r.token, r.from_draft))
        if stop is not None and len(out) >= stop and not r.from_draft:
            break
    gen.close()
    return [t for t, _ in out], [f for _, f in out]


def test_greedy_equals_stock_and_cache_is_exact(family):
    """About 25 generations per family: each prompt cold (drafts from the
    prompt, mostly rejected), then warm (drafts from the first response) with
    a smaller ``max_tokens``, so the last tokens come from a draft cut short,
    some with drafts perturbed in the middle (partial acceptance), some
    closed early (after a token not from a draft; closing in the middle of a
    draft is the next test's). Every output is stock's, and the prompt cache
    afterwards is a fresh prefill of prompt + yielded tokens."""
    name, model, tokenizer = family
    drafter = _Perturbing(policy="fixed", num_draft_tokens=8)
    stock: Dict[int, List[int]] = {}
    drafted = total = cut_drafts = 0
    for i, prompt in enumerate(_prompts(tokenizer)):
        cases = [(MAX_TOKENS, False, None), (MAX_TOKENS - 7, i % 2 == 1, None)]
        if i % 3:
            cases.append((MAX_TOKENS, i % 3 == 2, 3 + 2 * i))
        for max_tokens, perturb, stop in cases:
            if i not in stock:  # greedy: shorter runs are its prefixes
                stock[i] = _run(model, tokenizer, prompt, MAX_TOKENS)[0]
            ref = stock[i][:max_tokens]
            drafter.perturb = perturb
            cache = make_prompt_cache(model)
            toks, flags = _run(model, tokenizer, prompt, max_tokens, drafter, stop, cache)
            what = f"{name}: prompt {i} ({len(prompt)} tokens), max_tokens={max_tokens}, stop={stop}"
            assert toks == (ref if stop is None else ref[: len(toks)]), what
            _assert_cache_is_fresh_prefill(model, cache, prompt + toks, what)
            drafted += sum(flags)
            total += len(toks)
            # A draft ran into max_tokens: drafts stop one short of it (the
            # verification's own next token is the last), here a run of them.
            cut_drafts += stop is None and len(toks) == max_tokens and flags[-3] and flags[-2]
    stats = drafter.snapshot()
    print(f"\n{name}: {drafted}/{total} tokens drafted, {stats['accepted']}/{stats['drafted']} accepted")
    assert drafted / total > 0.1, (name, drafted, total, stats)
    assert stats["accepted"] < stats["drafted"], stats  # some were rejected
    assert cut_drafts > 0
    assert stats["active_requests"] == 0


class _Scripted(SuffixDrafter):
    """Drafts once, after ``at`` tokens: the next 4 tokens of ``script``
    (stock's output), the one at index ``wrong`` changed (None: none)."""

    def __init__(self, script: List[int], at: int, wrong: Optional[int]) -> None:
        super().__init__(policy="fixed", num_draft_tokens=4)
        self.script, self.at, self.wrong = script, at, wrong
        self.n, self.done = 0, False

    def commit(self, req_id: int, tokens: Sequence[int], grow: bool = True) -> None:
        self.n += len(tokens)
        super().commit(req_id, tokens, grow)

    def propose(self, req_id: int, max_tokens: Optional[int] = None) -> Draft:
        if self.done or self.n < self.at:
            return Draft()
        self.done = True
        tokens = list(self.script[self.n : self.n + 4])
        if self.wrong is not None:
            tokens[self.wrong] ^= 1
        return Draft(tokens=tokens, probs=[1.0] * len(tokens))


@pytest.mark.parametrize("wrong", [None, 2], ids=["all-accepted", "2-of-4-accepted"])
@pytest.mark.parametrize("short", [False, True], ids=["long-prompt", "short-prompt"])
def test_close_in_the_middle_of_a_draft(family, wrong, short):
    """Close the generator right after the first token of a draft, which a
    plain forward confirmed and which is handed out while the verification
    of the rest is queued (its positions in the cache, never yielded): the
    cache must still be a fresh prefill of prompt + yielded tokens. The
    draft is stock's next 4 tokens, all right or the 3rd wrong; the prompt
    overflows the sliding window or not."""
    name, model, tokenizer = family
    prompt = _prompts(tokenizer)[-1 if short else 0]
    ref = _run(model, tokenizer, prompt, 12)[0]
    drafter = _Scripted(ref, at=3, wrong=wrong)
    cache = make_prompt_cache(model)
    gen = stream_generate(model, tokenizer, prompt, max_tokens=12, draft_model=drafter, prompt_cache=cache)
    out = [(r.token, r.from_draft) for r in itertools.islice(gen, 4)]
    gen.close()
    toks = [t for t, _ in out]
    # Token 4 (the draft's first, confirmed by the pipelined step) is
    # yielded and counted; the queued verification of the rest is taken back.
    assert [f for _, f in out] == [False] * 3 + [True] and drafter.stats.accepted == 1
    assert drafter.stats.accepted_per_position == {0: 1}
    assert toks == ref[:4]
    _assert_cache_is_fresh_prefill(model, cache, prompt + toks, f"{name}: closed mid-draft")


def test_logits_processors_see_stock_contexts(family):
    """Before each position, a logits processor gets the whole context, the
    prompt and the tokens before it, as from stock ``generate_step``; also
    around a verification that rolls back (2 of 4 drafted tokens accepted)."""
    name, model, tokenizer = family
    prompt = _prompts(tokenizer)[0]

    def recorder(log: List[Tuple[int, ...]]) -> Any:
        def processor(tokens: mx.array, logits: mx.array) -> mx.array:
            log.append(tuple(tokens.tolist()))
            return logits

        return processor

    stock_contexts: List[Tuple[int, ...]] = []
    contexts: List[Tuple[int, ...]] = []
    ref = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=10,
                                       logits_processors=[recorder(stock_contexts)])]
    drafter = _Scripted(ref, at=3, wrong=2)
    steps = suffix_generate_step(mx.array(prompt), model, drafter, max_tokens=10,
                                 logits_processors=[recorder(contexts)])
    assert [t for t, _, _ in steps] == ref and drafter.stats.accepted >= 2
    assert all(c[: len(prompt)] == tuple(prompt) for c in contexts), f"{name}: a context lacks prompt tokens"
    assert set(stock_contexts) <= set(contexts), name


def _fork(cache: List[Any]) -> List[Any]:
    """A copy of a KVCache/ArraysCache prompt cache that steps independently
    (MLX arrays are immutable; only the containers are new)."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            f = ArraysCache(len(c.cache))
            f.cache = list(c.cache)
        else:
            f = KVCache()
            f.state = c.state  # grows by concatenation: the original is not written
        out.append(f)
    return out


def _exact_joint(model: Any, prompt: List[int], allowed: List[int], temp: float) -> np.ndarray:
    """P(x4, x5) when sampling 5 tokens among ``allowed`` at ``temp`` after
    ``prompt``, from one batched forward over every x1..x4 (no cache)."""
    k = len(allowed)
    paths = list(itertools.product(range(k), repeat=4))
    tokens = mx.array([prompt + [allowed[j] for j in path] for path in paths])
    logits = model(tokens)[:, len(prompt) - 1 :, :][..., mx.array(allowed)]
    probs = np.array(mx.softmax(logits / temp, axis=-1))  # (k^4, 5, k)
    joint = np.zeros((k, k))
    for n, path in enumerate(paths):
        p = np.prod([probs[n, j, x] for j, x in enumerate(path)])
        joint[path[3]] += p * probs[n, 4]
    return joint


def test_sampling_is_lossless_on_a_hybrid(tiny_family_path):
    """Sampling at temperature 1 from qwen3_5 (GatedDeltaNet + attention)
    among 4 allowed tokens: the joint of the 4th and 5th tokens, sampled after
    verifications that restore the recurrent state, is the model's own
    (chi-square over 16 cells, 15 dof)."""
    model, tokenizer = load(str(tiny_family_path("qwen3_5")))
    model.set_dtype(mx.float32)
    allowed = sorted(set(tokenizer.encode("x y z w")))
    assert len(allowed) == 4
    index = {t: i for i, t in enumerate(allowed)}
    prompt = tokenizer.encode("xyzw ") + allowed * 2
    bias = mx.full((model.args.text_config["vocab_size"],), -1e9)
    bias[mx.array(allowed)] = 0.0
    n = 300
    joint = _exact_joint(model, prompt, allowed, 1.0)
    assert n * joint.min() > 5  # the chi-square approximation holds
    # The prompt but its last token, prefilled once.
    prefilled = make_prompt_cache(model)
    model(mx.array(prompt[:-1])[None], cache=prefilled)
    mx.random.seed(0)
    sampler = make_sampler(temp=1.0)
    drafter = SuffixDrafter(policy="fixed", num_draft_tokens=3)
    counts = np.zeros((4, 4))
    for _ in range(n):
        out = list(suffix_generate_step(mx.array(prompt[-1:]), model, drafter, max_tokens=5, sampler=sampler,
                                        logits_processors=[lambda _, logits: logits + bias],
                                        prompt_cache=_fork(prefilled),
                                        options=RequestOptions(prompt=prompt)))
        counts[index[out[3][0]], index[out[4][0]]] += 1
    chi2 = ((counts - n * joint) ** 2 / (n * joint)).sum()
    assert chi2 < 37.7, (chi2, counts, n * joint)  # 15 dof, p = 0.001
    # Drafts were verified while sampling, and some rejected (restores).
    assert 0 < drafter.stats.accepted < drafter.stats.drafted


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "gpt_oss"])
def test_quantized_kv_cache_as_stock(name, models_dir):
    """``kv_bits`` 4 and 8, ``quantized_kv_start`` 0 and after the prompt,
    on families with attention beside recurrent layers (their KV layers
    quantize, the recurrent ones do not) and with sliding windows (stock
    cannot quantize those: the same error): greedy tokens are stock's, each
    prompt twice so the second drafts the first answer. The mini models:
    their heads of 32 quantize in groups of 32."""
    from mlx_lm_suffix.tools.models import ensure_model

    model, tokenizer = load(str(ensure_model(name, "mini", cache_dir=models_dir)))
    model.set_dtype(mx.float32)
    prompts = _prompts(tokenizer, 4)[:4]
    for bits, start in itertools.product((4, 8), (0, 60)):
        kw = dict(max_tokens=24, kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
        drafter = SuffixDrafter(policy="fixed", num_draft_tokens=8)
        for prompt in prompts:
            try:
                ref = [r.token for r in stream_generate(model, tokenizer, prompt, **kw)]
            except NotImplementedError as e:  # sliding windows: stock's error
                with pytest.raises(type(e)):
                    list(stream_generate(model, tokenizer, prompt, draft_model=drafter, **kw))
                continue
            for _ in range(2):
                out = [r.token for r in stream_generate(model, tokenizer, prompt,
                                                        draft_model=drafter, **kw)]
                assert out == ref, (name, bits, start)
        assert name == "gpt_oss" or drafter.stats.accepted > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_a_repeat_drafts_its_whole_answer(name, tiny_family_path):
    """Where a verification costs about a plain step whatever its width (a
    GPU's curve), a repeated request drafts its whole answer on every
    family, alone and batched with three other repeats: what the policy
    leaves out on a steeper curve (a CPU's, whose wide forwards cost more
    than the plain steps they save, hybrid models' rejections a replay) is
    its cut, not the family."""
    model, tokenizer = load(str(tiny_family_path(name)))
    asks = ("Write a function that adds two numbers.", "Explain recursion.",
            "List three colors.", "What is a tree?")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True) for q in asks]
    flat = VerifyCost({1: 1.0, 2: 1.01, 64: 1.1}, smoothing=0)
    drafter = SuffixDrafter(cost=flat)
    for _ in range(2):
        out = list(stream_generate(model, tokenizer, prompts[0], max_tokens=64, draft_model=drafter))
    assert sum(r.from_draft for r in out) >= 0.95 * (len(out) - 1), name
    drafter = SuffixDrafter(cost=flat)
    for _ in range(2):
        before = drafter.stats.copy()
        gen = SuffixBatchGenerator(model, drafter, stop_tokens=[[t] for t in tokenizer.eos_token_ids])
        gen.insert(prompts, [64] * 4)
        while gen.next_generated():
            pass
        gen.close()
    repeat = drafter.stats.delta(before)
    assert repeat.accepted >= 0.9 * (repeat.tokens - 4), (name, repeat.accepted, repeat.tokens)
