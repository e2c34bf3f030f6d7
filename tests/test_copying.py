"""Following the output through the prompt (copying.py) and its drafts in
SuffixDrafter.propose, without a model."""

from mlx_lm_suffix.drafter import COPY_PROB, SuffixDrafter
from mlx_lm_suffix.sources.prompt_copy import PromptCopy
from mlx_lm_suffix.tools.simulate import Record, replay
from mlx_lm_suffix.verification import accepted_length

# A "file" of distinct tokens: every n-gram in it occurs once.
FILE = list(range(100, 400))


def test_follows_a_copy_and_rejoins_after_an_edit():
    c = PromptCopy([1, 2] + FILE + [3])
    assert c.propose(8) == []  # nothing fed: not copying
    c.feed([7, 100])
    assert c.pointer is None  # (7, 100) is not in the prompt
    c.feed([101])
    assert c.pointer == 4 and c.run == 2 and c.propose(3) == [102, 103, 104]
    c.feed(FILE[2:50])
    assert c.run == 50 and c.propose(2) == FILE[50:52]
    # An inserted line: the output leaves the prompt...
    c.feed([9, 8, 9])
    assert c.pointer is None and c.propose(8) == []
    # ...and re-joins where it left as soon as two tokens copy it again.
    c.feed(FILE[50:52])
    assert c.propose(4) == FILE[52:56] and c.run == 2
    # A replaced span: re-joins past it.
    c.feed(FILE[52:60] + [9, 9])
    c.feed(FILE[70:72])
    assert c.propose(3) == FILE[72:75]
    # The prompt's end: nothing more to copy.
    c.feed(FILE[72:] + [3])
    assert c.propose(8) == []
    assert c.propose(0) == []


def test_where_an_ambiguous_or_distant_ngram_joins():
    # Never copied yet: an n-gram occurring twice is no evidence of where.
    c = PromptCopy([5, 6, 1, 5, 6, 2])
    c.feed([5, 6])
    assert c.pointer is None
    c.feed([1])  # (6, 1) occurs once
    assert c.propose(2) == [5, 6]

    quote = [60, 61, 62]  # the instruction quotes the inserted text
    prompt = FILE + [7] + quote + [7] + list(range(500, 520))
    c = PromptCopy(prompt)
    c.feed(FILE[:100])
    assert c.pointer == 100
    # The inserted text is in the prompt once, far from where the output
    # left: two (or three) tokens of it are not enough to jump there.
    c.feed(quote + [9])
    assert c.pointer is None
    c.feed(FILE[100:102])  # back to where it left
    assert c.propose(3) == FILE[102:105]
    # A deleted block: far from where it left, the output is not followed...
    c.feed(FILE[102:150])
    c.feed(FILE[260:268])
    assert c.pointer is None
    # ...and a join the next token does not confirm leaves the place it
    # left (150): the output can still re-join near it with two tokens.
    c.feed(FILE[151:153] + [0])
    assert c.pointer is None
    c.feed(FILE[154:156])
    assert c.propose(1) == [FILE[156]]


def test_drafts_copy_past_the_trees_limit():
    d = SuffixDrafter(num_draft_tokens=64, max_cached_requests=0)
    q = d.start([1, 2] + FILE + [3, 4])
    d.commit(q, FILE[:40] + [9, 9, 9] + FILE[40:42])  # an edit, then two copied tokens
    tree = d._trees[None].speculate(q, d._active[q].context, 64, 2.0, 0.0, 0.1)
    draft = d.propose(q)
    # The trees match two tokens and draft at most four; the copy goes on,
    # with the trees' estimates as far as they draft, then their last.
    assert 0 < len(tree.token_ids) <= 4 and list(tree.token_ids) == FILE[42 : 42 + len(tree.token_ids)]
    assert draft.tokens == FILE[42:106] and draft.source == "copy"
    assert draft.match_len == max(2, tree.match_len)
    assert (draft.tree_len, draft.tree_match) == (len(tree.token_ids), tree.match_len)
    assert draft.truncate(3).tree_len == draft.tree_len  # the split survives a cut
    assert draft.probs == list(tree.probs) + [tree.probs[-1]] * (64 - len(tree.token_ids))
    assert d.propose(q, 5).tokens == FILE[42:47]  # the caller's cap holds
    assert d.propose(q, 0).tokens == []
    # Where the trees draft as far as the copy, theirs is kept.
    d.commit(q, FILE[42:250])
    kept = d.propose(q)
    assert kept.source == "tree" and kept.tokens[:52] == FILE[250:] + [3, 4]


def test_the_trees_draft_wins_a_disagreement_and_copies_alone_get_an_estimate():
    d = SuffixDrafter(max_cached_requests=0)
    prompt = FILE[:100] + [7, 8, 500, 501, 502] + FILE[100:] + [5, 5, 7, 8] + list(range(600, 610))
    q = d.start(prompt)
    d.commit(q, FILE[:100] + [5, 5, 7, 8])  # copied, then an edit
    # The copy re-joined where the output left, where 500 follows (7, 8); the
    # trees' longest match says 600. Their draft is kept.
    assert d._active[q].copy.propose(1) == [500]
    draft = d.propose(q)
    assert draft.tokens == list(range(600, 600 + len(draft))) and len(draft) >= 3
    assert draft.source == "tree" and draft.tree_len == 0

    # (7, 8) is followed by 13 different tokens: the trees rate each below
    # min_token_prob and draft nothing; the copy drafts at COPY_PROB.
    others = [t for i in range(12) for t in (7, 8, 901 + i)]
    prompt = FILE[:100] + [7, 8, 900] + FILE[100:200] + others
    d = SuffixDrafter(max_cached_requests=0)
    q = d.start(prompt)
    d.commit(q, FILE[:100] + [5, 7, 8])
    tree = d._trees[None].speculate(q, d._active[q].context, 64, 2.0, 0.0, 0.1)
    draft = d.propose(q)
    assert len(tree.token_ids) == 0
    assert draft.tokens == prompt[102:166] and draft.source == "copy"
    assert draft.probs == [COPY_PROB] * 64 and draft.match_len == max(2, tree.match_len)
    assert draft.tree_len == 0


def test_copying_shortens_a_replayed_edit(monkeypatch):
    # A file rewritten with three inserted lines. The replay accepts what
    # equals the response; with the copy it needs fewer steps than the
    # trees' ramp after each edit allows.
    line = [9, 8, 7, 6]
    response = FILE[:80] + line + FILE[80:160] + line + FILE[160:240] + line
    prompt = [1, 2] + FILE + [3]
    with_copy = SuffixDrafter(policy="fixed", max_cached_requests=0)
    replay(with_copy, Record(prompt, response))
    with monkeypatch.context() as m:
        m.setattr(PromptCopy, "propose", lambda self, limit: [])
        trees_only = SuffixDrafter(policy="fixed", max_cached_requests=0)
        replay(trees_only, Record(prompt, response))
    assert with_copy.stats.tokens == trees_only.stats.tokens == len(response)
    assert with_copy.stats.steps < trees_only.stats.steps
    # Two tokens after the first inserted line, the whole next run is drafted.
    d = SuffixDrafter(max_cached_requests=0)
    q = d.start(prompt)
    d.commit(q, response[:86])
    assert accepted_length(d.propose(q).tokens, response[86:]) == 64
