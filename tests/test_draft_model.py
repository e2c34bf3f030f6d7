"""A draft model beside the suffix trees (mlx_lm_suffix.sources.draft_model),
token for token against stock mlx-lm: in process (one sequence), batched, with
every family as target and as draft, its cache in step with the target's."""

from typing import Any, List, Optional, Sequence, Tuple

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_families import _assert_cache_is_fresh_prefill, _prompts
from test_policy import _counting_model

from mlx_lm_suffix import SuffixDrafter
from mlx_lm_suffix.batch import SuffixBatchGenerator
from mlx_lm_suffix.loop import decode, suffix_generate_step
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.sources.draft_model import DraftModel, Paired
from mlx_lm_suffix.speculation import Row
from mlx_lm_suffix.tools import simulate
from mlx_lm_suffix.tools.models import FAMILIES

MAX_TOKENS = 24


def _load(path) -> Tuple[Any, Any]:
    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)
    return model, tokenizer


def _every(n: int) -> Any:
    """A guide that makes every ``n``-th draft token wrong (the draft model
    is the target itself, so the others hold): drafts then hold in part."""
    def guide(context: Sequence[int]) -> Optional[Tuple[int, float]]:
        return ((context[-1] + 7) % 1000, 0.9) if len(context) % n == 0 else None
    return guide


def _stock(model: Any, prompt: List[int], n: int = MAX_TOKENS) -> List[int]:
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def _with_draft(model: Any, draft: Any, guide: Any = None, **kwargs: Any) -> SuffixDrafter:
    kwargs.setdefault("policy", "fixed")
    kwargs.setdefault("max_cached_requests", 0)  # the draft model, not earlier answers
    return SuffixDrafter(draft_model=DraftModel(draft, guide), num_draft_tokens=6, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_as_target_and_as_draft(family, tiny_family_path):
    """A family's tiny model drafting for itself (every third draft token
    made wrong) and for qwen3, and qwen3 drafting for it: stock's tokens,
    drafts verified and partly rejected, and after each generation the
    cache of both models is a fresh prefill of the prompt and the tokens."""
    model, tokenizer = _load(tiny_family_path(family))
    qwen3, _ = _load(tiny_family_path("qwen3"))
    prompt = _prompts(tokenizer, 2)[1]
    for target, draft, guide in ((model, model, _every(3)), (qwen3, model, None),
                                 (model, qwen3, None)):
        drafter = _with_draft(target, draft, guide)
        cache = drafter.draft_model.pair(target).make_cache()
        out = [t for t, _, _ in suffix_generate_step(mx.array(prompt), target, drafter,
                                                     max_tokens=MAX_TOKENS, prompt_cache=cache)]
        assert out == _stock(target, prompt), (family, target is model, draft is model)
        stats = drafter.stats
        assert stats.source_drafted.get("model", 0) > 0 and stats.model_forwards > 0
        if guide is not None:  # the draft is the target's own greedy, but for its wrong tokens
            assert 0 < stats.source_accepted["model"] < stats.source_drafted["model"]
        _assert_cache_is_fresh_prefill(drafter.draft_model.pair(target), cache,
                                       prompt + out, f"{family}: both models' cache")


def test_the_draft_model_keeps_its_drafted_positions_as_stocks(tiny_family_path):
    """As stock's speculative decoding, the draft model keeps the positions
    it drafted: a verification feeds it none of them (the last drafted
    token, where all are verified, waits for its next draft's first
    forward), so its forwards are its prompt's, its drafts' own and the
    plain steps', not one more a verification; the output is stock's and
    the cache of both models a fresh prefill after it."""
    model, tokenizer = _load(tiny_family_path("qwen3"))
    prompt = _prompts(tokenizer, 2)[1]
    fed, prefilled = [], []
    drafter = _with_draft(model, _counting_model(tiny_family_path("qwen3"), fed), _every(3))
    paired = drafter.draft_model.pair(model)
    cache = paired.make_cache()
    out = [t for t, _, _ in suffix_generate_step(mx.array(prompt), model, drafter,
                                                 max_tokens=MAX_TOKENS, prompt_cache=cache)]
    assert out == _stock(model, prompt)
    stats = drafter.stats
    assert stats.draft_steps >= 3 and stats.source_accepted["model"] > 0
    list(generate_step(mx.array(prompt), _counting_model(tiny_family_path("qwen3"), prefilled),
                       max_tokens=0))
    # the prompt's forwards, the drafts', the plain steps' and the request's end
    most = len(prefilled) + stats.model_forwards + stats.steps - stats.draft_steps + 1
    assert len(fed) <= most, (len(fed), most, stats)
    _assert_cache_is_fresh_prefill(paired, cache, prompt + out, "both models' cache")


def test_a_target_only_cache_gets_the_draft_model_its_prefix(tiny_family_path):
    """A caller's cache of the target alone, holding part of the prompt: the
    draft model gets the cached prefix (from the whole prompt, ``options``)
    and drafts after it; the caller's list is left as it was."""
    from mlx_lm_suffix.speculation import RequestOptions

    model, tokenizer = _load(tiny_family_path("qwen3"))
    prompt = _prompts(tokenizer, 2)[1]
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:30])[None], cache=cache)
    drafter = _with_draft(model, model, _every(4))
    out = [t for t, _, _ in suffix_generate_step(
        mx.array(prompt[30:]), model, drafter, max_tokens=MAX_TOKENS, prompt_cache=cache,
        options=RequestOptions(prompt=prompt))]
    assert out == _stock(model, prompt)
    assert len(cache) == len(make_prompt_cache(model))
    assert drafter.stats.source_accepted.get("model", 0) > 0


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_family_path):
    model, _ = _load(tiny_family_path("qwen3"))
    other, _ = _load(tiny_family_path("qwen3"))
    other.args.vocab_size = model.args.vocab_size + 1
    drafter = SuffixDrafter(draft_model=other)
    with pytest.raises(ValueError, match="vocabulary"):
        list(suffix_generate_step(mx.array([1, 2, 3]), model, drafter, max_tokens=4))
    with pytest.raises(ValueError, match="mlx-lm model"):
        SuffixDrafter(draft_model="not a model")


def _eos(tokenizer: Any) -> List[List[int]]:
    return [[t] for t in tokenizer.eos_token_ids]


def _batch(gen: Any, prompts: List[List[int]], lengths: List[int], check: Any = None
           ) -> List[List[int]]:
    uids = gen.insert(prompts, lengths)
    tokens = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
        if check is not None:
            check(gen)
    return [tokens[u] for u in uids]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss"])
def test_batched_rows_draft_from_the_model_and_equal_stock(family, tiny_family_path):
    """A batch whose rows (finishing at different steps) draft from a draft
    model (the target itself, every third token made wrong): stock's tokens,
    verifications settled with the pending tokens, and after every step
    each row's draft cache holds what its target cache holds (the batch's
    tokens, by the cache's own offsets)."""
    model, tokenizer = _load(tiny_family_path(family))
    prompts = _prompts(tokenizer, 4)[:4]
    lengths = [MAX_TOKENS, 9, 17, MAX_TOKENS]
    stock = BatchGenerator(model, stop_tokens=_eos(tokenizer))
    ref = _batch(stock, prompts, lengths)
    stock.close()
    drafter = _with_draft(model, model, _every(3))

    def check(gen: Any) -> None:
        batch = gen.generation_batch
        if not len(batch) or batch.held is not None:
            return
        for c in batch.prompt_cache[-1].caches:  # the draft model's
            if hasattr(c, "offset") and isinstance(c.offset, mx.array) and c.offset.size:
                target = next(t for t in batch.prompt_cache if hasattr(t, "offset")
                              and isinstance(t.offset, mx.array))
                assert c.offset.tolist() == target.offset.tolist()

    gen = SuffixBatchGenerator(model, drafter, stop_tokens=_eos(tokenizer))
    assert isinstance(gen.model, Paired)
    out = _batch(gen, prompts, lengths, check)
    stats = gen.draft_stats
    gen.close()
    assert out == ref
    assert drafter.stats.source_accepted.get("model", 0) > 0
    assert stats.unpipelined_steps > 0 and stats.max_verify_batch_size > 1
    assert drafter.active_requests == 0


def _staggered(gen: Any, prompts: List[List[int]], check: Any = None) -> Tuple[dict, dict]:
    """Three prompts, three more after the third step, the second removed
    after the fifth; every uid's tokens and finishing response (``check``
    after every step)."""
    first = gen.insert(prompts[:3], [MAX_TOKENS] * 3)
    tokens, finished, steps = {}, {}, 0
    while (responses := gen.next_generated()) or steps < 3:
        steps += 1
        if steps == 3:
            gen.insert(prompts[3:], [MAX_TOKENS] * 3)
        if steps == 5:
            gen.remove([first[1]])
        for r in responses:
            tokens.setdefault(r.uid, []).append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r
        if check is not None:
            check(gen)
    return tokens, finished


def test_a_batchs_draft_model_keeps_its_drafted_positions(tiny_family_path, monkeypatch):
    """A batch's draft model whose every layer trims per row (attention, no
    window) keeps the positions it drafted, each row its own: the
    verification of a draft feeds the target alone, and the next draft
    feeds each row the tokens it lacks before its pending token. With rows
    joining and leaving mid-run and the left padding compacted whenever
    any: stock's tokens; after every step each row of the draft model holds
    the target's tokens less those it lacks plus those it drafted; each
    finished row's cache, both models', a fresh prefill of its tokens; and
    the draft model is fed fewer tokens than where its rows roll back with
    the target's (every verification feeds it)."""
    from mlx_lm_suffix import batch as batch_module

    monkeypatch.setattr(batch_module, "COMPACT_LEFT_PADDING", 1)
    model, tokenizer = _load(tiny_family_path("qwen3"))
    prompts = _prompts(tokenizer, 6)[:6]
    stock = BatchGenerator(model, stop_tokens=_eos(tokenizer))
    ref = _batch(stock, prompts, [MAX_TOKENS] * 6)
    stock.close()
    checked = []

    def check(gen: Any) -> None:
        batch = gen.generation_batch
        if not len(batch):
            return
        rows = batch.draft_rows
        fed = batch.held.width if batch.held is not None else 0  # (a verification queued)
        ahead = [len(a) for a in rows.ahead] if rows.ahead is not None else [fed] * len(batch)
        want = [len(t) - len(x) + a for t, x, a in zip(batch.tokens, rows.lack, ahead)]
        assert batch.prompt_cache[0].offset.tolist() == [len(t) + fed for t in batch.tokens]
        assert batch.prompt_cache[-1].caches[0].offset.tolist() == want
        checked.append(any(rows.lack) or rows.ahead is not None)

    fed = {}
    for apart in (True, False):
        if not apart:
            monkeypatch.setattr(Paired, "rows_apart", lambda self: False)
        fed[apart] = []
        drafter = _with_draft(model, _counting_model(tiny_family_path("qwen3"), fed[apart]),
                              _every(3))
        gen = SuffixBatchGenerator(model, drafter, stop_tokens=_eos(tokenizer))
        assert (gen.generation_batch.draft_rows is not None) == apart
        tokens, finished = _staggered(gen, prompts, check if apart else None)
        gen.close()
        fed[apart] = list(fed[apart])  # (not the checks' prefills below)
        outs = list(tokens.values())
        assert outs[1] == ref[1][: len(outs[1])] and outs[:1] + outs[2:] == ref[:1] + ref[2:]
        assert drafter.stats.source_accepted.get("model", 0) > 0
        assert drafter.active_requests == 0
        if apart:
            assert any(checked) and gen.draft_stats.compactions > 0
            for r in finished.values():
                _assert_cache_is_fresh_prefill(drafter.draft_model.pair(model), r.prompt_cache,
                                               r.all_tokens, "a finished row's cache")
    assert sum(fed[True]) < sum(fed[False]) and len(fed[True]) <= len(fed[False])


def test_the_policy_runs_the_draft_model_where_its_drafts_hold(tiny_family_path):
    """Adaptive, where a verification of 7 tokens costs 1.7 plain steps, of
    one 1.2 (so a one-token try costs a fifth of a step beyond a plain
    step, the draft model keeping its drafted positions), and a draft
    model's forward a tenth of one (of one token or eight, as a small
    model's forwards cost about alike): a draft model whose tokens hold
    is run and verified; one whose every token is wrong (however sure it
    says it is) soon runs no more than a short try per request and its
    probes (a forward each, at most OVERHEAD of the plain steps' time: a
    tenth of a step every ten steps)."""
    from mlx_lm_suffix.policy.rules import OVERHEAD

    model, tokenizer = _load(tiny_family_path("qwen3"))
    prompts = _prompts(tokenizer, 4)
    cost = VerifyCost({1: 1.0, 2: 1.2, 8: 1.7}, smoothing=0)
    # A random-weight model's probabilities say nothing: the guides give the
    # estimates a sure draft model would (0.95), with stock's next token or
    # a wrong one.
    truth = {}
    for p in prompts:
        seq = p + _stock(model, p)
        truth.update({tuple(seq[i - 8 : i]): seq[i] for i in range(8, len(seq))})
    right = lambda context: (truth.get(tuple(context[-8:]), 0), 0.95)  # noqa: E731
    wrong = lambda context: ((context[-1] + 7) % 1000, 0.95)  # noqa: E731
    for guide, holds in ((right, True), (wrong, False)):
        drafter = _with_draft(model, model, guide, policy="adaptive", cost=cost)
        drafter.policy.draft_cost = VerifyCost({1: 0.1, 8: 0.1}, smoothing=0)
        runs = []
        for p in prompts:
            before = drafter.stats.model_forwards
            out = [t for t, _, _ in suffix_generate_step(mx.array(p), model, drafter,
                                                         max_tokens=MAX_TOKENS)]
            assert out == _stock(model, p)
            runs.append(drafter.stats.model_forwards - before)
        if holds:
            assert drafter.stats.source_accepted.get("model", 0) > MAX_TOKENS
        else:
            assert drafter.stats.source_accepted.get("model", 0) == 0
            probes = OVERHEAD * MAX_TOKENS / 0.1
            assert runs[0] >= 5 * max(runs[-2:]) and max(runs[-2:]) <= 3 + probes, runs


def test_a_guide_that_names_every_token_drafts_as_one_that_is_read_each_step(
        tiny_family_path, monkeypatch):
    """A guide that names every draft token plans the draft before the draft
    model's forwards (no step's result read by the host): the same tokens
    and estimates as read step by step, the guide's chain, and the draft
    cache as before; where the guide names none, the model's own tokens."""
    model, tokenizer = _load(tiny_family_path("qwen3"))
    prompt = _prompts(tokenizer, 2)[1]
    chain = lambda context: ((context[-1] * 3 + 1) % 1000, 0.5)  # noqa: E731
    dm = DraftModel(model, chain)
    paired = dm.pair(model)
    cache = paired.make_cache()
    paired(mx.array(prompt)[None], cache=cache)
    first = mx.array([prompt[-1]], mx.uint32)
    offset = cache[-1].caches[0].offset
    planned = dm.draft(paired, cache, first, 5, [prompt])[:2]
    want = [prompt[-1]]
    for _ in range(5):
        want.append((want[-1] * 3 + 1) % 1000)
    assert planned == ([want[1:]], [[0.5] * 5])
    # (it keeps the pending token and 4 drafted positions, as stock's draft cache)
    assert cache[-1].caches[0].offset == offset + 5
    paired.settle(cache)
    assert cache[-1].caches[0].offset == offset
    monkeypatch.setattr(DraftModel, "_planned", lambda self, contexts, steps: None)
    assert dm.draft(paired, cache, first, 5, [prompt])[:2] == planned
    paired.settle(cache)
    dm.guide = lambda context: None
    own = dm.draft(paired, cache, first, 5, [prompt])[:2]
    paired.settle(cache)
    dm.guide = None
    assert own == dm.draft(paired, cache, first, 5, [prompt])[:2]


# ---------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("draft-model-server-logs")


def test_server_with_a_draft_model_batches_and_equals_stock(tiny_model_path, server_logs):
    """``--draft suffix --draft-model D``: concurrent requests are batched
    (stock serves a draft model's requests one at a time), the model drafts
    (``usage`` per source, summing to the stats' per-source counts), texts
    are a stock server's; a request with a seed takes the single path,
    with the draft model too."""
    import concurrent.futures

    from test_server import SUFFIX_FIXED, Server, _chat, _source_text

    texts = [_source_text(60 + i, n=120) for i in range(6)]
    stock = Server(tiny_model_path, log_dir=server_logs, name="stock")
    ours = Server(tiny_model_path, *SUFFIX_FIXED, "--draft-model", str(tiny_model_path),
                  "--num-draft-tokens", "6", log_dir=server_logs, name="suffix-draft")
    try:
        refs = [_chat(stock.client(), t)[:2] for t in texts]
        seeded = _chat(stock.client(), texts[0], seed=5)[:2]
        x = ours.client()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda t: _chat(x, t), texts))
        assert [o[:2] for o in outs] == refs
        stats = ours.wait_idle()
        assert stats["batch"]["max_verify_batch_size"] > 1
        usage = [o[2] for o in outs]
        by_source = [u.model_extra["accepted_draft_tokens_by_source"] for u in usage]
        assert all(s.get("model", 0) > 0 for s in by_source)
        drafted = sum(u.model_extra["draft_tokens_by_source"].get("model", 0) for u in usage)
        model = stats["models"][0]
        assert model["source_drafted"]["model"] == drafted
        assert model["draft_model"] is True
        assert _chat(x, texts[0], seed=5)[:2] == seeded
    finally:
        stock.stop()
        ours.stop()


def test_server_refuses_a_draft_model_of_another_tokenizer(tiny_model_path, tmp_path,
                                                            server_logs):
    """A draft model whose tokenizer is not the model's: exit status 2 at
    start-up with a message, before anything is served."""
    import json
    import shutil
    import subprocess

    from test_server import SERVER

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_path, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    out = subprocess.run(
        [SERVER, "--model", str(tiny_model_path), "--draft", "suffix", "--draft-model",
         str(other), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "draft model's tokenizer is not the model's" in out.stderr


def test_seeded_sampling_with_a_draft_model_is_stocks(tiny_family_path):
    """Sampled with a seed, drafts from a draft model (partly wrong) give
    stock's tokens for that seed: each position draws from the random state
    its own step would have."""
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = _load(tiny_family_path("qwen3"))
    prompt = _prompts(tokenizer, 2)[1]
    sampler = make_sampler(temp=0.05)  # (a random model: its distributions are flat)
    mx.random.seed(11)
    ref = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS,
                                       sampler=sampler)]
    drafter = _with_draft(model, model, _every(3))
    mx.random.seed(11)
    out = [t for t, _, _ in suffix_generate_step(mx.array(prompt), model, drafter,
                                                 max_tokens=MAX_TOKENS, sampler=sampler)]
    assert out == ref
    assert drafter.stats.source_accepted.get("model", 0) > 0


# ------------------------------------------------------ replayed choices
class _Foreseeing(simulate.Replay):
    """A replay whose draft model drafts the response's next tokens (each
    with estimate 0.9), its forwards free."""

    def model_draft(self, steps: int, settled: bool, contexts: Any
                    ) -> Tuple[List[List[int]], List[List[float]], float]:
        start = self.at + (1 if settled else 0)
        tokens = self.response[start : start + steps]
        return [tokens + [-2] * (steps - len(tokens))], [[0.9] * steps], 0.0


def _replay_with_model(credit: Optional[float] = None, in_prompt: bool = False
                       ) -> Tuple[SuffixDrafter, List[str]]:
    """A new text (nothing in it repeats; ``in_prompt``: the prompt holds
    it, so the trees draft it long and sure) replayed through an adaptive
    drafter with a draft model that foresees it, where a verification of
    ``n`` tokens costs ``1 + 0.1 (n - 1)`` plain steps and a draft forward a
    tenth of one; ``credit``: the request's, set before it starts. Returns
    the drafter and the forwards' kinds in order."""
    cost = lambda n: 1.0 + 0.1 * n  # noqa: E731
    step = 0.05
    drafter = SuffixDrafter(cost=VerifyCost({n: cost(n - 1) * step for n in (1, 2, 4, 8, 16)}),
                            draft_model=DraftModel(None))
    drafter.policy.draft_cost = VerifyCost({1: 0.1 * step}, smoothing=0)
    prompt, response = list(range(100, 140)), list(range(500, 600))
    req = drafter.start(prompt + response if in_prompt else prompt)
    row = Row(drafter, req, drafter.num_draft_tokens, len(response))
    row.model = True
    if credit is not None:
        row.trust.credit = credit
    target = _Foreseeing(row, response, drafter.policy, cost, step)
    kinds = []
    plain, verify = target.plain, target.verify
    target.plain = lambda: (kinds.append("plain"), plain())[1]  # type: ignore[method-assign]
    target.verify = lambda *a: (kinds.append("verify"), verify(*a))[1]  # type: ignore[method-assign]
    for _ in decode(target, row):
        pass
    row.finish()
    assert target.at == len(response)
    return drafter, kinds


def test_a_row_with_a_draft_model_drafts_after_its_pending_token():
    """Where the policy runs the draft model, a row with nothing else to
    draft drafts from it after its pending token from its first step on: it
    takes no plain forward (a pipelined step would check the model's
    surest token with a forward of its own)."""
    drafter, kinds = _replay_with_model()
    assert kinds and "plain" not in kinds
    assert drafter.stats.source_accepted["model"] >= 0.7 * 100


def test_draft_model_drafts_are_verified_whatever_the_requests_credit():
    """A request whose credit a failed draft spent still verifies the draft
    model's drafts (their length is priced with the draft forwards; the
    credit bounds the trees' long drafts)."""
    drafter, _ = _replay_with_model(credit=-10.0)
    assert drafter.stats.source_accepted["model"] >= 0.7 * 100


def test_a_spent_credit_hands_the_trees_long_draft_to_the_draft_model():
    """Where the request's credit affords none of the trees' draft (a long
    one failed before), the draft model drafts in its place: the policy
    weighs the trees' draft as much of it as a verification may take, not
    whole (it had kept the trees' draft, verified none of it, and took a
    plain step for every token)."""
    drafter, kinds = _replay_with_model(credit=-10.0, in_prompt=True)
    assert sum(drafter.stats.source_accepted.values()) >= 0.7 * 100
    assert kinds.count("plain") < 10


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_pending_token_is_handed_out_while_its_verification_runs(family, tiny_family_path):
    """A row with a draft model verifies from its first step after the
    pending token; that token is the model's already, so the consumer has
    it once the verification is queued, not once it is read; the first
    token as soon as the prompt's forward gives it, before the draft model
    drafts after it. Closing after any token leaves both models' cache a
    fresh prefill of the prompt and the tokens given (the queued
    verification's drafts leave, the token given stays)."""
    model, tokenizer = _load(tiny_family_path(family))
    prompt = _prompts(tokenizer, 2)[1]
    ref = _stock(model, prompt)
    drafter = _with_draft(model, model, _every(3))
    gen = suffix_generate_step(mx.array(prompt), model, drafter, max_tokens=MAX_TOKENS)
    assert next(gen)[0] == ref[0]
    assert drafter.stats.model_forwards == 0  # the draft model has not drafted yet
    assert next(gen)[0] == ref[1]
    assert drafter.stats.model_forwards > 0
    gen.close()
    for stop in range(1, MAX_TOKENS):
        drafter = _with_draft(model, model, _every(3))
        cache = drafter.draft_model.pair(model).make_cache()
        gen = suffix_generate_step(mx.array(prompt), model, drafter, max_tokens=MAX_TOKENS,
                                   prompt_cache=cache)
        toks = [t for t, _, _ in (next(gen) for _ in range(stop))]
        gen.close()
        assert toks == ref[:stop]
        _assert_cache_is_fresh_prefill(drafter.draft_model.pair(model), cache, prompt + toks,
                                       f"{family}: closed after {stop} tokens")
