"""Offline replay of request logs through a :class:`SuffixDrafter`.

In the spirit of arctic-inference's ``suffix_decoding/simulator.py``: pure
CPU, no model. Each logged ``(prompt, response)`` pair is replayed in order
as if the model had produced the logged response greedily, so a draft is
accepted exactly as far as it equals the response. This measures what the
suffix trees would predict on a real workload and picks the drafting knobs
for ``mlx_lm.server --draft suffix``.

The replay steps each request through the single-sequence loop
(:func:`mlx_lm_suffix.loop.decode`), with the logged response playing the
model (:func:`replay`): pipelined plain steps whose forward
checks a draft's first token, verifications of confirmed drafts, settled
verifications of the pending token with a draft, the same caps and the same
policy. With ``policy="adaptive"`` (the default, as in the server) each
draft is cut by the cost-aware policy of :mod:`mlx_lm_suffix.policy`, which
learns its calibration from the replayed steps and its cost curve as the
loop learns it: from the forwards it calibrates first (a 1- and a 2-token
one) and every verification, each priced by
the cost curve given (measured or assumed); ``"fixed"`` drafts as long as
the limits let.

Each finished request stays in the drafter's global cache, so later records
draft from earlier responses (one cache per ``"user"`` when records have one,
as a partitioned server would keep them).

Log format (JSONL), one request per line::

    {"prompt": "text" | [token ids], "response": "text" | [token ids], "user": "optional"}

Text is tokenized without special tokens by the tokenizer of a model folder
or Hugging Face id (only the tokenizer is loaded). Without one, the
byte-level BPE tokenizer of :mod:`mlx_lm_suffix.tools.models` (trained on the
Python standard library, 2048 tokens) is used: good enough to compare knobs,
but token counts differ from a real model's.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import (
    Any,
    Callable,
    Dict,
    Hashable,
    Iterable,
    List,
    Mapping,
    NamedTuple,
    Optional,
    Sequence,
    Union,
)

from ..drafter import SuffixDrafter
from ..loop import decode
from ..policy import VerifyCost
from ..policy.cost import CALIBRATION_SIZES
from ..speculation import Row

#: Knobs a grid may vary, in table order. Missing ones take SuffixDrafter's defaults.
KNOBS = (
    "num_draft_tokens",
    "max_tree_depth",
    "max_spec_factor",
    "max_spec_offset",
    "min_token_prob",
    "max_cached_requests",
    "policy",
)

#: ``mlx_lm.server`` flag of each knob.
SERVER_FLAGS = {
    "num_draft_tokens": "--num-draft-tokens",
    "max_tree_depth": "--suffix-max-tree-depth",
    "max_spec_factor": "--suffix-max-spec-factor",
    "max_spec_offset": "--suffix-max-spec-offset",
    "min_token_prob": "--suffix-min-token-prob",
    "max_cached_requests": "--suffix-max-cached-requests",
    "policy": "--suffix-policy",
}

#: Assumed extra cost of each draft token in a verification forward, relative
#: to a plain one-token decode step: ``cost(k) = 1 + 0.04 * k``. An assumption
#: close to a Mac GPU (or CPU with OpenBLAS) for small k; pass measured costs
#: where they matter.
DEFAULT_COST_PER_DRAFT_TOKEN = 0.04
#: Seconds of a plain decode step where none is given (a small model on a
#: Mac's GPU): the policy weighs the replay's host time, measured, against
#: forwards of ``cost`` times this.
DEFAULT_STEP_SECONDS = 0.01

CostFn = Callable[[int], float]
Grid = Union[Sequence[Mapping[str, Any]], Mapping[str, Any]]


class Record(NamedTuple):
    """One tokenized request: prompt ids, response ids and cache scope."""

    prompt: List[int]
    response: List[int]
    user: Hashable = None


def default_cost(k: int) -> float:
    """Cost of a forward verifying ``k`` draft tokens, relative to a plain
    decode step: ``1 + DEFAULT_COST_PER_DRAFT_TOKEN * k`` (an assumption)."""
    return 1.0 + DEFAULT_COST_PER_DRAFT_TOKEN * k


def policy_cost(cost: CostFn, step_seconds: float = DEFAULT_STEP_SECONDS) -> VerifyCost:
    """The adaptive policy's cost curve (seconds) for a :data:`CostFn` and a
    plain step of ``step_seconds``, as the loop's starts: the forwards it
    calibrates (:data:`~mlx_lm_suffix.policy.cost.CALIBRATION_SIZES`), the
    rest to learn from the replayed forwards."""
    return VerifyCost({n: cost(n - 1) * step_seconds for n in CALIBRATION_SIZES})


def cost_from_times(times: Mapping[Any, float]) -> CostFn:
    """A cost function from measured forward times.

    ``times`` maps the number of tokens in one forward (``1`` is a plain
    decode step, ``1 + k`` verifies ``k`` draft tokens) to its time in any
    unit; key ``1`` is required. Costs are interpolated linearly between the
    measured widths and extrapolated with the last segment's slope.
    """
    points = sorted((int(n), float(t)) for n, t in times.items())
    base = dict(points).get(1)
    if not base or base <= 0:
        raise ValueError("measured costs need a positive time for a 1-token forward")
    if any(n < 1 or t <= 0 for n, t in points):
        raise ValueError("measured costs need widths >= 1 and positive times")
    widths = [n for n, _ in points]
    rel = [t / base for _, t in points]

    def cost(k: int) -> float:
        n = 1 + k
        if len(widths) == 1:
            return rel[0]
        i = 1
        while i < len(widths) - 1 and widths[i] < n:
            i += 1
        n0, n1 = widths[i - 1], widths[i]
        c0, c1 = rel[i - 1], rel[i]
        return max(c0 + (c1 - c0) * (n - n0) / (n1 - n0), 0.0)

    return cost


def load_cost_file(path: Union[str, os.PathLike]) -> CostFn:
    """Read a JSON object ``{"<tokens per forward>": time, ...}`` (e.g.
    ``{"1": 118, "2": 119, "4": 146, "8": 158, "16": 194, "32": 281}``) and
    return :func:`cost_from_times` of it."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of tokens -> time")
    return cost_from_times(data)


def read_records(path: Union[str, os.PathLike]) -> List[Dict[str, Any]]:
    """Read a JSONL log of ``{"prompt", "response"[, "user"]}`` objects."""
    from .workloads import read_jsonl

    records = []
    for lineno, rec in read_jsonl(path):
        if not isinstance(rec, dict) or "prompt" not in rec or "response" not in rec:
            raise ValueError(f"{path}:{lineno}: needs 'prompt' and 'response'")
        records.append(rec)
    return records


def load_encoder(tokenizer: Any = None) -> Callable[[str], List[int]]:
    """A ``text -> token ids`` function (no special tokens added).

    ``tokenizer`` is a model folder or Hugging Face id (its tokenizer is
    loaded with ``mlx_lm.utils.load_tokenizer``), an object with an
    ``encode`` method (a ``transformers``/``tokenizers`` tokenizer or
    mlx-lm's ``TokenizerWrapper``), or ``None`` for the tiny model's BPE
    tokenizer from :mod:`mlx_lm_suffix.tools.models`.
    """
    if tokenizer is None:
        from .models import get_tokenizer

        tokenizer = get_tokenizer()
    elif isinstance(tokenizer, (str, os.PathLike)):
        from mlx_lm.utils import load_tokenizer

        tokenizer = load_tokenizer(Path(tokenizer))

    def encode(text: str) -> List[int]:
        out = tokenizer.encode(text, add_special_tokens=False)
        return [int(t) for t in getattr(out, "ids", out)]

    return encode


def tokenize_records(
    records: Iterable[Union[Record, Mapping[str, Any]]], tokenizer: Any = None
) -> List[Record]:
    """Turn log entries into :class:`Record` s. Records and token lists are
    kept as they are; text is encoded with :func:`load_encoder`
    ``(tokenizer)``, which is only loaded when some entry holds text."""
    encode = None
    out = []
    for i, rec in enumerate(records, 1):
        if isinstance(rec, Record):
            out.append(rec)
            continue
        fields = []
        for key in ("prompt", "response"):
            value = rec[key]
            if isinstance(value, str):
                if encode is None:
                    encode = load_encoder(tokenizer)
                value = encode(value)
            elif not isinstance(value, (list, tuple)) or not all(
                type(t) is int and 0 <= t < 2**31 for t in value
            ):
                raise ValueError(f"record {i}: {key} must be text or a list of token ids "
                                 f"(integers from 0)")
            fields.append([int(t) for t in value])
        out.append(Record(fields[0], fields[1], rec.get("user")))
    if not out:
        raise ValueError("no records to replay")
    return out


def expand_grid(grid: Grid) -> List[Dict[str, Any]]:
    """Grid points from a list of dicts, or from a dict of value lists (their
    Cartesian product; a scalar counts as a one-value list)."""
    if isinstance(grid, Mapping):
        keys = list(grid)
        values = [v if isinstance(v, (list, tuple)) else [v] for v in grid.values()]
        points = [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]
    else:
        points = [dict(p) for p in grid]
    for p in points:
        unknown = set(p) - set(KNOBS)
        if unknown:
            raise ValueError(f"unknown knobs {sorted(unknown)}; expected some of {KNOBS}")
    return points


class Replay:
    """One recorded request as a :class:`~mlx_lm_suffix.loop.Target`: its
    response plays the target model, which samples the response's next
    token after any input; a forward of ``n`` tokens costs ``cost(n - 1)``,
    summed in ``total``, and the policy learns it as ``step`` times that
    many seconds. Each time the host reads a forward's result before it
    queues the next (a verification, a check of first tokens) the device
    waits ``wait`` more (in plain steps, in ``total``; as seconds in the
    policy's idle time, which it prices). As the loop, the policy learns a
    plain step from each that follows another
    (:meth:`~mlx_lm_suffix.policy.Policy.observe_plain`)."""

    def __init__(self, row: Row, response: List[int], policy: Any, cost: CostFn, step: float,
                 wait: float = 0.0):
        self.row, self.policy, self.cost, self.step = row, policy, cost, step
        self.response, self.wait = response, wait
        self.at = 0  # where the pending token is in the response
        self.total = 0.0
        self._fed: List[int] = []
        self._queued = False  # a plain forward runs: reading its token waits
        self._plain_run = False  # the last step was plain, its token not read

    def _waits(self) -> None:
        self.total += self.wait
        self.policy.stats.waited(self.wait * self.step, False)

    def pending(self) -> int:
        self._plain_run = False
        if self._queued:
            self._queued = False
            self._waits()
        return self.response[self.at]

    def plain(self) -> None:
        self.total += self.cost(0)
        if self._plain_run:
            self.policy.observe_plain(self.cost(0) * self.step)
        self._plain_run = True
        self.row.stepped(self.response[self.at])
        self.at += 1
        self._queued = True

    def verify(self, token: int, draft: Any, first: int) -> None:
        tokens = [token] + draft.tokens[first:]
        self._fed, self._queued, self._plain_run = tokens, False, False
        cost = self.verify_cost(len(tokens), draft)
        self.total += cost
        self._waits()
        self.policy.observe(len(tokens), cost * self.step,
                            unpaired=draft.source == "model" and self.row.holds)

    def verify_cost(self, n: int, draft: Any) -> float:
        """A verification's forward of ``n`` tokens (of ``draft``), in plain
        steps: ``cost(n - 1)``."""
        return self.cost(n - 1)

    def verified(self) -> List[int]:
        after = self.response[self.at + 1 : self.at + 1 + len(self._fed)]
        return after + [-1] * (len(self._fed) - len(after))

    def commit(self, accepted: int, draft: Any, first: int) -> None:
        self.row.emit(self._fed[: accepted + 1], accepted + first, draft.source)
        self.at += accepted + 1

    def room(self) -> float:
        return math.inf

    def replays(self, width: int) -> bool:
        return False


def replay(
    drafter: SuffixDrafter,
    record: Record,
    cost: CostFn = default_cost,
    step_seconds: float = DEFAULT_STEP_SECONDS,
    wait: float = 0.0,
) -> tuple[float, float]:
    """Replay one request through ``drafter`` as the single-sequence loop
    steps it (:func:`~mlx_lm_suffix.loop.decode`, pipelining included),
    counting into its ``stats``: the first response token comes from the
    prompt's forward; every step is a plain forward (``cost(0)``), a plain
    forward and a verification of a confirmed draft, or, settled, a
    verification of the pending token and a draft of ``k`` tokens
    (``cost(k)``). The policy learns each forward as ``step_seconds`` times
    its cost (a plain step's seconds), to weigh against its host time.
    ``wait``: plain steps the device waits after each forward whose result
    the host reads (a verification, a check of first tokens), as the loop's
    ``idle_us_per_wait`` over its plain step (:class:`Replay`).

    Returns ``(verification_cost, host_seconds)``: the summed ``cost`` of
    its forwards, and the wall time of the steps' own work (drafting and
    the policy)."""
    response = list(record.response)
    req = drafter.start(record.prompt, scope=record.user)
    row = Row(drafter, req, drafter.num_draft_tokens, len(response))
    target = Replay(row, response, drafter.policy, cost, step_seconds, wait)
    tic = time.perf_counter()
    for _ in decode(target, row):
        pass
    seconds = time.perf_counter() - tic
    row.finish()
    return target.total, seconds


def simulate(
    records: Iterable[Union[Record, Mapping[str, Any]]],
    grid: Grid,
    tokenizer: Any = None,
    *,
    cost: Optional[CostFn] = None,
    warm: bool = False,
    step_seconds: float = DEFAULT_STEP_SECONDS,
    wait: float = 0.0,
) -> List[Dict[str, Any]]:
    """Replay ``records`` in order once per grid point.

    Args:
        records: :class:`Record` s, or log entries (``{"prompt", "response"
            [, "user"]}`` with text or token lists).
        grid: Knob values (see :data:`KNOBS`): a list of dicts or a dict of
            lists (Cartesian product).
        tokenizer: For text entries; see :func:`load_encoder`.
        cost: Verification cost of a step drafting ``k`` tokens relative to a
            plain decode step (default :func:`default_cost`, an assumption;
            see :func:`cost_from_times` for measured ones).
        warm: Replay twice: the first pass only fills the global cache with
            every response, the second is measured.
        step_seconds: A plain decode step's seconds (see :func:`replay`).
        wait: Plain steps the device waits for the host after a forward
            whose result it reads (see :func:`replay`).

    Returns:
        One dict per grid point: every knob, ``records``, ``tokens``,
        ``steps``, ``drafted``, ``accepted``, ``acceptance_rate`` (accepted /
        drafted), ``accepted_per_step``, ``tokens_per_step`` (the speedup
        bound with free verification), ``est_speedup`` (tokens / summed step
        cost) and ``draft_us_per_token`` (drafting overhead per output token).
    """
    cost = cost or default_cost
    recs = tokenize_records(records, tokenizer)
    results = []
    for point in expand_grid(grid):
        drafter = SuffixDrafter(**point, cost=policy_cost(cost, step_seconds))
        if warm:
            drafter.add_responses((r.user, r.response) for r in recs)
        total_cost = 0.0
        seconds = 0.0
        for rec in recs:
            c, s = replay(drafter, rec, cost, step_seconds, wait)
            total_cost += c
            seconds += s
        st = drafter.stats
        config = drafter.config()
        results.append(
            {
                **{k: config[k] for k in KNOBS},
                "records": len(recs),
                "tokens": st.tokens,
                "steps": st.steps,
                "drafted": st.drafted,
                "accepted": st.accepted,
                "acceptance_rate": st.accepted / st.drafted if st.drafted else 0.0,
                "accepted_per_step": st.accepted / st.steps if st.steps else 0.0,
                "tokens_per_step": st.tokens / st.steps if st.steps else 0.0,
                "est_speedup": st.tokens / total_cost if total_cost else 0.0,
                "draft_us_per_token": 1e6 * seconds / st.tokens if st.tokens else 0.0,
            }
        )
    return results


def recommend(results: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The result with the highest estimated speedup (on a tie, the one with
    fewer draft tokens, then the earlier one)."""
    if not results:
        raise ValueError("no results to recommend from")
    best = max(
        enumerate(results),
        key=lambda ir: (ir[1]["est_speedup"], -ir[1]["num_draft_tokens"], -ir[0]),
    )
    return dict(best[1])


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def server_command(knobs: Mapping[str, Any], model: Optional[str] = None) -> str:
    """The ``mlx_lm.server`` command line that uses ``knobs`` (e.g. the
    result of :func:`recommend`)."""
    args = ["mlx_lm.server"]
    if model is not None:
        args += ["--model", str(model)]
    args += ["--draft", "suffix"]
    for knob, flag in SERVER_FLAGS.items():
        if knob in knobs:
            args += [flag, _fmt(knobs[knob])]
    return shlex.join(args)


_COLUMNS = (
    ("num_draft_tokens", "draft", "{}"),
    ("max_tree_depth", "depth", "{}"),
    ("max_spec_factor", "factor", "{:g}"),
    ("max_spec_offset", "offset", "{:g}"),
    ("min_token_prob", "min_p", "{:g}"),
    ("policy", "policy", "{}"),
    ("acceptance_rate", "accept", "{:.1%}"),
    ("accepted_per_step", "acc/step", "{:.2f}"),
    ("tokens_per_step", "tok/step", "{:.2f}"),
    ("est_speedup", "est.speedup", "{:.2f}x"),
    ("draft_us_per_token", "us/tok", "{:.1f}"),
)


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    """A text table of ``results``, best estimated speedup first."""
    rows = sorted(results, key=lambda r: -r["est_speedup"])
    cells = [[h for _, h, _ in _COLUMNS]]
    cells += [[f.format(r[k]) for k, _, f in _COLUMNS] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells
    )
