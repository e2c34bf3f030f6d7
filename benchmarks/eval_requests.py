"""Stock against cold suffix decoding, request by request, over the
evaluation set, in process (``mlx_lm.stream_generate``), interleaved.

    python benchmarks/eval_requests.py [--model smollm2|smollm2-f32|PATH]
        [--size tiny|mini|small|bench] [--family qwen3]
        [--workloads code-edit,open-ended] [--half report] [--requests N]
        [--max-tokens 256] [--repetitions 1] [--group 1]
        [--policy adaptive] [--blas auto] [--json FILE]

With ``--model`` a real model generates its own output (the real
SmolLM2-135M-Instruct: ``smollm2`` 4-bit, ``smollm2-f32``); without it the
local random-weight model of ``--family`` and ``--size`` runs in scripted
mode (its greedy output follows each request's reference; see
:class:`mlx_lm_suffix.tools.bench.ScriptedProcessor`).

Each group of ``--group`` sessions (a code-edit or open-ended request is a
session of its own; an agentic session is its turns) gets a fresh
:class:`SuffixDrafter` (cold: its global cache holds only the group's
earlier answers) whose cost curve is a copy of one calibrated before
anything is timed. Each request runs on stock and on the suffix drafter in
turn, the order alternating from request to request. Prints, per request,
decode tokens/s of both, the ratio (the median over repetitions),
acceptance and whether the suffix output matched stock's token for token;
per workload, the median, 10th percentile and worst ratio (decode and end
to end). Measures nothing itself: the bench's ``generate_one``,
``summarize`` and ``request_spreads`` do.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

from mlx_lm_suffix.drafter import SuffixDrafter
from mlx_lm_suffix.tools import bench, workloads

ARMS = ("stock", "suffix")


def groups_of(requests: Sequence[bench.Request], size: int) -> List[List[bench.Request]]:
    """``requests`` (in session and turn order) cut into groups of ``size``
    whole sessions."""
    sessions: Dict[str, List[bench.Request]] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    ordered = list(sessions.values())
    return [sum(ordered[i : i + size], []) for i in range(0, len(ordered), size)]


def run_workload(
    model: Any,
    tokenizer: Any,
    requests: Sequence[bench.Request],
    *,
    max_tokens: int,
    repetitions: int,
    group: int,
    scripted: bool,
    eos_id: int,
    drafter_kwargs: Dict[str, Any],
    cost: Any,
) -> Dict[str, Any]:
    """Run ``requests`` on both arms; returns, per repetition, each arm's
    :func:`bench.summarize` output (``reps``), the suffix arm's
    :func:`bench.request_spreads`, and per request id whether the suffix
    output equalled stock's in every repetition (``matched``) and its
    acceptance counts over the repetitions."""
    reps: List[Dict[str, Dict[str, Any]]] = []
    matched: Dict[str, bool] = {}
    counts: Dict[str, List[int]] = {}
    runs = 0  # requests run so far: the arm order alternates with it
    for rep in range(repetitions):
        samples: Dict[str, List[bench.Sample]] = {a: [] for a in ARMS}
        for reqs in groups_of(requests, group):
            drafter = SuffixDrafter(**drafter_kwargs, cost=copy.deepcopy(cost))
            for req in reqs:
                outs = {}
                for arm in ARMS if runs % 2 == 0 else reversed(ARMS):
                    d = drafter if arm == "suffix" else None
                    s, outs[arm] = bench.generate_one(
                        model, tokenizer, req, max_tokens, d, scripted, eos_id
                    )
                    samples[arm].append(s)
                runs += 1
                matched[req.id] = matched.get(req.id, True) and outs["suffix"] == outs["stock"]
                s = samples["suffix"][-1]
                c = counts.setdefault(req.id, [0, 0, 0, 0])
                for i, v in enumerate((s.drafted, s.accepted, s.tokens, s.steps)):
                    c[i] += v
        reps.append({a: bench.summarize(samples[a]) for a in ARMS})
        print(f"  repetition {rep + 1}/{repetitions} done", file=sys.stderr, flush=True)
    return {
        "reps": reps,
        "spreads": bench.request_spreads(reps, "suffix", "stock"),
        "matched": matched,
        "counts": counts,
    }


def _median_rate(reps: Sequence[Dict[str, Dict[str, Any]]], arm: str, rid: str) -> Optional[float]:
    rates = [r[arm]["per_request"][rid]["decode_tokens_per_s"] for r in reps]
    rates = [x for x in rates if x is not None]
    return statistics.median(rates) if rates else None


def report_lines(name: str, result: Dict[str, Any], floor: float) -> List[str]:
    """The per-request table and the summary lines of one workload."""

    def f(v: Optional[float], fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    reps, decode = result["reps"], result["spreads"]["decode"]
    e2e = result["spreads"]["end_to_end"]
    lines = [
        f"{'request':<32}{'stock tok/s':>12}{'suffix tok/s':>13}{'ratio':>7}"
        f"{'accept':>8}{'tok/step':>9}  same as stock"
    ]
    for rid, ratios in decode["ratios"].items():
        drafted, accepted, tokens, steps = result["counts"][rid]
        lines.append(
            f"{rid:<32}{f(_median_rate(reps, 'stock', rid), '.1f'):>12}"
            f"{f(_median_rate(reps, 'suffix', rid), '.1f'):>13}"
            f"{f(statistics.median(ratios), '.2f'):>7}"
            f"{f(accepted / drafted if drafted else None, '.0%'):>8}"
            f"{f(tokens / steps if steps else None, '.2f'):>9}  "
            + ("yes" if result["matched"][rid] else "NO")
        )
    same = sum(result["matched"].values())
    below = [rid for rid, r in decode["ratios"].items() if statistics.median(r) < floor]
    lines += [
        f"{name}: decode median {f(decode['median'], '.2f')}x, p10 {f(decode['p10'], '.2f')}x, "
        f"worst {f(decode['worst'], '.2f')}x ({decode['worst_request']}); end to end median "
        f"{f(e2e['median'], '.2f')}x, p10 {f(e2e['p10'], '.2f')}x, worst {f(e2e['worst'], '.2f')}x "
        f"({e2e['worst_request']})",
        f"{name}: {len(below)} of {decode['requests']} requests below {floor:.2f}x of stock's decode "
        f"tokens/s{': ' + ', '.join(below) if below else ''}; outputs matched stock's on "
        f"{same} of {len(result['matched'])}",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="real model name or path (real output)")
    ap.add_argument("--size", default="tiny", choices=("tiny", "mini", "small", "bench"))
    ap.add_argument("--family", default="qwen3")
    ap.add_argument("--workloads", default="code-edit,open-ended")
    ap.add_argument("--half", default="report", choices=(*workloads.HALVES, "all"))
    ap.add_argument("--requests", type=int, default=None, help="the first N of each workload")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repetitions", type=int, default=1)
    ap.add_argument("--group", type=int, default=1, help="sessions per fresh drafter")
    ap.add_argument("--policy", default="adaptive", choices=("adaptive", "fixed"))
    ap.add_argument("--floor", type=float, default=0.95, help="count requests below this ratio")
    ap.add_argument("--blas", default="auto", choices=("auto", "openblas", "reference"))
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    bench.maybe_reexec_with_openblas(args.blas, [sys.executable, __file__, *sys.argv[1:]])

    import mlx_lm

    from mlx_lm_suffix.tools.models import ensure_model, resolve_model

    if args.model:
        path = resolve_model(args.model)
        scripted = bench.is_local_random_model(path)
    else:
        path, scripted = str(ensure_model(args.family, args.size)), True
    model, tokenizer = mlx_lm.load(path)
    eos_id = sorted(tokenizer.eos_token_ids)[0] if tokenizer.eos_token_ids else 0
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    sets = {
        n: bench.load_requests(workloads.eval_set(n, args.half)[: args.requests], tokenizer)
        for n in names
    }
    print(
        f"model {path} ({'scripted' if scripted else 'real output'}), blas {bench.blas_in_use()}, "
        f"{args.half} half, max_tokens {args.max_tokens}, {args.repetitions} repetition(s), "
        f"{args.group} session(s) per fresh drafter, policy {args.policy}",
        flush=True,
    )
    # Untimed: first-call compilation, and the one cost calibration.
    bench.generate_one(model, tokenizer, next(iter(sets.values()))[0], 4, None, scripted, eos_id)
    kwargs = {"policy": args.policy}
    probe = SuffixDrafter(**kwargs)
    probe.policy.ensure_cost(model)
    results = {}
    for name, requests in sets.items():
        results[name] = run_workload(
            model, tokenizer, requests, max_tokens=args.max_tokens, repetitions=args.repetitions,
            group=args.group, scripted=scripted, eos_id=eos_id, drafter_kwargs=kwargs,
            cost=probe.policy.cost,
        )
        print("\n".join(["", *report_lines(name, results[name], args.floor)]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": path, "scripted": scripted, "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
