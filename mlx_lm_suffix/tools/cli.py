"""The ``mlx-lm-suffix`` command line (also ``python -m mlx_lm_suffix``).

Each subcommand is a thin ``click`` wrapper around a module that holds its
logic (``simulate`` -> :mod:`mlx_lm_suffix.tools.simulate`, ``parity`` ->
:mod:`mlx_lm_suffix.tools.parity`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import click

from ..drafter import (
    DEFAULT_MAX_CACHED_REQUESTS,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_SPEC_OFFSET,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_NUM_DRAFT_TOKENS,
)
from .models import FAMILIES


def _list_of(kind: Callable[[str], Any]) -> Callable[..., List[Any]]:
    """A click callback parsing a comma-separated list of ``kind`` values."""

    def parse(ctx: click.Context, param: click.Parameter, value: str) -> List[Any]:
        try:
            return [kind(v) for v in value.split(",") if v.strip()]
        except ValueError as e:
            raise click.BadParameter(f"expected comma-separated numbers: {e}") from e

    return parse


def _write_json(path: Union[str, os.PathLike], data: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _json_option(help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A ``--json FILE`` option, passed as ``json_out`` (None when not given)."""
    return click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help=help)


@click.group(name="mlx-lm-suffix")
def main() -> None:
    """Suffix decoding for mlx-lm: tools."""


@main.command("simulate")
@click.argument("log", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--model",
    default=None,
    help="Model folder or Hugging Face id whose tokenizer encodes text records "
    "(only the tokenizer is loaded). Default: the tiny model's BPE tokenizer.",
)
@click.option("--num-draft-tokens", default="16,32,64", callback=_list_of(int), show_default=True)
@click.option("--max-tree-depth", default="64,96", callback=_list_of(int), show_default=True)
@click.option("--max-spec-factor", default="1,2", callback=_list_of(float), show_default=True)
@click.option(
    "--max-spec-offset",
    default=f"{DEFAULT_MAX_SPEC_OFFSET:g}",
    callback=_list_of(float),
    show_default=True,
)
@click.option("--min-token-prob", default="0.05,0.1", callback=_list_of(float), show_default=True)
@click.option(
    "--max-cached-requests",
    default=str(DEFAULT_MAX_CACHED_REQUESTS),
    callback=_list_of(int),
    show_default=True,
)
@click.option(
    "--policy",
    default="adaptive",
    callback=_list_of(str),
    show_default=True,
    help="Draft-length policies to replay (adaptive, fixed), as --suffix-policy.",
)
@click.option(
    "--cost-file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help='Measured forward times, JSON {"<tokens per forward>": time, ...} with '
    "key 1. Default: assume cost(k draft tokens) = 1 + 0.04 k decode steps.",
)
@click.option(
    "--step-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="Milliseconds of a plain decode step on the machine to tune for: the policy weighs "
    "its host time (measured here) against steps this long.",
)
@click.option(
    "--wait-ms",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Milliseconds the device waits for the host after a verification or a check of "
    "first tokens on that machine (idle_us_per_wait in /v1/suffix/stats or generate "
    "--verbose): each costs that, and the policy prices it.",
)
@click.option("--warm", is_flag=True, help="Fill the global cache with every response first.")
@_json_option("Write the results (and the recommendation) to this JSON file.")
def simulate_command(
    log: str,
    model: Optional[str],
    num_draft_tokens: List[int],
    max_tree_depth: List[int],
    max_spec_factor: List[float],
    max_spec_offset: List[float],
    min_token_prob: List[float],
    max_cached_requests: List[int],
    policy: List[str],
    cost_file: Optional[str],
    step_ms: float,
    wait_ms: float,
    warm: bool,
    json_out: Optional[str],
) -> None:
    """Replay a JSONL log of {"prompt", "response"} pairs through the suffix
    drafter for each knob combination, and recommend server flags."""
    from . import simulate as sim

    grid = {
        "num_draft_tokens": num_draft_tokens,
        "max_tree_depth": max_tree_depth,
        "max_spec_factor": max_spec_factor,
        "max_spec_offset": max_spec_offset,
        "min_token_prob": min_token_prob,
        "max_cached_requests": max_cached_requests,
        "policy": policy,
    }
    try:
        cost = sim.load_cost_file(cost_file) if cost_file else None
        records = sim.tokenize_records(sim.read_records(log), model)
        results = sim.simulate(records, grid, cost=cost, warm=warm, step_seconds=step_ms / 1000,
                               wait=wait_ms / step_ms)
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    best = sim.recommend(results)
    command = sim.server_command(best, model)
    n_tokens = sum(len(r.response) for r in records)
    click.echo(
        f"{len(records)} records, {n_tokens} response tokens" + (" (warm cache)" if warm else "")
    )
    click.echo(
        "cost model: "
        + (
            f"measured ({cost_file})"
            if cost_file
            else f"assumed 1 + {sim.DEFAULT_COST_PER_DRAFT_TOKEN:g} k per step"
        )
    )
    click.echo(sim.format_table(results))
    click.echo(f"\nRecommended ({best['est_speedup']:.2f}x estimated):\n  {command}")
    if json_out:
        _write_json(json_out, {"results": results, "recommended": best, "command": command})


@main.command("parity")
@click.option(
    "--model",
    default=None,
    help="Model path, Hugging Face id, or a real model's name (smollm2, smollm2-f32, "
    "smollm2-f16, smollm2-bf16: SmolLM2-135M-Instruct, converted on first use). "
    "Default: the tiny qwen3 model.",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help='JSONL of {"prompt": text or token ids}. Default: built-in set.',
)
@click.option("--max-tokens", default=64, show_default=True, type=int)
@click.option("--num-draft-tokens", default=DEFAULT_NUM_DRAFT_TOKENS, show_default=True, type=int)
@click.option(
    "--top-k",
    default=5,
    show_default=True,
    type=int,
    help="A divergence is a near tie only if both tokens are in the top-k.",
)
@click.option(
    "--tie-threshold",
    default=0.05,
    show_default=True,
    type=float,
    help="Largest logprob gap (nats) at the divergence for a near tie.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=None,
    help="Cast the model weights to this dtype.",
)
@click.option("--kv-bits", type=click.IntRange(1, 8), default=None,
              help="Quantize the KV cache to this many bits (as mlx_lm.generate's --kv-bits).")
@click.option("--kv-group-size", default=64, show_default=True, type=int)
@click.option("--quantized-kv-start", default=None, type=int,
              help="Quantize the KV cache from this many tokens on. Default: mlx-lm's.")
@click.option("--strict", is_flag=True, help="Exit non-zero on near ties too.")
@_json_option("Write the per-prompt results to this JSON file.")
@click.pass_context
def parity_command(
    ctx: click.Context,
    model: Optional[str],
    prompts_file: Optional[str],
    max_tokens: int,
    num_draft_tokens: int,
    top_k: int,
    tie_threshold: float,
    dtype: Optional[str],
    kv_bits: Optional[int],
    kv_group_size: int,
    quantized_kv_start: Optional[int],
    strict: bool,
    json_out: Optional[str],
) -> None:
    """Compare greedy spec-off and spec-on decoding token for token:
    EXACT, NEAR_TIE (numerics at a near tie) or FAIL per prompt."""
    from . import parity as par

    try:
        prompts = par.read_prompts(prompts_file) if prompts_file else par.builtin_prompts()
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    from .gguf import WheelUnavailable

    try:
        model_obj, tokenizer = par.load_model(model, dtype)
    except WheelUnavailable as e:
        raise click.ClickException(str(e)) from e
    from ..persistence import vocabulary_size

    vocab = vocabulary_size(model_obj, tokenizer)
    if any(isinstance(p, list) and max(p) >= vocab for p in prompts):
        raise click.ClickException(f"a prompt's token ids must be below {vocab}, the model's "
                                   "vocabulary size")
    try:
        results = par.parity(
            model_obj,
            tokenizer,
            prompts,
            max_tokens=max_tokens,
            num_draft_tokens=num_draft_tokens,
            top_k=top_k,
            tie_threshold=tie_threshold,
            report=lambda line: click.echo(line, err=True),
            kv_bits=kv_bits,
            kv_group_size=kv_group_size,
            **({} if quantized_kv_start is None else {"quantized_kv_start": quantized_kv_start}),
        )
    except ValueError as e:  # e.g. a KV group size the model's head size does not divide
        raise click.ClickException(str(e)) from e
    click.echo(par.format_report(results))
    if json_out:
        _write_json(json_out, results)
    ctx.exit(par.exit_status(results, strict))


@main.command("bench")
@click.option(
    "--model",
    default=None,
    help="Model path, Hugging Face id, or a real model's name (smollm2 = 4-bit, smollm2-f32, "
    "smollm2-f16, smollm2-bf16: SmolLM2-135M-Instruct, converted on first use). "
    "Default: the local random-weight model of --family and --size.",
)
@click.option(
    "--family",
    type=click.Choice(FAMILIES),
    default="qwen3",
    show_default=True,
    help="Architecture of the local random-weight model (ignored with --model): "
    "qwen3/llama have only KV caches; the others have sliding windows or "
    "recurrent layers (see the README's model families).",
)
@click.option(
    "--size",
    type=click.Choice(["tiny", "mini", "small", "bench"]),
    default="bench",
    show_default=True,
    help="Size of the local random-weight model (bench: about 200M parameters).",
)
@click.option(
    "--workload",
    "workload_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="Workload JSONL (repeatable), instead of --set's. Default: the code-edit, agentic "
    "and open-ended workloads of --set.",
)
@click.option(
    "--set",
    "workload_set",
    type=click.Choice(["builtin", "eval"]),
    default="builtin",
    show_default=True,
    help="builtin: workloads generated from this machine's Python standard library "
    "(--requests, --prompt-chars); eval: the evaluation set kept in the package "
    "(at least 24 requests per workload of original text, in two halves; --half).",
)
@click.option(
    "--half",
    type=click.Choice(["tune", "report", "all"]),
    default=None,
    help="With --set eval: the half to run (tune: for choosing constants, report: for "
    "figures).  [default: report]",
)
@click.option(
    "--workloads",
    "workload_names",
    default="code-edit,agentic,open-ended",
    show_default=True,
    help="Workloads of --set to run (comma-separated), when no --workload is given.",
)
@click.option(
    "--requests",
    "n_requests",
    default=None,
    type=int,
    help="Requests per workload (the first ones).  [default: all of the half with --set "
    "eval, else 8]",
)
@click.option(
    "--prompt-chars",
    default=4000,
    show_default=True,
    type=int,
    help="Source length in code-edit prompts (--set builtin).",
)
@click.option("--max-tokens", default=256, show_default=True, type=int)
@click.option("--repetitions", default=3, show_default=True, type=int, help="Paired repetitions (arm order alternates).")
@click.option(
    "--arms",
    default=None,
    help="In-process arms (comma-separated; stock is always included): stock, "
    "suffix-cold, suffix-warm, suffix-cold-fixed, suffix-warm-fixed, oracle, "
    "oracle@N (drafts of up to N tokens), and with --draft-model stock-draft "
    "(stock mlx-lm's speculative decoding with it) and suffix-draft (a fresh drafter "
    "with it beside the trees); or 'none' for the server arms alone.  [default: "
    "stock,suffix-cold,suffix-warm,oracle; with --draft-model "
    "stock,stock-draft,suffix-cold,suffix-draft]",
)
@click.option(
    "--draft-model",
    default=None,
    help="A draft model of the model's vocabulary for the draft arms (and with --server "
    "the draft servers): as --model, or tiny/mini/small/bench for the local random-weight "
    "model of that size of --family.",
)
@click.option(
    "--draft-agreement",
    default=0.75,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="Scripted mode: the share of draft positions where the draft model proposes "
    "the target's token (the same positions for every arm and run).",
)
@click.option(
    "--stock-draft-tokens",
    default=3,
    show_default=True,
    type=click.IntRange(1),
    help="Draft tokens a round of stock's speculative decoding (stock-draft arms; "
    "mlx-lm's own default).",
)
@click.option("--server/--no-server", default=False, show_default=True, help="Also run the server arms.")
@click.option(
    "--server-fixed/--no-server-fixed",
    default=False,
    show_default=True,
    help="With --server, also run a --suffix-policy fixed server.",
)
@click.option("--concurrency", default="1,8", show_default=True, callback=_list_of(int), help="Server concurrencies.")
@click.option(
    "--ranks",
    default=1,
    show_default=True,
    type=click.IntRange(1, 8),
    help="Processes of each server (more than 1: mlx.launch on this machine, "
    "the model sharded by tensor parallelism).",
)
@click.option(
    "--scripted/--no-scripted",
    default=None,
    help="Scripted-target mode (bias logits so greedy output follows the "
    "reference). Default: on for the local random models, off otherwise.",
)
@click.option("--blas", type=click.Choice(["auto", "openblas", "reference"]), default="auto", show_default=True)
@click.option("--num-draft-tokens", default=DEFAULT_NUM_DRAFT_TOKENS, show_default=True, type=int)
@click.option("--max-tree-depth", default=DEFAULT_MAX_TREE_DEPTH, show_default=True, type=int)
@click.option(
    "--max-spec-factor",
    default=DEFAULT_MAX_SPEC_FACTOR,
    show_default=True,
    type=float,
    help="The suffix arms' drafts are at most match length * this tokens.",
)
@click.option(
    "--suffix-policy",
    type=click.Choice(["adaptive", "fixed"]),
    default="adaptive",
    show_default=True,
    help="Draft-length policy of the suffix arms (fixed: as long as the trees allow).",
)
@click.option("--out", "out_dir", default="bench-results", show_default=True, type=click.Path(file_okay=False))
def bench_command(
    model: Optional[str],
    family: str,
    size: str,
    workload_files: tuple,
    workload_set: str,
    half: Optional[str],
    workload_names: str,
    n_requests: Optional[int],
    prompt_chars: int,
    max_tokens: int,
    repetitions: int,
    arms: Optional[str],
    draft_model: Optional[str],
    draft_agreement: float,
    stock_draft_tokens: int,
    server: bool,
    server_fixed: bool,
    concurrency: List[int],
    ranks: int,
    scripted: Optional[bool],
    blas: str,
    num_draft_tokens: int,
    max_tree_depth: int,
    max_spec_factor: float,
    suffix_policy: str,
    out_dir: str,
) -> None:
    """Compare stock mlx-lm, suffix decoding (cold and warm global cache) and
    an oracle drafter side by side; writes bench.json and bench.png."""
    if ranks > 1 and not server:
        raise click.ClickException("--ranks needs --server (only the servers are distributed)")
    if half is not None and (workload_set != "eval" or workload_files):
        raise click.ClickException("--half needs --set eval (and no --workload)")
    from . import bench as b

    b.maybe_reexec_with_openblas(blas)
    from .gguf import WheelUnavailable
    from .models import ensure_model, resolve_model
    from .workloads import write_eval_set, write_workloads

    try:
        model_path = resolve_model(model) if model else str(ensure_model(family, size))
        draft_path = None
        if draft_model in b.LOCAL_SIZES:
            draft_path = str(ensure_model(family, draft_model))
        elif draft_model:
            draft_path = resolve_model(draft_model)
    except WheelUnavailable as e:
        raise click.ClickException(str(e)) from e
    if scripted is None:
        scripted = model is None or b.is_local_random_model(model_path)
    out = Path(out_dir)
    names = [n.strip() for n in workload_names.split(",") if n.strip()]
    try:
        if workload_set == "eval" and not workload_files:
            files = write_eval_set(out / "workloads", names=names, half=half or "report")
            selection: Dict[str, Any] = {"set": "eval", "half": half or "report"}
        else:
            n_requests = 8 if n_requests is None else n_requests
            if workload_files:
                files = {Path(f).stem: Path(f) for f in workload_files}
                selection = {"set": "files"}
            else:
                files = write_workloads(out / "workloads", n=n_requests, max_chars=prompt_chars, names=names)
                selection = {"set": "builtin"}
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    if arms is None:
        arms = ",".join(b.DEFAULT_DRAFT_ARMS if draft_path else b.DEFAULT_ARMS)
    if arms.strip() == "none":
        if not server:
            raise click.ClickException("--arms none needs --server")
        arm_list = []
    else:
        arm_list = ["stock"] + [a.strip() for a in arms.split(",") if a.strip() and a.strip() != "stock"]
    bad = [a for a in arm_list if not b.is_inprocess_arm(a)]
    if bad:
        raise click.ClickException(f"unknown arms {bad}; choose from {b.INPROCESS_ARMS} or oracle@N")
    drafting = [a for a in arm_list if a in b.DRAFT_ARMS]
    if drafting and not draft_path:
        raise click.ClickException(f"arms {drafting} need --draft-model")
    from .workloads import read_workload

    try:
        counts = {k: len(read_workload(v)[:n_requests]) for k, v in files.items()}
    except ValueError as e:
        raise click.ClickException(str(e)) from e
    total = b.total_ticks(counts, arm_list, repetitions, server, concurrency, server_fixed,
                          draft=draft_path is not None)
    with click.progressbar(length=total, label="bench", file=sys.stderr) as bar:
        try:
            report = b.run_bench(
                model_path,
                files,
                arms=arm_list,
                server=server,
                server_fixed=server_fixed,
                concurrency=concurrency,
                repetitions=repetitions,
                max_tokens=max_tokens,
                max_requests=n_requests,
                scripted=scripted,
                blas=blas,
                drafter_kwargs={
                    "num_draft_tokens": num_draft_tokens,
                    "max_tree_depth": max_tree_depth,
                    "max_spec_factor": max_spec_factor,
                    "policy": suffix_policy,
                },
                progress=bar.update,
                log_dir=out,
                ranks=ranks,
                draft_model_path=draft_path,
                draft_agreement=draft_agreement,
                stock_draft_tokens=stock_draft_tokens,
            )
        except b.DraftModelMismatch as e:
            raise click.ClickException(str(e)) from e
    report["workload_set"] = selection
    click.echo(b.format_table(report))
    _write_json(out / "bench.json", report)
    png = b.plot(report, out / "bench.png")
    click.echo(f"\nwrote {out / 'bench.json'}" + (f" and {png}" if png else " (no matplotlib: no plot)"))


@main.command("demo")
@click.option(
    "--model",
    default=None,
    help="A model folder, a real model's name (smollm2, smollm2-f32, ...), or 'random' "
    "(the random-weight model of --size, scripted output). Default: SmolLM2-135M-Instruct, "
    "float32 with a fast BLAS, else 4-bit; the random model where the wheel cannot be had.",
)
@click.option(
    "--size",
    type=click.Choice(["tiny", "mini", "small", "bench"]),
    default="small",
    show_default=True,
    help="Size of the random-weight model (with --model random, or as the fallback).",
)
@click.option("--requests", "n_requests", default=2, show_default=True, type=int, help="Requests per workload.")
@click.option("--max-tokens", default=96, show_default=True, type=int)
@click.option("--prompt-chars", default=1500, show_default=True, type=int, help="Source length in code-edit prompts.")
@click.option("--blas", type=click.Choice(["auto", "openblas", "reference"]), default="auto", show_default=True)
def demo_command(
    model: Optional[str], size: str, n_requests: int, max_tokens: int, prompt_chars: int, blas: str
) -> None:
    """Start a stock and a `--draft suffix` mlx_lm.server on a real small
    model, send agentic and code-edit requests, and compare answers, speed
    and outputs."""
    from .demo import run_demo

    try:
        results = run_demo(
            model=model, size=size, n_requests=n_requests, max_tokens=max_tokens,
            prompt_chars=prompt_chars, blas=blas, echo=click.echo,
        )
    except RuntimeError as e:
        raise click.ClickException(str(e)) from e
    if not all(r["outputs_match"] for r in results.values()):
        raise click.ClickException("outputs of the stock and suffix servers differ")


@main.command("soak")
@click.option("--model", default=None, help="Model to serve. Default: the tiny test model.")
@click.option("--requests", "n_requests", default=500, show_default=True)
@click.option("--max-tokens", default=32, show_default=True)
@click.option("--max-concurrency", default=8, show_default=True)
@click.option("--distinct-prompts", default=40, show_default=True)
@click.option("--disconnect-rate", default=0.15, show_default=True)
@click.option("--max-cached-requests", default=50, show_default=True)
@click.option("--max-cached-tokens", default=20000, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--rss-growth-limit-mb", default=None, type=float,
              help="Most RSS growth after the warm-up (the first fifth of the requests). "
                   "Default: 64 MB plus 1 KiB per token of --max-cached-tokens.")
@click.option("--log-dir", default=None, help="Server logs. Default: a temporary folder.")
@click.option("--json-out", default=None, help="Write the summary as JSON here.")
@click.option("--fuzz", is_flag=True,
              help="Differential fuzzing instead: generated requests (valid, invalid, junk) "
                   "to a stock and a suffix server side by side (--examples, --seed, --model, "
                   "--log-dir, --json-out apply).")
@click.option("--examples", default=3000, show_default=True, help="With --fuzz: requests to send.")
@click.option("--draft-model", default=None,
              help="The suffix server pairs this draft model (--draft suffix --draft-model); "
                   "the stock server it is checked against has none.")
@click.option("--policy", type=click.Choice(["adaptive", "fixed"]), default="adaptive",
              show_default=True,
              help="The suffix server's --suffix-policy (fixed: drafts as proposed, so a draft "
                   "model drafts even where its forward costs the target's).")
def soak_command(model, n_requests, max_tokens, max_concurrency, distinct_prompts,
                 disconnect_rate, max_cached_requests, max_cached_tokens, seed,
                 rss_growth_limit_mb, log_dir, json_out, fuzz, examples, draft_model,
                 policy) -> None:
    """Soak a `--draft suffix` server: N requests at mixed concurrency with
    disconnects; checks outputs against a stock server, leaks and bounds.
    With --fuzz: answers to generated requests against a stock server's,
    a witness request beside each, memory."""
    if fuzz:
        from .fuzz import run_fuzz

        result = run_fuzz(model=model, examples=examples, seed=seed, log_dir=log_dir,
                          json_out=json_out, echo=click.echo, draft_model=draft_model,
                          policy=policy)
        sys.exit(0 if result["ok"] else 1)
    from .soak import run_soak

    result = run_soak(
        model=model, requests=n_requests, max_tokens=max_tokens,
        max_concurrency=max_concurrency, distinct_prompts=distinct_prompts,
        disconnect_rate=disconnect_rate, max_cached_requests=max_cached_requests,
        max_cached_tokens=max_cached_tokens, seed=seed,
        rss_growth_limit_mb=rss_growth_limit_mb, log_dir=log_dir,
        json_out=json_out, echo=click.echo, draft_model=draft_model, policy=policy,
    )
    sys.exit(0 if result["ok"] else 1)
