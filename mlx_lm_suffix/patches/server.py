"""The patch of ``mlx_lm.server`` (mlx-lm 0.32.2) for ``--draft suffix``.

Thin wrappers: the logic is in :mod:`mlx_lm_suffix.patches.serving` (state,
requests, failures), :mod:`mlx_lm_suffix.persistence` (the cache file) and
:mod:`mlx_lm_suffix.batch` (batched verification). Each wrapper passes
straight through to stock unless the server was started with ``--draft
suffix``, except that a request for ``draft_model: "suffix"`` on a stock
server gets HTTP 400 instead of an attempt to load a model called "suffix".

:func:`patch` and :func:`refuse` build the replacements and change nothing;
:func:`mlx_lm_suffix.patches.apply` sets one or the other.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from types import ModuleType
from typing import Any, List, Tuple

from . import compat, serving
from .args import add_server_arguments, finalize_server_args, refuse_suffix_options

# (object, attribute, new value)
Replacements = List[Tuple[Any, str, Any]]


class _SuffixServerParser(argparse.ArgumentParser):
    """``mlx_lm.server``'s parser with ``--draft suffix`` and ``--suffix-*``
    added when it parses (stock ``main()`` adds its own options first)."""

    def parse_known_args(self, args=None, namespace=None):
        if not getattr(self, "_mlx_lm_suffix_ready", False):
            self._mlx_lm_suffix_ready = True
            add_server_arguments(self)
        ns, extras = super().parse_known_args(args, namespace)
        finalize_server_args(self, ns)
        return ns, extras


def _argparse_with(parser_cls: type) -> ModuleType:
    """``argparse`` as seen from ``mlx_lm.server``: the real module, except
    that ``ArgumentParser`` is ``parser_cls``."""
    proxy = ModuleType("argparse")
    proxy.__dict__.update(vars(argparse))
    proxy.ArgumentParser = parser_cls
    return proxy


def patch(module: ModuleType) -> Replacements:
    """The suffix-decoding replacements for ``mlx_lm.server``."""
    generate_module = sys.modules["mlx_lm.generate"]
    provider_cls = module.ModelProvider
    rg_cls = module.ResponseGenerator
    handler_cls = module.APIHandler
    stock_run = module.run
    stock_main = module.main
    stock_load = provider_cls._load
    stock_batch_generator = module.BatchGenerator
    stock_tokenize = rg_cls._tokenize
    stock_next_request = rg_cls._next_request
    stock_generate = rg_cls._generate
    stock_rg_generate = rg_cls.generate
    stock_stream_generate = module.stream_generate
    stock_validate = handler_cls.validate_model_parameters
    stock_handle_completion = handler_cls.handle_completion
    stock_do_post = handler_cls.do_POST
    stock_do_get = handler_cls.do_GET

    # mlx-lm 0.32.2 run(host, port, model_provider, ...): start-up check of the cache file,
    # background saver, SIGTERM handler and final save around stock `run`.
    @functools.wraps(stock_run)
    def run(host, port, model_provider, *args, **kwargs):
        state = serving.state_for(model_provider.cli_args)
        if state is None:
            return stock_run(host, port, model_provider, *args, **kwargs)
        serving.prepare_run(state)
        with state.lifetime():
            return stock_run(host, port, model_provider, *args, **kwargs)

    # mlx-lm 0.32.2 main(): parses the CLI and calls run(...) until Ctrl-C (or SIGTERM,
    # see run above). After a suffix server's orderly shutdown, exit at once.
    @functools.wraps(stock_main)
    def main():
        stock_main()
        serving.exit_after_shutdown()

    # mlx-lm 0.32.2 ModelProvider._load(model_path, adapter_path, draft_model_path) loads
    # and sets self.model/tokenizer/model_key: register the model's drafter.
    @functools.wraps(stock_load)
    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        stock_load(self, model_path, adapter_path, draft_model_path)
        serving.on_model_loaded(self, model_path)

    # mlx-lm 0.32.2 ResponseGenerator._generate creates `BatchGenerator(model, ...)` by the
    # module-global name: a suffix batch generator for suffix servers' models.
    def BatchGenerator(model, **kwargs):
        return serving.make_batch_generator(stock_batch_generator, model, **kwargs)

    # mlx-lm 0.32.2 ResponseGenerator._tokenize(tokenizer, request, args) -> (prompt, ...)
    # runs, in the generation thread, right before the request is inserted
    # into the batch (insert_segments) or served by _serve_single, with the
    # request's model loaded; what it raises fails that request alone.
    @functools.wraps(stock_tokenize)
    def _tokenize(self, tokenizer, request, args):
        serving.check_for_model(self.model_provider, args)
        result = stock_tokenize(self, tokenizer, request, args)
        serving.note_prompt(self.model_provider.cli_args, request, result[0])
        return result

    # mlx-lm 0.32.2 ResponseGenerator._next_request(timeout) -> (rqueue, request, args) or
    # None, and _generate() (the generation loop, which stock _run_generate
    # runs once, ending the thread at its first exception): fail the requests
    # in flight and run the loop again.
    @functools.wraps(stock_next_request)
    def _next_request(self, timeout=None):
        item = stock_next_request(self, timeout)
        serving.note_request_taken(self, item)
        return item

    @functools.wraps(stock_generate)
    def _generate(self):
        serving.generate_restarting(self, stock_generate)

    # mlx-lm 0.32.2 ResponseGenerator.generate(request, generation_args, progress_callback)
    # raises what the generation thread put on the request's queue before its
    # first response, and APIHandler.handle_completion answers any Exception
    # from it with HTTP 404: a request the generation thread refused
    # (serving.RequestRefused) passes it as serving.Refused to do_POST (400).
    @functools.wraps(stock_rg_generate)
    def generate(self, request, generation_args, progress_callback=None):
        try:
            return stock_rg_generate(self, request, generation_args, progress_callback)
        except serving.RequestRefused as e:
            raise serving.Refused(e) from None

    # mlx-lm 0.32.2 ResponseGenerator._serve_single calls the module-global
    # `stream_generate(model=..., tokenizer=..., prompt=rest, ...,
    # draft_model=provider.draft_model, num_draft_tokens=...)`; the patched
    # mlx_lm.generate.stream_generate takes a SuffixDrafter.
    @functools.wraps(stock_stream_generate)
    def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
        return serving.single_stream_generate(
            generate_module.stream_generate,
            model,
            tokenizer,
            prompt,
            max_tokens,
            draft_model,
            kwargs,
        )

    # mlx-lm 0.32.2 APIHandler.validate_model_parameters(): called by do_POST once the body
    # fields are attributes; a ValueError becomes HTTP 400 with its message.
    @functools.wraps(stock_validate)
    def validate_model_parameters(self):
        self._mlx_lm_suffix = None
        stock_validate(self)
        self._mlx_lm_suffix = serving.request_info(self)

    # mlx-lm 0.32.2 APIHandler.handle_completion(request, stop_words): the CompletionRequest
    # travels to the generation thread; it carries the request's suffix info.
    @functools.wraps(stock_handle_completion)
    def handle_completion(self, request, stop_words):
        info = getattr(self, "_mlx_lm_suffix", None)
        if info is None:
            return stock_handle_completion(self, request, stop_words)
        # It reads self.stream_options["include_usage"] once the stream is
        # done (a KeyError there: no [DONE]).
        self.stream_options = serving.stream_options_with_usage(self.stream_options)
        serving.attach_request_info(request, info)
        serving.mark_generating(self)
        return stock_handle_completion(self, request, stop_words)

    # mlx-lm 0.32.2 APIHandler.generate_response(...) / completion_usage_response(...)
    # return the response dicts; add the draft counters to their "usage".
    def with_usage(stock_method):
        @functools.wraps(stock_method)
        def method(self, *args, **kwargs):
            response = stock_method(self, *args, **kwargs)
            return serving.add_usage(response, getattr(self, "_mlx_lm_suffix", None))

        return method

    # mlx-lm 0.32.2 APIHandler.do_POST(): on suffix servers, an exception (a body that is
    # not UTF-8, a failed generation) is answered instead of dropping the
    # connection without a response.
    @functools.wraps(stock_do_post)
    def do_POST(self):
        if serving.state_for(self.response_generator.cli_args) is None:
            try:
                return stock_do_post(self)
            except serving.DraftRefused as e:
                # mlx-lm 0.32.0 lets a ValueError of validate_model_parameters
                # close the connection; 0.32.1 answers 400 itself.
                return serving.answer_error(self, e)
        serving.mark_generating(self, False)
        try:
            stock_do_post(self)
        except serving.Refused as e:
            serving.mark_generating(self, False)
            serving.answer_error(self, e.args[0])
        except Exception as e:
            serving.answer_error(self, e)

    # mlx-lm 0.32.2 APIHandler.do_GET(): GET /v1/suffix/stats on suffix servers.
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

    return [
        # mlx-lm 0.32.2 main() builds `argparse.ArgumentParser(...)` by the module-global
        # name `argparse` and calls `parser.parse_args()` once all options
        # are added.
        (module, "argparse", _argparse_with(_SuffixServerParser)),
        (module, "run", run),
        (module, "main", main),
        (module, "BatchGenerator", BatchGenerator),
        (module, "stream_generate", stream_generate),
        (provider_cls, "_load", _load),
        (rg_cls, "_tokenize", _tokenize),
        (rg_cls, "_next_request", _next_request),
        (rg_cls, "_generate", _generate),
        (rg_cls, "generate", generate),
        (handler_cls, "validate_model_parameters", validate_model_parameters),
        (handler_cls, "handle_completion", handle_completion),
        (handler_cls, "generate_response", with_usage(handler_cls.generate_response)),
        (
            handler_cls,
            "completion_usage_response",
            with_usage(handler_cls.completion_usage_response),
        ),
        (handler_cls, "do_POST", do_POST),
        (handler_cls, "do_GET", do_GET),
    ]


def refuse(module: ModuleType, missing: List[str]) -> Replacements:
    """For an mlx-lm left stock: ``mlx_lm.server``'s parser answers ``--draft
    suffix`` (or ``--draft-model suffix``, as stock reads it) and any
    ``--suffix-*`` option with a one-line error, exit status 2; everything
    else is stock."""

    class RefusingParser(argparse.ArgumentParser):
        def parse_known_args(self, args=None, namespace=None):
            ns, extras = super().parse_known_args(args, namespace)
            refuse_suffix_options(
                self, ns, extras, lambda o: compat.refusal(o, missing), server=True
            )
            return ns, extras

    return [(module, "argparse", _argparse_with(RefusingParser))]
