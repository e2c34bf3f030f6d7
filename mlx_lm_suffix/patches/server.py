"""The patch of ``mlx_lm.server`` (mlx-lm 0.32.2) for ``--draft suffix``, as
data: :data:`PATCHES` (and :data:`REFUSALS` for an mlx-lm left stock),
applied by :func:`mlx_lm_suffix.patches.apply`.

Thin wrappers: the logic is in :mod:`mlx_lm_suffix.patches.serving` (state,
requests, failures), :mod:`mlx_lm_suffix.persistence` (the cache file) and
:mod:`mlx_lm_suffix.batch` (batched verification). Each wrapper passes
straight through to stock unless the server was started with ``--draft
suffix``, except that a request for ``draft_model: "suffix"`` on a stock
server gets HTTP 400 instead of an attempt to load a model called "suffix".
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from http.server import ThreadingHTTPServer
from types import ModuleType

from .. import internals
from . import compat, isolation, serving, validation
from .args import add_server_arguments, finalize_server_args, refuse_suffix_options
from .compat import Patch, original


class _SuffixServerParser(argparse.ArgumentParser):
    """``mlx_lm.server``'s parser with ``--draft suffix`` and ``--suffix-*``
    added when it parses (stock ``main()`` adds its own options first)."""

    suffix_options = False  # (added yet)

    def parse_known_args(self, args=None, namespace=None):
        if not self.suffix_options:
            self.suffix_options = True
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


# mlx-lm 0.32.2 run(host, port, model_provider, ...): start-up check of the cache file,
# background saver, SIGTERM handler and final save around stock `run`.
def run(host, port, model_provider, *args, **kwargs):
    state = serving.state_for(model_provider.cli_args)
    if state is None:
        return original(run)(host, port, model_provider, *args, **kwargs)
    serving.prepare_run(state)
    with state.lifetime():
        return original(run)(host, port, model_provider, *args, **kwargs)


class ListeningServer(ThreadingHTTPServer):
    """Stock's HTTP server class, listening with the system's largest
    backlog: socketserver's 5 leaves connections beyond the sixth that arrive
    at once unaccepted (reset, or delayed by a SYN retransmit of a second)."""

    request_queue_size = socket.SOMAXCONN


# mlx-lm 0.32.2 _run_http_server(host, port, response_generator, server_class,
# handler_class) builds and serves the HTTP server (stock run() passes it no
# server_class): a suffix server's listens with ListeningServer's backlog.
def _run_http_server(host, port, response_generator, *args, **kwargs):
    if (not args and "server_class" not in kwargs
            and serving.state_for(response_generator.model_provider.cli_args) is not None):
        kwargs["server_class"] = ListeningServer
    return original(_run_http_server)(host, port, response_generator, *args, **kwargs)


# mlx-lm 0.32.2 main(): parses the CLI and calls run(...) until Ctrl-C (or SIGTERM,
# see run above). After a suffix server's orderly shutdown, exit at once.
def main():
    original(main)()
    serving.exit_after_shutdown()


# mlx-lm 0.32.2 ModelProvider._load(model_path, adapter_path, draft_model_path) loads
# and sets self.model/tokenizer/draft_model/model_key/is_batchable: register
# the model's drafter (with a draft model: serve the pair, batched).
def _load(self, model_path, adapter_path=None, draft_model_path=None):
    original(_load)(self, model_path, adapter_path, draft_model_path)
    serving.on_model_loaded(self, model_path, draft_model_path)


# mlx-lm 0.32.2 ResponseGenerator._generate creates `BatchGenerator(model, ...)` by the
# module-global name: a suffix batch generator for suffix servers' models.
def BatchGenerator(model, **kwargs):
    return serving.make_batch_generator(original(BatchGenerator), model, **kwargs)


# mlx-lm 0.32.2 ResponseGenerator._tokenize(tokenizer, request, args) -> (prompt, ...)
# runs, in the generation thread, right before the request is inserted
# into the batch (insert_segments) or served by _serve_single, with the
# request's model loaded; what it raises fails that request alone.
def _tokenize(self, tokenizer, request, args):
    serving.check_for_model(self.model_provider, args, request)
    result = original(_tokenize)(self, tokenizer, request, args)
    serving.admit(self.model_provider.cli_args, request, result[0])
    return result


# mlx-lm 0.32.2 ResponseGenerator._next_request(timeout) -> (rqueue, request, args) or
# None, and _generate() (the generation loop, which stock _run_generate
# runs once, ending the thread at its first exception): fail the requests
# in flight and run the loop again.
def _next_request(self, timeout=None):
    item = original(_next_request)(self, timeout)
    serving.note_request_taken(self, item)
    if item is not None and serving.state_for(self.cli_args) is not None:
        isolation.track(item[2], item[0])
    return item


# mlx-lm 0.32.2 _make_sampler(args, tokenizer) and _make_logits_processors(args): module
# globals that ResponseGenerator._generate (inserting a request into the batch) and
# _serve_single call per request: on suffix servers what they make fails its request alone.
def _make_sampler(args, tokenizer):
    return isolation.guard_sampler(original(_make_sampler)(args, tokenizer), args)


def _make_logits_processors(args):
    return isolation.guard_processors(original(_make_logits_processors)(args), args)


def _generate(self):
    serving.generate_restarting(self, original(_generate))


# mlx-lm 0.32.2 ResponseGenerator.generate(request, generation_args, progress_callback)
# raises what the generation thread put on the request's queue before its
# first response, and APIHandler.handle_completion answers any Exception
# from it with HTTP 404: a request the generation thread refused
# (serving.RequestRefused) passes it as serving.Refused to do_POST (400).
# It returns (ctx, the iterator of the request's token responses): timed.
def generate(self, request, generation_args, progress_callback=None):
    try:
        ctx, responses = original(generate)(self, request, generation_args, progress_callback)
    except serving.RequestRefused as e:
        raise serving.Refused(e) from None
    return ctx, serving.timed_responses(request, ctx, responses)


# mlx-lm 0.32.2 ResponseGenerator._serve_single calls the module-global
# `stream_generate(model=..., tokenizer=..., prompt=rest, ...,
# draft_model=provider.draft_model, num_draft_tokens=...)`; the patched
# mlx_lm.generate.stream_generate takes a SuffixDrafter.
def stream_generate(model, tokenizer, prompt, max_tokens=256, draft_model=None, **kwargs):
    return serving.single_stream_generate(
        sys.modules["mlx_lm.generate"].stream_generate,
        model,
        tokenizer,
        prompt,
        max_tokens,
        draft_model,
        kwargs,
    )


# mlx-lm 0.32.2 APIHandler.validate_model_parameters(): called by do_POST once the body
# fields are attributes; a ValueError becomes HTTP 400 with its message.
def validate_model_parameters(self):
    if serving.state_for(self.response_generator.cli_args) is not None:
        # (Stock converts logit_bias catching ValueError only.)
        validation.check_logit_bias_values(self.logit_bias)
    original(validate_model_parameters)(self)
    serving.request_options(self)


# mlx-lm 0.32.2 APIHandler.handle_completion(request, stop_words): the CompletionRequest
# travels to the generation thread, with the request's options.
def handle_completion(self, request, stop_words):
    if serving.hand_to_generation(self, request):
        # It reads self.stream_options["include_usage"] once the stream is
        # done (a KeyError there: no [DONE]).
        self.stream_options = serving.stream_options_with_usage(self.stream_options)
        serving.mark_generating(self)
    return original(handle_completion)(self, request, stop_words)


# mlx-lm 0.32.2 APIHandler.generate_response(...) / completion_usage_response(...)
# return the response dicts; add the draft counters to their "usage".
def generate_response(self, *args, **kwargs):
    response = original(generate_response)(self, *args, **kwargs)
    return serving.add_usage(response, self)


def completion_usage_response(self, *args, **kwargs):
    response = original(completion_usage_response)(self, *args, **kwargs)
    return serving.add_usage(response, self)


# mlx-lm 0.32.2 APIHandler.do_POST(): on suffix servers, an exception (a body that is
# not UTF-8, a failed generation) is answered instead of dropping the
# connection without a response.
def do_POST(self):
    if serving.state_for(self.response_generator.cli_args) is None:
        try:
            return original(do_POST)(self)
        except serving.DraftRefused as e:
            # mlx-lm 0.32.0 lets a ValueError of validate_model_parameters
            # close the connection; 0.32.1 answers 400 itself.
            return serving.answer_error(self, e)
    serving.mark_generating(self, False)
    started, error = serving.start_post(self), None
    try:
        original(do_POST)(self)
    except serving.Refused as e:
        serving.mark_generating(self, False)
        serving.answer_error(self, e.args[0])
    except Exception as e:
        error = e
        serving.answer_error(self, e)
    serving.observe_post(self, started, error)


# The status of every answer: mlx-lm 0.32.2's APIHandler sends it through
# BaseHTTPRequestHandler.send_response (_set_completion_headers, _set_stream_headers).
def send_response(self, code, message=None):
    serving.note_status(self, code)
    return original(send_response)(self, code, message)


# mlx-lm 0.32.2 APIHandler.do_GET(): GET /v1/suffix/stats and /metrics on suffix servers.
def do_GET(self):
    state = serving.state_for(self.response_generator.cli_args)
    if state is not None and serving.is_metrics_path(self.path):
        body, content_type = state.metrics.exposition(self.headers.get("Accept"))
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        return
    if state is None or not serving.is_stats_path(self.path):
        return original(do_GET)(self)
    body = json.dumps(state.stats_payload()).encode()
    internals.start_json_response(self, 200)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    self.wfile.write(body)
    self.wfile.flush()


_SERVER, _PROVIDER = "mlx_lm.server", "mlx_lm.server:ModelProvider"
_GENERATOR, _HANDLER = "mlx_lm.server:ResponseGenerator", "mlx_lm.server:APIHandler"

PATCHES = [
    # mlx-lm 0.32.2 main() builds `argparse.ArgumentParser(...)` by the module-global
    # name `argparse` and calls `parser.parse_args()` once all options are added.
    Patch(_SERVER, "argparse", _argparse_with(_SuffixServerParser)),
    Patch(_SERVER, "run", run),
    Patch(_SERVER, "_run_http_server", _run_http_server),
    Patch(_SERVER, "main", main),
    Patch(_SERVER, "BatchGenerator", BatchGenerator),
    Patch(_SERVER, "stream_generate", stream_generate),
    Patch(_SERVER, "_make_sampler", _make_sampler),
    Patch(_SERVER, "_make_logits_processors", _make_logits_processors),
    Patch(_PROVIDER, "_load", _load),
    Patch(_GENERATOR, "_tokenize", _tokenize),
    Patch(_GENERATOR, "_next_request", _next_request),
    Patch(_GENERATOR, "_generate", _generate),
    Patch(_GENERATOR, "generate", generate),
    Patch(_HANDLER, "validate_model_parameters", validate_model_parameters),
    Patch(_HANDLER, "handle_completion", handle_completion),
    Patch(_HANDLER, "generate_response", generate_response),
    Patch(_HANDLER, "completion_usage_response", completion_usage_response),
    Patch(_HANDLER, "do_POST", do_POST),
    Patch(_HANDLER, "send_response", send_response),
    Patch(_HANDLER, "do_GET", do_GET),
]


# ------------------------------------------------- mlx-lm left stock
class _RefusingParser(argparse.ArgumentParser):
    """``mlx_lm.server``'s parser answering ``--draft suffix`` (or
    ``--draft-model suffix``, as stock reads it) and any ``--suffix-*``
    option with a one-line error, exit status 2."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        refuse_suffix_options(
            self, ns, extras, lambda o: compat.refusal(o, compat.MISSING), server=True
        )
        return ns, extras


REFUSALS = [Patch(_SERVER, "argparse", _argparse_with(_RefusingParser), required=False)]
