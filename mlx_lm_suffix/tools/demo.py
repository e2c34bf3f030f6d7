"""The README's first command: ``mlx-lm-suffix demo``.

Builds the "small" local model once (cached), starts two real
``mlx_lm.server`` subprocesses on free loopback ports (stock, and
``--draft suffix``), sends an agentic and a code-edit workload to both in
scripted-target mode (greedy output follows real stdlib text), and prints
tokens/s with and without suffix decoding, acceptance, and whether the
outputs matched. Servers are stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from . import bench
from .workloads import read_workload, write_workloads

DEMO_WORKLOADS = ("agentic", "code-edit")


def run_demo(
    size: str = "small",
    n_requests: int = 6,
    max_tokens: int = 160,
    blas: str = "auto",
    echo: Callable[[str], None] = print,
    cache_dir: Optional[str] = None,
) -> Dict[str, Any]:
    """Run the demo; returns per-workload results
    ``{name: {"stock": {...}, "suffix": {...}, "outputs_match": bool}}``."""
    from .models import ensure_model

    echo(f"Building/loading the local '{size}' model (random weights, cached) ...")
    model_path = ensure_model("qwen3", size, cache_dir=cache_dir)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(model_path))
    eos_id = sorted(tokenizer.eos_token_ids)[0]
    tmp = Path(tempfile.mkdtemp(prefix="mlx_lm_suffix_demo_"))
    files = write_workloads(tmp, n=n_requests, max_chars=2500, names=list(DEMO_WORKLOADS))
    workloads = {
        name: bench.load_requests(read_workload(path), tokenizer) for name, path in files.items()
    }
    script = bench.write_script(tmp / "script.jsonl", [r for w in workloads.values() for r in w])
    echo(f"Scripted-target mode: greedy output follows real stdlib text. BLAS: {_blas(blas)}")
    results: Dict[str, Any] = {}
    texts: Dict[str, Dict[str, List[str]]] = {}
    for kind, suffix in (("stock", False), ("suffix", True)):
        log = tmp / f"server-{kind}.log"
        echo(f"Starting mlx_lm.server{' --draft suffix' if suffix else ''} (log: {log}) ...")
        with bench.server_process(
            str(model_path), suffix=suffix, script=script, eos_id=eos_id, blas=blas, log=log
        ) as server:
            bench.http_generate(server.url, workloads["agentic"][0], 4)  # warm-up
            for name, requests in workloads.items():
                samples, outs = [], []
                for r in requests:
                    s, text = bench.http_generate(server.url, r, max_tokens)
                    samples.append(s)
                    outs.append(text)
                results.setdefault(name, {})[kind] = bench.summarize(samples)
                texts.setdefault(name, {})[kind] = outs
    for name in workloads:
        results[name]["outputs_match"] = texts[name]["stock"] == texts[name]["suffix"]
        results[name]["follows_reference"] = all(
            r.reference.startswith(t) and t for r, t in zip(workloads[name], texts[name]["suffix"])
        )
    echo(format_demo(results))
    return results


def _blas(blas: str) -> str:
    if blas == "reference":
        return "reference"
    return "openblas" if bench.blas_env(blas).get("LD_PRELOAD", "").find("openblas") >= 0 else "reference"


def format_demo(results: Dict[str, Any]) -> str:
    """The demo's summary lines."""
    lines = []
    for name, r in results.items():
        st, sx = r["stock"], r["suffix"]
        speed = sx["tokens_per_s"] / st["tokens_per_s"] if st["tokens_per_s"] else 0.0
        acc = sx["acceptance_rate"]
        lines.append(
            f"{name:>10}: stock {st['tokens_per_s']:6.1f} tok/s | suffix {sx['tokens_per_s']:6.1f} tok/s "
            f"({speed:.2f}x), acceptance {'-' if acc is None else f'{acc:.0%}'}, "
            f"{'n/a' if sx['tokens_per_step'] is None else format(sx['tokens_per_step'], '.2f')} tokens/step; "
            f"outputs {'identical' if r['outputs_match'] else 'DIFFER'}"
            f"{', follow the reference' if r.get('follows_reference') else ', do NOT follow the reference'}"
        )
    return "\n".join(lines)
