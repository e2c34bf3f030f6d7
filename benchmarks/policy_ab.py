"""Side-by-side replay of drafting-rule variants (no model, deterministic).

Replays the built-in workloads (code edit, agentic, open-ended; a cold pass
in order into one global cache, then a warm pass of the same requests)
through :func:`mlx_lm_suffix.tools.simulate.replay` with fixed verification
cost curves, once per variant (each switches one rule off), and prints the
estimated speedup (tokens / summed step cost). Used to decide which rules
pay; see docs/choosing-defaults.md. Run from a checkout:

    python benchmarks/policy_ab.py [--n 24] [--variants current,unscaled]
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Tuple

from mlx_lm_suffix import copying, drafter
from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.policy import calibration
from mlx_lm_suffix.tools import simulate, workloads

#: Forward cost by tokens fed, relative to a 1-token step: a Mac GPU-like
#: flat curve, this CPU's float32 with OpenBLAS, and its 4-bit (notes.md).
CURVES: Dict[str, Dict[int, float]] = {
    "gpu": {1: 1.0, 2: 1.04, 4: 1.12, 8: 1.28, 16: 1.6, 32: 2.24, 64: 3.5},
    "cpu-f32": {1: 1.0, 2: 1.0, 4: 1.25, 8: 1.37, 16: 1.67, 32: 2.0, 64: 3.6},
    "4bit": {1: 1.0, 2: 1.18, 4: 2.2, 8: 4.2, 16: 8.4, 32: 16.8, 64: 33.6},
}


class Unscaled(calibration.Calibration):
    """The trees' estimates as they are."""

    def _ratio(self, cell):
        return 1.0


class NoSource(calibration.Calibration):
    """Copies calibrated with the trees' drafts."""

    def _cells(self, n, match_len, source, tree_len, tree_match):
        return [("tree", self.bucket(match_len))] * n


class NoCopy(copying.PromptCopy):
    """No prompt copies."""

    def propose(self, limit):
        return []


#: name -> (drafter class, calibration class, prompt copy class)
VARIANTS = {
    "current": (SuffixDrafter, calibration.Calibration, copying.PromptCopy),
    "unscaled": (SuffixDrafter, Unscaled, copying.PromptCopy),
    "no-source": (SuffixDrafter, NoSource, copying.PromptCopy),
    "no-copy": (SuffixDrafter, calibration.Calibration, NoCopy),
}


def records(name: str, n: int, max_chars: int = 4000) -> List[simulate.Record]:
    """Workload ``name``'s requests as replay records (prompt: the messages'
    text; response: the reference answer)."""
    out = []
    for rec in workloads.build(name, n, max_chars):
        prompt = "\n".join(m["content"] for m in rec["messages"])
        out.append({"prompt": prompt, "response": rec["reference"]})
    return simulate.tokenize_records(out)


def run(recs: List[simulate.Record], curve: Dict[int, float], variant: tuple) -> Tuple[float, ...]:
    """Estimated speedups of a cold pass over ``recs`` and a warm one."""
    cls, calib, copy = variant
    cost = simulate.cost_from_times(curve)
    d = cls(cost=simulate.policy_cost(cost))
    d.policy.calibration = calib()
    drafter.PromptCopy = copy
    try:
        out = []
        for _ in ("cold", "warm"):
            before = d.stats.tokens
            total = sum(simulate.replay(d, r, cost)[0] for r in recs)
            out.append((d.stats.tokens - before) / total)
    finally:
        drafter.PromptCopy = copying.PromptCopy
    return tuple(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=24, help="requests per workload")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    args = ap.parse_args()
    recs = {w: records(w, args.n) for w in workloads.WORKLOADS}
    cols = [(w, c) for w in recs for c in CURVES]
    print("estimated speedup, cold | warm; columns: workload/cost curve")
    print(f"{'variant':<14} " + " ".join(f"{w[:9] + '/' + c:>17}" for w, c in cols))
    for name in args.variants.split(","):
        row = [run(recs[w], CURVES[c], VARIANTS[name]) for w, c in cols]
        print(f"{name:<14} " + " ".join(f"{a:>8.3f} |{b:>7.2f}" for a, b in row), flush=True)


if __name__ == "__main__":
    main()
