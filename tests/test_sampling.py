"""Seeded sampling with drafting: the same tokens as stock's for the seed
(mlx_lm_suffix.sampling), on the single-sequence path."""

import inspect

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_lm_suffix import SuffixDrafter, suffix_generate_step
from mlx_lm_suffix.sampling import rewind, sample


@pytest.fixture(scope="module")
def setting(tiny_model_path):
    """The tiny model, a prompt that holds a text, and a logits processor
    that pulls each position towards that text (strongly, not surely: at
    temperature 1 a few draws leave it), so drafts from the prompt are
    verified and mostly accepted while sampling still decides tokens."""
    model, tokenizer = load(str(tiny_model_path))
    text = inspect.getsource(inspect)[3000:3400]
    ref = tokenizer.encode(text)
    prompt = tokenizer.encode(f"Repeat:\n{text}\nAgain:\n")

    def nudge(tokens, logits):
        n = tokens.shape[-1] - len(prompt)
        if 0 <= n < len(ref):
            logits = logits + 11.0 * (mx.arange(logits.shape[-1]) == ref[n])
        return logits

    return model, prompt, ref, nudge


def test_a_seed_gives_stocks_tokens(setting):
    model, prompt, ref, nudge = setting
    drafter = SuffixDrafter(policy="fixed")
    kw = dict(max_tokens=60, logits_processors=[nudge])
    left = 0
    for seed in range(6):
        mx.random.seed(seed)
        stock = [t for t, _ in generate_step(mx.array(prompt), model,
                                             sampler=make_sampler(temp=1.0), **kw)]
        mx.random.seed(seed)
        ours = list(suffix_generate_step(mx.array(prompt), model, drafter,
                                         sampler=make_sampler(temp=1.0), **kw))
        assert [t for t, _, _ in ours] == stock, seed
        assert sum(f for _, _, f in ours) > 20  # most tokens came from drafts
        left += stock != ref[: len(stock)]
    assert left > 0  # sampling, not the nudge alone, chose tokens


def test_rewind_puts_back_the_state_after_the_kept_draws():
    sampler = make_sampler(temp=1.0)
    logprobs = mx.log(mx.ones((5, 50)) / 50)
    mx.random.seed(7)
    one_by_one = [sampler(logprobs[:1]).item() for _ in range(5)]
    mx.random.seed(7)
    tokens, states = sample(sampler, logprobs)
    assert tokens.tolist() == one_by_one
    rewind(states, 2)  # two draws kept: the next one is stock's third
    assert sampler(logprobs[:1]).item() == one_by_one[2]
    greedy = make_sampler(temp=0.0)
    tokens, states = sample(greedy, logprobs)
    assert states is None and tokens.shape == (5,)
