"""Integration with mlx-lm's Python API and CLIs: the one place that patches
mlx-lm. Written against mlx-lm 0.32.2; each patch names what it relies on.

- ``mlx_lm.generate.stream_generate`` (and the names bound from it in
  ``mlx_lm`` and ``mlx_lm.server``): a :class:`SuffixDrafter` or ``"suffix"``
  as ``draft_model`` routes to :func:`suffix_generate_step`. Stock
  ``stream_generate`` calls ``speculative_generate_step`` by its module-global
  name for any draft model and drops ``max_kv_size`` and
  ``prompt_progress_callback``; the wrappers carry those past it.
- ``mlx_lm.generate.setup_arg_parser`` / ``generate``: the
  ``mlx_lm.generate --suffix-draft`` flags and the drafting stats printed with
  ``--verbose``.
- ``mlx_lm.server`` (:func:`patch_server`): ``--draft suffix`` and the
  ``--suffix-*`` options, batched verification in the server's
  ``BatchGenerator``, suffix drafting on its single-request path, per-request
  ``num_draft_tokens``/``draft_model``/scope, usage counters, ``GET
  /v1/suffix/stats`` and the cache file. The logic is in
  :mod:`mlx_lm_suffix.serving` and :mod:`mlx_lm_suffix.batch`.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from types import ModuleType
from typing import Any, Optional

import mlx.nn as nn

from .drafter import (
    DEFAULT_MAX_CACHED_REQUESTS,
    DEFAULT_MAX_CACHED_TOKENS,
    DEFAULT_MAX_SPEC_FACTOR,
    DEFAULT_MAX_SPEC_OFFSET,
    DEFAULT_MAX_TREE_DEPTH,
    DEFAULT_MIN_TOKEN_PROB,
    DEFAULT_NUM_DRAFT_TOKENS,
    SuffixDrafter,
)
from .policy.rules import POLICIES

SUFFIX = "suffix"

# The drafter configured by `mlx_lm.generate --suffix-draft`, used by the
# next generate() call that has no draft model of its own.
_cli_drafter: Optional[SuffixDrafter] = None


def drafter_for(model: nn.Module) -> SuffixDrafter:
    """The process-wide drafter of ``model`` (used for ``draft_model="suffix"``)."""
    # Kept on the model (modules are unhashable dicts), alive as long as it.
    drafter = getattr(model, "_mlx_lm_suffix_drafter", None)
    if drafter is None:
        drafter = SuffixDrafter()
        object.__setattr__(model, "_mlx_lm_suffix_drafter", drafter)
    return drafter


def resolve_drafter(draft_model: Any, model: nn.Module) -> Optional[SuffixDrafter]:
    """The drafter meant by a ``draft_model`` argument, or None for a real
    draft model (or none at all)."""
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


def add_drafter_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--suffix-*`` drafter knobs to a CLI parser."""
    group = parser.add_argument_group("suffix decoding (mlx-lm-suffix)")
    group.add_argument(
        "--suffix-max-tree-depth",
        type=int,
        default=DEFAULT_MAX_TREE_DEPTH,
        help="Depth of the suffix trees (longest context matched; a draft is at "
        f"most ~depth*f/(1+f) tokens at spec factor f). Default: {DEFAULT_MAX_TREE_DEPTH}",
    )
    group.add_argument(
        "--suffix-max-cached-requests",
        type=int,
        default=DEFAULT_MAX_CACHED_REQUESTS,
        help="Earlier responses kept in the global suffix cache (0 disables it). "
        f"Default: {DEFAULT_MAX_CACHED_REQUESTS}",
    )
    group.add_argument(
        "--suffix-max-cached-tokens",
        type=int,
        default=DEFAULT_MAX_CACHED_TOKENS,
        help="Total tokens of cached responses kept; oldest evicted first. "
        f"Default: {DEFAULT_MAX_CACHED_TOKENS}",
    )
    group.add_argument(
        "--suffix-max-spec-factor",
        type=float,
        default=DEFAULT_MAX_SPEC_FACTOR,
        help="A suffix trees' draft is at most match_length * factor + offset tokens "
        "(prompt copies are capped by --num-draft-tokens only). "
        f"Default: {DEFAULT_MAX_SPEC_FACTOR}",
    )
    group.add_argument(
        "--suffix-max-spec-offset",
        type=float,
        default=DEFAULT_MAX_SPEC_OFFSET,
        help=f"See --suffix-max-spec-factor. Default: {DEFAULT_MAX_SPEC_OFFSET}",
    )
    group.add_argument(
        "--suffix-min-token-prob",
        type=float,
        default=DEFAULT_MIN_TOKEN_PROB,
        help="Stop a draft at a token whose estimated probability is below "
        f"this. Default: {DEFAULT_MIN_TOKEN_PROB}",
    )
    group.add_argument(
        "--suffix-policy",
        choices=list(POLICIES),
        default="adaptive",
        help="'adaptive': each step's draft length (per batch for concurrent "
        "requests) is chosen from the trees' probabilities and the measured cost "
        "of verifying it; 'fixed': draft as long as the trees allow (up to "
        "--num-draft-tokens). Default: adaptive",
    )


def drafter_from_args(args: argparse.Namespace) -> SuffixDrafter:
    """A drafter configured from parsed ``--suffix-*`` arguments."""
    return SuffixDrafter(
        num_draft_tokens=args.num_draft_tokens,
        max_tree_depth=args.suffix_max_tree_depth,
        max_cached_requests=args.suffix_max_cached_requests,
        max_cached_tokens=args.suffix_max_cached_tokens,
        max_spec_factor=args.suffix_max_spec_factor,
        max_spec_offset=args.suffix_max_spec_offset,
        min_token_prob=args.suffix_min_token_prob,
        policy=args.suffix_policy,
    )


def format_stats(stats: dict) -> str:
    """One line of drafting stats for ``--verbose`` output and logs."""
    return (
        f"Suffix decoding: drafted {stats['drafted']}, accepted {stats['accepted']} "
        f"({100 * stats['acceptance_rate']:.1f}%), {stats['tokens']} tokens in "
        f"{stats['steps']} steps ({stats['tokens_per_step']:.2f} tokens/step)"
    )


def _stats_delta(drafter: SuffixDrafter, before: dict) -> dict:
    now = drafter.stats.as_dict()
    d = {k: now[k] - before[k] for k in ("steps", "drafted", "accepted", "tokens")}
    d["acceptance_rate"] = d["accepted"] / d["drafted"] if d["drafted"] else 0.0
    d["tokens_per_step"] = d["tokens"] / d["steps"] if d["steps"] else 0.0
    return d


def patch_generate(module: ModuleType) -> None:
    """Patch ``mlx_lm.generate`` (mlx-lm 0.32.2: ``stream_generate``,
    ``speculative_generate_step``, ``generate``, ``setup_arg_parser``)."""
    if getattr(module, "_mlx_lm_suffix_patched", False):
        return
    stock_stream_generate = module.stream_generate
    stock_speculative = module.speculative_generate_step
    stock_generate = module.generate
    stock_setup_arg_parser = module.setup_arg_parser

    @functools.wraps(stock_stream_generate)
    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
        drafter = resolve_drafter(draft_model, model)
        if drafter is not None:
            draft_model = drafter
            # Stock stream_generate pops these for draft models.
            kwargs["_suffix_kwargs"] = {
                k: kwargs.pop(k)
                for k in ("max_kv_size", "prompt_progress_callback")
                if k in kwargs
            }
        return stock_stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft_model, **kwargs
        )

    @functools.wraps(stock_speculative)
    def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):
        if isinstance(draft_model, SuffixDrafter):
            # Imported here: mlx_lm_suffix modules import mlx_lm, whose import
            # runs this patch.
            from .loop import suffix_generate_step

            kwargs.update(kwargs.pop("_suffix_kwargs", {}))
            return suffix_generate_step(prompt, model, draft_model, *args, **kwargs)
        return stock_speculative(prompt, model, draft_model, *args, **kwargs)

    @functools.wraps(stock_generate)
    def generate(model, tokenizer, prompt, verbose=False, **kwargs):
        global _cli_drafter
        if kwargs.get("draft_model") is None and _cli_drafter is not None:
            kwargs["draft_model"], _cli_drafter = _cli_drafter, None
        drafter = resolve_drafter(kwargs.get("draft_model"), model)
        before = drafter.stats.as_dict() if drafter is not None else None
        text = stock_generate(model, tokenizer, prompt, verbose=verbose, **kwargs)
        if verbose and drafter is not None:
            print(format_stats(_stats_delta(drafter, before)))
        return text

    @functools.wraps(stock_setup_arg_parser)
    def setup_arg_parser():
        parser = stock_setup_arg_parser()
        stock_default = parser.get_default("num_draft_tokens")
        parser.add_argument(
            "--suffix-draft",
            action="store_true",
            help="Speculative decoding with suffix trees of the prompt and of "
            "earlier outputs (mlx-lm-suffix); no draft model needed. "
            f"--num-draft-tokens defaults to {DEFAULT_NUM_DRAFT_TOKENS} with it.",
        )
        add_drafter_arguments(parser)
        parser.set_defaults(num_draft_tokens=None)
        parse_known_args = parser.parse_known_args

        def parse_known_args_with_suffix(args=None, namespace=None):
            global _cli_drafter
            ns, extras = parse_known_args(args, namespace)
            suffix = ns.suffix_draft
            if ns.num_draft_tokens is None:
                ns.num_draft_tokens = DEFAULT_NUM_DRAFT_TOKENS if suffix else stock_default
            if suffix:
                if ns.draft_model is not None:
                    parser.error("--suffix-draft and --draft-model cannot be combined")
                try:
                    _cli_drafter = drafter_from_args(ns)
                except ValueError as e:
                    parser.error(str(e))
            return ns, extras

        parser.parse_known_args = parse_known_args_with_suffix
        return parser

    module.stream_generate = stream_generate
    module.speculative_generate_step = speculative_generate_step
    module.generate = generate
    module.setup_arg_parser = setup_arg_parser
    module._mlx_lm_suffix_patched = True

    # Names bound before this patch (when mlx_lm_suffix is imported late).
    package = sys.modules.get("mlx_lm")
    if package is not None:
        if getattr(package, "stream_generate", None) is stock_stream_generate:
            package.stream_generate = stream_generate
        if getattr(package, "generate", None) is stock_generate:
            package.generate = generate


class _ServerArgumentParser(argparse.ArgumentParser):
    """``mlx_lm.server``'s parser with ``--draft suffix`` and ``--suffix-*``
    added when it parses (stock ``main()`` adds its own options first)."""

    def parse_known_args(self, args=None, namespace=None):
        from . import serving

        if not getattr(self, "_mlx_lm_suffix_ready", False):
            self._mlx_lm_suffix_ready = True
            serving.add_server_arguments(self)
        ns, extras = super().parse_known_args(args, namespace)
        serving.finalize_server_args(self, ns)
        return ns, extras


class _ServerArgparse(ModuleType):
    """``argparse`` as seen from ``mlx_lm.server``: the real module, except
    that ``ArgumentParser`` is :class:`_ServerArgumentParser`."""

    ArgumentParser = _ServerArgumentParser

    def __getattr__(self, name: str) -> Any:
        return getattr(argparse, name)


def patch_server(module: ModuleType) -> None:
    """Patch ``mlx_lm.server`` for ``--draft suffix`` (mlx-lm 0.32.2).

    Thin wrappers; the logic is in :mod:`mlx_lm_suffix.serving` (state, CLI,
    requests, persistence) and :mod:`mlx_lm_suffix.batch` (batched
    verification). Each wrapper passes straight through to stock unless the
    server was started with ``--draft suffix``, except that a request for
    ``draft_model: "suffix"`` on a stock server gets HTTP 400 instead of an
    attempt to load a model called "suffix".
    """
    if getattr(module, "_mlx_lm_suffix_patched", False):
        return
    from . import serving

    generate_module = sys.modules["mlx_lm.generate"]
    patch_generate(generate_module)
    stock_stream_generate = generate_module.stream_generate  # patched: takes SuffixDrafter

    # main() builds `argparse.ArgumentParser(...)` by the module-global name
    # `argparse` and calls `parser.parse_args()` once all options are added.
    module.argparse = _ServerArgparse("argparse")

    # run(host, port, model_provider): start-up checks of the cache file,
    # background saver, SIGTERM handler and final save around stock `run`.
    stock_run = module.run

    @functools.wraps(stock_run)
    def run(host, port, model_provider, *args, **kwargs):
        state = serving.state_for(model_provider.cli_args)
        if state is None:
            return stock_run(host, port, model_provider, *args, **kwargs)
        serving.prepare_run(state)
        with state.lifetime():
            return stock_run(host, port, model_provider, *args, **kwargs)

    module.run = run

    # main(): parses the CLI and calls run(...) until Ctrl-C (or SIGTERM,
    # see run above). After a suffix server's orderly shutdown, exit at once.
    stock_main = module.main

    @functools.wraps(stock_main)
    def main():
        stock_main()
        serving.exit_after_shutdown()

    module.main = main

    # ModelProvider._load(model_path, adapter_path, draft_model_path) loads
    # and sets self.model/tokenizer/model_key: register the model's drafter.
    provider_cls = module.ModelProvider
    stock_load = provider_cls._load

    @functools.wraps(stock_load)
    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        stock_load(self, model_path, adapter_path, draft_model_path)
        serving.on_model_loaded(self, model_path, adapter_path)

    provider_cls._load = _load

    # ResponseGenerator._generate creates `BatchGenerator(model, ...)` by the
    # module-global name: a suffix batch generator for suffix servers' models.
    stock_batch_generator = module.BatchGenerator

    def BatchGenerator(model, **kwargs):
        return serving.make_batch_generator(stock_batch_generator, model, **kwargs)

    module.BatchGenerator = BatchGenerator

    # ResponseGenerator._tokenize(tokenizer, request, args) -> (prompt, ...)
    # runs, in the generation thread, right before the request is inserted
    # into the batch (insert_segments) or served by _serve_single.
    rg_cls = module.ResponseGenerator
    stock_tokenize = rg_cls._tokenize

    @functools.wraps(stock_tokenize)
    def _tokenize(self, tokenizer, request, args):
        result = stock_tokenize(self, tokenizer, request, args)
        serving.note_prompt(self.model_provider.cli_args, request, result[0])
        return result

    rg_cls._tokenize = _tokenize

    # ResponseGenerator._next_request(timeout) -> (rqueue, request, args) or
    # None, and _run_generate() (the generation thread's body, which stock
    # ends at the first exception): fail the requests in flight and restart.
    stock_next_request = rg_cls._next_request

    @functools.wraps(stock_next_request)
    def _next_request(self, timeout=None):
        item = stock_next_request(self, timeout)
        serving.note_request_taken(self, item)
        return item

    rg_cls._next_request = _next_request
    stock_run_generate = rg_cls._run_generate

    @functools.wraps(stock_run_generate)
    def _run_generate(self):
        serving.run_generation(self, stock_run_generate)

    rg_cls._run_generate = _run_generate

    # _serve_single calls the module-global `stream_generate(model=...,
    # tokenizer=..., prompt=rest, ..., draft_model=provider.draft_model,
    # num_draft_tokens=...)`.
    @functools.wraps(stock_stream_generate)
    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
        return serving.single_stream_generate(
            stock_stream_generate, model, tokenizer, prompt, max_tokens, draft_model, kwargs
        )

    module.stream_generate = stream_generate

    # APIHandler.validate_model_parameters(): called by do_POST once the body
    # fields are attributes; a ValueError becomes HTTP 400 with its message.
    handler_cls = module.APIHandler
    stock_validate = handler_cls.validate_model_parameters

    @functools.wraps(stock_validate)
    def validate_model_parameters(self):
        self._mlx_lm_suffix = None
        stock_validate(self)
        self._mlx_lm_suffix = serving.request_info(self)

    handler_cls.validate_model_parameters = validate_model_parameters

    # APIHandler.handle_completion(request, stop_words): the CompletionRequest
    # travels to the generation thread; it carries the request's suffix info.
    stock_handle_completion = handler_cls.handle_completion

    @functools.wraps(stock_handle_completion)
    def handle_completion(self, request, stop_words):
        serving.attach_request_info(request, getattr(self, "_mlx_lm_suffix", None))
        serving.mark_generating(self)
        return stock_handle_completion(self, request, stop_words)

    handler_cls.handle_completion = handle_completion

    # APIHandler.generate_response(...) / completion_usage_response(...)
    # return the response dicts; add the draft counters to their "usage".
    for name in ("generate_response", "completion_usage_response"):
        stock_method = getattr(handler_cls, name)

        def method(self, *args, _stock=stock_method, **kwargs):
            response = _stock(self, *args, **kwargs)
            return serving.add_usage(response, getattr(self, "_mlx_lm_suffix", None))

        setattr(handler_cls, name, functools.wraps(stock_method)(method))

    # APIHandler.do_POST(): on suffix servers, an exception (a body that is
    # not UTF-8, a failed generation) is answered instead of dropping the
    # connection without a response.
    stock_do_post = handler_cls.do_POST

    @functools.wraps(stock_do_post)
    def do_POST(self):
        if serving.state_for(self.response_generator.cli_args) is None:
            return stock_do_post(self)
        serving.mark_generating(self, False)
        try:
            stock_do_post(self)
        except Exception as e:
            serving.answer_error(self, e)

    handler_cls.do_POST = do_POST

    # APIHandler.do_GET(): GET /v1/suffix/stats on suffix servers.
    stock_do_get = handler_cls.do_GET

    @functools.wraps(stock_do_get)
    def do_GET(self):
        state = serving.state_for(self.response_generator.cli_args)
        if state is None or not serving.is_stats_path(self.path):
            return stock_do_get(self)
        body = json.dumps(state.stats_payload()).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    handler_cls.do_GET = do_GET

    module._mlx_lm_suffix_patched = True
