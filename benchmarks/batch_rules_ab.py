"""Side-by-side servers, one per batch-rule variant, on the bench's workloads.

Each variant is a ``mlx_lm.server --draft suffix`` (adaptive policy) with one
rule of :mod:`mlx_lm_suffix.policy.rules` switched off; they run at once
beside a stock server and get the same waves of requests, interleaved
(:func:`mlx_lm_suffix.tools.bench.run_server_arms`): a cold pass, then the
same requests again (warm). Used to decide which batch rules pay; results in
docs/choosing-defaults.md. Run from a checkout (OpenBLAS on Linux):

    python benchmarks/batch_rules_ab.py [--family qwen3] [--workloads agentic,open-ended]
        [--concurrency 1,8] [--variants current,no-margin]

Variants: ``current``; ``no-margin`` (``BATCH_MARGIN`` 1: a batch verifies
whatever beats plain steps). Rules this compared and removed (the first-token
check's cost, a one-row batch's own settled rule) are in the git history of
this file and in docs/choosing-defaults.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Dict, List

VARIANT_ENV = "MLX_LM_SUFFIX_AB_VARIANT"


def patch(variant: str) -> None:
    """Switch the variant's rule off in this process."""
    from mlx_lm_suffix.policy import rules

    if variant == "no-margin":
        rules.BATCH_MARGIN = 1.0
    elif variant != "current":
        raise SystemExit(f"unknown variant {variant!r}")


def serve(argv: List[str]) -> None:
    """The bench's scripted server with the variant of ``$VARIANT_ENV``."""
    from mlx_lm_suffix.tools import bench

    patch(os.environ[VARIANT_ENV])
    bench.serve_main(argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3")
    p.add_argument("--size", default="bench")
    p.add_argument("--workloads", default="agentic,open-ended")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--variants", default="current,no-margin")
    args = p.parse_args()

    from mlx_lm.utils import load_tokenizer

    from mlx_lm_suffix.tools import bench
    from mlx_lm_suffix.tools.launcher import ServerProcess
    from mlx_lm_suffix.tools.models import ensure_model
    from mlx_lm_suffix.tools.workloads import read_workload, write_workloads

    bench.maybe_reexec_with_openblas("auto", [sys.executable, __file__, *sys.argv[1:]])
    model = str(ensure_model(args.family, args.size))
    tokenizer = load_tokenizer(Path(model))
    eos = sorted(tokenizer.eos_token_ids)[0] if tokenizer.eos_token_ids else 0
    tmp = Path(tempfile.mkdtemp(prefix="batch_rules_ab_"))
    names = args.workloads.split(",")
    files = write_workloads(tmp, n=args.requests, max_chars=args.prompt_chars, names=names)
    variants = args.variants.split(",")
    print(f"blas: {bench.blas_in_use()}  model: {model}", flush=True)

    for name, path in files.items():
        requests = bench.load_requests(read_workload(path)[: args.requests], tokenizer)
        script = bench.write_script(tmp / f"{name}.script.jsonl", requests)
        for c in map(int, args.concurrency.split(",")):
            runs: Dict[str, List[Dict[str, Any]]] = {}
            for rep in range(args.repetitions):
                servers = ["stock"] + variants
                if rep % 2:
                    servers.reverse()
                with ExitStack() as stack:
                    urls = {}
                    for s in servers:
                        env = bench.blas_env("auto")
                        env.update({bench.SCRIPT_ENV: str(script), "MLX_LM_SUFFIX_SCRIPT_EOS": str(eos)})
                        flags: List[str] = []
                        command = bench.SERVE_MAIN
                        if s != "stock":
                            env[VARIANT_ENV] = s
                            flags = ["--draft", "suffix"]
                            command = (sys.executable, __file__, "--serve")
                        proc = ServerProcess(model, *flags, command=command, env=env,
                                             log=tmp / f"server-{s}.log", append_log=True)
                        urls[s] = stack.enter_context(proc).url
                        bench.warm_up(urls[s])
                    for phase in ("cold", "warm"):
                        res = bench.run_server_arms(urls, requests, args.max_tokens, c, True)
                        for s, r in res.items():
                            runs.setdefault(f"{s}/{phase}", []).append(r)
            print(f"\n{name} c={c}: {args.requests} requests, {args.repetitions} repetition(s)")
            print(f"{'server':<12} {'pass':<5} {'e2e':>6} {'decode':>7} {'TTFT s':>7} {'tok/step':>8} {'accept':>7}")
            for key, rs in runs.items():
                s, phase = key.split("/")
                base = runs[f"stock/{phase}"]
                e2e = statistics.median(r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base))
                dec = statistics.median(
                    r["decode_tokens_per_s"] / b["decode_tokens_per_s"] for r, b in zip(rs, base)
                )
                ttft = statistics.median(r["ttft_s"] for r in rs)
                tps, acc = rs[0]["tokens_per_step"], rs[0]["acceptance_rate"]
                print(f"{s:<12} {phase:<5} {e2e:>5.2f}x {dec:>6.2f}x {ttft:>7.2f} "
                      f"{'-' if tps is None else f'{tps:.2f}':>8} "
                      f"{'-' if acc is None else f'{acc:.0%}':>7}", flush=True)
            out = tmp / f"{name}-c{c}.json"
            out.write_text(json.dumps(runs, indent=1))
            print(f"wrote {out}")

if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2:])
    else:
        main()
