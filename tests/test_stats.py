"""The counter types: report, add and subtract."""

from mlx_lm_suffix.sources import Draft
from mlx_lm_suffix.stats import BatchDraftStats, DraftStats, RequestUsage


def test_delta_and_merge():
    s = DraftStats(steps=3, drafted=4, accepted=2, tokens=6, lengths={4: 1})
    before = s.copy()
    s.steps += 2
    s.drafted += 8
    s.lengths[8] = 1
    d = s.delta(before)
    assert (d.steps, d.drafted, d.accepted, d.lengths) == (2, 8, 0, {8: 1})
    assert before.lengths == {4: 1}  # a copy, not a view
    assert d.as_dict()["lengths"] == {"8": 1} and d.as_dict()["acceptance_rate"] == 0.0
    b = BatchDraftStats(verify_steps=1, verify_rows=4, max_batch_size=4)
    b.merge(BatchDraftStats(verify_steps=1, verify_rows=2, max_batch_size=2))
    assert (b.verify_steps, b.max_batch_size, b.as_dict()["mean_verify_batch_size"]) == (2, 4, 3.0)
    u = RequestUsage(drafted=3)
    u.merge(RequestUsage(drafted=1, accepted=1))
    assert u.as_dict() == {
        "drafted": 4, "accepted": 1, "steps": 0, "replays": 0, "replayed_tokens": 0, "host_s": 0.0,
        "source_drafted": {}, "source_accepted": {},
    }


def test_counts_per_source_and_position():
    s = DraftStats()
    tree, copy = Draft([1, 2, 3, 4], [1.0] * 4, source="tree"), Draft([7], [0.5], source="copy")
    s.count(steps=1, drafted=4, draft=tree)
    s.count(accepted=2, source="tree")  # two of them emitted
    s.count(drafted=1, draft=copy)  # a first token the plain forward missed
    s.count(steps=1, drafted=3, draft=tree)
    s.count(accepted=3, source="tree")
    s.count(steps=1)  # a plain step
    assert (s.steps, s.drafted, s.accepted, s.draft_steps) == (3, 8, 5, 3)
    assert s.source_drafts == {"tree": 2, "copy": 1}
    assert s.source_drafted == {"tree": 7, "copy": 1}
    assert s.source_accepted == {"tree": 5}
    assert s.accepted_per_position == {0: 2, 1: 2, 2: 1}
    d = s.as_dict()
    assert d["accepted_per_position"] == {"0": 2, "1": 2, "2": 1}
    assert d["mean_acceptance_length"] == 1.0 + 5 / 3
    s.count(accepted=-1, source="tree", last=3)  # the last of those 3 taken back
    assert s.accepted == 4 and s.accepted_per_position == {0: 2, 1: 2, 2: 0}
    later = s.copy()
    later.count(drafted=2, draft=Draft([1, 2], [1.0, 1.0], source="copy"))
    assert later.delta(s).source_drafted == {"copy": 2}
