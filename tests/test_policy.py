"""The cost-aware draft-length policy on synthetic cost curves and
probability vectors, and the cost model's calibration on a real model."""

import time

import mlx.core as mx
import pytest
from mlx_lm import load

from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.patches.generate import format_stats
from mlx_lm_suffix.policy import (
    LONG_MATCH,
    Calibration,
    VerifyCost,
    best_batch_lengths,
    best_length,
    given_first,
)
from mlx_lm_suffix.policy import rules as policy
from mlx_lm_suffix.policy.calibration import RequestTrust
from mlx_lm_suffix.policy.rules import Policy
from mlx_lm_suffix.sources import Draft


def _draft(drafter, req, max_tokens=None):
    """The draft one settled sequence verifies."""
    draft = drafter.propose(req, max_tokens)
    return draft.truncate(drafter.policy.length(draft, pipelined=False))


FLAT = VerifyCost({1: 1.0, 16: 1.1, 32: 1.6, 64: 3.0})  # GPU-like: cheap up to 16
LINEAR = VerifyCost({1: 1.0, 2: 2.0, 32: 32.0})  # every token costs a full step
CPU = VerifyCost({1: 118, 2: 119, 4: 146, 8: 158, 16: 194, 32: 281})  # notes.md


def test_cost_interpolation_and_extrapolation():
    assert CPU(1) == 118 and CPU(16) == 194
    assert CPU(12) == pytest.approx((158 + 194) / 2)
    # Past the last point: as the last segment grows, at most proportionally.
    assert CPU(64) == pytest.approx(281 + (281 - 194) * 2)
    assert VerifyCost({1: 1.0, 2: 2.0})(8) == 8.0
    assert CPU(0) == 118
    with pytest.raises(ValueError):
        VerifyCost({4: 1.0})


def test_cost_curve_stays_physical_under_noise():
    # Noise only adds time: a point above a larger size's, or above
    # proportional growth from a smaller size's, comes down to that bound.
    noisy = VerifyCost({1: 2.0, 2: 1.0, 4: 10.0, 8: 3.0})
    assert noisy.points == {1: 1.0, 2: 1.0, 4: 2.0, 8: 3.0}
    # Online refinement keeps it so: a slow step at 2 cannot make 2 tokens
    # cost more than 4, nor more than two one-token steps.
    noisy.observe(2, 50.0)
    assert noisy.points[2] <= min(noisy.points[4], 2 * noisy.points[1])
    assert CPU.points == {1: 118, 2: 119, 4: 146, 8: 158, 16: 194, 32: 281}


def test_cost_curve_learns_sizes_past_its_points():
    # With the plain step's point alone the curve grows proportionally; the
    # first wider forward seen, even of two tokens, becomes a point (it does
    # not refine the plain step's).
    first = VerifyCost({1: 2.0})
    assert first(9) == 18.0
    first.observe(2, 3.0)
    assert first.points == {1: 2.0, 2: 3.0} and first(4) == 5.0
    # Past the last point the curve grows as the last segment does, and a
    # step with no point within a factor of two becomes a point of its own.
    c = VerifyCost({1: 1.0, 8: 1.4})
    assert c(64) == pytest.approx(1.4 + 0.4 / 7 * 56)
    c.observe(64, 3.0)
    assert c.points[64] == 3.0 and c(128) == pytest.approx(3.0 + 1.6 / 56 * 64)
    c.observe(100, 6.0)  # refines 64 (within a factor of two)
    assert 3.0 < c.points[64] and 100 not in c.points
    c.observe(3, 1.1)
    assert c.points[3] == 1.1
    known = VerifyCost({1: 1.0, 64: 4.0}, smoothing=0)
    known.observe(100, 5.0)
    assert known.points == {1: 1.0, 64: 4.0}


def test_least_prices_widths_past_the_widest_point_at_its_cost():
    # Past the widest point, up to four times it, a forward may cost no more
    # than that point (the curve never falls); further out, and for a batch,
    # the curve's own guess.
    c = VerifyCost({1: 1.0, 2: 1.2})
    assert [c.least(n) for n in (1, 2, 3, 8)] == [1.0, 1.2, 1.2, 1.2]
    assert c.least(9) == c(9) == pytest.approx(2.6)
    assert c.least(6, rows=2) == c(6, rows=2)
    c.observe(8, 1.3)  # past twice the widest point: a point, priced from there
    assert c.points[8] == 1.3 and c.least(32) == 1.3 and c(32) > 1.3


def test_batched_steps_learn_their_own_factor():
    # A batch forward of B rows x W tokens costs more than one sequence's
    # forward of B*W (each row attends to its own context, samples and runs
    # its processors per position). Before any is seen, the prior: the more
    # of that forward and of the plain B-row step made as much dearer as one
    # sequence's forward gets from 1 to W tokens.
    c = VerifyCost({1: 1.0, 8: 2.0, 16: 2.2, 64: 5.0})
    assert c(16, rows=8) == c.batch_prior(16, 8) == pytest.approx(c(8) * c(2))  # 8 x 2
    assert c(64, rows=2) == c.batch_prior(64, 2) == c(64) == 5.0  # 2 x 32: the curve
    assert all(c.batch_prior(b, b) == c(b) for b in (2, 8, 16))  # width 1: the plain step
    # Real batched steps teach a factor per shape, and leave the
    # one-sequence curve alone.
    c.observe(16, 3.3, rows=8)  # 8 rows x 2 tokens
    assert c(16, rows=8) == pytest.approx(3.3) and c.points[16] == 2.2
    c.observe(24, 3.9, rows=8)  # 8 x 3: the same width bucket, averaged
    factor = (3.3 / c.batch_prior(16, 8) + 3.9 / c.batch_prior(24, 8)) / 2
    assert c.batch_factors[(8, 2)] == [pytest.approx(factor), 2]
    assert c(16, rows=1) == 2.2
    # A shape not seen yet takes the factor of the same widths with the
    # nearest number of rows; other widths' factors do not carry over.
    assert c(12, rows=4) == pytest.approx(c.batch_prior(12, 4) * factor)  # 4 rows x 3
    assert c(4, rows=2) == pytest.approx(c.batch_prior(4, 2) * factor)  # 2 rows x 2
    assert c(64, rows=8) == c.batch_prior(64, 8)  # 8 x 8: no shape of that width seen
    c.observe(64, 2 * c.batch_prior(64, 8), rows=8)  # 8 x 8, first seen: the mean starts there
    assert c.batch_factors[(8, 4)] == [pytest.approx(2.0), 1]
    assert c(80, rows=8) == pytest.approx(2 * c.batch_prior(80, 8))
    assert c(48, rows=4) == pytest.approx(2 * c.batch_prior(48, 4))  # 4 x 12: the 8 x 8-15 factor
    assert c(512, rows=8) == c.batch_prior(512, 8)  # 8 x 64: wider than any seen
    assert c.batch_relative() == {"8x2-3": pytest.approx(factor), "8x8-15": pytest.approx(2.0)}
    # The policy's verification cost is the batch's: a width that paid on
    # the prior alone does not once the batch forward is seen to be dear.
    rows = [[0.9, 0.8]] * 8
    assert best_batch_lengths(rows, VerifyCost(dict(c.points)), pipelined=True) == [2] * 8
    assert best_batch_lengths(rows, c, pipelined=True) == [0] * 8
    frozen = VerifyCost({1: 1.0}, smoothing=0)
    frozen.observe(8, 5.0, rows=8)
    assert frozen.batch_factors == {} and frozen(8, rows=8) == frozen.batch_prior(8, 8)


def test_a_batch_of_fewer_rows_costs_no_more():
    """One noisy step that prices a shape too dear does not keep it from
    running: a batch of fewer rows at the same width costs at most what a
    seen batch of more rows does."""
    c = VerifyCost({1: 1.0, 2: 1.1, 8: 1.4})
    c.observe(24, 1.5 * c.batch_prior(24, 8), rows=8)  # 8 rows x 3
    c.observe(21, 4.0 * c.batch_prior(21, 7), rows=7)  # 7 rows x 3, during a spike
    assert c(21, rows=7) == pytest.approx(1.5 * c.batch_prior(24, 8))
    assert c(21, rows=7) < 4.0 * c.batch_prior(21, 7)
    c.observe(16, 3.0 * c.batch_prior(16, 8), rows=8)  # 8 rows x 2 (the same bucket), dearer
    assert c(21, rows=7) == pytest.approx(c.batch_prior(24, 8) * c.batch_factors[(8, 2)][0])
    assert c(24, rows=9) == pytest.approx(c.batch_prior(24, 9) * c.batch_factors[(8, 2)][0])


def _cum(p, n):
    """Cumulative estimates, as arctic-inference returns them."""
    return [p ** (i + 1) for i in range(n)]


MID = VerifyCost({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4, 16: 4.0})


def test_drafts_long_when_cheap_and_likely():
    assert best_length([1.0] * 32, FLAT) == 32
    # (31: past its largest point, 32 tokens, the curve grows proportionally)
    assert best_length([1.0] * 31, CPU) == 31
    assert best_length(_cum(0.95, 32), CPU) >= 8
    assert best_length(_cum(0.98, 15), MID) == 15


def test_drafts_short_or_nothing_when_unlikely_or_dear():
    assert best_length(_cum(0.005, 16), CPU) == 0
    assert best_length(_cum(0.15, 16), MID) == 0  # 1.15 tokens for 1.2 steps
    assert best_length(_cum(0.6, 16), MID) <= 2
    # When verification costs a full step per token, no uncertain draft pays.
    assert best_length(_cum(0.9, 8), LINEAR) == 0
    # Sure tokens then unlikely ones: stop where the next token stops paying.
    k = best_length([1.0, 1.0, 1.0, 0.3, 0.05, 0.01, 0.001], MID)
    assert k == 3


def _shrunk(accepted, expected, pool_accepted, pool_expected, prior=10.0, start=1.0):
    """A cell's ratio: its own counts, plus ``prior`` tokens at its pool's
    ratio (the pool's own prior: ``prior`` tokens at ``start``, 1.0 but for
    short matches' tail steps)."""
    pooled = (pool_accepted + prior * start) / (pool_expected + prior)
    return (accepted + prior * pooled) / (expected + prior)


def test_probability_scale_shortens_drafts():
    probs = _cum(0.97, 16)
    assert best_length(probs, MID) > 8
    assert best_length([0.1 * p for p in probs], MID) == 0
    c = Calibration()
    assert c.ratio(1, "first") == c.ratio(LONG_MATCH, "tail") == 1.0  # nothing seen
    # An unverified short match's continuation may break at any step.
    assert c.ratio(40, "tail") == c.short_tail_ratio == 0.9
    for i in range(50):  # first tokens right 4 in 5, tails never
        c.update([0.5] * 4, accepted=1 if i % 5 else 0, match_len=2)
    first = _shrunk(40, 25, 40, 25)
    # Only the steps reached are trials: the second token after each of
    # the 40 accepted first tokens (estimate 1 given the first).
    tail = _shrunk(0, 40, 0, 40, start=0.9)
    assert c.ratio(1, "first") == pytest.approx(first)
    assert c.ratio(1, "tail") == pytest.approx(tail)
    # Match lengths not seen yet start from what their part has earned.
    # Long matches (repeats) have pools of their own: short ones' distrust
    # does not carry over.
    assert c.ratio(20, "first") == pytest.approx(50 / 35)
    assert c.ratio(90, "tail") == 1.0
    assert c.ratio(LONG_MATCH, "first") == 1.0
    assert c.scale([1.0, 1.0], LONG_MATCH) == [1.0, 1.0]
    assert c.ratio(20, "tail") == pytest.approx(9 / 50)
    # Flat estimates after a short match (one continuation known) are scaled
    # down after the first token too, step by step, so a pipelined tail no
    # longer looks sure and falls the further it goes; each step a draft
    # survived counts for the next (one of draft_weight steps).
    w = c.draft_weight
    assert c.scale([0.5] * 3, 2) == pytest.approx(
        [first / 2, first / 2 * tail, first / 2 * tail * (tail * w + 1) / (w + 1)]
    )
    assert best_length([0.5] * 8, MID, pipelined=True) == 8
    assert best_length(c.scale([0.5] * 8, 2), MID, pipelined=True) == 0
    # A new drafter's flat 64-token draft after a short match: its second
    # token at the prior's 0.9, every later one lower, yet the steps it
    # survived count, so its last is not 0.9 ** 63.
    fresh = Calibration().scale([1.0] * 64, 2)
    assert fresh[1] == pytest.approx(0.9) and all(q < p for p, q in zip(fresh[1:], fresh[2:]))
    assert 0.2 < fresh[63] < 0.3
    ratios = c.ratios()
    assert list(ratios) == ["tree", "copy", "model"] and list(ratios["tree"]) == ["first", "tail"]
    assert list(ratios["tree"]["first"]) == list(ratios["copy"]["tail"]) == [
        "1-2", "3-4", "5-8", "9-16", "17-32", "33-47", "48+"
    ]
    assert ratios["tree"]["first"]["1-2"] == pytest.approx(first)

    # Repeats the trees rate 0.5 (their own occurrence counts) are accepted in
    # full: their first token is trusted more, up to the cap, and then they pay.
    r = Calibration()
    for _ in range(50):
        r.update([0.5, 0.5], accepted=2, match_len=20)
    assert r.ratio(20, "first") == pytest.approx(_shrunk(50, 25, 50, 25))
    # Flat tails were right: their steps come to be trusted, from the prior.
    tail = _shrunk(50, 50, 50, 50, start=0.9)
    assert r.ratio(20, "tail") == pytest.approx(tail) and 0.99 < tail < 1
    first = _shrunk(50, 25, 50, 25)
    assert r.scale([0.5, 0.25], 20) == pytest.approx([first / 2, first / 4 * tail])
    dearish = VerifyCost({1: 1.0, 2: 1.6, 32: 19.6})
    assert best_length([0.5] * 8, dearish) == 0
    assert best_length(r.scale([0.5] * 8, 20), dearish) == 8
    for _ in range(50):
        r.update([0.1, 0.1], accepted=2, match_len=9)
    assert r.ratio(9, "first") == r.max_ratio == 2.5

    # Estimates that fall along the draft faster than acceptance does (repeats
    # that branch) are trusted more; the draft stays monotone, each at most 1.
    b = Calibration()
    for _ in range(50):
        b.update([0.5, 0.3, 0.1], accepted=3, match_len=5)
    ratio = b.ratio(5, "tail")
    steps = 50 * (0.6 + 0.1 / 0.3)  # each step's estimate given the one before
    assert ratio == pytest.approx(_shrunk(100, steps, 100, steps, start=0.9))
    first = 0.5 * _shrunk(50, 25, 50, 25)
    assert 0.6 * ratio > 1  # a step: at most 1
    second = (ratio * b.draft_weight + 1) / (b.draft_weight + 1)  # after one step survived
    assert b.scale([0.5, 0.3, 0.1], 5) == pytest.approx([first, first, first * second / 3])
    assert best_length(b.scale([0.5, 0.3, 0.1], 5), MID, pipelined=True) == 3

    # Unverified drafts teach nothing; a first-token miss teaches the first part only.
    m = Calibration()
    m.update([], accepted=0, match_len=3)
    m.update([0.9], accepted=0, match_len=3)
    assert m.ratio(3, "first") == pytest.approx(_shrunk(0, 0.9, 0, 0.9))
    assert m.ratio(3, "tail") == m.short_tail_ratio
    assert m.expected == {("first", "tree", 1): 0.9, ("first", "tree", "short"): 0.9}


def test_copies_are_trusted_apart_from_the_trees():
    # Prompt copies that keep failing (a prompt the answers do not copy) lose
    # trust without touching the trees' cells, whose drafts keep paying.
    c = Calibration()
    for _ in range(50):
        c.update([0.5] * 8, accepted=8, match_len=2, source="tree")
        c.update([0.5] * 8, accepted=0, match_len=2, source="copy")
    assert c.ratio(2, "first", source="tree") == pytest.approx(_shrunk(50, 25, 50, 25))
    assert c.ratio(2, "first", source="copy") == pytest.approx(_shrunk(0, 25, 0, 25))
    # A copy cell not seen yet starts from what copies have earned, not trees.
    assert c.ratio(40, "first", source="copy") == pytest.approx(10 / 35)
    assert best_length(c.scale([0.5] * 8, 2, source="tree"), MID) == 8
    assert best_length(c.scale([0.5] * 8, 2, source="copy"), MID) == 0
    assert c.ratios()["copy"]["first"]["1-2"] == pytest.approx(
        c.ratio(2, "first", source="copy")
    )


def test_the_trees_part_of_a_copy_is_calibrated_as_the_trees():
    # Copies keep failing after their first token, the trees' drafts keep
    # paying: a copy that extends a tree draft keeps the trees' trust for
    # their part (first token and tail), and only its copied tail is cut.
    c = Calibration()
    for _ in range(50):
        c.update([0.5] * 8, accepted=8, match_len=20, source="tree")
        c.update([0.5] * 12, accepted=1, match_len=20, source="copy")
    tree = c.scale([0.5] * 8, 20, source="tree")
    mixed = c.scale([0.5] * 12, 20, source="copy", tree_len=8, tree_match=20)
    assert mixed[:8] == pytest.approx(tree)
    assert mixed[8] < mixed[7]  # the copy's tail is trusted less
    assert best_length(mixed, MID) >= 8
    # Calibrated as a copy throughout, the draft would keep one token.
    assert best_length(c.scale([0.5] * 12, 20, source="copy"), MID) == 1
    # Learning splits the same way: a copy rejected past the trees' part
    # teaches the trees' cells that their part was right.
    d = Calibration()
    d.update([0.5] * 12, accepted=8, match_len=20, source="copy", tree_len=8, tree_match=20)
    assert d.expected[("first", "tree", d.bucket(20))] == 0.5
    assert ("first", "copy", d.bucket(20)) not in d.expected
    assert d.accepted[("tail", "copy", d.bucket(20))] == 0


def test_pipelined_drafts_pay_only_for_their_tail():
    # The running plain forward checks the first token for free: a draft is
    # worth it when its tail is, given a confirmed first token.
    assert given_first([0.5, 0.45, 0.05]) == pytest.approx([0.9, 0.1])
    assert given_first([]) == [] and given_first([0.0, 0.0]) == []
    # A lone token gains nothing over the plain step already running.
    assert best_length([1.0], FLAT, pipelined=True) == 0
    assert best_length([1.0] * 16, FLAT, pipelined=True) == 16
    # An unlikely first token with a sure tail is still worth checking...
    assert best_length([0.2] * 8, MID, pipelined=True) == 8
    # ...but a tail that falls apart after the first token is not.
    assert best_length([0.9, 0.09, 0.009], MID, pipelined=True) == 0
    tail = best_length(given_first(_cum(0.8, 16)), MID)
    assert best_length(_cum(0.8, 16), MID, pipelined=True) == tail + 1


def test_the_wait_after_each_read_is_priced():
    """A verification, and pipelined a check of a first token, make the
    device wait for the host after the forward (plain steps do not): a
    draft that pays without that wait is not verified, nor checked, where
    the wait eats its saving; a likely draft is verified longer, over more
    tokens to share it."""
    likely, unsure = _cum(0.95, 16), _cum(0.6, 16)
    assert best_length(unsure, MID) == 2 and best_length(unsure, MID, wait=1.0) == 0
    assert best_length(unsure, MID, pipelined=True) == 3
    assert best_length(unsure, MID, pipelined=True, wait=0.5) == 0
    assert best_length(likely, MID, wait=1.0) > best_length(likely, MID) > 0
    # A sure tail is still worth checking behind an unlikely first token.
    assert best_length([0.2] * 8, MID, pipelined=True, wait=1.0) == 8
    rows = [_cum(0.9, 8), _cum(0.5, 8)]
    assert best_batch_lengths(rows, MID, pipelined=True) == [4, 4]
    assert best_batch_lengths(rows, MID, pipelined=True, wait=0.3) == [0, 0]
    # The policy's wait is the stats' mean idle per wait.
    p = Policy(cost=MID)
    draft = Draft(tokens=list(range(16)), probs=unsure, match_len=32)
    assert p.wait_s == 0.0 and p.length(draft, pipelined=True) > 0
    p.stats.waits, p.stats.idle_s = 4, 2.0
    assert p.wait_s == 0.5 and p.length(draft, pipelined=True) == 0


def test_proposals_are_skipped_to_one_percent_of_the_steps_they_span():
    """A request whose proposals find nothing skips as many steps as keep
    their host time within OVERHEAD (1%) of the plain steps between them; in
    a batch every row proposes in turn, so the rows' proposals are held to
    1% of the batch's plain steps."""
    p = Policy(cost=VerifyCost({1: 1e-3, 2: 1.2e-3}))
    assert p.skips() == 0  # no proposal timed yet
    p.observe_host(30e-6)
    assert p.skips() == 3  # 30 us against 1% of 1 ms steps
    p.observe_host(30e-6, rows=32)
    # 32 rows x 30 us against 1% of the batch's plain step: a forward of 32
    # tokens, 1 ms + 31 x 0.2 ms on this curve.
    assert p.cost(32, rows=32) == pytest.approx(7.2e-3)
    assert p.skips() == 13
    assert Policy("fixed").skips() == 0


def test_plain_steps_are_observed_sixteen_at_a_time():
    """The loop's pipelined plain steps teach the curve's 1-token point as
    the mean of every PLAIN_STEPS of them (one observation each)."""
    p = Policy(cost=VerifyCost({1: 1.0, 2: 1.2}))
    times = [1.5, 2.5] * (policy.PLAIN_STEPS // 2)
    for t in times[:-1]:
        p.observe_plain(t)
    assert p.cost(1) == 1.0
    p.observe_plain(times[-1])
    assert p.cost(1) == pytest.approx(1.0 + p.cost.smoothing * (2.0 - 1.0))


def test_a_request_verifies_what_its_credit_can_lose():
    """A draft is cut to what the request can lose if it fails at its first
    token: its forward less the plain step it replaces (and the wait),
    within the credit (the allowance, then what its drafts saved); where
    verification is cheap that never binds."""
    dear = VerifyCost({1: 1.0, 2: 2.0, 32: 32.0})  # a token a plain step
    p = Policy(cost=dear)
    assert p.affordable(16, RequestTrust.ALLOWANCE, pipelined=False) == 4  # cost(5) - 1 = 4
    assert p.affordable(16, RequestTrust.ALLOWANCE, pipelined=True) == 5  # the first is checked
    trust = RequestTrust()
    p.paid(trust, 9, 9)  # a verification of 9 that emitted 9: nothing saved
    p.paid(trust, 0, 0)  # a check whose first token failed: no wait measured yet
    assert trust.credit == RequestTrust.ALLOWANCE
    p.paid(trust, 2, 0)  # a 2-token forward that emitted nothing it would not have
    assert trust.credit == RequestTrust.ALLOWANCE - 2
    p.stats.waits, p.stats.idle_s = 1, 0.5  # half a step after each read
    assert p.affordable(16, trust.credit, pipelined=False) == 1
    # The cut takes the draft's request's credit.
    mid = Policy(cost=MID)
    sure = Draft(tokens=list(range(16)), probs=[1.0] * 16, match_len=64, trust=RequestTrust())
    assert mid.length(sure, pipelined=False) == 16
    sure.trust.credit = 0.5
    assert mid.length(sure, pipelined=False) == 2  # cost(3) - 1 = 0.4
    assert Policy(cost=FLAT).affordable(64, RequestTrust.ALLOWANCE, pipelined=False) == 64
    # Past the widest forward measured, a forward costs at most proportionally
    # more: the first-use curve (1 and 2 tokens) lets a credit of 4 plain
    # steps risk 8 tokens (9 x 1.02 / 2 - 1 = 3.6), not 64 at its 1-2 slope.
    first = Policy(cost=VerifyCost({1: 1.0, 2: 1.02}))
    assert first.cost(65) < 2.5 and first.cost.most(65) == pytest.approx(65 * 0.51)
    assert first.affordable(64, RequestTrust.ALLOWANCE, pipelined=False) == 8


def test_a_verification_must_beat_plain_steps_by_the_margin():
    """One sequence verifies only what commits tokens MARGIN times as fast
    as plain steps: a sure draft that gains 3% (a token of verification
    costing nearly a plain step) is not verified; where drafts gain more,
    nothing changes."""
    nearly = VerifyCost({1: 1.0, 9: 8.7})  # 9 tokens for 8.7 steps: 1.034x
    assert policy.MARGIN == 1.05
    assert best_length([1.0] * 8, nearly) == 0
    assert best_length([1.0] * 8, nearly, pipelined=True) == 0
    assert best_length([1.0] * 8, VerifyCost({1: 1.0, 9: 8.4})) == 8  # 1.07x
    assert best_length([1.0] * 32, FLAT) == 32


def test_batch_width_accounts_for_longest_row():
    # One confident long row and seven rows with nothing: the whole batch
    # pays for the long row's width, so it is kept short on a linear curve...
    rows = [[1.0] * 16] + [[] for _ in range(7)]
    assert best_batch_lengths(rows, LINEAR) == [0] * 8
    # ...and long where verification is nearly free.
    free = VerifyCost({1: 1.0, 256: 1.0})
    assert best_batch_lengths(rows, free) == [16] + [0] * 7
    # Rows with drafts shorter than the chosen width keep their length.
    assert best_batch_lengths([[1.0] * 3, [1.0] * 10], free) == [3, 10]
    assert best_batch_lengths([], CPU) == []
    # Pipelined: widths for the tails after a free first-token check; a
    # lone token never pays.
    assert best_batch_lengths([[1.0] * 16, [1.0]], free, pipelined=True) == [16, 0]
    assert best_batch_lengths(rows, LINEAR, pipelined=True) == [0] * 8


def test_batch_width_saves_the_most_time():
    # Eight sure drafts of different lengths (a warm pass of repeats) on
    # this CPU's measured curve: the width with the best rate for this step
    # is the shortest draft's, which leaves most rows a few tokens short and
    # costs them another batch step; the width that saves the most time
    # against plain steps covers them.
    cost = VerifyCost({1: 1.0, 2: 1.16, 4: 1.52, 8: 1.6, 16: 1.79, 32: 2.69, 64: 4.29, 128: 7.97, 256: 15.94})
    lengths = [36, 42, 64, 37, 42, 64, 38, 43]
    rows = [[1.0] * n for n in lengths]
    tails = [given_first(p) for p in rows]

    def rate(k):  # the whole step's: the plain forward, then the tails
        return (16 + sum(sum(t[:k]) for t in tails)) / (cost(8) + cost(8 * (k + 1), rows=8))

    assert max(range(1, 64), key=rate) == 35
    assert best_batch_lengths(rows, cost, pipelined=True) == [min(n, 43) for n in lengths]
    # Whether to verify at all is as before: only when the step (its plain
    # forward included) commits tokens faster than plain steps do.
    cost = VerifyCost({1: 1.0, 8: 2.0, 16: 2.2, 64: 5.0, 256: 17.0})
    assert best_batch_lengths([[0.5, 0.02]] * 8, cost, pipelined=True) == [0] * 8
    assert best_batch_lengths([[0.5, 0.5]] * 8, cost, pipelined=True) == [2] * 8


def test_batch_verification_must_clearly_pay(monkeypatch):
    # One row's sure extra token in a batch of 8 pays for the wider forward
    # on the token count alone, barely: the other rows wait for it and the
    # request that finishes last gains nothing, so the batch does not verify.
    cost = VerifyCost({1: 1.0, 2: 1.05, 8: 2.0, 16: 2.1, 64: 5.0})
    rows = [[1.0, 1.0]] + [[]] * 7
    assert (16 + 1) / (cost(8) + cost(16, rows=8)) > 8 / cost(8)
    assert best_batch_lengths(rows, cost, pipelined=True) == [0] * 8
    monkeypatch.setattr(policy, "BATCH_MARGIN", 1.0)
    assert best_batch_lengths(rows, cost, pipelined=True) == [2] + [0] * 7
    monkeypatch.undo()
    # Alone, the row is the one that finishes last: it verifies.
    assert best_batch_lengths(rows[:1], cost, pipelined=True) == [2]
    # When every row gains, the batch verifies.
    assert best_batch_lengths([[1.0, 1.0]] * 8, cost, pipelined=True) == [2] * 8


def test_waiting_prompts_bound_the_step():
    # A budget (seconds beyond a plain step) keeps widths whose step takes
    # longer out; within it the choice is the unbounded one.
    cost = VerifyCost({1: 1.0, 2: 1.16, 4: 1.52, 8: 1.6, 16: 1.79, 32: 2.69, 64: 4.29, 128: 7.97, 256: 15.94})
    lengths = [36, 42, 64, 37, 42, 64, 38, 43]
    rows = [[1.0] * n for n in lengths]
    free = best_batch_lengths(rows, cost, pipelined=True)
    assert best_batch_lengths(rows, cost, pipelined=True, budget=1e9) == free
    # Pipelined, the whole verifying forward is beyond the plain step.
    width = max(free) - 1
    just = cost(8 * (width + 1), rows=8)
    assert best_batch_lengths(rows, cost, pipelined=True, budget=just) == free
    bounded = best_batch_lengths(rows, cost, pipelined=True, budget=just * 0.9)
    k = max(bounded) - 1
    assert 0 < k < width and cost(8 * (k + 1), rows=8) <= just * 0.9
    assert best_batch_lengths(rows, cost, pipelined=True, budget=0.0) == [0] * 8
    # Not pipelined (one sequence): the forward less the plain step it replaces.
    sure = [1.0] * 32
    n = best_length(sure, cost)
    assert best_length(sure, cost, budget=cost(n + 1) - cost(1)) == n
    assert 0 < best_length(sure, cost, budget=cost(9) - cost(1)) <= 8
    assert best_length(sure, cost, budget=0.0) == 0
    assert best_length(sure, cost, pipelined=True, budget=cost(1) * 0.5) == 0
    # The policy: no exploring past the budget, nothing without a cost curve.
    p = Policy("adaptive", cost)
    d = Draft(tokens=list(range(8)), probs=[0.5] + [1e-5] * 7, match_len=1)
    for _ in range(policy.EXPLORE_AFTER + 2):
        assert p.batch_lengths([d, d], pipelined=True, budget=10.0) == [0, 0]
    assert p.stats.refused == 0
    assert Policy("fixed").batch_lengths([d, d], pipelined=True, budget=10.0) == [0, 0]
    assert Policy("fixed").batch_lengths([d, d], pipelined=True) == [8, 8]
    assert Policy("fixed").length(d, pipelined=False, budget=10.0) == 0


def test_a_batch_of_one_row_is_one_sequence():
    # One rule per situation: a batch of one row takes the single-sequence
    # lengths, pipelined (the plain forward checks the first token) and
    # settled (the pending token is known: verify it with the draft at once,
    # or 0 for the plain step); a wider batch verifies only pipelined.
    curves = (FLAT, CPU, LINEAR, VerifyCost({1: 1.0, 2: 1.28, 4: 1.76, 8: 1.88, 16: 1.98, 32: 3.36}))
    drafts = [[0.9, 0.85, 0.8, 0.75], [0.15] * 4, [0.5] * 8, [1.0] * 8, [0.1, 0.01], []]
    for cost in curves:
        policy = Policy(cost=cost)
        for probs in drafts:
            d = Draft(list(range(len(probs))), probs, 8)
            for pipelined in (True, False):
                assert policy.batch_lengths([d], pipelined) == [policy.length(d, pipelined)]
            assert policy.batch_lengths([d, d], pipelined=False) == [0, 0]
    # Settled, a likely draft is verified with the known token where that
    # beats plain steps; where every token costs a full step, nothing pays.
    likely = Draft([1, 2, 3, 4], [0.9, 0.85, 0.8, 0.75], 8)
    assert Policy(cost=curves[3]).length(likely, pipelined=False) == 4
    assert Policy(cost=LINEAR).length(likely, pipelined=False) == 0


def test_drafter_applies_policy_and_records_stats():
    cheap = SuffixDrafter(cost=FLAT)
    dear = SuffixDrafter(cost=LINEAR)
    fixed = SuffixDrafter(cost=LINEAR, policy="fixed")
    for d in (cheap, dear, fixed):
        r = d.start([1, 2, 3])
        d.commit(r, list(range(10, 40)))
        d.finish(r)
        q = d.start([4])
        d.commit(q, [10, 11, 12, 13, 14, 15, 16, 17, 18, 19])
        d.record(drafted=4, accepted=3, draft=Draft([1, 2, 3, 4], [1.0, 1.0, 1.0, 0.5]))
    lens = [len(_draft(d, q)) for d, q in ((cheap, 1), (dear, 1), (fixed, 1))]
    # Cheap verification takes the draft about as far as its cost stays flat.
    assert 0 < lens[0] <= lens[2] == 20 and lens[1] == 0
    # Where nothing pays, the stats say so.
    assert [d.snapshot()["refused"] for d in (cheap, dear, fixed)] == [0, 1, 0]
    before = dear.stats.copy()
    _draft(dear, q)
    line = format_stats(dear.stats.delta(before).as_dict())  # mlx_lm.generate --verbose
    assert line.endswith("; 1 drafts not verified: they would not pay")
    assert "not verified" not in format_stats(cheap.stats.as_dict())
    snap = fixed.snapshot()
    assert snap["lengths"] == {"4": 1} and snap["expected_acceptance_rate"] == 0.875
    with pytest.raises(ValueError, match="policy"):
        SuffixDrafter(policy="greedy")


def test_calibration_on_the_loaded_model(tiny_model_path):
    model, _ = load(str(tiny_model_path))
    model.set_dtype(mx.float32)
    cost = VerifyCost.calibrate(model, sizes=(1, 4, 16), context=32, repeats=1)
    assert set(cost.points) == {1, 4, 16} and all(v > 0 for v in cost.points.values())
    # Real steps refine it: a faster one lowers the point (and smaller sizes
    # with it where they would cost more), a slower one raises it up to the
    # proportional bound.
    before = cost(16)
    cost.observe(16, before / 3)
    assert cost(16) < before and cost(4) <= cost(16)
    before = cost(16)
    cost.observe(16, before * 3)
    assert before < cost(16) <= 4 * cost(4)


def _counting_model(path, fed):
    """The model at ``path``, appending each forward's token count to ``fed``."""
    model, _ = load(str(path))

    class Counting:
        args = model.args

        def __call__(self, tokens, cache):
            fed.append(tokens.shape[1])
            return model(tokens, cache=cache)

        def __getattr__(self, name):
            return getattr(model, name)

    return Counting()


def test_the_first_use_probe_feeds_a_few_tokens_where_forwards_are_slow(tiny_model_path):
    # Where each forward takes longer than min_seconds (here: every forward,
    # min_seconds=0), the probe is the one-token context and two runs of
    # each size, taking turns: 5 forwards, 7 tokens.
    fed = []
    counting = _counting_model(tiny_model_path, fed)
    cost = VerifyCost.calibrate(counting, min_seconds=0.0)
    assert fed == [1, 1, 2, 1, 2] and set(cost.points) == {1, 2}


def test_a_load_spike_in_one_run_does_not_price_the_curve(tiny_model_path):
    # One 2-token forward of the probe takes a second (a load spike): the
    # point is the other run's, and a draft is still worth verifying.
    fed = []
    counting = _counting_model(tiny_model_path, fed)
    call = type(counting).__call__

    def spiking(self, tokens, cache):
        out = call(self, tokens, cache)
        if tokens.shape[1] == 2 and fed.count(2) == 1:
            mx.eval(out)
            time.sleep(1.0)
        return out

    type(counting).__call__ = spiking
    cost = VerifyCost.calibrate(counting, min_seconds=0.0)
    # (the point as timed: the curve itself grows at most proportionally)
    assert cost.points[2] < 0.5 and cost(2) < 0.5


def test_a_batch_wider_than_the_curve_times_its_plain_step(tiny_model_path):
    # Probed at 1 and 2 tokens, a 32-row batch's plain step and verifications
    # would be priced at the 1-2 slope; the first such batch times a forward
    # of 32 tokens (after a one-token context) and the curve has that point.
    fed = []
    counting = _counting_model(tiny_model_path, fed)
    wide = policy.Policy(cost=VerifyCost({1: 1.0, 2: 1.3}))
    wide.ensure_width(counting, 4)  # within twice the widest point
    assert fed == [] and set(wide.cost.points) == {1, 2}
    wide.ensure_width(counting, 32)
    assert fed == [1, 32] and set(wide.cost.points) == {1, 2, 32}
    wide.ensure_width(counting, 48)
    assert fed == [1, 32]
    frozen = policy.Policy(cost=VerifyCost({1: 1.0, 2: 1.3}, smoothing=0.0))
    frozen.ensure_width(counting, 32)
    assert fed == [1, 32] and set(frozen.cost.points) == {1, 2}


def test_a_server_times_its_batches_widths_up_to_its_most_rows(tiny_model_path):
    # ensure_batches: widths 8, 32, ... below the most rows, and the most
    # rows; every batch up to them within twice a timed width. The draft
    # model's curve too.
    fed, drafted = [], []
    counting = _counting_model(tiny_model_path, fed)
    draft = _counting_model(tiny_model_path, drafted)
    p = policy.Policy(cost=VerifyCost({1: 1.0, 2: 1.3}))
    p.draft_cost = VerifyCost({1: 0.1, 2: 0.12})
    p.ensure_batches(counting, 48, draft)
    assert fed == [1, 8, 1, 32] and drafted == fed  # (48: within twice 32)
    assert set(p.cost.points) == set(p.draft_cost.points) == {1, 2, 8, 32}
    fed.clear()
    for rows in range(2, 49):
        p.ensure_width(counting, rows)
    assert fed == []
    small = policy.Policy(cost=VerifyCost({1: 1.0, 2: 1.3}))
    small.ensure_batches(counting, 5)
    assert fed == [1, 5]


def test_a_curve_too_dear_to_remeasure_is_explored_now_and_then():
    # A 16-token verification timed in a load spike (26 plain steps, capped
    # at proportional): no draft pays on the learnt curve, so none would be
    # timed again. Every EXPLORE_AFTER refusals one is verified at 2 tokens.
    from mlx_lm_suffix.policy.rules import EXPLORE_AFTER

    p = policy.Policy("adaptive", VerifyCost({1: 1.0, 16: 26.0}))
    assert p.cost.points[16] == 16.0
    draft = Draft(list(range(16)), [0.9] * 16, 20)
    lengths = [p.length(draft, pipelined=True) for _ in range(2 * EXPLORE_AFTER + 2)]
    assert lengths[EXPLORE_AFTER] == lengths[2 * EXPLORE_AFTER + 1] == 2
    assert sum(n > 0 for n in lengths) == 2
    # The batch's entry point explores the same way, every row at 2 tokens.
    b = policy.Policy("adaptive", VerifyCost({1: 1.0, 16: 26.0}))
    rows = [b.batch_lengths([draft, draft], pipelined=True) for _ in range(EXPLORE_AFTER + 1)]
    assert rows[-1] == [2, 2] and rows.count([0, 0]) == EXPLORE_AFTER
    # A draft the curve accepts resets the count.
    cheap = policy.Policy("adaptive", VerifyCost({1: 1.0, 16: 1.1}))
    assert all(cheap.length(draft, pipelined=True) == 16 for _ in range(EXPLORE_AFTER + 2))


def test_a_request_earns_no_more_trust_than_the_pool():
    # A request's own record only lowers the pooled trust: where a forward
    # costs nearly a plain step a token, one short copy that held must not
    # make a long flat copy look certain (it was verified at 58 tokens and
    # 2 held: 40 plain steps' time for 3 tokens).
    from mlx_lm_suffix.policy.calibration import RequestTrust

    quantized_cpu = VerifyCost({1: 1.0, 2: 1.85, 6: 5.54, 13: 10.5, 24: 19.4, 457: 279.0})
    c, trust = Calibration(), RequestTrust()
    trust.held([1.0, 1.0], 0, 2, True, "copy")
    flat = [1.0] * 58
    assert c.scale(flat, 8, "copy", trust=trust) == pytest.approx(c.scale(flat, 8, "copy"))
    assert best_length(c.scale(flat, 8, "copy", trust=trust), quantized_cpu) <= 2
    # Failures still cut it, below the pool's.
    trust.held([1.0, 1.0], 1, 2, False, "copy")
    assert c.scale(flat, 8, "copy", trust=trust)[1] < c.scale(flat, 8, "copy")[1]


def test_a_draft_models_length_tries_wider_forwards():
    """The first-use curve knows 1 and 2 tokens and grows past them as its
    1-2 segment does, dear where a forward's cost jumps from 1 token to 2
    and then grows slowly (a CPU's bench model). The draft model's length,
    at its tokens' prior rate, is tried wider at once, the forward becomes
    a point, and it drafts 4 tokens or more at every step; before, its 3- and
    4-token forwards refined the 2-token point and it drafted 2-3 tokens
    for good."""
    truth = VerifyCost({1: 1.0, 2: 1.12, 4: 1.25, 8: 1.3, 16: 1.45}, smoothing=0)
    p = Policy(cost=VerifyCost({1: 1.0, 2: 1.12}))
    p.draft_cost = VerifyCost({1: 0.01})
    rate, lengths = policy.ModelRate.PRIOR[0], []
    for _ in range(6):
        k = p.model_steps([(rate, rate)], 1, False, 16, held=True)
        draft = Draft(list(range(k)), [rate ** (i + 1) for i in range(k)], source="model")
        n = p.length(draft, pipelined=False)  # the cut prices it alike
        assert n <= k
        lengths.append(n)
        p.observe(n + 1, truth(n + 1))
    assert min(lengths) >= 4 and lengths[0] >= 7
    assert 8 in p.cost.points and p.cost.points[8] == pytest.approx(truth(8), rel=0.01)


def test_a_draft_model_not_run_is_probed_within_the_overhead():
    """Where model_steps drafts nothing, the draft model still drafts 2
    tokens once the plain steps since it last ran have spent OVERHEAD of
    their time as many times as its forwards cost: 1 forward pipelined, 2
    settled; never for the fixed policy or a cap under 2."""
    p = Policy(cost=VerifyCost({1: 1.0, 2: 2.0}))
    p.draft_cost = VerifyCost({1: 0.045})  # a draft forward: 4.5% of a plain step
    calls = [p.probe(1, True, 8) for _ in range(10)]
    assert calls == [0, 0, 0, 0, 2] * 2
    calls = [p.probe(1, False, 8) for _ in range(10)]
    assert calls == [0] * 8 + [2, 0]
    assert p.probe(1, True, 1) == 0
    fixed = Policy("fixed", cost=VerifyCost({1: 1.0}))
    fixed.draft_cost = VerifyCost({1: 0.05})
    assert all(fixed.probe(1, True, 8) == 0 for _ in range(20))


def test_a_batch_whose_every_row_drafts_from_the_model_takes_one_sequences_margin():
    """Settled, where every row has a draft model's draft, the cut asks a
    verification to beat plain steps by MARGIN, as model_steps does; where a
    row would wait without a draft, by BATCH_MARGIN."""
    from mlx_lm_suffix.sources import Draft

    cost = VerifyCost({1: 1.0, 4: 1.0, 8: 1.36}, smoothing=0)  # 4 rows x 2: 1.36 plain steps
    assert best_batch_lengths([[0.5]] * 4, cost, margin=policy.MARGIN) == [1] * 4
    assert best_batch_lengths([[0.5]] * 4, cost) == [0] * 4  # BATCH_MARGIN
    p = Policy(cost=cost)
    model = [Draft([7], [0.5], source="model") for _ in range(4)]
    assert p.batch_lengths(model, pipelined=False) == [1] * 4
    assert p.batch_lengths(model[:3] + [Draft()], pipelined=False) == [0] * 4
