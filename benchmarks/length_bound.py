"""How close any draft-length policy can come to the oracle, replayed.

    python benchmarks/length_bound.py [--curve tiny,bench,q4]
        [--sets T,A,tune,report] [--max-tokens 128]

Each request's reference answer is replayed through a fresh drafter as the
single-sequence loop steps it (:mod:`mlx_lm_suffix.tools.simulate`, no
model), with three length policies over the same proposals:

- ``adaptive``: the product's policy, cold;
- ``whole``: every proposal verified as proposed (``policy="fixed"``);
- ``knowing``: every proposal cut at its first token the answer does not
  have (a policy that knows the answer: no policy that does not can
  verify fewer wasted tokens or stop a draft later), pipelined drafts
  under two tokens dropped as the loop drops them;

beside ``oracle@64``: the answer itself, 64 draft tokens a verification
from its first token (as the bench's oracle arm). A policy's share is the
oracle's cost over its own (both emit the same tokens). What ``knowing``
lacks is the drafter's: the draft it has at each step (the first step
knows one answer token; a copy of the prompt joins after two; an edit is
not known before the model writes it).

Curves (a forward of ``n`` tokens over a plain step's, as measured in the
loop: docs/benchmarks.md): ``tiny`` the bench's tiny size on this CPU,
``bench`` 1 + 0.11k, ``q4`` 1 + 0.8k (SmolLM2 4-bit on this CPU); the policy
knows the curve from the start. Sets:
``T`` the README's run T (4 code edits of 1,500 characters), ``A`` run A
(2 of 2,500), ``tune`` / ``report`` the evaluation set's halves.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx_lm

from mlx_lm_suffix import SuffixDrafter, loop, speculation
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.sources import Draft
from mlx_lm_suffix.tools import bench, simulate, workloads
from mlx_lm_suffix.tools.models import ensure_model

ORACLE_DRAFT = 64
_TINY = {1: 1.0, 2: 1.36, 8: 3.64, 16: 5.88, 32: 9.42, 65: 17.6}
# name -> (cost of a forward verifying k draft tokens, a plain step's seconds)
CURVES: Dict[str, Tuple[Callable[[int], float], float]] = {
    "tiny": (simulate.cost_from_times(_TINY), 0.0008),
    "bench": (lambda k: 1.0 + 0.11 * k, 0.02),
    "q4": (lambda k: 1.0 + 0.8 * k, 0.15),
}
# The forwards whose cost the policy knows (as a drafter does once it has
# run them; the bench's cold arm after its first repetition).
KNOWN = (1, 2, 4, 8, 16, 32, 64)
POLICIES = ("adaptive", "whole", "knowing")


def records(name: str) -> List[Dict]:
    """The code edits of set ``name`` (see the module docstring)."""
    if name == "T":
        return workloads.build("code-edit", n=4, max_chars=1500)
    if name == "A":
        return workloads.build("code-edit", n=2, max_chars=2500)
    return workloads.eval_set("code-edit", name)


def oracle_cost(n_tokens: int, cost: Callable[[int], float]) -> float:
    """The oracle's forwards for an answer of ``n_tokens``: its first token
    from the prompt's forward, then ``[pending] + 64`` a verification."""
    total, emitted = 0.0, 1
    while emitted < n_tokens:
        k = min(ORACLE_DRAFT, n_tokens - emitted - 1)
        total += cost(k)
        emitted += k + 1
    return total


def knowing(driver: simulate.Replay) -> Callable[..., List[int]]:
    """``Policy.batch_lengths`` that cuts the replay's draft where the
    answer leaves it."""
    def lengths(drafts: Sequence[Draft], pipelined: bool, replay: bool = False,
                budget: Optional[float] = None) -> List[int]:
        d = drafts[0]
        # Pipelined, the draft follows the token just emitted; settled, the
        # pending token.
        start = driver.at + (0 if pipelined else 1)
        truth = driver.response[start : start + len(d)]
        n = next((i for i, (a, b) in enumerate(zip(d.tokens, truth)) if a != b), len(truth))
        return [n if n >= speculation.shortest(not pipelined) else 0]
    return lengths


def replay(prompt: List[int], response: List[int], policy: str,
           cost: Callable[[int], float], step: float) -> float:
    """One request through a fresh drafter (as :func:`simulate.replay`,
    the length policy swapped for ``knowing``): its forwards' cost."""
    known = VerifyCost({n: cost(n - 1) * step for n in KNOWN})
    drafter = SuffixDrafter(cost=known, policy="fixed" if policy == "whole" else "adaptive")
    req = drafter.start(prompt)
    row = speculation.Row(drafter, req, drafter.num_draft_tokens, len(response))
    driver = simulate.Replay(row, response, drafter.policy, cost, step)
    if policy == "knowing":
        drafter.policy.batch_lengths = knowing(driver)
    for _ in loop.decode(driver, row):
        pass
    row.finish()
    return driver.total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--curve", default="tiny,bench,q4")
    ap.add_argument("--sets", default="T,A,tune,report")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    _, tokenizer = mlx_lm.load(str(ensure_model("qwen3", "tiny")))
    print("share of oracle@64 (its cost over the policy's), summed over the set's requests; "
          "in brackets the median request's share and the worst's")
    print("| curve | set | requests | " + " | ".join(POLICIES) + " |")
    print("|---|---|---|" + "---|" * len(POLICIES))
    for name in args.sets.split(","):
        reqs = bench.load_requests(records(name), tokenizer)
        answers = [(r.prompt_ids, r.reference_ids[: args.max_tokens]) for r in reqs]
        for curve in args.curve.split(","):
            cost, step = CURVES[curve]
            oracle = [oracle_cost(len(a), cost) for _, a in answers]
            cells = []
            for policy in POLICIES:
                costs = [replay(p, a, policy, cost, step) for p, a in answers]
                shares = [o / c for o, c in zip(oracle, costs)]
                cells.append(f"{sum(oracle) / sum(costs):.1%} ({statistics.median(shares):.0%}, "
                             f"{min(shares):.0%})")
            print(f"| {curve} | {name} | {len(answers)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
