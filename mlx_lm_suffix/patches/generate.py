"""The patch of ``mlx_lm.generate`` (mlx-lm 0.32.2).

- ``stream_generate`` / ``speculative_generate_step``: a :class:`SuffixDrafter`
  or ``"suffix"`` as ``draft_model`` routes to
  :func:`~mlx_lm_suffix.loop.suffix_generate_step`.
- ``setup_arg_parser`` / ``generate``: ``mlx_lm.generate --suffix-draft`` and
  the drafting stats printed with ``--verbose``.

:func:`patch` and :func:`refuse` build the replacements and change nothing;
:func:`mlx_lm_suffix.patches.apply` sets one or the other.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
from types import ModuleType
from typing import Any, Dict, List, Optional, Tuple

from ..drafter import SuffixDrafter
from . import compat
from .args import SUFFIX, add_generate_arguments, finalize_generate_args, refuse_suffix_options

# (object, attribute, new value)
Replacements = List[Tuple[Any, str, Any]]

# The drafter configured by `mlx_lm.generate --suffix-draft`, used by the
# next generate() call that has no draft model of its own.
_cli_drafter: Optional[SuffixDrafter] = None


def drafter_for(model: Any) -> SuffixDrafter:
    """The process-wide drafter of ``model`` (used for ``draft_model="suffix"``)."""
    # Kept on the model (modules are unhashable dicts), alive as long as it.
    drafter = getattr(model, "_mlx_lm_suffix_drafter", None)
    if drafter is None:
        drafter = SuffixDrafter()
        object.__setattr__(model, "_mlx_lm_suffix_drafter", drafter)
    return drafter


def resolve_drafter(draft_model: Any, model: Any) -> Optional[SuffixDrafter]:
    """The drafter meant by a ``draft_model`` argument, or None for a real
    draft model (or none at all). Raises ``ValueError`` for another string."""
    if isinstance(draft_model, SuffixDrafter):
        return draft_model
    if isinstance(draft_model, str):
        if draft_model != SUFFIX:
            raise ValueError(
                f"Unknown draft_model {draft_model!r}: pass a model, a "
                f"SuffixDrafter, or {SUFFIX!r}."
            )
        return drafter_for(model)
    return None


def format_stats(stats: dict) -> str:
    """One line of drafting stats for ``--verbose`` output and logs."""
    line = (
        f"Suffix decoding: drafted {stats['drafted']}, accepted {stats['accepted']} "
        f"({100 * stats['acceptance_rate']:.1f}%), {stats['tokens']} tokens in "
        f"{stats['steps']} steps ({stats['tokens_per_step']:.2f} tokens/step)"
    )
    if stats.get("refused"):
        line += f"; {stats['refused']} drafts not verified: they would not pay"
    if stats.get("steps"):
        line += f"; drafting took {stats['host_us_per_step']:.0f} us/step of host time"
    return line


def patch(module: ModuleType) -> Replacements:
    """The suffix-decoding replacements for ``mlx_lm.generate``."""
    stock_stream_generate = module.stream_generate
    stock_speculative = module.speculative_generate_step
    stock_generate = module.generate
    stock_setup_arg_parser = module.setup_arg_parser

    # mlx-lm 0.32.2 stream_generate(model, tokenizer, prompt, max_tokens, draft_model, ...)
    # calls speculative_generate_step by its module-global name for any draft
    # model, having popped max_kv_size and prompt_progress_callback.
    @functools.wraps(stock_stream_generate)
    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
        drafter = resolve_drafter(draft_model, model)
        if drafter is not None:
            draft_model = drafter
            kwargs["_suffix_kwargs"] = {
                k: kwargs.pop(k) for k in ("max_kv_size", "prompt_progress_callback") if k in kwargs
            }
        return stock_stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft_model, **kwargs
        )

    # mlx-lm 0.32.2 speculative_generate_step(prompt, model, draft_model, stream, **kwargs)
    # yields (token, logprobs, from_draft), as suffix_generate_step does.
    @functools.wraps(stock_speculative)
    def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
        if not isinstance(draft_model, SuffixDrafter):
            return stock_speculative(prompt, model, draft_model, *args, **kwargs)
        # Imported here: loop imports mlx_lm, whose import applies this patch.
        from ..loop import suffix_generate_step

        kwargs.update(kwargs.pop("_suffix_kwargs", {}))
        return suffix_generate_step(prompt, model, draft_model, *args, **kwargs)

    # mlx-lm 0.32.2 generate(model, tokenizer, prompt, verbose, **kwargs) calls
    # stream_generate by its module-global name; main() calls generate.
    @functools.wraps(stock_generate)
    def generate(model, tokenizer, prompt, verbose=False, **kwargs):
        global _cli_drafter
        if kwargs.get("draft_model") is None and _cli_drafter is not None:
            kwargs["draft_model"], _cli_drafter = _cli_drafter, None
        drafter = resolve_drafter(kwargs.get("draft_model"), model)
        before = drafter.stats.copy() if drafter is not None else None
        text = stock_generate(model, tokenizer, prompt, verbose=verbose, **kwargs)
        if verbose and drafter is not None:
            print(format_stats(drafter.stats.delta(before).as_dict()))
        return text

    # mlx-lm 0.32.2 setup_arg_parser() returns main()'s parser, which main() parses with
    # parse_args() (which calls parse_known_args).
    @functools.wraps(stock_setup_arg_parser)
    def setup_arg_parser():
        parser = stock_setup_arg_parser()
        add_generate_arguments(parser)
        parse_known_args = parser.parse_known_args

        def parse_known_args_with_suffix(args=None, namespace=None):
            global _cli_drafter
            ns, extras = parse_known_args(args, namespace)
            drafter = finalize_generate_args(parser, ns)
            if drafter is not None:
                _cli_drafter = drafter
            return ns, extras

        parser.parse_known_args = parse_known_args_with_suffix
        return parser

    return _with_package_names(
        module,
        {
            "stream_generate": stream_generate,
            "speculative_generate_step": speculative_generate_step,
            "generate": generate,
            "setup_arg_parser": setup_arg_parser,
        },
    )


def refuse(module: ModuleType, missing: List[str]) -> Replacements:
    """For an mlx-lm left stock: replacements that answer suffix drafting
    (``--suffix-draft``, a :class:`SuffixDrafter` or ``"suffix"`` as draft
    model) with a one-line error naming the supported mlx-lm versions, and
    pass everything else to stock untouched (where those targets exist)."""
    new = {}
    stock_stream_generate = getattr(module, "stream_generate", None)
    if callable(stock_stream_generate):
        new["stream_generate"] = _refusing_stream_generate(stock_stream_generate, missing)
    stock_setup_arg_parser = getattr(module, "setup_arg_parser", None)
    if callable(stock_setup_arg_parser):
        new["setup_arg_parser"] = _refusing_setup_arg_parser(stock_setup_arg_parser, missing)
    return _with_package_names(module, new)


def _refusing_stream_generate(stock: Any, missing: List[str]) -> Any:
    @functools.wraps(stock)
    def stream_generate(*args, **kwargs):
        try:
            draft_model = (
                inspect.signature(stock).bind(*args, **kwargs).arguments.get("draft_model")
            )
        except (TypeError, ValueError):  # stock raises for its own arguments
            draft_model = kwargs.get("draft_model")
        if isinstance(draft_model, SuffixDrafter):
            what = "a SuffixDrafter as draft_model"
        elif isinstance(draft_model, str) and draft_model == SUFFIX:
            what = f"draft_model={SUFFIX!r}"
        else:
            return stock(*args, **kwargs)
        raise compat.IncompatibleMlxLm(compat.refusal(what, missing))

    return stream_generate


def _refusing_setup_arg_parser(stock: Any, missing: List[str]) -> Any:
    @functools.wraps(stock)
    def setup_arg_parser(*args, **kwargs):
        parser = stock(*args, **kwargs)
        if not isinstance(parser, argparse.ArgumentParser):
            return parser
        parse_known_args = parser.parse_known_args

        def parse_known_args_refusing_suffix(args=None, namespace=None):
            ns, extras = parse_known_args(args, namespace)
            refuse_suffix_options(parser, ns, extras, lambda o: compat.refusal(o, missing))
            return ns, extras

        parser.parse_known_args = parse_known_args_refusing_suffix
        return parser

    return setup_arg_parser


def _with_package_names(module: ModuleType, new: Dict[str, Any]) -> Replacements:
    """``module``'s replacements, plus those of the names that ``mlx_lm``
    bound to the same stock objects (``from .generate import ...``) before
    the patch (when mlx_lm_suffix is installed late)."""
    out = [(module, name, value) for name, value in new.items()]
    package = sys.modules.get("mlx_lm")
    for name, value in new.items():
        if package is not None and getattr(package, name, None) is getattr(module, name):
            out.append((package, name, value))
    return out
