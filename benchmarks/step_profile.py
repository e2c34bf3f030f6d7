"""Host time per step kind: where a step's microseconds go, single and
batched, and how long the host works after reading a forward's result.

    python benchmarks/step_profile.py [--size tiny] [--requests 6]
        [--max-tokens 128] [--rows 1,8,32] [--json out.json]

Single sequence: the bench's open-ended and code-edit requests (scripted, as
``bench`` runs them) through ``mlx_lm.stream_generate``, stock and with a
cold, calibrated :class:`~mlx_lm_suffix.SuffixDrafter`, interleaved; the
loop's pieces are timed by wrapping them (``perf_counter``):

- ``plain``: a plain step's target call (``ModelTarget.plain``): the forward's
  graph built (``build``), queued (``mx.async_eval``; on a CPU backend it
  computes there), the previous token read, the row's bookkeeping;
- ``propose+cut``: the rows' proposals and the policy's cut (a step in
  which every row skips proposing has none: it ends after its plain step);
- ``check``: the wait for a plain forward whose token checks a draft
  (``pending`` after ``plain``) and the check;
- ``verify`` (the verification's forward, built and read) and ``keep``
  (acceptance, rollback, the emitted tokens), and the host's time after each
  read of a result before it builds the next forward (the drafter's
  ``idle_us_per_wait``).

Batched: ``--rows`` open-ended requests in one ``BatchGenerator``, stock and
``SuffixBatchGenerator``, each generation step timed (``next``) once every
row is generating; the difference of the medians is the plugin's host time
per batch step, beside its ``propose+cut``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import BatchGenerator

from mlx_lm_suffix import SuffixDrafter, loop
from mlx_lm_suffix.batch import SuffixBatchGenerator
from mlx_lm_suffix.tools import bench, workloads
from mlx_lm_suffix.tools.models import ensure_model

TIMES: Dict[str, List[float]] = defaultdict(list)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tic = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - tic)
    return wrapper


def _instrument() -> None:
    single = loop.ModelTarget
    forward = single.forward

    def timed_forward(self: Any, inputs: mx.array, quantize: bool = True, single: bool = False):
        tic = time.perf_counter()
        out = forward(self, inputs, quantize, single)
        TIMES["build (plain)" if single else "build (verify)"].append(time.perf_counter() - tic)
        return out

    single.forward = timed_forward
    single.plain = _timed("plain", single.plain)
    single.verify = _timed("verify", single.verify)
    single.keep = _timed("keep", single.keep)
    loop.plan_row = _timed("propose+cut", loop.plan_row)
    loop.check = _timed("check", loop.check)
    pending = single.pending

    def timed_pending(self: Any) -> int:
        # After plain(): the wait for its forward (a check of first tokens).
        checking = self.plain_at is not None
        tic = time.perf_counter()
        out = pending(self)
        if checking:
            TIMES["check"].append(time.perf_counter() - tic)
        return out

    single.pending = timed_pending


def _single(model: Any, tokenizer: Any, requests: int, max_tokens: int) -> Dict[str, Any]:
    eos = sorted(tokenizer.eos_token_ids)[0]
    proto = SuffixDrafter()
    proto.policy.ensure_cost(model)
    out: Dict[str, Any] = {}
    for wl in ("open-ended", "code-edit"):
        chars = 1500 if wl == "open-ended" else 2500
        reqs = bench.load_requests(workloads.build(wl, n=requests, max_chars=chars), tokenizer)
        TIMES.clear()
        stock_s = suffix_s = 0.0
        tokens = 0
        drafter = SuffixDrafter(cost=proto.policy.cost, max_cached_requests=0)
        bench.generate_one(model, tokenizer, reqs[0], 8, None, True, eos)  # warm up
        for i, req in enumerate(reqs):
            for arm in ("stock", "suffix") if i % 2 == 0 else ("suffix", "stock"):
                s, _ = bench.generate_one(model, tokenizer, req, max_tokens, drafter if arm == "suffix"
                                          else None, True, eos)
                decode = s.seconds - s.ttft
                if arm == "stock":
                    stock_s += decode
                    tokens += s.tokens - 1
                else:
                    suffix_s += decode
        snap = drafter.snapshot()
        steps = snap["steps"]
        pieces = {k: {"calls_per_step": len(v) / steps, "median_us": 1e6 * statistics.median(v),
                      "mean_us": 1e6 * statistics.mean(v)} for k, v in sorted(TIMES.items())}
        out[wl] = {
            "stock_us_per_token": 1e6 * stock_s / tokens,
            "suffix_us_per_token": 1e6 * suffix_s / tokens,
            "steps": steps, "tokens": snap["tokens"], "drafted": snap["drafted"],
            "accepted": snap["accepted"], "waits": snap["waits"],
            "idle_us_per_wait": snap["idle_us_per_wait"],
            "host_us_per_step": snap["host_us_per_step"],
            "pieces": pieces,
        }
    return out


def _batch_steps(gen: Any, prompts: List[List[int]], max_tokens: int) -> List[float]:
    """Each ``next`` call's seconds once every row generates."""
    gen.insert(prompts, [max_tokens] * len(prompts))
    started, times = set(), []
    while True:
        tic = time.perf_counter()
        _, responses = gen.next()
        took = time.perf_counter() - tic
        if not responses and not started:
            continue
        if len(started) == len(prompts) and responses:
            times.append(took)
        started.update(r.uid for r in responses)
        if any(r.finish_reason for r in responses) or (not responses and started):
            break
    gen.close()
    return times


def _batched(model: Any, tokenizer: Any, rows: List[int], max_tokens: int) -> Dict[str, Any]:
    reqs = bench.load_requests(workloads.build("open-ended", n=max(rows), max_chars=1500), tokenizer)
    eos = set(tokenizer.eos_token_ids)
    proto = SuffixDrafter()
    proto.policy.ensure_cost(model)
    out = {}
    for n in rows:
        prompts = [r.prompt_ids for r in reqs[:n]]
        TIMES.clear()
        drafter = SuffixDrafter(cost=proto.policy.cost, max_cached_requests=0)
        stock, suffix = [], []
        for i in range(2):
            for arm in ("stock", "suffix") if i % 2 == 0 else ("suffix", "stock"):
                if arm == "stock":
                    stock += _batch_steps(BatchGenerator(model, stop_tokens=[[t] for t in eos]),
                                          prompts, max_tokens)
                else:
                    gen = SuffixBatchGenerator(model, drafter, stop_tokens=[[t] for t in eos])
                    suffix += _batch_steps(gen, prompts, max_tokens)
        drafts = TIMES.get("propose+cut", [0.0])
        out[n] = {"stock_step_us": 1e6 * statistics.median(stock),
                  "suffix_step_us": 1e6 * statistics.median(suffix),
                  "propose_cut_us": 1e6 * statistics.median(drafts),
                  "drafted": drafter.snapshot()["drafted"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model, tokenizer = mlx_lm.load(str(ensure_model("qwen3", args.size)))
    _instrument()
    single = _single(model, tokenizer, args.requests, args.max_tokens)
    for wl, r in single.items():
        print(f"{wl}: stock {r['stock_us_per_token']:.0f} us/token, suffix "
              f"{r['suffix_us_per_token']:.0f}; {r['tokens']} tokens in {r['steps']} steps, "
              f"{r['accepted']}/{r['drafted']} accepted; {r['waits']} reads, host "
              f"{r['idle_us_per_wait']:.0f} us after each")
        for k, p in r["pieces"].items():
            print(f"  {k:15} {p['calls_per_step']:6.3f} per step  median {p['median_us']:7.1f} us"
                  f"  mean {p['mean_us']:7.1f} us")
    rows = [int(x) for x in args.rows.split(",")]
    batched = _batched(model, tokenizer, rows, args.max_tokens)
    for n, r in batched.items():
        print(f"batch of {n}: step stock {r['stock_step_us']:.0f} us, suffix {r['suffix_step_us']:.0f}"
              f" us, propose+cut {r['propose_cut_us']:.1f} us; drafted {r['drafted']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "single": single, "batched": batched}, f, indent=1)


if __name__ == "__main__":
    main()
