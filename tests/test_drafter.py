"""The drafter's request lifecycle, bounds and cache file, without a model."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_lm_suffix.drafter import PRIVATE, SuffixDrafter
from mlx_lm_suffix.persistence import CacheFileError, read_cache_file, save_cache_file
from mlx_lm_suffix.policy import LONG_MATCH


def test_drafts_from_prompt_and_from_earlier_response():
    d = SuffixDrafter(num_draft_tokens=8, max_spec_factor=1.0)
    text = [5, 6, 7, 8, 9, 10, 11, 12]
    prompt = text + [1, 2] + text[:3]
    r = d.start(prompt)
    # From its own prompt; at most match_length * max_spec_factor tokens.
    assert d.propose(r).tokens == text[3:6]
    assert d.propose(r).match_len == 3
    e = SuffixDrafter()  # the default factor, 2
    draft = e.propose(e.start(prompt))
    assert draft.tokens == [8, 9, 10, 11, 12, 1] and draft.source == "tree"
    d.finish(r)
    r1 = d.start([40, 41])
    d.commit(r1, [20, 21, 22, 23, 24, 25, 26, 27, 28, 29])
    d.finish(r1)
    r2 = d.start([50, 51])
    d.commit(r2, [20, 21, 22, 23])
    assert d.propose(r2, 4).tokens == [24, 25, 26, 27]  # from the cached response
    assert d.propose(r2, 0).tokens == []
    d.finish(r2)
    assert d.active_requests == 0 and d.cached_requests == 3


def test_a_repeat_matches_longer_than_a_shared_template():
    """A cached response keeps enough of its prompt's tail that a repeated
    request's first draft matches well past a 24-token chat template, while
    another question after the same template matches the template alone: the
    policy calibrates the two in different match length buckets."""
    d = SuffixDrafter()
    template = list(range(900, 924))
    answer = list(range(500, 540))
    q = d.start(list(range(100, 160)) + template)
    d.commit(q, answer)
    d.finish(q)
    repeat = d.start(list(range(100, 160)) + template)
    other = d.start(list(range(200, 260)) + template)
    for r in (repeat, other):
        d.commit(r, answer[:1])
    rd, od = d.propose(repeat), d.propose(other)
    assert rd.tokens[:8] == od.tokens[:8] == answer[1:9]
    assert od.match_len <= len(template) + 1 < 33 <= rd.match_len
    assert d.policy.calibration.bucket(rd.match_len) > d.policy.calibration.bucket(od.match_len)


def test_a_repeat_drafts_its_own_answer_where_earlier_answers_branch():
    """Three answers after the same template share their start and then part,
    two of them one way: the drafter, whatever its policy, drafts a
    repeated request's own answer from its long match, and calibrates it as
    one (the request's own newest token is not in the trees, so its own
    occurrence does not halve the repeat's estimates, and the long match
    scores best)."""
    template = list(range(900, 924))
    shared, own, other = list(range(500, 510)), list(range(600, 630)), list(range(700, 730))
    prompts = [list(range(100 * i, 100 * i + 60)) + template for i in (1, 2, 3)]
    drafts = {}
    for policy in ("adaptive", "fixed"):
        d = SuffixDrafter(policy=policy)
        for prompt, tail in zip(prompts, (own, other, other)):
            q = d.start(prompt)
            d.commit(q, shared + tail)
            d.finish(q)
        repeat = d.start(prompts[0])
        d.commit(repeat, shared[:1])
        drafts[policy] = d.propose(repeat, 32)
    for draft in drafts.values():
        assert draft.tokens == shared[1:] + own[:23]
        assert draft.match_len >= LONG_MATCH


def test_scopes_are_isolated():
    d = SuffixDrafter()
    r = d.start([1], scope="alice")
    d.commit(r, list(range(100, 130)))
    d.finish(r)
    bob = d.start([2], scope="bob")
    d.commit(bob, [100, 101, 102, 103])
    assert d.propose(bob).tokens == []
    alice = d.start([3], scope="alice")
    d.commit(alice, [100, 101, 102, 103])
    assert d.propose(alice).tokens[:3] == [104, 105, 106]
    # Bob's finished response stays cached, so his scope stays; a scope with
    # nothing active or cached keeps no tree (here: nothing is ever cached).
    d.finish(bob)
    assert "bob" in d._trees._caches
    nocache = SuffixDrafter(max_cached_requests=0)
    r = nocache.start([1], scope="carol")
    nocache.finish(r)
    assert list(nocache._trees._caches) == []


def test_bounds_evict_oldest_first():
    d = SuffixDrafter(max_cached_requests=3, max_cached_tokens=25)
    for i in range(6):
        r = d.start([i])
        d.commit(r, [1000 * i + j for j in range(10)])
        d.finish(r)
        assert d.cached_requests <= 3 and d.cached_tokens <= 25
    assert d.cached_tokens == 22
    # Each cached response keeps its one-token prompt as context.
    assert [t[:2] for _, t in d.cached_responses()] == [[4, 4000], [5, 5000]]
    assert d.stats.evictions == 4  # six kept in turn, two left
    d.add_responses([(None, list(range(30)))])  # longer than the bound: not kept
    assert d.stats.evictions == 4 and d.cached_requests == 2
    probe = d.start([9])
    d.commit(probe, [0, 1, 2])  # the first response was evicted
    assert d.propose(probe).tokens == []


def _cached_by_scope(d):
    """Cached tokens per scope, read from the responses kept, and a check
    that the suffix trees hold as many finished responses."""
    held = {}
    for scope, tokens in d.cached_responses():
        held[scope] = held.get(scope, 0) + len(tokens)
    trees = list(d._trees._caches.values())
    assert sum(len(c.cached_requests - c.active_requests) for c in trees) == d.cached_requests
    assert sum(held.values()) == d.cached_tokens
    # The trees' own count (active responses are in the global trees too).
    assert d.snapshot()["tree_responses"] == d.cached_requests + d.active_requests
    return held


def _respond(d, scope, first, n):
    """A finished request of ``scope``: a one-token prompt, ``n - 1`` tokens
    of response from ``first`` on (``n`` cached tokens)."""
    r = d.start([first], scope=scope)
    d.commit(r, list(range(first + 1, first + n)))
    d.finish(r)


def _drafts_from(d, scope, first):
    """Whether a request of ``scope`` drafts the response that started at ``first``."""
    r = d.start([7], scope=scope)
    d.commit(r, [first, first + 1, first + 2])
    tokens = d.propose(r, 3).tokens
    d.finish(r)
    return tokens == [first + 3, first + 4, first + 5]


def test_a_scope_cannot_evict_other_scopes_beyond_its_share():
    """Past a bound, the scope holding the most loses its oldest response:
    one tenant's long or many responses do not evict the others'."""
    d = SuffixDrafter(max_cached_requests=6, max_cached_tokens=100)
    for i, scope in enumerate("abc"):
        _respond(d, scope, 1000 * (i + 1), 20)
    _respond(d, "d", 10_000, 150)  # longer than the bound: not kept
    assert _cached_by_scope(d) == {"a": 20, "b": 20, "c": 20}
    for i in range(10):
        _respond(d, "d", 20_000 + 100 * i, 30)
        held = _cached_by_scope(d)
        assert d.cached_tokens <= 100 and d.cached_requests <= 6
        assert held["a"] == held["b"] == held["c"] == 20
    assert held["d"] == 30  # its newest one
    assert _drafts_from(d, "d", 20_900) and not _drafts_from(d, "d", 20_800)
    for i, scope in enumerate("abc"):
        assert _drafts_from(d, scope, 1000 * (i + 1))
    # The count bound: the scope with the most responses loses its oldest.
    e = SuffixDrafter(max_cached_requests=4, max_cached_tokens=10_000)
    for i, scope in enumerate("abc"):
        _respond(e, scope, 1000 * (i + 1), 5)
    for i in range(5):
        _respond(e, "d", 20_000 + 100 * i, 5)
        assert e.cached_requests <= 4
        assert set(_cached_by_scope(e)) == set("abcd")
    # Equal holdings: the oldest response goes, as with one scope.
    for i, scope in enumerate("abcd"):
        _respond(e, scope, 30_000 + 100 * i, 5)
        assert e.cached_requests <= 4
    assert _cached_by_scope(e) == dict.fromkeys("abcd", 5)
    assert all(t[0] >= 30_000 for _, t in e.cached_responses())


@pytest.mark.parametrize(
    "knobs, scope",
    [
        ({"max_cached_tokens": 0}, None),
        ({"max_cached_requests": 0}, None),
        ({}, PRIVATE),
    ],
)
def test_no_drafting_across_requests(knobs, scope):
    """With the global cache off (either bound 0) or in the PRIVATE scope, a
    request drafts from nothing of another one, in flight or finished, and
    still from its own prompt and output."""
    prompt, answer = list(range(100, 140)), list(range(500, 540))

    def repeat_drafts(d, scope):
        first = d.start(prompt, scope=scope)
        d.commit(first, answer)  # in flight
        live = d.start(prompt, scope=scope)
        d.commit(live, answer[:6])
        in_flight = d.propose(live, 8).tokens
        d.finish(first)
        done = d.start(prompt, scope=scope)
        d.commit(done, answer[:6])
        finished = d.propose(done, 8).tokens
        # Its own output and prompt.
        d.commit(done, [9] + answer[:3])
        own_output = d.propose(done, 3).tokens
        d.commit(done, prompt[:6])
        own_prompt = d.propose(done, 3).tokens
        for r in (live, done):
            d.finish(r)
        return in_flight, finished, own_output, own_prompt

    shared = repeat_drafts(SuffixDrafter(), None)
    assert shared[0] == shared[1] == answer[6:14]  # the test can tell
    d = SuffixDrafter(**knobs)
    in_flight, finished, own_output, own_prompt = repeat_drafts(d, scope)
    assert in_flight == finished == []
    assert own_output == answer[3:6] and own_prompt == prompt[6:9]
    assert d.cached_requests == d.cached_tokens == 0 and PRIVATE not in d._trees._caches


def test_invalid_knobs_raise_clear_errors():
    for kwargs in (
        {"num_draft_tokens": -1},
        {"num_draft_tokens": 2.5},
        {"max_tree_depth": 0},
        {"min_token_prob": 1.5},
        {"max_cached_tokens": "many"},
    ):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SuffixDrafter(**kwargs)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("sfxa"), st.integers(0, 7)), max_size=60))
def test_random_lifecycles_leave_nothing_active(ops):
    d = SuffixDrafter(max_cached_requests=4, max_cached_tokens=50)
    live, seen = [], set()
    for op, arg in ops:
        if op == "s":
            r = d.start([arg, arg + 1], scope="abc"[arg % 3])
            assert r not in seen
            seen.add(r)
            live.append(r)
        elif live and op == "f":
            d.commit(live[arg % len(live)], [arg] * 3)
            d.propose(live[arg % len(live)], 4)
        elif live:  # finish or abort: both stop the request
            d.finish(live.pop(arg % len(live)))
        assert d.cached_requests <= 4 and sum(_cached_by_scope(d).values()) <= 50
    for r in live:
        d.finish(r)
        d.finish(r)  # idempotent
    assert d.active_requests == 0


def test_cache_file_round_trip_and_errors(tmp_path):
    d = SuffixDrafter()
    r = d.start([1, 2])
    d.commit(r, [7, 8, 9, 10])
    d.finish(r)
    path = tmp_path / "cache.json"
    save_cache_file(d, path, "model-a")
    assert read_cache_file(path, "model-a") == [(None, [1, 2, 7, 8, 9, 10])]
    d2 = SuffixDrafter()
    assert d2.add_responses(read_cache_file(path, "model-a")) == 1
    q = d2.start([0])
    d2.commit(q, [7, 8])
    assert d2.propose(q).tokens == [9, 10]
    assert d2.stats.tokens == 2  # warming does not count as generated tokens

    with pytest.raises(CacheFileError, match="model-a"):
        read_cache_file(path, "model-b")
    path.write_text(path.read_text()[:20])
    with pytest.raises(CacheFileError):
        read_cache_file(path, "model-a")
    path.write_text(json.dumps({"format": "mlx-lm-suffix-cache", "version": 1,
                                "model": "model-a", "responses": [{"tokens": [-1]}]}))
    with pytest.raises(CacheFileError):
        read_cache_file(path, "model-a")
    with pytest.raises(FileNotFoundError):
        read_cache_file(tmp_path / "missing.json", "model-a")
    assert [p.name for p in tmp_path.iterdir()] == ["cache.json"]  # no temp files left


@pytest.mark.parametrize("kwargs", [
    {"max_spec_factor": float("nan")}, {"max_spec_factor": float("inf")},
    {"max_spec_factor": 1e30}, {"max_spec_offset": 1e30}, {"max_spec_offset": float("nan")},
    {"min_token_prob": float("nan")}, {"cost": "abc"}, {"cost": 123},
])
def test_non_finite_and_out_of_range_settings_are_refused(kwargs):
    """NaN passed every range check (comparisons with it are false), and a
    huge spec factor or offset overflowed the trees' draft length: each
    turned drafting off without a word. A cost that is not a VerifyCost
    failed at the first generation."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SuffixDrafter(**kwargs)


def test_tokens_committed_without_growing_reach_the_trees_at_grow():
    """``commit(grow=False)`` gives drafts the context at once and the
    trees nothing until ``grow`` (or ``finish``); the trees then hold every
    token but the newest, as after plain commits."""
    d = SuffixDrafter(num_draft_tokens=4)
    r = d.start([1, 2, 3])
    d.commit(r, [50, 51, 52, 53, 60, 50, 51], grow=False)
    assert d.propose(r).tokens == []  # 50, 51 is in no tree yet
    d.commit(r, [52], grow=False)
    d.grow(r)
    assert d.propose(r).tokens == [53, 60, 50, 51]
    plain = SuffixDrafter(num_draft_tokens=4)
    q = plain.start([1, 2, 3])
    plain.commit(q, [50, 51, 52, 53, 60, 50, 51, 52])
    assert plain.propose(q).tokens == d.propose(r).tokens
    d.commit(r, [7, 8], grow=False)
    d.finish(r)  # the response goes to the global tree whole
    assert d.propose(d.start([9, 60, 50, 51, 52, 7]), 2).tokens == [8]
