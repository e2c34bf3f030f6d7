"""Replay a real model's own greedy outputs through the drafter and the
policy as the single-sequence loop runs them (pipelined), under fixed cost
curves, once per calibration variant (no model needed after the outputs).

    python benchmarks/real_replay.py [--model smollm2-f32] [--n 8]
        [--max-tokens 128] [--outputs FILE] [--group 2] [--reference]

The outputs (stock ``stream_generate``, greedy, of the built-in workloads)
are generated once and kept in ``--outputs`` (default: a file under ``build/``
named for the model, ``--n`` and ``--max-tokens``). The replay is
:func:`mlx_lm_suffix.tools.simulate.replay`, which steps a request as the
loop does: a plain step's forward runs while the next draft is chosen
(pipelined) and checks the draft's first token; a confirmed draft is
verified at ``cost(len)``; after a verification the bonus token is known and
nothing runs (settled): a draft is verified with it at ``cost(len + 1)``, or
a plain step is taken. Each ``--group``
requests share a fresh drafter (as the bench's cold arms do: 2 requests
per repetition). Prints, per cost curve and workload, the mean over
requests of the estimated decode speedup (stock's forwards / the summed
costs), cold and warm (the global cache holding every response first).
Results: docs/choosing-defaults.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Any, Callable, Dict, List, Sequence, Tuple

from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.policy import Calibration, VerifyCost, calibration
from mlx_lm_suffix.tools import simulate, workloads

#: Forward cost by tokens fed, relative to a 1-token step: the 4-bit real
#: model as this CPU's loop learnt it (a 457-token prefill chunk included),
#: float32 with OpenBLAS, and a Mac GPU-like flat curve.
CURVES: Dict[str, Dict[int, float]] = {
    "4bit": {1: 1.0, 2: 1.85, 6: 5.54, 13: 10.5, 24: 19.4, 457: 279.0},
    "cpu-f32": {1: 1.0, 2: 1.1, 4: 1.3, 8: 1.6, 16: 2.3, 64: 9.0, 128: 17.0},
    "gpu": {1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.2, 32: 1.4, 64: 1.8, 128: 2.6},
    # The bench model (float32, OpenBLAS) as run A learnt it.
    "cpu-bench": {1: 1.0, 2: 1.12, 14: 2.61, 33: 3.82, 65: 6.98},
}


class CumulativeTail(Calibration):
    """The tail calibrated as before 2026-12-03: one ratio of accepted to
    expected cumulative estimates (given the first), over every verified
    position, scaling each position alike."""

    def __init__(self):
        super().__init__(short_tail_ratio=1.0)

    def scale(self, probs, match_len, source="tree", tree_len=0, tree_match=0, trust=None):
        if not probs or probs[0] <= 0:
            return [0.0] * len(probs)
        cells = self._cells(len(probs), match_len, source, tree_len, tree_match)
        first = min(1.0, self._ratio(("first", *cells[0])) * probs[0])
        out, cond = [first], 1.0
        for cell, q in zip(cells[1:], calibration.given_first(probs)):
            cond = min(cond, self._ratio(("tail", *cell)) * q)
            out.append(first * cond)
        return out

    def update(self, probs, accepted, match_len, source="tree", tree_len=0, tree_match=0):
        if not probs:
            return
        cells = self._cells(len(probs), match_len, source, tree_len, tree_match)
        self._add(("first", *cells[0]), probs[0], min(accepted, 1))
        if accepted:
            for i, (cell, q) in enumerate(zip(cells[1:], calibration.given_first(probs)), 1):
                self._add(("tail", *cell), q, int(accepted > i))


VARIANTS: Dict[str, Callable[[], Calibration]] = {
    "current": Calibration,
    "cumulative-tail": CumulativeTail,
    # Each tail step on its own (a survived step counting for nothing).
    "independent-steps": functools.partial(Calibration, draft_weight=1e12),
    "draft-weight-3": functools.partial(Calibration, draft_weight=3.0),
    "draft-weight-10": functools.partial(Calibration, draft_weight=10.0),
}


def generate_outputs(model_name: str, n: int, max_tokens: int) -> Dict[str, List[Dict[str, Any]]]:
    """Stock greedy outputs of ``n`` requests of each built-in workload."""
    import mlx.core as mx
    import mlx_lm

    from mlx_lm_suffix.tools.bench import prompt_ids_for
    from mlx_lm_suffix.tools.models import resolve_model

    model, tokenizer = mlx_lm.load(resolve_model(model_name))
    out: Dict[str, List[Dict[str, Any]]] = {}
    for w in workloads.WORKLOADS:
        out[w] = []
        for body in workloads.build(w, n=n, max_chars=1500):
            ids = prompt_ids_for(tokenizer, body)
            stream = mlx_lm.stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens)
            out[w].append({"prompt": ids, "response": [r.token for r in stream]})
    return out


def reference_answers(n: int, max_tokens: int) -> Dict[str, List[Dict[str, Any]]]:
    """The built-in workloads' reference answers (what the scripted models
    copy), as :func:`policy_ab.records` tokenizes them."""
    from policy_ab import records  # this folder's, beside this script

    return {
        w: [
            {"prompt": r.prompt, "response": r.response[:max_tokens]}
            for r in records(w, n, max_chars=2500)
        ]
        for w in workloads.WORKLOADS
    }


def replay(drafter: SuffixDrafter, prompt: Sequence[int], response: Sequence[int]) -> float:
    """One request as the loop runs it (:func:`mlx_lm_suffix.tools.simulate.
    replay`); returns its decode forwards' summed cost (the forward over the
    first token, which the prefill gave, not counted)."""
    cost = drafter.policy.cost
    total, _ = simulate.replay(drafter, simulate.Record(list(prompt), list(response)),
                               lambda k: cost(k + 1) / cost(1), cost(1))
    return total - 1.0


def speedups(
    records: List[Dict[str, Any]],
    curve: Dict[int, float],
    calib: Callable[[], Calibration],
    group: int,
    warm: bool,
    max_tokens: int,
) -> List[float]:
    """Each request's estimated decode speedup (stock: one forward a token)."""
    out = []
    for j in range(0, len(records), group):
        part = records[j : j + group]
        seconds = {n: c * simulate.DEFAULT_STEP_SECONDS for n, c in curve.items()}
        d = SuffixDrafter(cost=VerifyCost(seconds, smoothing=0))
        d.policy.calibration = calib()
        if warm:
            d.add_responses((None, r["response"]) for r in part)
        for r in part:
            c = replay(d, r["prompt"], r["response"][:max_tokens])
            out.append((len(r["response"]) - 1) / c if c > 0 else 1.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-f32")
    ap.add_argument("--n", type=int, default=8, help="requests per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--outputs", default=None, help="cache of the outputs (default: under build/)")
    ap.add_argument("--group", type=int, default=2, help="requests per fresh drafter")
    ap.add_argument("--reference", action="store_true", help="replay the reference answers instead")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    args = ap.parse_args()
    if args.reference:
        data = reference_answers(args.n, args.max_tokens)
    else:
        path = args.outputs or f"build/real_outputs-{args.model}-{args.n}-{args.max_tokens}.json"
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                json.dump(generate_outputs(args.model, args.n, args.max_tokens), f)
        with open(path) as f:
            data = json.load(f)
    print("mean (min) estimated decode speedup per request")
    rows: List[Tuple[str, ...]] = []
    for curve in CURVES:
        for w, recs in data.items():
            for warm in (False, True):
                for name in args.variants.split(","):
                    calib = VARIANTS[name]
                    s = speedups(recs, CURVES[curve], calib, args.group, warm, args.max_tokens)
                    rows.append(
                        (
                            curve,
                            w,
                            "warm" if warm else "cold",
                            name,
                            f"{sum(s) / len(s):.3f}x ({min(s):.2f})",
                        )
                    )
                    print("  ".join(f"{c:<16}" for c in rows[-1]), flush=True)


if __name__ == "__main__":
    main()
