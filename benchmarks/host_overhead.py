"""The plugin's own host work per token, where no forward hides it.

    python benchmarks/host_overhead.py [--tokens 2000] [--runs 7] [--reps 5]

On this CPU backend ``mx.async_eval`` computes most of a forward before it
returns, so host work is serial with the model, shows 2-3 times its own
time in situ, and the bench's ratios at the fast sizes move by more than a
few microseconds a token change. Two measures that do not depend on that:

- **Loop**: ``mlx_lm``'s ``generate_step`` against
  :func:`~mlx_lm_suffix.suffix_generate_step` on a compute-free model (its
  logits are ``mx.zeros``, its cache a ``KVCache``), microseconds a token
  after the first, interleaved, min and median of ``--runs``: without
  drafting (``num_draft_tokens=0``), with a drafter whose walks find
  nothing, and with the default drafter (the fake's greedy output repeats
  one token, so its drafts hold: a repeat's host work).
- **Core on replays**: :func:`~mlx_lm_suffix.tools.simulate.replay` of the
  evaluation set's report half (no model; a fresh drafter a request; costs
  as at the tiny size: a 0.8 ms plain step, a k-token verification
  ``1 + 0.1 k`` steps, a tenth of a step's wait after each read), host
  microseconds a step, min of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from mlx_lm_suffix import SuffixDrafter, suffix_generate_step
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.sources import Draft
from mlx_lm_suffix.tools import bench, simulate, workloads
from mlx_lm_suffix.tools.models import ensure_model

VOCAB = 256
STEP = 0.8e-3  # seconds of a plain step, as at the tiny size


class Fake:
    """A model that computes nothing: zero logits for every position."""

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return mx.zeros((1, inputs.shape[1], VOCAB))

    def make_cache(self) -> List[Any]:
        return [KVCache()]


class Nothing(SuffixDrafter):
    """Walks that find nothing (the policy learns their host time)."""

    def propose(self, req_id: int, max_tokens: Any = None) -> Draft:
        return Draft()


def _us_per_token(arm: str, prompt: mx.array, tokens: int) -> float:
    model = Fake()
    if arm == "stock":
        gen = generate_step(prompt, model, max_tokens=tokens)
    else:
        drafter = (Nothing if arm == "nothing found" else SuffixDrafter)(
            cost=VerifyCost({1: 1e-4, 2: 1.2e-4, 64: 5e-4}))
        gen = suffix_generate_step(prompt, model, drafter, max_tokens=tokens,
                                   num_draft_tokens=0 if arm == "no drafting" else None)
    n, start = 0, 0.0
    for n, _ in enumerate(gen):
        if n == 0:
            start = time.perf_counter()
    return (time.perf_counter() - start) / max(n, 1) * 1e6


def loop(tokens: int, runs: int) -> Dict[str, List[float]]:
    prompt = mx.array(list(range(5, 200)), mx.uint32)
    arms = ("stock", "no drafting", "nothing found", "default")
    out: Dict[str, List[float]] = {a: [] for a in arms}
    for _ in range(runs):
        for arm in arms:
            out[arm].append(_us_per_token(arm, prompt, tokens))
    return out


def core(reps: int) -> Dict[str, float]:
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(ensure_model("qwen3", "tiny")))  # its chat template
    out = {}
    for name in ("code-edit", "open-ended"):
        records = [simulate.Record(r.prompt_ids, r.reference_ids[:256])
                   for r in bench.load_requests(workloads.eval_set(name, "report"), tokenizer)]
        best = None
        for _ in range(reps):
            host = steps = 0.0
            for rec in records:
                drafter = SuffixDrafter(cost=VerifyCost({1: STEP, 2: 1.3 * STEP, 16: 2.5 * STEP,
                                                         64: 6 * STEP}))
                _, seconds = simulate.replay(drafter, rec, lambda k: 1 + (0.3 if k == 1 else 0.1 * k),
                                             STEP, wait=0.1)
                host, steps = host + seconds, steps + drafter.stats.steps
            best = host / steps if best is None else min(best, host / steps)
        out[name] = 1e6 * best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    times = loop(args.tokens, args.runs)
    base = min(times["stock"])
    print(f"loop, compute-free model, {args.tokens} tokens, {args.runs} runs (us a token)")
    for arm, t in times.items():
        print(f"  {arm:14} min {min(t):6.1f}  median {statistics.median(t):6.1f}"
              f"  min over stock's {min(t) - base:+6.1f}")
    print(f"core on replays of the evaluation set, tiny-like costs, min of {args.reps} (us a step)")
    for name, us in core(args.reps).items():
        print(f"  {name:14} {us:6.1f}")


if __name__ == "__main__":
    main()
