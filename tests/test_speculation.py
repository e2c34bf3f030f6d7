"""The speculation core (mlx_lm_suffix.speculation): its one cap rule, on
its own and on every path that drives it (the loop, the batch and the
simulator)."""

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_lm_suffix.batch import SuffixBatchGenerator
from mlx_lm_suffix.loop import suffix_generate_step
from mlx_lm_suffix.speculation import Row
from mlx_lm_suffix.tools.bench import OracleDrafter
from mlx_lm_suffix.tools.simulate import Record, replay


def test_the_cap_rule():
    row = Row(None, None, num_draft_tokens=8, max_tokens=10, emitted=5)
    # Pipelined, the draft's first token is the pending one: as many as
    # may still be emitted; settled, the pending token is fed first.
    assert row.cap(room=float("inf"), settled=False) == 5
    assert row.cap(room=float("inf"), settled=True) == 4
    assert row.cap(room=3, settled=False) == 3 and row.cap(room=3, settled=True) == 2
    row.emitted = 0
    assert row.cap(room=100, settled=False) == 8 and row.cap(room=100, settled=True) == 8
    row.emitted = 10
    assert row.cap(room=100, settled=False) == 0


class _Spy:
    """The model, recording (positions before, positions fed) of each forward."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __call__(self, inputs, cache=None, **kw):
        offset = cache[0].offset
        offset = int(mx.max(offset).item()) if isinstance(offset, mx.array) else offset
        self.calls.append((offset, inputs.shape[1]))
        return self.model(inputs, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


MAX_TOKENS, CONTEXT = 12, 9


@pytest.fixture(scope="module")
def setting(tiny_model_path):
    """The tiny model, a prompt, and stock's first 2 * MAX_TOKENS tokens
    after it."""
    model, tokenizer = load(str(tiny_model_path))
    prompt = tokenizer.encode("def add(a, b):\n    return a + b\n" * 3)
    ref = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=2 * MAX_TOKENS)]
    return model, prompt, ref


def _oracle(ref):
    """Drafts of stock's own continuation, as long as asked for (past
    MAX_TOKENS too)."""
    drafter = OracleDrafter(num_draft_tokens=64)
    drafter.set_reference(ref)
    return drafter


@pytest.mark.parametrize("path", ["loop", "batch"])
def test_drafts_never_pass_max_tokens_nor_the_context(setting, path):
    """Drafts that would be accepted whole: every path still verifies no
    position that may not be emitted (max_tokens) nor any past the model's
    context, and emits stock's tokens."""
    model, prompt, ref = setting
    spy, limit = _Spy(model), len(prompt) + CONTEXT
    old, model.args.max_position_embeddings = model.args.max_position_embeddings, limit
    drafter = _oracle(ref)
    try:
        if path == "loop":
            out = [t for t, _, _ in suffix_generate_step(
                mx.array(prompt), spy, drafter, max_tokens=MAX_TOKENS)]
        else:
            gen = SuffixBatchGenerator(spy, drafter, stop_tokens=[])
            gen.insert([prompt], [MAX_TOKENS])
            out = []
            while responses := gen.next_generated():
                out += [r.token for r in responses]
            gen.close()
    finally:
        model.args.max_position_embeddings = old
    assert out == ref[:MAX_TOKENS]
    wide = [(at, n) for at, n in spy.calls if at >= len(prompt) and n > 1]
    assert wide and drafter.stats.accepted > 0
    assert all(at + n <= limit for at, n in wide), wide
    # Past the context, only plain steps (as stock's): max_tokens is reached.
    spy.calls.clear()
    drafter = _oracle(ref)
    out = [t for t, _, _ in suffix_generate_step(mx.array(prompt), spy, drafter, max_tokens=5)]
    assert out == ref[:5]
    assert all(at + n <= len(prompt) + 5 for at, n in spy.calls if n > 1)


def test_the_simulator_caps_as_the_loop(setting, monkeypatch):
    from mlx_lm_suffix.tools import simulate

    _, prompt, ref = setting
    fed, verify = [], simulate._Replay.verify

    def spy(self, inputs):
        fed.append((self.at, len(inputs[0])))
        return verify(self, inputs)

    monkeypatch.setattr(simulate._Replay, "verify", spy)
    drafter = _oracle(ref)
    replay(drafter, Record(prompt, ref[:MAX_TOKENS]))
    assert fed and drafter.stats.accepted > 0
    assert drafter.stats.tokens == MAX_TOKENS
    assert all(at + n <= MAX_TOKENS for at, n in fed), fed
