"""What a chooser between the trees and a draft model that knows the answer
reaches, replayed without a model; and the bound on a draft model at c=8.

    python benchmarks/source_bound.py [--agreement 0.75] [--d D] [--max-tokens 512]
        [--sets builtin,report] [--reps 5] [--blas auto] [--measured PATH] [--json PATH]

(about a minute on this 2-core CPU; ``--measured`` takes an earlier
``--json``'s measurements instead of timing forwards again.)

Each request's reference answer plays the target model (as
:mod:`mlx_lm_suffix.tools.simulate`): replayed in order through one fresh
drafter per workload and arm (cold). The **draft model is scripted**: its
token at answer position ``j`` of request ``r`` is the answer's, unless a hash
of ``(r, j)`` puts it among the ``1 - A`` wrong ones (then a token no answer
has); the same positions are wrong in every arm; every token's estimate is
``A`` (it says nothing about which tokens are wrong). ``A`` = ``--agreement``.

Cost model, in plain steps of the bench-size target (one 1-token forward):

- a verification of ``k`` draft tokens: ``V(k) = 1 + 0.11 k`` (the bench
  size's curve in the loop, length_bound.py's ``bench``);
- a draft model forward of ``n`` tokens: ``d * D(n)``; ``d`` its 1-token
  forward over the target's (measured here, tiny over bench size, or
  ``--d``), ``D`` its own width curve (measured);
- the prompt of ``P`` tokens: ``T(P)`` (the target's curve, measured to 256
  tokens, past it as its last segment grows), and
  ``d * D(P)`` for the draft model in the arms that prefill one;
- host time, waits, rollback: nothing (the replay's ``wait`` 0).

Arms, summed over a workload's requests (answers cut at ``--max-tokens``),
as speed over stock's, decode (``N`` plain steps for ``N`` tokens) and end
to end (with the prompts, ``T(P) + N``):

- ``trees``: the product without a draft model (the real loop and policy);
- ``model@k``: stock's ``--draft-model`` (``speculative_generate_step``):
  every round ``k`` draft forwards (the first 2 wide after a round accepted
  whole) and ``V(k)``; the best fixed ``k`` in 1..8 over the workload;
- ``product``: the trees and the draft model as the real loop and policy
  choose (``speculation.propose``), the draft model fed with the target as
  :class:`~mlx_lm_suffix.sources.draft_model.Paired` feeds it (a plain step
  costs ``1 + d``, a verification of the trees' draft ``V(k) + d D(k +
  1)``) but for the positions it drafted, which it keeps (one sequence of
  ``KVCache`` layers: :meth:`~mlx_lm_suffix.sources.draft_model.Paired.hold`):
  a verification of its own draft costs ``V(k)``, and where it verified
  the whole draft its next draft's first forward ``d D(2)``;
- ``knowing``: each step, greedily, whichever of the trees' draft cut at its
  first wrong token, the draft model's run of right tokens, or a plain step
  commits the most tokens per cost, all settled (the pending token known);
  its draft model, prefilled with the prompt, is fed lazily as stock's is
  (the tokens it missed in the first forward of its next draft). Greedy per
  step: not the best sequence of choices, but no policy that does not know
  the answer gets more from a step.

The c=8 bound: with the bench size's batched forwards measured here (8 rows,
a BatchKVCache of ``PREFIX`` tokens a row, ``OPENBLAS_NUM_THREADS=1``),
``B(w)`` a forward of ``w`` tokens a row over one of 1, ``d8`` the tiny
model's batched 1-token step over the target's, the best over ``k`` of
``E(k) / (B(k + 1) + k d8)``, ``E(k) = (1 - A^(k+1)) / (1 - A)`` the tokens
a row commits per verification: what any draft length of a draft model
whose tokens hold at rate ``A`` gains over the stock batched server (no
host time, no padding beyond ``k``); and the ``A`` it needs for 1.2x. Fed
every forward as the product feeds it, each verification costs ``d8
Bd(k + 1)`` more (``Bd`` the tiny model's batched curve).

The issue's targets are checked on decode speed, for the product and for
the knowing chooser (whether they are reachable at all).

Sets: ``builtin`` (tools.workloads.build) and ``report`` (the evaluation
set's half). ``mixed`` is built here: each agentic record whose prompt holds
a tool result answers new text (half of an open-ended reference), the tool
result copied, its own answer, then the other half.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
import time
from typing import Callable, Dict, List, Sequence, Tuple

import mlx_lm

from mlx_lm_suffix import SuffixDrafter, loop, speculation
from mlx_lm_suffix.policy import VerifyCost
from mlx_lm_suffix.sources.draft_model import DraftModel
from mlx_lm_suffix.tools import bench, simulate, workloads
from mlx_lm_suffix.tools.models import ensure_model

AGREEMENT = 0.75
KS = range(1, 9)  # stock's num_draft_tokens tried
PREFIX = 300  # cache tokens a row when timing forwards
ROWS = 8  # the server's concurrency
STEP = 0.02  # a plain step's seconds, as the policy learns it (length_bound's bench)
TARGET_C8 = 1.2
WORKLOADS = ("code-edit", "open-ended", "mixed")
KNOWN = (1, 2, 4, 8, 16, 32, 64)  # the forwards whose cost the policy knows (length_bound's)


def V(k: int) -> float:
    """A verification of ``k`` draft tokens, in plain steps (bench size)."""
    return 1.0 + 0.11 * k


@functools.lru_cache(maxsize=None)
def wrong(rid: int, pos: int, a: float) -> bool:
    """Whether the scripted draft model misses answer position ``pos`` of
    request ``rid`` (a hash of both: rate ``1 - a``)."""
    h = hashlib.blake2b(f"{rid},{pos}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < 1.0 - a


# ------------------------------------------------------------ measurement
def measure(reps: int = 5) -> Dict:
    """Forward times on this machine (the best of ``reps`` interleaved runs): the bench
    size's and the tiny size's curves for one row, and for 8 rows."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    models = {s: mlx_lm.load(str(ensure_model("qwen3", s)))[0] for s in ("bench", "tiny")}
    vocab = models["bench"].args.vocab_size

    def caches(model, rows):
        if rows == 1:
            cache = make_prompt_cache(model)
        else:
            cache = [BatchKVCache([0] * rows) for _ in model.layers]
        model(mx.arange(rows * PREFIX).reshape(rows, PREFIX) % vocab, cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def timed(model, cache, rows, n):
        tic = time.perf_counter()
        mx.eval(model((mx.arange(rows * n).reshape(rows, n) * 7 + 1) % vocab, cache=cache))
        took = time.perf_counter() - tic
        for c in cache:
            c.trim(n)
        return took

    plan = [(s, 1, n) for s in models for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 64, 256)]
    plan += [(s, ROWS, w) for s in models for w in range(1, 10)]
    cs = {(s, r): caches(models[s], r) for s in models for r in (1, ROWS)}
    times: Dict[Tuple, List[float]] = {p: [] for p in plan}
    for rep in range(reps + 1):  # (the first warms up)
        for s, r, n in plan if rep % 2 else reversed(plan):
            if n < 256 or rep < 3:
                took = timed(models[s], cs[(s, r)], r, n)
                if rep:
                    times[(s, r, n)].append(took)
    t = {p: min(v) for p, v in times.items()}
    b1, t1 = t[("bench", 1, 1)], t[("tiny", 1, 1)]
    b8, t8 = t[("bench", ROWS, 1)], t[("tiny", ROWS, 1)]
    return {
        "target": {n: t[("bench", 1, n)] / b1 for s, r, n in plan if s == "bench" and r == 1},
        "draft": {n: t[("tiny", 1, n)] / t1 for s, r, n in plan if s == "tiny" and r == 1},
        "d": t1 / b1,
        "plain_ms": 1e3 * b1,
        "batch": {w: t[("bench", ROWS, w)] / b8 for w in range(1, 10)},
        "draft_batch": {w: t[("tiny", ROWS, w)] / t8 for w in range(1, 10)},
        "d8": t8 / b8,
        "batch_plain_ms": 1e3 * b8,
    }



def curve(rel: Dict) -> Callable[[int], float]:
    """A forward of ``n`` tokens, from measured ``{n: relative time}``."""
    f = simulate.cost_from_times({int(n): t for n, t in rel.items()})
    return lambda n: f(n - 1)


# ----------------------------------------------------------------- replays
class Scripted(simulate.Replay):
    """:class:`simulate.Replay` whose draft model is scripted (module
    docstring): ``steps`` tokens after the pending token (settled) or the
    one just emitted (pipelined: the plain forward gave the first), each a
    draft forward of ``d`` plain steps. The draft model keeps its drafted
    positions (:meth:`~mlx_lm_suffix.sources.draft_model.Paired.hold`): a
    verification of its draft feeds it nothing (``V(k)``), and where it
    verified all of them the last waits for the next draft's first forward
    (``d D(2)``)."""

    def __init__(self, row, response, policy, cost, rid: int, a: float, d: float, D):
        super().__init__(row, response, policy, cost, STEP)
        self.rid, self.a, self.d, self.D = rid, a, d, D
        self.drafted, self.lags = 0, False

    def model_draft(self, steps, settled, contexts):
        start = self.at + 1 if settled else self.at
        x = self.response
        tokens = [x[j] if j < len(x) and not wrong(self.rid, j, self.a) else -2 - j
                  for j in range(start, start + steps)]
        forwards = steps if settled else steps - 1
        spent = forwards * self.d + (self.d * (self.D(2) - 1) if self.lags and settled else 0.0)
        self.total += spent
        self.drafted, self.lags = steps, False
        return [tokens], [[self.a] * steps], spent * STEP

    def verify_cost(self, n, draft):
        if draft.source != "model":
            return super().verify_cost(n, draft)
        self.lags = len(draft.tokens) >= self.drafted
        return V(n - 1)


def fresh(model: bool, cost: Callable[[int], float], d: float, D) -> SuffixDrafter:
    """A cold drafter knowing the cost curve (and the draft model's)."""
    drafter = SuffixDrafter(cost=VerifyCost({n: cost(n - 1) * STEP for n in KNOWN}),
                            draft_model=DraftModel(None) if model else None)
    if model:
        drafter.policy.draft_cost = VerifyCost({n: d * D(n) * STEP for n in (1, 2, 4, 8)})
    return drafter


def product(drafter: SuffixDrafter, prompt, response, rid, a, cost, d, D) -> float:
    """One request through the real loop and policy: its decode cost."""
    row = speculation.Row(drafter, drafter.start(prompt), drafter.num_draft_tokens, len(response))
    row.model = row.holds = drafter.draft_model is not None
    driver = Scripted(row, response, drafter.policy, cost, rid, a, d, D)
    for _ in loop.decode(driver, row):
        pass
    row.finish()
    return driver.total


def stock_model(response, rid, a, k, d, D) -> Tuple[float, int, int]:
    """Stock's speculative decoding at ``k``: decode cost, drafted, accepted."""
    n, at, total, whole, drafted, accepted = len(response), 0, 0.0, False, 0, 0
    while at < n:
        kk = min(k, n - at - 1)
        acc = 0
        while acc < kk and not wrong(rid, at + 1 + acc, a):
            acc += 1
        total += V(kk) + (d * ((D(2) if whole else 1.0) + kk - 1) if kk else 0.0)
        whole, drafted, accepted, at = acc == kk, drafted + kk, accepted + acc, at + acc + 1
    return total, drafted, accepted


def knowing(drafter: SuffixDrafter, prompt, response, rid, a, d, D, counts) -> float:
    """The greedy chooser that knows the answer (module docstring)."""
    req, n, i, have, total = drafter.start(prompt), len(response), 0, 0, 0.0
    drafter.commit(req, response[:1])
    while i < n:
        k = min(drafter.num_draft_tokens, n - i - 1)
        best = (1.0, 1.0, "plain", 0)  # (tokens per cost, cost, source, accepted)
        if k > 0:
            draft, truth = drafter.propose(req, k).tokens, response[i + 1 : i + 1 + k]
            t = next((j for j, (x, y) in enumerate(zip(draft, truth)) if x != y), min(len(draft), len(truth)))
            r = next((j for j in range(k) if wrong(rid, i + 1 + j, a)), k)
            c = V(r) + d * (D(i - have + 1) + r - 1)
            for rate, cost, source, acc in ((t + 1) / V(t), V(t), "trees", t), ((r + 1) / c, c, "model", r):
                if acc and rate > best[0]:
                    best = (rate, cost, source, acc)
        _, cost, source, acc = best
        total += cost
        counts[source] = counts.get(source, 0) + acc
        if source == "model":
            have = i + acc
        drafter.commit(req, response[i + 1 : i + acc + 2])
        i += acc + 1
    drafter.finish(req)
    return total


# --------------------------------------------------------------- workloads
def mix(agentic: List[Dict], prose: List[Dict]) -> List[Dict]:
    """``mixed``: each agentic record whose prompt ends with a tool result
    answers new text, the result copied, its own answer, more new text."""
    out, j = [], 0
    for r in agentic:
        r, last = dict(r), r["messages"][-1]["content"]
        if last.startswith("Tool result:\n"):
            text = prose[j % len(prose)]["reference"]
            j += 1
            h = text.find(" ", len(text) // 2) % (len(text) + 1)
            r["reference"] = "\n\n".join((text[:h], last[13:], r["reference"], text[h + 1 :]))
        out.append(r)
    return out


def records(name: str, workload: str) -> List[Dict]:
    if workload == "mixed":
        return mix(records(name, "agentic"), records(name, "open-ended"))
    return workloads.build(workload) if name == "builtin" else workloads.eval_set(workload, name)


def arms(answers: Sequence[Tuple[List[int], List[int]]], a: float, m: Dict) -> Dict:
    """Each arm's ``(decode cost, prefill cost, {source: [drafted, accepted]})``."""
    T, D, d = curve(m["target"]), curve(m["draft"]), m["d"]
    pre = sum(T(len(p)) for p, _ in answers)
    pre_d = pre + sum(d * D(len(p)) for p, _ in answers)
    out = {"stock": (sum(len(x) for _, x in answers), pre, {})}
    best = None
    for k in KS:
        runs = [stock_model(x, rid, a, k, d, D) for rid, (_, x) in enumerate(answers)]
        total = sum(c for c, _, _ in runs)
        if best is None or total < best[0]:
            best = (total, k, sum(r[1] for r in runs), sum(r[2] for r in runs))
    out["model@k"] = (best[0], pre_d, {"model": [best[2], best[3]]}, best[1])
    paired = lambda k: V(k) + d * D(k + 1)  # noqa: E731
    for arm, model, cost in (("trees", False, V), ("product", True, paired)):
        drafter = fresh(model, cost, d, D)
        total = sum(product(drafter, p, x, rid, a, cost, d, D)
                    for rid, (p, x) in enumerate(answers))
        st, counts = drafter.stats, {}
        for source, n in st.source_drafted.items():
            c = counts.setdefault("model" if source == "model" else "trees", [0, 0])
            c[0] += n
            c[1] += st.source_accepted.get(source, 0)
        out[arm] = (total, pre_d if model else pre, counts)
    drafter, held = fresh(False, V, d, D), {}
    total = sum(knowing(drafter, p, x, rid, a, d, D, held) for rid, (p, x) in enumerate(answers))
    out["knowing"] = (total, pre_d, {s: [n, n] for s, n in held.items() if s != "plain"})
    return out


def c8_bound(m: Dict, a: float) -> Dict:
    """The best speedup of a draft model at c=8 (module docstring), lazy as
    stock's and fed every forward as the product's (``paired``)."""
    B, Bd, d8 = m["batch"], m["draft_batch"], m["d8"]

    def rates(a: float, paired: bool) -> List[float]:
        return [(1 - a ** (k + 1)) / (1 - a) / (B[k + 1] + k * d8 + paired * d8 * Bd[k + 1])
                for k in KS]

    def needed(paired: bool) -> float:
        lo, hi = 0.0, 0.999
        if max(rates(hi, paired)) < TARGET_C8:
            return float("nan")
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if max(rates(mid, paired)) >= TARGET_C8 else (mid, hi)
        return hi
    lazy, paired = rates(a, False), rates(a, True)
    return {"speedup": dict(zip(KS, lazy)), "paired": dict(zip(KS, paired)),
            "best": max(lazy), "best_k": KS[lazy.index(max(lazy))], "best_paired": max(paired),
            "needed_agreement": needed(False), "needed_agreement_paired": needed(True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agreement", type=float, default=AGREEMENT)
    ap.add_argument("--d", type=float, help="a draft forward over the target's (default: measured)")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--sets", default="builtin,report")
    ap.add_argument("--reps", type=int, default=5, help="timed runs of each forward")
    ap.add_argument("--measured", help="take the measurements from an earlier --json")
    ap.add_argument("--blas", default="auto", choices=("auto", "openblas", "reference"))
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    if not args.measured:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        bench.maybe_reexec_with_openblas(args.blas, [sys.executable, os.path.abspath(__file__),
                                                     *sys.argv[1:]])
    if args.measured:
        with open(args.measured) as f:
            m = json.load(f)["measured"]
    else:
        m = measure(args.reps)
    m.setdefault("blas", bench.blas_in_use())
    for key in ("target", "draft", "batch", "draft_batch"):
        m[key] = {int(n): t for n, t in m[key].items()}
    if args.d is not None:
        m["d"] = args.d
    a, T = args.agreement, curve(m["target"])
    print(f"measured ({m['blas']} BLAS): plain step {m['plain_ms']:.0f} ms; target forward of "
          + ", ".join(f"{n}: {T(n):.2f}" for n in (2, 5, 9, 16, 64, 256))
          + f" (verifications priced V(k) = 1 + 0.11k); d = {m['d']:.4f}; 8 rows: plain "
          f"{m['batch_plain_ms']:.0f} ms, d8 = {m['d8']:.4f}, width w a row: "
          + ", ".join(f"{w}: {b:.2f}" for w, b in m["batch"].items()))
    print(f"\nspeedup over stock at agreement {a}, decode (end to end), and per source "
          "drafted/accepted (tr: trees, dm: draft model)\n")
    print("| set | workload | requests | tokens | model@k | trees | product | knowing |")
    print("|---|---|---|---|---|---|---|---|")
    _, tokenizer = mlx_lm.load(str(ensure_model("qwen3", "tiny")))
    results = []
    for name in args.sets.split(","):
        for workload in WORKLOADS:
            reqs = bench.load_requests(records(name, workload), tokenizer)
            answers = [(r.prompt_ids, r.reference_ids[: args.max_tokens]) for r in reqs]
            res = arms(answers, a, m)
            n, pre = res["stock"][0], res["stock"][1]
            row = {"set": name, "workload": workload, "requests": len(answers), "tokens": n}
            cells = []
            for arm in ("model@k", "trees", "product", "knowing"):
                total, prefill, counts = res[arm][:3]
                row[arm] = {"decode": n / total, "e2e": (pre + n) / (prefill + total),
                            "counts": counts, **({"k": res[arm][3]} if arm == "model@k" else {})}
                src = " ".join(f"{s[:2].replace('mo', 'dm')} {c[0]}/{c[1]}" for s, c in counts.items())
                k = f"k={res[arm][3]}: " if arm == "model@k" else ""
                cells.append(f"{k}{n / total:.2f}x ({row[arm]['e2e']:.2f}x); {src}")
            results.append(row)
            print(f"| {name} | {workload} | {len(answers)} | {n} | " + " | ".join(cells) + " |")
    targets(results)
    b = c8_bound(m, a)
    print(f"\nc=8 bound at agreement {a}: best {b['best']:.2f}x (k={b['best_k']}; fed every "
          f"forward as the product's: {b['best_paired']:.2f}x); by k: "
          + ", ".join(f"{k}: {s:.2f}" for k, s in b["speedup"].items())
          + f"; {TARGET_C8}x needs agreement {b['needed_agreement']:.3f} "
          f"({b['needed_agreement_paired']:.3f} fed every forward)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"agreement": a, "max_tokens": args.max_tokens, "measured": m,
                       "results": results, "c8": b}, f, indent=1)


def checks(w: Dict[str, Dict], arm: str) -> List[Tuple[str, bool]]:
    """The issue's targets for ``arm`` (decode speed; ``w``: one set's rows)."""
    def x(workload: str, of: str = arm) -> float:
        return w[workload][of]["decode"]
    return [("open-ended >= 1.3x stock", x("open-ended") >= 1.3),
            ("open-ended >= model@k", x("open-ended") >= x("open-ended", "model@k")),
            ("code-edit >= 0.95 trees", x("code-edit") >= 0.95 * x("code-edit", "trees")),
            ("mixed > trees and model@k", x("mixed") > max(x("mixed", "trees"),
                                                           x("mixed", "model@k")))]


def targets(results: List[Dict]) -> None:
    """The issue's targets, per set: met by the product, reachable (knowing)."""
    print()
    for name in dict.fromkeys(r["set"] for r in results):
        w = {r["workload"]: r for r in results if r["set"] == name}
        got = zip(checks(w, "product"), checks(w, "knowing"))
        print(f"{name}: " + "; ".join(f"{label}: product {'yes' if p else 'NO'}, knowing "
                                      f"{'yes' if k else 'NO'}" for (label, p), (_, k) in got))


if __name__ == "__main__":
    main()
