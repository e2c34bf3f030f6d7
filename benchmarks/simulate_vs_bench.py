"""How far ``mlx-lm-suffix simulate`` is from what ``bench`` measured: replay
a bench run's own requests through :func:`mlx_lm_suffix.tools.simulate.replay`
and set its estimate beside the run's measured decode speedup.

    python benchmarks/simulate_vs_bench.py BENCH_OUT [--arm suffix-cold]

``BENCH_OUT`` is a ``bench --out`` folder (``bench.json`` and the
``workloads/`` it ran) of a scripted run, whose outputs are the workloads'
reference answers cut at ``max_tokens``. Per workload, the requests replay in
order through one fresh drafter with the run's knobs (as the cold arm's
drafter takes them in each repetition), under the cost curve that arm's
drafter learnt, each forward's cost in seconds by that arm's plain step
(``plain_step_s``), which the policy weighs its host time against, and with
the device's wait after each read of a forward's result that the arm
measured (``idle_s_per_wait``; ``--no-wait``: none). The estimate is stock's
decode forwards (one a token after the first) over the replay's, in plain
steps; the measured figure has the rest of the loop's host work in it
besides (the replay's own host time per token is printed beside it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx_lm

from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.tools import bench, simulate
from mlx_lm_suffix.tools.workloads import read_workload


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
    max_tokens = report["max_tokens"]
    print(f"{'workload':<12} {'measured':>9} {'sim':>7} {'host us':>8}  (decode speedup vs stock;"
          " the replay's host time per token)")
    for name, wl in report["workloads"].items():
        arm = wl["arms"][args.arm]
        records = read_workload(args.out / "workloads" / f"{name}.jsonl")[: wl["requests"]]
        requests = bench.load_requests(records, tokenizer)
        cost = simulate.cost_from_times({int(n): v for n, v in arm["verify_cost"].items()})
        step = arm["plain_step_s"]
        wait = 0.0 if args.no_wait else (arm.get("idle_s_per_wait") or 0.0) / step
        drafter = SuffixDrafter(**report["drafter"], cost=simulate.policy_cost(cost, step))
        forwards = tokens = host = 0.0
        for r in requests:
            response = r.reference_ids[:max_tokens]
            record = simulate.Record(r.prompt_ids, response)
            total, seconds = simulate.replay(drafter, record, cost, step, wait)
            forwards += total - cost(0)  # the first token is the prefill's
            tokens += len(response) - 1
            host += seconds
        st = drafter.stats
        print(f"{name:<12} {arm['decode_speedup_vs_stock']:>8.2f}x {tokens / forwards:>6.2f}x"
              f" {1e6 * host / tokens:>8.0f}  wait {wait:.2f}; steps/drafted/accepted: measured "
              f"{arm['steps']:.0f}/{arm['drafted']:.0f}/{arm['accepted']:.0f} (mean of "
              f"repetitions), replayed {st.steps}/{st.drafted}/{st.accepted}")


if __name__ == "__main__":
    main()
