"""Greedy parity of suffix decoding against stock mlx-lm decoding.

For each prompt, a spec-off run (stock ``mlx_lm.generate.generate_step``,
greedy) is compared token for token with spec-on runs (a step function such
as :func:`mlx_lm_suffix.loop.suffix_generate_step`, greedy). The prompt but
its last token is prefilled once (by stock ``generate_step``), and every run
starts from its own copy of that cache and feeds the last token, so a
prefill-bound model (4-bit or bfloat16 on a CPU) prefills each prompt once,
not three times. The spec-on runs share one fresh
:class:`SuffixDrafter` and each prompt runs twice: the *first* run drafts
from the prompt, its own output and earlier prompts' responses; the *repeat*
run also finds its own earlier response in the global cache, so it drafts
heavily.

A run is:

- ``EXACT``: the same tokens;
- ``NEAR_TIE``: they first differ at a position where both tokens are in the
  spec-off run's top-k and their logprob gap there is at most the tie
  threshold (kernel numerics, not a bug);
- ``FAIL``: anything else.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generate_step
from mlx_lm.models.cache import make_prompt_cache

from ..drafter import DEFAULT_NUM_DRAFT_TOKENS, SuffixDrafter
from ..loop import suffix_generate_step
from ..speculation import RequestOptions

EXACT = "EXACT"
NEAR_TIE = "NEAR_TIE"
FAIL = "FAIL"
_SEVERITY = {EXACT: 0, NEAR_TIE: 1, FAIL: 2}

DEFAULT_TOP_K = 5
DEFAULT_TIE_THRESHOLD = 0.05
DEFAULT_MAX_TOKENS = 64

Prompt = Union[str, Sequence[int]]
StepFn = Callable[..., Iterator[Tuple[int, mx.array, bool]]]

_PROMPT_CHARS = 1500
#: Seconds between progress reports inside one run.
PROGRESS_EVERY = 10.0


def _clip(text: str, n: int = _PROMPT_CHARS) -> str:
    """``text`` cut to at most ``n`` characters, at a line end if possible."""
    if len(text) <= n:
        return text
    cut = text.rfind("\n", 0, n)
    return text[: cut if cut > 0 else n]


def builtin_prompts() -> List[str]:
    """About a dozen prompts made from the Python standard library's own
    sources and docstrings, some highly repetitive (a code block to repeat,
    a function given three times)."""
    import argparse
    import base64
    import csv
    import difflib
    import fnmatch
    import heapq
    import keyword
    import shlex
    import statistics
    import textwrap

    def src(obj: Any) -> str:
        return _clip(inspect.getsource(obj))

    translate = src(fnmatch.translate)
    return [
        "Summarize this module documentation:\n\n" + _clip(json.__doc__),
        "Explain what this function does:\n\n" + src(textwrap.dedent),
        "Repeat the following code block exactly:\n\n```python\n"
        + src(functools.update_wrapper)
        + "```\n",
        "Here is a function, then the same function twice more. Write it a "
        "fourth time.\n\n" + translate + "\n" + translate + "\n" + translate,
        "Add type hints to this function:\n\n" + src(shlex.split),
        "Write unit tests for this function:\n\n" + src(statistics.median),
        "Rewrite this docstring as a bulleted list:\n\n" + _clip(heapq.__doc__),
        "Give every variable in this function a clearer name:\n\n" + src(base64.b64encode),
        "Continue this list of Python keywords, one per line:\n\n" + "\n".join(keyword.kwlist[:12]),
        "Convert this class to a dataclass:\n\n" + src(argparse.Namespace),
        "Fix any bugs in this function:\n\n" + src(difflib.get_close_matches),
        "Repeat this text exactly, twice:\n\n" + _clip(difflib.__doc__),
        "Document this class:\n\n" + src(csv.DictReader),
        "What does fnmatch('data.csv', '*.csv') return? Show the code path.\n\n"
        + src(fnmatch.fnmatch),
    ]


def read_prompts(path: Union[str, os.PathLike]) -> List[Prompt]:
    """Read prompts from JSONL: ``{"prompt": "text" | [token ids]}`` per
    line (a bare JSON string also works)."""
    from .workloads import read_jsonl

    prompts: List[Prompt] = []
    for lineno, entry in read_jsonl(path):
        prompt = entry.get("prompt") if isinstance(entry, dict) else entry
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ValueError(f"{path}:{lineno}: expected a prompt string or token list")
        if isinstance(prompt, list) and not all(type(t) is int and t >= 0 for t in prompt):
            raise ValueError(f"{path}:{lineno}: a token list holds token ids (integers from 0)")
        prompts.append(prompt)
    return prompts


def encode_prompt(tokenizer: Any, prompt: Prompt) -> List[int]:
    """Token ids of ``prompt``: a token list as is; text as a user message
    through the chat template when the tokenizer has one, else plain."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(prompt))


def load_model(
    path: Union[str, os.PathLike, None] = None, dtype: Optional[str] = None
) -> Tuple[nn.Module, Any]:
    """``mlx_lm.load`` of ``path`` (a folder, a Hugging Face id or a name in
    :data:`mlx_lm_suffix.tools.models.REAL_MODELS`; default: the tiny qwen3
    model of :mod:`mlx_lm_suffix.tools.models`), with floating weights cast
    to ``dtype`` (e.g. ``"float32"``) when given."""
    import mlx_lm

    from .models import ensure_model, resolve_model

    path = ensure_model("qwen3", "tiny") if path is None else resolve_model(str(path))
    model, tokenizer = mlx_lm.load(str(path))
    if dtype is not None:
        model.set_dtype(getattr(mx, dtype))
    return model, tokenizer


def _top_k(logprobs: mx.array, k: int) -> Dict[int, float]:
    k = min(k, logprobs.size)
    idx = mx.argpartition(-logprobs, kth=k - 1)[:k]
    return dict(zip(idx.tolist(), logprobs[idx].tolist(), strict=True))


class Progress:
    """Reports how a parity run goes to ``report`` (one line each): the end
    of every prompt's prefill and of every run (which prompt, tokens,
    seconds, and the time left estimated
    from the seconds per run so far) and, inside a run, every
    :data:`PROGRESS_EVERY` seconds the tokens so far."""

    def __init__(self, report: Callable[[str], None], prompts: int, runs_per_prompt: int = 4):
        self.report, self.runs = report, prompts * runs_per_prompt
        self.prompts, self.start = prompts, time.perf_counter()
        self.runs_done, self.what, self.run_start, self.last = 0, "", 0.0, 0.0

    def begin(self, index: int, run: str) -> None:
        self.what = f"prompt {index + 1}/{self.prompts} {run}"
        self.run_start = self.last = time.perf_counter()

    def token(self, tokens: int, max_tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY:
            self.last = now
            self.report(f"{self.what}: {tokens}/{max_tokens} tokens, {now - self.run_start:.0f} s")

    def end(self, tokens: int) -> None:
        now = time.perf_counter()
        self.runs_done += 1
        left = (now - self.start) / self.runs_done * (self.runs - self.runs_done)
        self.report(
            f"{self.what}: {tokens} tokens in {now - self.run_start:.1f} s; "
            f"about {_duration(left)} left"
        )


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _quiet(line: str) -> None:
    pass


def prefill(model: nn.Module, prompt: Sequence[int], **kv: Any) -> Tuple[List[Any], List[int]]:
    """A cache holding ``prompt`` but its last token (stock ``generate_step``'s
    prefill and first step over them, with ``kv``: its KV quantization
    arguments), and what is left to feed. Each run takes a copy
    (:func:`copy.deepcopy`: the cache's arrays are its own)."""
    cache = make_prompt_cache(model)
    if len(prompt) < 2:
        return cache, list(prompt)
    for _ in generate_step(mx.array(prompt[:-1]), model, max_tokens=0, prompt_cache=cache, **kv):
        pass
    mx.eval([c.state for c in cache])
    return cache, list(prompt[-1:])


def reference_run(
    model: nn.Module,
    prompt: Sequence[int],
    max_tokens: int,
    eos: Sequence[int],
    top_k: int,
    progress: Optional[Progress] = None,
    prompt_cache: Optional[List[Any]] = None,
    **kv: Any,
) -> Tuple[List[int], List[Dict[int, float]]]:
    """Spec-off greedy tokens and, per position, the top-k ``{token: logprob}``
    (``prompt``: the tokens not in ``prompt_cache``; ``kv``: the KV
    quantization arguments of ``generate_step``)."""
    tokens: List[int] = []
    tops: List[Dict[int, float]] = []
    for tok, logprobs in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=prompt_cache, **kv
    ):
        tokens.append(int(tok))
        tops.append(_top_k(logprobs, top_k))
        if progress:
            progress.token(len(tokens), max_tokens)
        if tok in eos:
            break
    return tokens, tops


def compare(
    reference: Sequence[int],
    reference_top: Sequence[Dict[int, float]],
    candidate: Sequence[int],
    tie_threshold: float = DEFAULT_TIE_THRESHOLD,
) -> Dict[str, Any]:
    """Classify ``candidate`` against the spec-off ``reference``.

    Returns ``status`` (EXACT / NEAR_TIE / FAIL), the first ``divergence``
    index (None when EXACT), the two tokens there, and ``gap``: the
    reference's logprob of its own token minus that of the candidate's token
    (None when the candidate's token is outside the reference's top-k or
    either run ended first)."""
    out: Dict[str, Any] = {
        "status": EXACT,
        "divergence": None,
        "reference_token": None,
        "spec_token": None,
        "gap": None,
    }
    if list(reference) == list(candidate):
        return out
    i = next(
        (j for j, (a, b) in enumerate(zip(reference, candidate, strict=False)) if a != b),
        min(len(reference), len(candidate)),
    )
    out["divergence"] = i
    out["status"] = FAIL
    if i >= len(reference) or i >= len(candidate):
        return out
    a, b = reference[i], candidate[i]
    out["reference_token"], out["spec_token"] = a, b
    top = reference_top[i]
    if a in top and b in top:
        out["gap"] = top[a] - top[b]
        if out["gap"] <= tie_threshold:
            out["status"] = NEAR_TIE
    return out


def parity(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    top_k: int = DEFAULT_TOP_K,
    tie_threshold: float = DEFAULT_TIE_THRESHOLD,
    step_fn: StepFn = suffix_generate_step,
    report: Callable[[str], None] = _quiet,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
) -> List[Dict[str, Any]]:
    """Compare spec-off and spec-on greedy decoding on each prompt.

    Args:
        model, tokenizer: As returned by ``mlx_lm.load``.
        prompts: Text (chat-templated when the tokenizer has a template) or
            token lists.
        max_tokens: Tokens per run (runs also stop at an EOS token).
        num_draft_tokens: Most tokens drafted per step in spec-on runs
            (fixed-length drafting: the longest draft the trees allow).
        top_k, tie_threshold: The NEAR_TIE rule (see :func:`compare`).
        step_fn: The spec-on generator, called like
            :func:`suffix_generate_step` ``(prompt, model, drafter,
            num_draft_tokens=..., max_tokens=..., prompt_cache=...,
            options=RequestOptions(prompt=...))``; tests inject broken ones.
        report: Called with a line of progress (see :class:`Progress`).
        kv_bits, kv_group_size, quantized_kv_start: KV cache quantization,
            as for ``generate_step``, in every run.

    Returns:
        Per prompt: ``index``, ``prompt`` (a short preview),
        ``prompt_tokens``, ``tokens`` (spec-off length), ``status`` (the
        worse of its runs) and ``runs``: the ``first`` and ``repeat`` spec-on
        runs, each with :func:`compare`'s fields plus ``tokens``,
        ``from_draft`` (tokens that came from accepted drafts), and the
        drafter's ``drafted`` / ``accepted`` counts for that run.
    """
    if top_k < 2:
        raise ValueError(f"top_k must be at least 2, got {top_k}")
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    # Fixed-length drafting: verify every draft the trees offer, whether or
    # not it would pay, so that as many tokens as possible are checked.
    drafter = SuffixDrafter(num_draft_tokens=num_draft_tokens, policy="fixed")
    progress = Progress(report, len(prompts))
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    results = []
    for index, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt)
        progress.begin(index, "prefill")
        cache, rest = prefill(model, ids, **kv)
        progress.end(len(ids) - len(rest))
        progress.begin(index, "spec-off")
        reference, tops = reference_run(
            model, rest, max_tokens, eos, top_k, progress, copy.deepcopy(cache), **kv
        )
        progress.end(len(reference))
        runs = []
        for name in ("first", "repeat"):
            progress.begin(index, name)
            before = drafter.snapshot()
            tokens: List[int] = []
            from_draft = 0
            for tok, _, drafted in step_fn(
                mx.array(rest),
                model,
                drafter,
                num_draft_tokens=num_draft_tokens,
                max_tokens=max_tokens,
                prompt_cache=copy.deepcopy(cache),
                options=RequestOptions(prompt=ids),
                **kv,
            ):
                tokens.append(int(tok))
                from_draft += bool(drafted)
                progress.token(len(tokens), max_tokens)
                if tok in eos:
                    break
            progress.end(len(tokens))
            after = drafter.snapshot()
            runs.append(
                {
                    "run": name,
                    **compare(reference, tops, tokens, tie_threshold),
                    "tokens": len(tokens),
                    "from_draft": from_draft,
                    "drafted": after["drafted"] - before["drafted"],
                    "accepted": after["accepted"] - before["accepted"],
                }
            )
        preview = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
        results.append(
            {
                "index": index,
                "prompt": " ".join(preview.split())[:40],
                "prompt_tokens": len(ids),
                "tokens": len(reference),
                "status": max((r["status"] for r in runs), key=_SEVERITY.__getitem__),
                "runs": runs,
            }
        )
    return results


def format_report(results: Sequence[Dict[str, Any]]) -> str:
    """One line per prompt and run, then a summary line."""
    lines = []
    for res in results:
        for run in res["runs"]:
            line = (
                f"{res['index']:>3} {run['run']:<6} {run['status']:<8} "
                f"tokens {run['tokens']:>4}/{res['tokens']:<4} "
                f"drafted {run['drafted']:>4} accepted {run['accepted']:>4}"
            )
            if run["divergence"] is not None:
                gap = "n/a" if run["gap"] is None else f"{run['gap']:.4f}"
                line += (
                    f"  diverges at {run['divergence']} "
                    f"({run['reference_token']} vs {run['spec_token']}, gap {gap} nats)"
                )
            lines.append(line + f"  {res['prompt']!r}")
    counts = {s: sum(r["status"] == s for r in results) for s in _SEVERITY}
    lines.append(f"{len(results)} prompts: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def exit_status(results: Sequence[Dict[str, Any]], strict: bool = False) -> int:
    """1 if any prompt FAILed (or, with ``strict``, was a NEAR_TIE), else 0."""
    bad = {FAIL, NEAR_TIE} if strict else {FAIL}
    return int(any(r["status"] in bad for r in results))
