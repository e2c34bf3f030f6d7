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

Where it joins, at an occurrence of the output's last :data:`NGRAM` tokens:

- before the output has ever copied, at their only occurrence;
- after, at the occurrence nearest to where the output left, if within
  :data:`REJOIN_SLACK` tokens plus twice the tokens written since (an edit
  replaces about as much as it writes; farther away, a short n-gram is
  often the instruction quoting the edit).

A join that the next token does not confirm leaves the place the output
left unchanged.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional, Sequence

#: Output tokens that must occur in the prompt for the output to join it.
NGRAM = 2
#: How far from where the output left the prompt it may re-join (plus
#: twice the tokens written since).
REJOIN_SLACK = 64


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
        self._tail: tuple = ()  # the output's last NGRAM tokens
        #: The prompt position of the next token while the output copies.
        self.pointer: Optional[int] = None
        #: Output tokens matched in a row at the pointer (the join's included).
        self.run = 0
        # Where the output last left the prompt, and tokens written since.
        self._left: Optional[int] = None
        self._gap = 0

    def feed(self, tokens: Sequence[int]) -> None:
        """Follow committed output tokens."""
        prompt, end, grams = self.prompt, len(self.prompt), self._after
        tail, p, run = self._tail, self.pointer, self.run
        for t in tokens:
            t = int(t)
            tail = (*tail, t)[-NGRAM:]
            if p is not None and p < end and prompt[p] == t:
                p, run = p + 1, run + 1
                continue
            if p is not None and run > NGRAM:
                self._left, self._gap = p, 0
            self._gap += 1
            after = grams.get(tail)
            p = self._join(after) if after else None
            run = NGRAM if p is not None else 0
        self._tail, self.pointer, self.run = tail, p, run

    def _join(self, after: List[int]) -> Optional[int]:
        """Where to join among ``after``, the positions after the output's
        last tokens' occurrences (see the module docstring)."""
        if self._left is None:
            return after[0] if len(after) == 1 else None
        i = bisect.bisect_left(after, self._left)
        near = min(after[max(0, i - 1) : i + 1], key=lambda q: abs(q - self._left))
        return near if abs(near - self._left) <= REJOIN_SLACK + 2 * self._gap else None

    def propose(self, limit: int) -> List[int]:
        """The prompt's next ``limit`` tokens after the pointer (none when the
        output is not copying the prompt)."""
        if self.pointer is None or limit <= 0:
            return []
        return self.prompt[self.pointer : self.pointer + limit]
