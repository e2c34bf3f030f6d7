"""The drafter's host time per row and step, as a generation spends it (no
model), against arctic-inference's own calls on the same data.

    python benchmarks/drafter_cost.py [--quick] [--rows 1,8,32]
        [--cached 0,1000000,4000000] [--steps 64] [--reps 2] [--json out.json]

About 3 minutes on an idle 2-core machine (more under load); ``--quick``
(cached 0 and 200k, rows 1 and 8, 24 steps, one pass) about 15 s.

Token streams are Python standard library sources tokenized with the tiny
model's BPE tokenizer (``tools.models.get_tokenizer``). The global cache is
filled once with ``add_responses`` (800-token responses of the library's
non-test modules), in order: empty, then ~1M, then ~4M tokens. Rows are
started with a ~1,500-token prompt and stepped in turn (round robin, as a
batch does); each step commits one token and proposes a draft of up to 64,
timed alone (``perf_counter_ns``). Two kinds of output:

- ``open``: each row continues a test module (``Lib/test``, not cached) after
  its prompt: text the cache has not seen, so most drafts fail;
- ``repeat``: each row's prompt ends with a cached response's 64 prompt
  tokens and its output is that response (a repeated request).

Methods: ``row`` is the product's per-row work in a pipelined step
(:class:`mlx_lm_suffix.speculation.Row`: ``stepped`` commits the token and
counts the step; :func:`mlx_lm_suffix.speculation.propose` keeps a draft's
rest while the output follows it, else asks the drafter); ``drafter`` is ``SuffixDrafter.commit`` then
``propose``; ``arctic`` is arctic-inference's ``add_active_response`` and one
``speculate`` (lists) on the drafter's cache. Every row count steps the same
rows (as many as the most rows asked for: one row at a time is 32 groups of
one), so only the interleaving differs; rows are discarded after a pass, so
the cache stays as filled. Draft quality: the draft's prefix that matches the
output (``acc``), also counted up to 16 tokens a step (what one verification
might take).

Timings on a shared machine are noisy: figures are pooled over ``--reps``
passes interleaved by method; the spread of the per-pass medians and the best
pass's p99 are shown (a pass preempted by other processes shows
multi-millisecond p99s).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mlx_lm_suffix import SuffixDrafter, speculation
from mlx_lm_suffix.drafter import PROMPT_TAIL_TOKENS
from mlx_lm_suffix.speculation import Row
from mlx_lm_suffix.tools.models import get_tokenizer

K = 64
PROMPT_TOKENS = 1500
RESPONSE_TOKENS = 800
# A method: start(prompt, output) -> state; step(state, i) -> draft tokens
# (commit output[i], then propose); stop(state).
Method = Tuple[Callable, Callable, Callable]


# ---------------------------------------------------------------- token data
def stdlib_files() -> Tuple[List[Path], List[Path]]:
    """The standard library's modules (sorted): non-test ones (the cache's
    text) and test ones (the rows' text)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    cache, test = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        is_test = any(p in ("test", "tests", "idle_test") for p in parts[:-1])
        (test if is_test else cache).append(path)
    return cache, test


def tokenize(paths: Sequence[Path]) -> List[List[int]]:
    tok = get_tokenizer()
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    return [e.ids for e in tok.encode_batch(texts)]


def cache_responses(paths: Sequence[Path], total: int) -> List[List[int]]:
    """``total`` tokens of the modules as responses of RESPONSE_TOKENS."""
    flat: List[int] = []
    for i in range(0, len(paths), 50):
        if len(flat) >= total:
            break
        for ids in tokenize(paths[i : i + 50]):
            flat.extend(ids)
    n = min(total, len(flat)) // RESPONSE_TOKENS
    return [flat[i * RESPONSE_TOKENS : (i + 1) * RESPONSE_TOKENS] for i in range(n)]


def held_out_streams(paths: Sequence[Path], n: int, length: int) -> List[List[int]]:
    """``n`` test modules of at least ``length`` tokens, spread over the list."""
    big = [p for p in paths if p.stat().st_size > 3 * length]
    picked = big[:: max(1, len(big) // (2 * n))][: 2 * n]
    out = [ids[:length] for ids in tokenize(picked) if len(ids) >= length]
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} test modules of {length} tokens")
    return out[:n]


def open_rows(held: List[List[int]], steps: int) -> List[Tuple[List[int], List[int]]]:
    """(prompt, output): a test module's first tokens, then its continuation."""
    return [
        (ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS : PROMPT_TOKENS + steps + K + 1]) for ids in held
    ]


def repeat_rows(
    held: List[List[int]], responses: List[List[int]], steps: int
) -> List[Tuple[List[int], List[int]]]:
    """(prompt, output): held-out text ending with a cached response's prompt
    tail, then the response (cached responses among the first quarter, so
    every filled cache holds them)."""
    stride = max(1, len(responses) // (4 * len(held)))
    out = []
    for j, ids in enumerate(held):
        r = responses[j * stride]
        out.append(
            (
                ids[: PROMPT_TOKENS - PROMPT_TAIL_TOKENS] + r[:PROMPT_TAIL_TOKENS],
                r[PROMPT_TAIL_TOKENS:],
            )
        )
    assert all(len(o) > steps for _, o in out), "responses shorter than the steps"
    return out


# ------------------------------------------------------------------- methods
def discard(drafter: SuffixDrafter, rid: int) -> None:
    """Stop a drafter's request without keeping its response."""
    req = drafter._active.pop(rid)
    cache = drafter._trees[req.scope]
    cache.stop_request(rid)
    if rid in cache.cached_requests:
        cache.evict_cached_response(rid)


class _Unbounded:
    """A driver whose cache has room for any draft."""

    def __init__(self, drafter: SuffixDrafter):
        self.policy = drafter.policy

    def room(self) -> float:
        return math.inf

    def replays(self, width: int) -> bool:
        return False


def row_method(drafter: SuffixDrafter) -> Method:
    driver = _Unbounded(drafter)

    def start(prompt, output):
        return Row(drafter, drafter.start(prompt), K, math.inf), output

    def step(st, i):
        row, output = st
        row.stepped(output[i])
        return speculation.propose((row,), driver, settled=False)[0].tokens

    return start, step, lambda st: discard(drafter, st[0].req)


def drafter_method(drafter: SuffixDrafter) -> Method:
    def start(prompt, output):
        return drafter.start(prompt), output

    def step(st, i):
        drafter.commit(st[0], [st[1][i]])
        return drafter.propose(st[0], K).tokens

    return start, step, lambda st: discard(drafter, st[0])


_raw_ids = itertools.count(-1, -1)


def arctic_method(drafter: SuffixDrafter) -> Method:
    """arctic's own add_active_response + one speculate on the drafter's
    cache, the request started as the drafter starts one."""
    cache = drafter._trees.open(None)
    depth, f, o, p = (drafter.max_tree_depth, drafter.max_spec_factor,
                      drafter.max_spec_offset, drafter.min_token_prob)

    def start(prompt, output):
        rid = next(_raw_ids)
        split = max(0, len(prompt) - PROMPT_TAIL_TOKENS)
        cache.start_request(rid, prompt[:split])
        cache.add_active_response(rid, prompt[split:])
        return rid, list(prompt[-depth:]), output

    def step(st, i):
        rid, context, output = st
        cache.add_active_response(rid, [output[i]])
        context.append(output[i])
        del context[:-depth]
        d = cache.speculate(rid, context, max_spec_tokens=K, max_spec_factor=f,
                            max_spec_offset=o, min_token_prob=p)
        return list(d.token_ids)

    def stop(st):
        cache.stop_request(st[0])
        if st[0] in cache.cached_requests:
            cache.evict_cached_response(st[0])

    return start, step, stop


def accepted(draft: Sequence[int], output: Sequence[int], i: int) -> int:
    n = 0
    for a, b in zip(draft, output[i + 1 : i + 1 + len(draft)]):
        if a != b:
            break
        n += 1
    return n


def run_pass(method: Method, rows: List[Tuple[List[int], List[int]]], n_rows: int,
             steps: int) -> Dict[str, Any]:
    """Step ``rows`` in groups of ``n_rows``, round robin, ``steps`` steps
    each. Returns ns per row-step (``ns``, ``(rows, steps)``), the accepted
    tokens per step (``acc``) and draft lengths, and the garbage collections
    seen (count, ms)."""
    start, step, stop = method
    clock = time.perf_counter_ns
    ns = np.full((len(rows), steps), -1, dtype=np.int64)
    acc = np.zeros((len(rows), steps), dtype=np.int32)
    lens = np.zeros((len(rows), steps), dtype=np.int32)
    collections = [0, 0.0, 0]

    def on_gc(phase, info):
        if phase == "start":
            collections[2] = clock()
        else:
            collections[0] += 1
            collections[1] += (clock() - collections[2]) / 1e6

    gc.collect()
    gc.callbacks.append(on_gc)
    try:
        for g0 in range(0, len(rows), n_rows):
            group = list(range(g0, min(len(rows), g0 + n_rows)))
            states = [start(*rows[r]) for r in group]
            for i in range(steps):
                for st, r in zip(states, group):
                    t0 = clock()
                    d = step(st, i)
                    ns[r, i] = clock() - t0
                    if d:
                        lens[r, i] = len(d)
                        acc[r, i] = accepted(d, rows[r][1], i)
            for st in states:
                stop(st)
    finally:
        gc.callbacks.remove(on_gc)
    return {"ns": ns, "acc": acc, "lens": lens, "gc": collections[:2]}


def summary(results: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Pooled percentiles (us) over passes, the spread of per-pass medians,
    and draft quality (of the first pass: the drafts are the same each)."""
    pooled = np.concatenate([r["ns"][r["ns"] >= 0] for r in results]) / 1e3
    medians = [float(np.median(r["ns"][r["ns"] >= 0])) / 1e3 for r in results]
    p99s = [float(np.percentile(r["ns"][r["ns"] >= 0], 99)) / 1e3 for r in results]
    first = results[0]
    mask = first["ns"] >= 0
    return {
        "median": float(np.median(pooled)),
        "p90": float(np.percentile(pooled, 90)),
        "p99": float(np.percentile(pooled, 99)),
        "mean": float(pooled.mean()),
        "spread": (min(medians), max(medians)),
        "p99_best": min(p99s),
        "n": int(pooled.size),
        "drafted": float((first["lens"][mask] > 0).mean()),
        "hit": float((first["acc"][mask] > 0).mean()),
        "acc": float(first["acc"][mask].mean()),
        "acc16": float(np.minimum(first["acc"][mask], 16).mean()),
        "gc": [r["gc"] for r in results],
    }


def fmt_row(label: str, s: Dict[str, Any]) -> str:
    lo, hi = s["spread"]
    return (
        f"| {label} | {s['median']:.1f} | {s['p90']:.1f} | {s['p99']:.1f} | {s['p99_best']:.1f} "
        f"| {s['mean']:.1f} | {lo:.1f}-{hi:.1f} | {100 * s['drafted']:.0f}% "
        f"| {100 * s['hit']:.0f}% | {s['acc']:.2f} | {s['acc16']:.2f} |"
    )


HEADER = (
    "| method | median us | p90 | p99 | p99, best pass | mean | medians over passes | drafted "
    "| first right | acc/step | acc/step, at most 16 |"
)
RULE = "|---|---|---|---|---|---|---|---|---|---|---|"


def fill(drafter: SuffixDrafter, responses: List[List[int]], upto: int) -> float:
    """Add responses until the cache holds ``upto`` tokens; seconds taken."""
    tic = time.perf_counter()
    have = drafter.cached_tokens
    batch = []
    for r in responses[drafter.cached_requests :]:
        if have >= upto:
            break
        batch.append((None, r))
        have += len(r)
    drafter.add_responses(batch)
    return time.perf_counter() - tic


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--cached", default="0,1000000,4000000")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.cached, args.steps, args.reps = "1,8", "0,200000", 24, 1
    rows_list = [int(x) for x in args.rows.split(",")]
    cached_list = [int(x) for x in args.cached.split(",")]
    nrows = max(rows_list)
    cache_paths, test_paths = stdlib_files()
    tic = time.perf_counter()
    responses = cache_responses(cache_paths, max(cached_list) + 64 * RESPONSE_TOKENS)
    held = held_out_streams(test_paths, nrows, PROMPT_TOKENS + args.steps + K + 1)
    sets = {"open": open_rows(held, args.steps), "repeat": repeat_rows(held, responses, args.steps)}
    print(f"# drafter_cost: {nrows} rows of {PROMPT_TOKENS}-token prompts, {args.steps} steps "
          f"per row, k={K}, {args.reps} passes; data in {time.perf_counter() - tic:.1f} s")
    drafter = SuffixDrafter(max_cached_tokens=max(max(cached_list), 1) * 2)
    print(f"drafter config: {json.dumps(drafter.config())}")
    methods = {
        "row": lambda: row_method(drafter),
        "drafter": lambda: drafter_method(drafter),
        "arctic": lambda: arctic_method(drafter),
    }
    report: Dict[str, Any] = {}
    for cached in cached_list:
        took = fill(drafter, responses, cached)
        label = f"{drafter.cached_tokens / 1e6:.1f}M cached tokens" if cached else "empty cache"
        print(f"\n## {label} ({drafter.cached_requests} responses; filled in {took:.1f} s)")
        for kind, rows in sets.items():
            if not cached and kind == "repeat":
                continue  # nothing to repeat
            for n in rows_list:
                res: Dict[str, List[Dict[str, Any]]] = {name: [] for name in methods}
                for _ in range(args.reps):  # interleaved: A B C A B C
                    for name, make in methods.items():
                        res[name].append(run_pass(make(), rows, n, args.steps))
                print(f"\n{label}, {kind}, {n} rows\n\n{HEADER}\n{RULE}")
                for name, r in res.items():
                    s = summary(r)
                    print(fmt_row(name, s))
                    report[f"{cached}/{kind}/{n}/{name}"] = {k: v for k, v in s.items() if k != "gc"}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
