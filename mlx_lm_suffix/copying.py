"""Drafting by following the output through the prompt.

A request that rewrites a file of its prompt with edits copies long runs of
the prompt, broken by the edits. After each edit the suffix trees find the
copy again only as fast as their match grows (a draft is at most
``max_spec_factor`` times the match), so every run restarts with short
drafts. A :class:`PromptCopy` keeps the prompt position the output is
copying from: while the output copies, it points at the next prompt token;
when the output leaves the prompt (an edit), it re-joins as soon as the
output's last tokens occur in the prompt again, and from then on drafts the
prompt's continuation as long as the limits allow (:class:`SuffixDrafter
<mlx_lm_suffix.drafter.SuffixDrafter>` uses it where it extends the trees'
draft). This is prompt lookup (vLLM's n-gram proposer) with a memory of
where in the prompt the output is.

Where it joins:

- near where the output left (within :data:`REJOIN_SLACK` tokens plus twice
  the tokens written since: an edit replaces about as much as it writes),
  at the occurrence of the last :data:`NGRAM` tokens nearest to it;
- before the output has ever copied, at the only occurrence of the last
  :data:`NGRAM` tokens;
- farther, at the only occurrence of the last :data:`FAR_NGRAM` tokens (a
  short n-gram far away is often the instruction quoting the edit).

A join that the next token does not confirm leaves the place the output
left unchanged.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Sequence, Tuple

NGRAM = 2
FAR_NGRAM = 8
REJOIN_SLACK = 64
# A draft (not yet committed) re-joins the prompt only where it copies this
# many tokens, its join's n-gram included: the trees' short drafts in text
# that copies nothing meet the prompt's n-grams by chance.
DRAFT_REJOIN_RUN = 2 * NGRAM


class PromptCopy:
    """Where in ``prompt`` the output is copying from, fed the output tokens
    as they are committed (:meth:`feed`)."""

    def __init__(self, prompt: Sequence[int]):
        self.prompt = [int(t) for t in prompt]
        # NGRAM tokens -> prompt positions right after each occurrence, sorted.
        self._after: Dict[tuple, List[int]] = {}
        grams = zip(*(self.prompt[i:] for i in range(NGRAM)))
        for q, gram in enumerate(grams, NGRAM):
            self._after.setdefault(gram, []).append(q)
        self._tail: List[int] = []
        #: The prompt position of the next token while the output copies.
        self.pointer: Optional[int] = None
        #: Output tokens matched in a row at the pointer (the join's included).
        self.run = 0
        # Where the output last left the prompt, and tokens written since.
        self._left: Optional[int] = None
        self._gap = 0

    def feed(self, tokens: Sequence[int]) -> None:
        """Follow committed output tokens."""
        prompt = self.prompt
        for t in tokens:
            t = int(t)
            self._tail.append(t)
            del self._tail[:-FAR_NGRAM]
            p = self.pointer
            if p is not None and p < len(prompt) and prompt[p] == t:
                self.pointer, self.run = p + 1, self.run + 1
                continue
            if p is not None and self.run > NGRAM:
                self._left, self._gap = p, 0
            self._gap += 1
            self.pointer = self._join()
            self.run = NGRAM if self.pointer is not None else 0

    def _join(self) -> Optional[int]:
        after = self._after.get(tuple(self._tail[-NGRAM:]))
        if not after:
            return None
        if self._left is None:
            return after[0] if len(after) == 1 else None
        i = bisect.bisect_left(after, self._left)
        near = min(after[max(0, i - 1) : i + 1], key=lambda q: abs(q - self._left))
        if abs(near - self._left) <= REJOIN_SLACK + 2 * self._gap:
            return near
        if len(self._tail) < FAR_NGRAM:
            return None
        hits = [q for q in after if self.prompt[max(0, q - FAR_NGRAM) : q] == self._tail]
        return hits[0] if len(hits) == 1 else None

    def propose(self, limit: int) -> List[int]:
        """The prompt's next ``limit`` tokens after the pointer (none when the
        output is not copying the prompt)."""
        if self.pointer is None or limit <= 0:
            return []
        return self.prompt[self.pointer : self.pointer + limit]

    def propose_after(self, tokens: Sequence[int], limit: int) -> Tuple[List[int], int]:
        """The prompt's next ``limit`` tokens after ``tokens``, were they
        committed, and the run they would make: where another draft (the
        trees') re-joins the prompt before the output does, and copies at
        least :data:`DRAFT_REJOIN_RUN` tokens there (else none). The copy
        itself is left as it is."""
        state = (self.pointer, self.run, self._left, self._gap, list(self._tail))
        try:
            self.feed(tokens)
            if self.run < DRAFT_REJOIN_RUN:
                return [], self.run
            return self.propose(limit), self.run
        finally:
            self.pointer, self.run, self._left, self._gap, self._tail = state
