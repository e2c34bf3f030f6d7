"""How far ``mlx-lm-suffix simulate`` is from what ``bench`` measured: replay
a bench run's own requests through :func:`mlx_lm_suffix.tools.simulate.replay`
and set its estimate beside the run's measured decode speedup, repetition by
repetition.

    python benchmarks/simulate_vs_bench.py BENCH_OUT [--arm suffix-cold]

``BENCH_OUT`` is a ``bench --out`` folder (``bench.json`` and the
``workloads/`` it ran) of a scripted run, whose outputs are the workloads'
reference answers cut at ``max_tokens``. Each repetition of a workload
replays its requests in order through one fresh drafter with the run's knobs,
as that repetition's drafter took them: from the cost curve its calibration
measured (``calibrated_cost``), learning the forwards as the replay prices
them, with the device's wait after each read of a forward's result that it
measured (``idle_s_per_wait``; ``--no-wait``: none).

The estimate is in seconds, each part measured on its own: a plain step is
stock's measured decode time a token (at the workload's context; the
drafter's curve has its 1-token point from a calibration at a one-token
context; each repetition's own where the run kept them), a verification the curve that repetition's drafter had learnt by
the end (``verify_cost`` times ``plain_step_s``), and the replay's own host
time (drafting and the policy, which on a CPU backend adds to the step). Its
speedup is stock's decode seconds over that. What it leaves out is the rest
of the loop's host work a step (the driver's, the hand-out's) beyond stock's.
The median over repetitions is set beside the bench's median.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import mlx_lm

from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.policy.cost import CALIBRATION_SIZES
from mlx_lm_suffix.tools import bench, simulate
from mlx_lm_suffix.tools.workloads import read_workload


def estimate(
    requests: Sequence[bench.Request],
    drafter_kwargs: Dict[str, Any],
    rep: Dict[str, Any],
    stock_step: float,
    max_tokens: int,
    wait: bool = True,
) -> Tuple[float, float, SuffixDrafter]:
    """One repetition's replayed decode speedup, the replay's host time a
    token (us) and its drafter (whose stats count the replayed steps)."""
    curve = simulate.cost_from_times({int(n): v for n, v in rep["verify_cost"].items()})
    step = rep["plain_step_s"]

    def cost(k: int) -> float:  # in the curve's plain steps
        return stock_step / step if k == 0 else curve(k)

    start = rep.get("calibrated_cost") or {n: curve(n - 1) for n in CALIBRATION_SIZES}
    start_step = rep.get("calibrated_step_s") or step
    drafter = SuffixDrafter(
        **drafter_kwargs, cost=VerifyCost({int(n): v * start_step for n, v in start.items()})
    )
    idle = (rep.get("idle_s_per_wait") or 0.0) / step if wait else 0.0
    seconds = tokens = host = 0.0
    for r in requests:
        response = r.reference_ids[:max_tokens]
        total, busy = simulate.replay(drafter, simulate.Record(r.prompt_ids, response),
                                      cost, step, idle)
        seconds += (total - cost(0)) * step + busy  # the first token is the prefill's
        tokens += len(response) - 1
        host += busy
    return tokens * stock_step / seconds, 1e6 * host / tokens, drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="a bench --out folder")
    ap.add_argument("--arm", default="suffix-cold")
    ap.add_argument("--no-wait", action="store_true", help="replay with no waits")
    args = ap.parse_args()
    report = json.loads((args.out / "bench.json").read_text())
    if report["mode"] != "scripted":
        raise SystemExit("the run must be scripted (its outputs are the references)")
    _, tokenizer = mlx_lm.load(report["model"])
    print("decode speedup vs stock, measured / replayed, by repetition, then the medians;"
          " the replay's host time per token")
    for name, wl in report["workloads"].items():
        arm = wl["arms"][args.arm]
        records = read_workload(args.out / "workloads" / f"{name}.jsonl")[: wl["requests"]]
        requests = bench.load_requests(records, tokenizer)
        reps = arm.get("costs_per_rep") or [arm]  # a run from before they were kept
        measured = arm.get("decode_speedup_per_rep") or [arm["decode_speedup_vs_stock"]]
        stock = wl["arms"]["stock"]
        steps = [1 / t for t in stock.get("decode_tokens_per_s_per_rep") or []]
        if len(steps) != len(reps):  # a run from before they were kept
            steps = [1 / stock["decode_tokens_per_s"]] * len(reps)
        sims = []
        for i, rep in enumerate(reps):
            sim, host, drafter = estimate(requests, report["drafter"], rep, steps[i],
                                          report["max_tokens"], not args.no_wait)
            sims.append(sim)
            st = drafter.stats
            got = f"{measured[i]:.2f}x" if len(measured) == len(reps) else "-"
            print(f"{name:<12} rep {i}: {got:>6} / {sim:.2f}x  host {host:.0f} us, wait "
                  f"{(rep.get('idle_s_per_wait') or 0) / rep['plain_step_s']:.2f} steps;"
                  f" replayed steps/drafted/accepted {st.steps}/{st.drafted}/{st.accepted}")
        med = statistics.median(sims)
        print(f"{name:<12} median: {arm['decode_speedup_vs_stock']:.2f}x / {med:.2f}x"
              f" ({med / arm['decode_speedup_vs_stock'] - 1:+.1%}); measured steps/drafted/"
              f"accepted {arm['steps']:.0f}/{arm['drafted']:.0f}/{arm['accepted']:.0f}"
              " (median of repetitions)")


if __name__ == "__main__":
    main()
