"""The patch of ``mlx_lm.generate`` (mlx-lm 0.32.2), as data: :data:`PATCHES`
(and :data:`REFUSALS` for an mlx-lm left stock), applied by
:func:`mlx_lm_suffix.patches.apply`.

- ``stream_generate`` / ``speculative_generate_step``: a :class:`SuffixDrafter`
  or ``"suffix"`` as ``draft_model`` routes to
  :func:`~mlx_lm_suffix.loop.suffix_generate_step`.
- ``setup_arg_parser`` / ``generate``: ``mlx_lm.generate --suffix-draft`` and
  the drafting stats printed with ``--verbose``.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..drafter import SuffixDrafter
from ..internals import Attached
from ..sources.draft_model import DraftModel
from . import compat
from .args import SUFFIX, add_generate_arguments, finalize_generate_args, refuse_suffix_options
from .compat import Patch, original

# The drafter configured by `mlx_lm.generate --suffix-draft`, used by the
# next generate() call that has no draft model of its own.
_cli_drafter: Optional[SuffixDrafter] = None
# The process-wide drafter of each model (draft_model="suffix").
_drafters: Attached[SuffixDrafter] = Attached()


def drafter_for(model: Any) -> SuffixDrafter:
    """The process-wide drafter of ``model`` (used for ``draft_model="suffix"``),
    alive as long as the model."""
    drafter = _drafters.get(model)
    if drafter is None:
        drafter = SuffixDrafter()
        _drafters.set(model, drafter)
    return drafter


@dataclass
class RequestDrafter:
    """A request's drafter as mlx-lm 0.32.2's ``stream_generate`` passes
    its ``draft_model`` on to ``speculative_generate_step`` (unchanged):
    the :class:`SuffixDrafter`, the request's
    :class:`~mlx_lm_suffix.speculation.RequestOptions`, and the arguments
    that ``stream_generate`` drops for a draft model and the suffix loop
    takes (``max_kv_size``, ``prompt_progress_callback``)."""

    drafter: SuffixDrafter
    options: Any = None
    max_kv_size: Optional[int] = None
    prompt_progress_callback: Optional[Callable[[int, int], None]] = None


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
    def by_source(counts: dict) -> str:
        names = {"tree": "trees", "copy": "prompt copy", "model": "draft model"}
        parts = [f"{names.get(k, k)} {v}" for k, v in counts.items() if v]
        return f" ({', '.join(parts)})" if len(parts) > 1 or "model" in counts else ""

    line = (
        f"Suffix decoding: drafted {stats['drafted']}"
        f"{by_source(stats.get('source_drafted', {}))}, accepted {stats['accepted']}"
        f"{by_source(stats.get('source_accepted', {}))} "
        f"({100 * stats['acceptance_rate']:.1f}%), {stats['tokens']} tokens in "
        f"{stats['steps']} steps ({stats['tokens_per_step']:.2f} tokens/step)"
    )
    if stats.get("refused"):
        line += f"; {stats['refused']} drafts not verified: they would not pay"
    if stats.get("steps"):
        line += f"; drafting took {stats['host_us_per_step']:.0f} us/step of host time"
    if stats.get("waits"):
        line += (f"; {stats['waits']} reads of a forward's result, the device idle "
                 f"{stats['idle_us_per_wait']:.0f} us after each")
    return line


# mlx-lm 0.32.2 stream_generate(model, tokenizer, prompt, max_tokens, draft_model, ...)
# calls speculative_generate_step by its module-global name for any draft
# model, passing draft_model on unchanged and dropping max_kv_size and
# prompt_progress_callback: a suffix drafter travels as a RequestDrafter
# with them. ``draft_options``: the request's RequestOptions (the server's).
def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
    drafter = resolve_drafter(draft_model, model)
    if drafter is not None:
        draft_model = RequestDrafter(drafter, kwargs.pop("draft_options", None),
                                     kwargs.pop("max_kv_size", None),
                                     kwargs.pop("prompt_progress_callback", None))
    return original(stream_generate)(
        model, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft_model, **kwargs
    )


# mlx-lm 0.32.2 speculative_generate_step(prompt, model, draft_model, stream, **kwargs)
# yields (token, logprobs, from_draft), as suffix_generate_step does.
def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
    if isinstance(draft_model, SuffixDrafter):
        draft_model = RequestDrafter(draft_model)
    if not isinstance(draft_model, RequestDrafter):
        return original(speculative_generate_step)(prompt, model, draft_model, *args, **kwargs)
    # Imported here: loop imports mlx_lm, whose import applies this patch.
    from ..loop import suffix_generate_step

    d = draft_model
    kwargs.setdefault("max_kv_size", d.max_kv_size)
    kwargs.setdefault("prompt_progress_callback", d.prompt_progress_callback)
    return suffix_generate_step(prompt, model, d.drafter, *args, options=d.options, **kwargs)


# mlx-lm 0.32.2 generate(model, tokenizer, prompt, verbose, **kwargs) calls
# stream_generate by its module-global name; main() calls generate.
def generate(model, tokenizer, prompt, verbose=False, **kwargs):
    global _cli_drafter
    if _cli_drafter is not None:
        # With --draft-model, main() passes the draft model it loaded (having
        # checked its tokenizer's vocabulary against the target's).
        draft = kwargs.get("draft_model")
        if draft is not None and not isinstance(draft, (str, SuffixDrafter)):
            _cli_drafter.draft_model = DraftModel(draft)
        kwargs["draft_model"], _cli_drafter = _cli_drafter, None
    drafter = resolve_drafter(kwargs.get("draft_model"), model)
    before = drafter.stats.copy() if drafter is not None else None
    text = original(generate)(model, tokenizer, prompt, verbose=verbose, **kwargs)
    if verbose and drafter is not None:
        print(format_stats(drafter.stats.delta(before).as_dict()))
    return text


# mlx-lm 0.32.2 setup_arg_parser() returns main()'s parser, which main() parses with
# parse_args() (which calls parse_known_args).
def setup_arg_parser():
    parser = original(setup_arg_parser)()
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


PATCHES = [
    Patch("mlx_lm.generate", "stream_generate", stream_generate),
    Patch("mlx_lm.generate", "speculative_generate_step", speculative_generate_step),
    Patch("mlx_lm.generate", "generate", generate),
    Patch("mlx_lm.generate", "setup_arg_parser", setup_arg_parser),
]


# ------------------------------------------------- mlx-lm left stock
def refusing_stream_generate(*args, **kwargs):
    """Stock, except that suffix drafting (a :class:`SuffixDrafter` or
    ``"suffix"`` as draft model) gets a one-line error naming the supported
    mlx-lm versions."""
    stock = original(refusing_stream_generate)
    try:
        draft_model = inspect.signature(stock).bind(*args, **kwargs).arguments.get("draft_model")
    except (TypeError, ValueError):  # stock raises for its own arguments
        draft_model = kwargs.get("draft_model")
    if isinstance(draft_model, SuffixDrafter):
        what = "a SuffixDrafter as draft_model"
    elif isinstance(draft_model, str) and draft_model == SUFFIX:
        what = f"draft_model={SUFFIX!r}"
    else:
        return stock(*args, **kwargs)
    raise compat.IncompatibleMlxLm(compat.refusal(what, compat.MISSING))


def refusing_setup_arg_parser(*args, **kwargs):
    """Stock's parser, whose ``--suffix-*`` options get a one-line error."""
    parser = original(refusing_setup_arg_parser)(*args, **kwargs)
    if not isinstance(parser, argparse.ArgumentParser):
        return parser
    parse_known_args = parser.parse_known_args

    def parse_known_args_refusing_suffix(args=None, namespace=None):
        ns, extras = parse_known_args(args, namespace)
        refuse_suffix_options(parser, ns, extras, lambda o: compat.refusal(o, compat.MISSING))
        return ns, extras

    parser.parse_known_args = parse_known_args_refusing_suffix
    return parser


REFUSALS = [
    Patch("mlx_lm.generate", "stream_generate", refusing_stream_generate, required=False),
    Patch("mlx_lm.generate", "setup_arg_parser", refusing_setup_arg_parser, required=False),
]
