"""The counter types: report, add and subtract."""

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
        "drafted": 4, "accepted": 1, "steps": 0, "replays": 0, "replayed_tokens": 0, "host_s": 0.0
    }


def test_counts_per_source_and_position():
    s = DraftStats()
    s.count(drafted=4, accepted=2, steps=1, probs=[1.0] * 4, source="tree")
    s.count(drafted=1, accepted=0, steps=0, probs=[0.5], source="copy")
    s.count(drafted=3, accepted=3, steps=1, probs=[1.0] * 3, source="tree")
    s.count(drafted=0, accepted=0, steps=1, probs=[], source="tree")  # a plain step
    assert s.source_drafts == {"tree": 2, "copy": 1}
    assert s.source_drafted == {"tree": 7, "copy": 1}
    assert s.source_accepted == {"tree": 5, "copy": 0}
    assert s.accepted_per_position == {0: 2, 1: 2, 2: 1}
    d = s.as_dict()
    assert d["accepted_per_position"] == {"0": 2, "1": 2, "2": 1}
    assert d["mean_acceptance_length"] == 1.0 + 5 / 3
    later = s.copy()
    later.count(drafted=2, accepted=1, steps=1, probs=[1.0, 1.0], source="copy")
    assert later.delta(s).source_drafted == {"copy": 2}
