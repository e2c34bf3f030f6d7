"""Counters of drafting: one base type for a drafter's, a batch's and a
request's counts, with one way to report, add and subtract them.

A *step* is one forward of the target model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional, Sequence, TypeVar

C = TypeVar("C", bound="Counters")


def histogram(lengths: Dict[int, int]) -> Dict[str, int]:
    """Draft-length histogram with string keys (JSON)."""
    return {str(k): v for k, v in sorted(lengths.items())}


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


@dataclass
class Counters:
    """Base of the counter types: numbers add up (fields named ``max_*``
    keep the larger), dicts of counts add up per key."""

    def as_dict(self) -> Dict[str, Any]:
        """The counts (dicts with string keys), for JSON."""
        return {
            f.name: histogram(v) if isinstance(v, dict) else v
            for f in fields(self)
            for v in (getattr(self, f.name),)
        }

    def merge(self, other: "Counters") -> None:
        """Add ``other``'s counts to these."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            elif f.name.startswith("max_"):
                setattr(self, f.name, max(mine, theirs))
            else:
                setattr(self, f.name, mine + theirs)

    def delta(self: C, before: C) -> C:
        """The counts since ``before`` (an earlier :meth:`copy` of these;
        ``max_*`` fields are the current ones)."""
        out = type(self)()
        for f in fields(self):
            now, then = getattr(self, f.name), getattr(before, f.name)
            if isinstance(now, dict):
                value = {k: v - then.get(k, 0) for k, v in now.items() if v != then.get(k, 0)}
            elif f.name.startswith("max_"):
                value = now
            else:
                value = now - then
            setattr(out, f.name, value)
        return out

    def copy(self: C) -> C:
        """A snapshot of the counts."""
        out = type(self)()
        out.merge(self)
        return out


@dataclass
class DraftStats(Counters):
    """A drafter's counts over all its requests."""

    requests: int = 0
    #: Earlier responses the global cache dropped for its bounds.
    evictions: int = 0
    steps: int = 0
    draft_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    #: Verifications after which a request's cache went back to its state
    #: before them (recurrent state) and was fed its kept tokens again (a
    #: batch's replay counts once per row).
    replays: int = 0
    replayed_tokens: int = 0
    #: Drafts of 2 or more tokens (a batch: steps with drafts) the policy did
    #: not verify because verifying them would not pay.
    refused: int = 0
    #: Host seconds of drafting and pricing: the drafter's walks and
    #: commits, the policy's cuts.
    host_s: float = 0.0
    #: Waits for the device (a verification, or a plain forward that checks
    #: drafts' first tokens), and the host seconds after them before the
    #: next forward was queued (the device idle, on a GPU), in this code.
    waits: int = 0
    idle_s: float = 0.0
    #: Sum of the trees' probability estimates over verified draft tokens.
    expected: float = 0.0
    #: Verified draft length -> number of steps.
    lengths: Dict[int, int] = field(default_factory=dict)
    #: Per draft source (``tree``, ``copy``, ...): the drafts verified (or
    #: checked: a first token the plain forward rejected is a draft of
    #: one), their tokens verified, and those accepted.
    source_drafts: Dict[str, int] = field(default_factory=dict)
    source_drafted: Dict[str, int] = field(default_factory=dict)
    source_accepted: Dict[str, int] = field(default_factory=dict)
    #: Draft position (0: a draft's first token) -> drafts whose token
    #: there was accepted (vLLM's ``num_accepted_tokens_per_pos``).
    accepted_per_position: Dict[int, int] = field(default_factory=dict)
    #: A draft model's forwards (each one token of every row of its
    #: driver) and their seconds.
    model_forwards: int = 0
    model_s: float = 0.0

    def count(self, steps: int = 0, drafted: int = 0, accepted: int = 0, draft: Any = None,
              host_s: float = 0.0, replayed: Optional[int] = None, source: str = "tree",
              last: int = 0) -> None:
        """The one writer of these counts but ``requests``, ``tokens``,
        ``evictions`` (the drafter's lifecycle) and the waits
        (:meth:`waited`): ``steps``
        forwards; ``drafted`` tokens of ``draft`` (a
        :class:`~mlx_lm_suffix.sources.Draft`) verified; ``accepted`` draft
        tokens from ``source`` emitted, at a draft's first positions
        (negative: taken back from the ``last`` a verification emitted);
        ``host_s`` seconds of drafting; a replay of ``replayed`` tokens."""
        self.steps += steps
        self.host_s += host_s
        if replayed is not None:
            self.replays += 1
            self.replayed_tokens += replayed
        if drafted:
            origin = draft.source if draft is not None else source
            self.drafted += drafted
            self.draft_steps += 1
            self.expected += sum(draft.probs[:drafted]) if draft is not None else 0.0
            self.lengths[drafted] = self.lengths.get(drafted, 0) + 1
            self.source_drafts[origin] = self.source_drafts.get(origin, 0) + 1
            self.source_drafted[origin] = self.source_drafted.get(origin, 0) + drafted
        if accepted:
            self.accepted += accepted
            self.source_accepted[source] = self.source_accepted.get(source, 0) + accepted
            per, one = self.accepted_per_position, 1 if accepted > 0 else -1
            for i in range(accepted) if accepted > 0 else range(last + accepted, last):
                per[i] = per.get(i, 0) + one

    def waited(self, seconds: float, wait: bool) -> None:
        """The host worked ``seconds`` while the device waited for it
        (``wait``: a new wait, after reading a forward's result)."""
        self.waits += wait
        self.idle_s += seconds

    def as_dict(self) -> Dict[str, Any]:
        d = super().as_dict()
        d["acceptance_rate"] = _ratio(self.accepted, self.drafted)
        d["expected_acceptance_rate"] = _ratio(self.expected, self.drafted)
        d["tokens_per_step"] = _ratio(self.tokens, self.steps)
        d["host_us_per_step"] = 1e6 * _ratio(self.host_s, self.steps)
        d["idle_us_per_wait"] = 1e6 * _ratio(self.idle_s, self.waits)
        d["mean_acceptance_length"] = 1.0 + _ratio(self.accepted, self.draft_steps)
        return d


@dataclass
class RequestUsage(Counters):
    """One request's counts, filled by the same code on every path
    (:class:`~mlx_lm_suffix.speculation.Row`): draft tokens verified, those
    accepted and emitted, target forwards, and replays (see
    :class:`DraftStats`)."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    replays: int = 0
    replayed_tokens: int = 0
    #: Host seconds of the request's drafting (see :class:`DraftStats`).
    host_s: float = 0.0
    #: ``drafted`` and ``accepted`` per draft source (``tree``, ``copy``,
    #: ``model``).
    source_drafted: Dict[str, int] = field(default_factory=dict)
    source_accepted: Dict[str, int] = field(default_factory=dict)


@dataclass
class BatchDraftStats(Counters):
    """A batch's forwards by kind and the batch sizes seen."""

    verify_steps: int = 0
    unpipelined_steps: int = 0
    #: Verifications after which every row was fed its kept tokens again.
    replays: int = 0
    #: Tokens those replays fed, over all rows (padding not counted).
    replayed_tokens: int = 0
    plain_steps: int = 0
    check_steps: int = 0
    verify_rows: int = 0
    max_batch_size: int = 0
    max_verify_batch_size: int = 0
    uneven_rollbacks: int = 0
    compactions: int = 0
    finish_trims: int = 0
    #: Verifications by their width: the tokens fed per row.
    widths: Dict[int, int] = field(default_factory=dict)
    #: Plain steps taken because prompts waited for prefill or rows for
    #: their first token (no verification runs then).
    yield_steps: int = 0
    #: Verifications run while prompts waited for prefill, each within its
    #: share of their prefill's time (``batch.PREFILL_SHARE``).
    prefill_verify_steps: int = 0
    #: Requests timed from their arrival to the start of their generation,
    #: the seconds of that time a verification ran, summed, and the most
    #: for one request.
    waited_requests: int = 0
    verify_wait_s: float = 0.0
    max_verify_wait_s: float = 0.0

    def count_verification(self, width: int, emitted: Sequence[Sequence[int]],
                           accepted: Sequence[int], replayed: bool, pipelined: bool) -> None:
        """A verification ``width`` tokens wide whose rows accepted
        ``accepted`` draft tokens and emitted ``emitted`` (fewer where a row
        finished in them); ``replayed``: every row was fed its emitted
        tokens again."""
        rows, kept = len(emitted), [len(e) for e in emitted]
        self.verify_steps += 1
        self.unpipelined_steps += not pipelined
        self.replays += replayed
        self.replayed_tokens += sum(kept) if replayed else 0
        self.verify_rows += rows
        self.max_batch_size = max(self.max_batch_size, rows)
        self.max_verify_batch_size = max(self.max_verify_batch_size, rows)
        self.uneven_rollbacks += len(set(kept)) > 1 and not replayed
        self.finish_trims += sum(k < 1 + a for k, a in zip(kept, accepted))
        self.widths[width] = self.widths.get(width, 0) + 1

    def count_wait(self, seconds: float) -> None:
        """A request waited ``seconds`` behind verifications."""
        self.waited_requests += 1
        self.verify_wait_s += seconds
        self.max_verify_wait_s = max(self.max_verify_wait_s, seconds)

    def as_dict(self) -> Dict[str, Any]:
        d = super().as_dict()
        d["mean_verify_batch_size"] = _ratio(self.verify_rows, self.verify_steps)
        d["mean_verify_wait_s"] = _ratio(self.verify_wait_s, self.waited_requests)
        return d
