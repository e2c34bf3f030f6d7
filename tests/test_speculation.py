"""The speculation core (mlx_lm_suffix.speculation): its one cap rule, on
its own and on every path that drives it (the loop, the batch and the
simulator)."""

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step

from mlx_lm_suffix.batch import SuffixBatchGenerator
from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.loop import suffix_generate_step
from mlx_lm_suffix.policy.cost import VerifyCost
from mlx_lm_suffix.sources import Draft
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
    MAX_TOKENS too), verified whole as far as the caps let (the fixed
    policy: the adaptive one prices them by timings, and under load once
    verified none)."""
    drafter = OracleDrafter(num_draft_tokens=64, policy="fixed")
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
    fed, verify = [], simulate.Replay.verify

    def spy(self, token, draft, first):
        fed.append((self.at, 1 + len(draft.tokens) - first))
        return verify(self, token, draft, first)

    monkeypatch.setattr(simulate.Replay, "verify", spy)
    drafter = _oracle(ref)
    replay(drafter, Record(prompt, ref[:MAX_TOKENS]))
    assert fed and drafter.stats.accepted > 0
    assert drafter.stats.tokens == MAX_TOKENS
    assert all(at + n <= MAX_TOKENS for at, n in fed), fed


class _WrongTail(OracleDrafter):
    """Stock's next token, then wrong ones: every draft's first token holds
    (the plain forward confirms it) and its tail fails. Its estimates are as
    sure as a repeat's."""

    def propose(self, req_id, max_tokens=None):
        d = super().propose(req_id, max_tokens)
        tokens = d.tokens[:1] + [(t + 1) % 2048 for t in d.tokens[1:]]
        return type(d)(tokens, [0.95] * len(tokens), match_len=20)


def _trusting(drafter):
    """The pooled calibration as other requests' accepted repeats left it."""
    for _ in range(50):
        drafter.policy.calibration.update([0.95] * 8, 8, 20)
    return drafter


@pytest.mark.parametrize("path", ["loop", "batch"])
def test_a_request_whose_drafts_fail_stops_being_verified(setting, path):
    """However much the pool of earlier requests trusts such drafts, a
    request whose own draft tails fail stops verifying them within
    FAILED_TAILS drafts (RequestTrust: each failed tail cuts its tail
    ratio; here a two-token forward costs 1.5 plain steps)."""
    from mlx_lm_suffix.policy import VerifyCost

    model, prompt, ref = setting
    cost = VerifyCost({1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5, 16: 8.5, 64: 32.5}, smoothing=0)
    drafter = _trusting(_WrongTail(num_draft_tokens=16, cost=cost, policy="adaptive"))
    drafter.set_reference(ref)
    if path == "loop":
        out = [t for t, _, _ in suffix_generate_step(mx.array(prompt), model, drafter,
                                                      max_tokens=2 * MAX_TOKENS)]
    else:
        gen = SuffixBatchGenerator(model, drafter, stop_tokens=[])
        gen.insert([prompt], [2 * MAX_TOKENS])
        out = []
        while responses := gen.next_generated():
            out += [r.token for r in responses]
        gen.close()
    assert out == ref
    verified = sum(n for k, n in drafter.stats.lengths.items() if k > 1)
    assert 0 < verified <= FAILED_TAILS, drafter.stats.lengths


class _WrongThenRight(_WrongTail):
    """Failing tails for the first SWITCH tokens, stock's own after."""

    def propose(self, req_id, max_tokens=None):
        if self._done[req_id] < SWITCH:
            return super().propose(req_id, max_tokens)
        d = OracleDrafter.propose(self, req_id, max_tokens)
        return type(d)(d.tokens, [0.95] * len(d), match_len=20)


SWITCH = 16


def test_a_request_gets_its_drafts_back_when_they_hold(setting):
    """Once its source's drafts hold again, a request verifies them at
    length again within a few drafts: every token it emits meanwhile is held
    against its last draft, verified or not (here a two-token forward costs
    1.1 plain steps, so one-token drafts, whose first token always holds,
    are verified throughout, and longer ones only while their tails hold)."""
    from mlx_lm_suffix.policy import VerifyCost

    model, prompt, _ = setting
    ref = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=4 * MAX_TOKENS)]
    cost = VerifyCost({1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.3, 64: 9.0}, smoothing=0)
    drafter = _trusting(_WrongThenRight(num_draft_tokens=16, cost=cost, policy="adaptive"))
    drafter.set_reference(ref)
    flags = [f for _, _, f in suffix_generate_step(mx.array(prompt), model, drafter,
                                                    max_tokens=len(ref))]

    def longest_run(fs):
        best = run = 0
        for f in fs:
            run = run + 1 if f else 0
            best = max(best, run)
        return best

    assert longest_run(flags[4:SWITCH]) <= 2  # failing tails: one-token drafts
    assert longest_run(flags[SWITCH:]) >= 6  # holding again: long drafts


#: Drafts whose tails fail that a request verifies at most before it stops
#: (after one, its tail ratio is half the pool's: RequestTrust).
FAILED_TAILS = 2


def test_host_work_and_waits_are_counted(setting):
    """The drafter's totals say how much host time drafting and pricing
    took per step and how long, after each wait for the device, the host
    took to queue the next forward."""
    model, prompt, ref = setting
    drafter = _oracle(ref)
    list(suffix_generate_step(mx.array(prompt), model, drafter, max_tokens=MAX_TOKENS))
    snap = drafter.snapshot()
    assert snap["waits"] > 0 and snap["idle_s"] > 0 and snap["host_s"] > 0
    assert snap["host_us_per_step"] == pytest.approx(1e6 * snap["host_s"] / snap["steps"])
    assert snap["idle_us_per_wait"] == pytest.approx(1e6 * snap["idle_s"] / snap["waits"])


def test_a_request_whose_walks_find_nothing_skips_them(setting):
    """A walk of the trees that finds nothing costs host time too: the
    policy learns it from such walks as from drafts, so a request whose
    text repeats nothing walks on a fraction of its steps
    (:meth:`~mlx_lm_suffix.policy.rules.Policy.skips`), not on every one."""
    _, prompt, ref = setting

    class Nothing(SuffixDrafter):
        walks = 0

        def propose(self, req_id, max_tokens=None):
            self.walks += 1
            return Draft()

    # Steps of 10 us: any walk costs more than 1% of one.
    drafter = Nothing(cost=VerifyCost({1: 1e-5, 2: 1.2e-5, 64: 6e-5}))
    replay(drafter, Record(prompt, ref[: 2 * MAX_TOKENS]), step_seconds=1e-5)
    steps = drafter.stats.steps
    assert steps >= 2 * MAX_TOKENS - 1 and drafter.walks <= steps // 4, (drafter.walks, steps)


def test_a_verification_grows_the_trees_while_its_forward_runs(setting, monkeypatch):
    """Tokens committed since the last forward reach the drafter's trees
    while the verification's forward runs (queued, not yet read), not in
    the walk before it: after a verification's result, a walk hands over
    the context alone."""
    from mlx_lm_suffix.tools import simulate

    _, prompt, ref = setting
    seen, verify, verified = [], simulate.Replay.verify, simulate.Replay.verified

    def ungrown(row):
        req = row.drafter._active[row.req]
        return len(row._tokens) + len(req.response) - 1 - req.planted

    def queue(self, *args):
        seen.append([ungrown(self.row)])
        return verify(self, *args)

    def read(self):
        seen[-1].append(ungrown(self.row))
        return verified(self)

    monkeypatch.setattr(simulate.Replay, "verify", queue)
    monkeypatch.setattr(simulate.Replay, "verified", read)
    drafter = OracleDrafter(num_draft_tokens=3, policy="fixed")
    drafter.set_reference(ref)
    replay(drafter, Record(prompt, ref[: 2 * MAX_TOKENS]))
    assert len(seen) > 1 and all(after == 0 for _, after in seen), seen
    assert sum(before for before, _ in seen) > 0, seen
