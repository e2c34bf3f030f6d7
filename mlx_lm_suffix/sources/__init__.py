"""Where drafts come from.

A :class:`Draft` is a guess at the next tokens of a sequence with an
estimate for each: ``probs[i]``, the chance that its first ``i + 1`` tokens
are all right. A *source* proposes drafts for the rows of a driver (the
single-sequence loop, the batch, the simulator), all of them at once, so
that a source whose proposals cost a forward (a draft model) runs one
batched forward for the rows that ask; the policy
(:mod:`~mlx_lm_suffix.policy`) then decides how much of each draft is
verified, and learns from what held.

- :mod:`.trees`: the suffix trees of each request's prompt and output and of
  earlier responses (arctic-inference), with the finished responses they
  keep;
- :mod:`.prompt_copy`: following the output through the prompt, which
  extends the trees' drafts where the output copies the prompt.

Both make the drafts of a :class:`~mlx_lm_suffix.drafter.SuffixDrafter`
(source ``tree``, or ``copy`` where the prompt's continuation extends
them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, List, Protocol, Sequence

from ..policy.calibration import given


@dataclass
class Draft:
    """Draft tokens, the probability estimate for each (cumulative), how
    many context tokens its source matched, and its source (see
    :data:`~mlx_lm_suffix.policy.Calibration.SOURCES`). A copy that extends
    the trees' draft also keeps how many leading tokens the trees drafted
    (``tree_len``) and from what match (``tree_match``): those are
    calibrated as the trees' draft, the rest as the copy. ``trust``: the
    proposing request's own record
    (:class:`~mlx_lm_suffix.policy.calibration.RequestTrust`), if any.
    Drafts are not changed once proposed."""

    tokens: List[int] = field(default_factory=list)
    probs: List[float] = field(default_factory=list)
    match_len: int = 0
    source: str = "tree"
    tree_len: int = 0
    tree_match: int = 0
    trust: Any = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> "Draft":
        """The first ``n`` tokens (the draft itself when it has no more)."""
        if n >= len(self.tokens):
            return self
        return replace(self, tokens=self.tokens[:n], probs=self.probs[:n]) if n > 0 else Draft()

    def after(self, n: int, limit: int) -> "Draft":
        """The rest of the draft once its first ``n`` tokens are committed
        (at most ``limit`` of it): its estimates given them, from a match
        ``n`` tokens longer."""
        q = self.probs[n - 1] if n else 1.0
        end = n + limit
        return replace(
            self,
            tokens=self.tokens[n:end],
            probs=[given(p, q) for p in self.probs[n:end]],
            match_len=self.match_len + n,
            tree_len=max(0, self.tree_len - n),
            tree_match=self.tree_match + n,
        )


class Source(Protocol):
    """What a driver's rows draft from (:func:`~mlx_lm_suffix.speculation.
    propose` asks it): one call for all the rows that ask this step, so
    that its work may be batched."""

    def drafts(self, reqs: Sequence[Any], limits: Sequence[int]) -> List[Draft]:
        """Each request's draft after its committed tokens, of at most
        ``limits[i]`` tokens (an empty :class:`Draft`: none)."""
