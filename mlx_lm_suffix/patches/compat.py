"""What mlx_lm_suffix relies on in mlx-lm, checked before anything is patched.

The patches wrap mlx-lm functions and methods and replace module globals
that mlx-lm looks up when it runs; :mod:`mlx_lm_suffix.batch` subclasses its
batch generator; :mod:`mlx_lm_suffix.internals` reads and writes its private
attributes (and declares them there). :func:`missing` checks all of that
against the mlx-lm that is installed; if anything is missing, nothing is
patched (see :func:`mlx_lm_suffix.patches.apply`).
"""

from __future__ import annotations

import dis
import importlib
import inspect
import sys
from dataclasses import dataclass
from types import CodeType
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from .. import internals

#: The mlx-lm releases mlx_lm_suffix is tested with, as setup.cfg requires
#: them (a PEP 440 specifier). 0.31.x lacks the batch API of 0.32 (its
#: GenerationBatch takes state machines, not stop sequences) and the
#: ``stream`` parameters of the generate functions.
SUPPORTED_VERSIONS = ">=0.32.0,<0.33"

# What mlx_lm_suffix wraps, calls or subclasses ("module:qualname"), with the
# parameters it relies on as in mlx-lm 0.32.0 to 0.32.2 ("" for none; None: it
# only has to exist).
SIGNATURES: Dict[str, Optional[str]] = {
    # patches.generate
    "mlx_lm.generate:stream_generate": (
        "model, tokenizer, prompt, max_tokens, draft_model, stream, **kwargs"
    ),
    "mlx_lm.generate:speculative_generate_step": (
        "prompt, model, draft_model, stream, num_draft_tokens, max_tokens, sampler, "
        "logits_processors, prompt_cache, prefill_step_size, kv_bits, kv_group_size, "
        "quantized_kv_start"
    ),
    "mlx_lm.generate:generate": "model, tokenizer, prompt, verbose, **kwargs",
    "mlx_lm.generate:setup_arg_parser": "",
    "mlx_lm.generate:main": "",
    # loop
    "mlx_lm.generate:DEFAULT_QUANTIZED_KV_START": None,
    "mlx_lm.generate:generation_stream": None,
    "mlx_lm.generate:maybe_quantize_kv_cache": None,
    "mlx_lm.generate:generate_step": (
        "prompt, model, stream, max_tokens, sampler, logits_processors, max_kv_size, "
        "prompt_cache, prefill_step_size, kv_bits, kv_group_size, quantized_kv_start, "
        "prompt_progress_callback, input_embeddings"
    ),
    "mlx_lm.models.cache:make_prompt_cache": None,
    "mlx_lm.sample_utils:greedy_sampler": None,
    # rollback: the cache kinds of its tables, their state and trims
    "mlx_lm.models.cache:KVCache.trim": "self, n",
    "mlx_lm.models.cache:QuantizedKVCache.trim": "self, n",
    "mlx_lm.models.cache:ConcatenateKVCache.trim": "self, n",
    "mlx_lm.models.cache:ChunkedKVCache.trim": "self, n",
    "mlx_lm.models.cache:RotatingKVCache.trim": "self, n",
    "mlx_lm.models.cache:RotatingKVCache.is_trimmable": "self",
    "mlx_lm.models.cache:RotatingKVCache.state": None,
    "mlx_lm.models.cache:ArraysCache.state": None,
    "mlx_lm.models.cache:ArraysCache.prepare": "self, lengths, **kwargs",
    "mlx_lm.models.cache:ArraysCache.finalize": "self",
    "mlx_lm.models.cache:ArraysCache.filter": "self, batch_indices",
    "mlx_lm.models.cache:BatchRotatingKVCache.trim": "self, n",
    "mlx_lm.models.cache:BatchRotatingKVCache.state": None,
    "mlx_lm.models.cache:BatchRotatingKVCache.prepare": (
        "self, left_padding, lengths, right_padding"
    ),
    "mlx_lm.models.cache:BatchRotatingKVCache.finalize": "self",
    "mlx_lm.models.cache:BatchRotatingKVCache.filter": "self, batch_indices",

    # batch, verification
    "mlx_lm.generate:GenerationBatch": (
        "model, uids, inputs, prompt_cache, tokens, samplers, fallback_sampler, "
        "logits_processors, stop_sequences, max_tokens"
    ),
    "mlx_lm.generate:GenerationBatch.Response": (
        "uid, token, logprobs, finish_reason, prompt_cache, all_tokens"
    ),
    "mlx_lm.generate:GenerationBatch.next": "self",
    "mlx_lm.generate:GenerationBatch.extend": "self, batch",
    "mlx_lm.generate:GenerationBatch.filter": "self, keep",
    "mlx_lm.generate:GenerationBatch.extract_cache": "self, idx",
    "mlx_lm.generate:BatchGenerator": (
        "model, max_tokens, stop_tokens, sampler, logits_processors, "
        "completion_batch_size, prefill_batch_size, prefill_step_size, max_kv_size, stream"
    ),
    "mlx_lm.generate:BatchGenerator.insert_segments": (
        "self, segments, max_tokens, caches, all_tokens, samplers, logits_processors, "
        "stop_sequences"
    ),
    "mlx_lm.generate:BatchGenerator.remove": "self, uids, return_prompt_caches",
    "mlx_lm.generate:BatchGenerator.next": "self",
    "mlx_lm.generate:BatchGenerator.next_generated": "self",
    "mlx_lm.generate:BatchGenerator.close": "self",
    "mlx_lm.models.cache:BatchKVCache.trim": "self, n",
    "mlx_lm.models.cache:BatchKVCache.prepare": "self, left_padding, lengths, right_padding",
    "mlx_lm.models.cache:BatchKVCache.finalize": "self",
    "mlx_lm.models.cache:BatchKVCache.filter": "self, batch_indices",
    # patches.server, patches.serving
    "mlx_lm.utils:load_tokenizer": None,
    "mlx_lm.server:run": "host, port, model_provider, server_class, handler_class",
    "mlx_lm.server:_run_http_server": (
        "host, port, response_generator, server_class, handler_class"
    ),
    "mlx_lm.server:main": "",
    "mlx_lm.server:ModelProvider._load": "self, model_path, adapter_path, draft_model_path",
    "mlx_lm.server:ModelProvider.reset": "self",
    "mlx_lm.server:ResponseGenerator._tokenize": "self, tokenizer, request, args",
    "mlx_lm.server:_make_sampler": "args, tokenizer",
    "mlx_lm.server:_make_logits_processors": "args",
    # patches.validation reads the request's fields by these names
    "mlx_lm.server:SamplingArguments": (
        "temperature, top_p, top_k, min_p, xtc_probability, xtc_threshold"
    ),
    "mlx_lm.server:LogitsProcessorArguments": (
        "logit_bias, repetition_penalty, repetition_context_size, presence_penalty, "
        "presence_context_size, frequency_penalty, frequency_context_size"
    ),
    "mlx_lm.server:ResponseGenerator._next_request": "self, timeout",
    "mlx_lm.server:ResponseGenerator._generate": "self",
    "mlx_lm.server:ResponseGenerator.generate": "self, request, generation_args, progress_callback",
    "mlx_lm.server:ResponseGenerator.cli_args": None,
    "mlx_lm.server:APIHandler.validate_model_parameters": "self",
    "mlx_lm.server:APIHandler.handle_completion": "self, request, stop_words",
    "mlx_lm.server:APIHandler.generate_response": None,
    "mlx_lm.server:APIHandler.completion_usage_response": None,
    "mlx_lm.server:APIHandler.do_POST": "self",
    "mlx_lm.server:APIHandler.do_GET": "self",
    "mlx_lm.server:APIHandler.send_response": "self, code, message",
    # serving.timed_responses reads the prompt and each response's finish reason
    "mlx_lm.server:GenerationContext": (
        "has_tool_calling, has_thinking, tool_parser, text_sm, initial_state, prompt, "
        "prompt_cache_count, _should_stop"
    ),
    "mlx_lm.server:Response": "text, token, logprob, finish_reason, top_tokens",
    **internals.CALLS,
}

# Functions and the names they look up when they run: module globals that
# the patches replace, methods they wrap.
LOOKUPS: Dict[str, Tuple[str, ...]] = {
    "mlx_lm.generate:stream_generate": ("speculative_generate_step",),
    "mlx_lm.generate:generate": ("stream_generate",),
    "mlx_lm.generate:main": ("setup_arg_parser", "generate"),
    **internals.LOOKS_UP,
    "mlx_lm.server:main": ("argparse", "run"),
    # patches.server._run_http_server: stock run() serves HTTP through it
    "mlx_lm.server:run": ("_run_http_server",),
    # patches.server.send_response sees every status the handler sends
    "mlx_lm.server:APIHandler._set_completion_headers": ("send_response",),
    "mlx_lm.server:APIHandler._set_stream_headers": ("send_response",),
    "mlx_lm.server:ResponseGenerator._run_generate": ("_generate",),
    "mlx_lm.server:ResponseGenerator._generate": (
        "BatchGenerator", "_next_request", "_tokenize", "_make_sampler", "_make_logits_processors"
    ),
    "mlx_lm.server:ResponseGenerator._serve_single": (
        "stream_generate", "_tokenize", "_make_sampler", "_make_logits_processors"
    ),
    # patches.isolation: a failed request's handler stops its context, which
    # the generation loop reads to remove its row (as a disconnect's)
    "mlx_lm.server:APIHandler.handle_completion": (
        "generate_response",
        "completion_usage_response",
        "generate",  # ResponseGenerator.generate, wrapped
        "stream_options",  # its "include_usage" made present
        "stop",  # ctx.stop() once the response loop ends, however
    ),
    "mlx_lm.server:APIHandler.do_POST": ("validate_model_parameters", "handle_completion"),
}

# Methods and the attributes they set on the instance, which mlx_lm_suffix
# reads (or, in a subclass, sets and stock reads).
ATTRIBUTES: Dict[str, Tuple[str, ...]] = {
    "mlx_lm.generate:GenerationBatch.__init__": (
        "model", "uids", "prompt_cache", "tokens", "samplers", "fallback_sampler",
        "logits_processors", "max_tokens",
    ),
    "mlx_lm.generate:BatchGenerator.__init__": ("model", "sampler", "max_kv_size"),
    # rollback: the fields each cache kind's strategy reads or sets
    "mlx_lm.models.cache:KVCache.__init__": ("offset",),
    "mlx_lm.models.cache:QuantizedKVCache.__init__": ("offset",),
    "mlx_lm.models.cache:ConcatenateKVCache.__init__": ("offset",),
    "mlx_lm.models.cache:ChunkedKVCache.__init__": ("offset",),
    "mlx_lm.models.cache:BatchKVCache.__init__": ("left_padding", "offset"),
    "mlx_lm.models.cache:RotatingKVCache.__init__": ("keep", "offset", "max_size"),
    "mlx_lm.models.cache:BatchRotatingKVCache.__init__": ("left_padding", "offset"),
    "mlx_lm.models.cache:CacheList.__init__": ("caches",),
    "mlx_lm.server:ModelProvider.__init__": (
        "cli_args", "model", "tokenizer", "model_key", "draft_model", "is_batchable",
    ),
    "mlx_lm.server:ResponseGenerator.__init__": ("model_provider",),
    "mlx_lm.server:APIHandler.__init__": ("response_generator",),
    "mlx_lm.server:APIHandler.do_POST": (
        "body",
        "stream",
        "max_tokens",
        "requested_draft_model",
        "num_draft_tokens",
        "requested_model",
        "adapter",
        "stream_options",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        # patches.validation
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "xtc_probability",
        "xtc_threshold",
        "repetition_penalty",
        "repetition_context_size",
        "presence_penalty",
        "presence_context_size",
        "frequency_penalty",
        "frequency_context_size",
    ),
}
# The private ones, read and written by mlx_lm_suffix.internals.
for _target, _names in internals.SETS.items():
    ATTRIBUTES[_target] = ATTRIBUTES.get(_target, ()) + _names


@dataclass(frozen=True)
class Patch:
    """One replacement of mlx-lm: attribute ``name`` of ``target`` (a module,
    ``"mlx_lm.server"``, or a class in it, ``"mlx_lm.server:APIHandler"``)
    becomes ``new``, a named function (or a value), which reaches what it
    replaced as ``original(new)``; written against mlx-lm ``versions``.
    ``required``: applied only where the target is there when False."""

    target: str
    name: str
    new: Any
    versions: str = SUPPORTED_VERSIONS
    required: bool = True


def original(replacement: Any) -> Any:
    """What a :class:`Patch`'s replacement replaced (set when applied)."""
    return replacement.__wrapped__


#: What the installed mlx-lm lacks, once it is left stock (the refusals'
#: messages name it).
MISSING: List[str] = []


def in_range(version: str, spec: str) -> bool:
    """Whether ``version`` (``"0.32.2"``) is within ``spec``, a comma-separated
    list of ``>=`` and ``<`` bounds (:data:`SUPPORTED_VERSIONS`' form)."""

    def parts(v: str) -> Tuple[int, ...]:
        return tuple(int(p) for p in v.strip().split(".") if p.isdigit())

    for bound in spec.split(","):
        bound = bound.strip()
        op, v = (">=", bound[2:]) if bound.startswith(">=") else ("<", bound[1:])
        if (parts(version) >= parts(v)) != (op == ">="):
            return False
    return True


class IncompatibleMlxLm(RuntimeError):
    """Suffix decoding was asked for, but this mlx-lm lacks what it relies on."""


def version() -> str:
    """The installed mlx-lm's version."""
    return getattr(sys.modules.get("mlx_lm"), "__version__", "(unknown version)")


def missing(patches: Sequence[Patch] = ()) -> List[str]:
    """What the installed mlx-lm lacks of :data:`SIGNATURES`,
    :data:`LOOKUPS`, :data:`ATTRIBUTES` and ``patches``' targets (and the
    versions they were written against), one line each (empty: all there).
    Imports the modules it checks."""
    out = []
    for p in patches:
        target = f"{p.target}.{p.name}" if ":" in p.target else f"{p.target}:{p.name}"
        problem = _resolve(target)[1]
        if problem is None and not in_range(version(), p.versions):
            problem = f"{_name(target)} as in mlx-lm {p.versions}"
        out.extend([problem] if problem and problem not in out else [])
    for target, params in SIGNATURES.items():
        obj, problem = _resolve(target)
        if problem is None and params is not None:
            found = _parameters(obj)
            if found != params:
                problem = f"{_name(target)}({params}) (found ({found}))"
        out.extend([problem] if problem else [])
    for table, what in ((LOOKUPS, "looking up"), (ATTRIBUTES, "setting")):
        for target, names in table.items():
            obj, problem = _resolve(target)
            if problem is None:
                have = _attributes_set(obj) if table is ATTRIBUTES else _names_used(obj)
                absent = [n for n in names if n not in have]
                if absent:
                    problem = f"{_name(target)} {what} {', '.join(absent)}"
            out.extend([problem] if problem and problem not in out else [])
    return out


def warning(missing: Sequence[str]) -> str:
    """The one warning of a process whose mlx-lm is left stock."""
    return (
        f"mlx-lm-suffix supports mlx-lm {SUPPORTED_VERSIONS}; mlx-lm {version()} lacks "
        f"{'; '.join(missing)}. mlx-lm runs stock, without suffix decoding."
    )


def refusal(what: str, missing: Sequence[str]) -> str:
    """The one-line answer to ``what`` (a flag, a draft model) on an mlx-lm
    that is left stock."""
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (
        f"mlx-lm-suffix: {what} needs mlx-lm {SUPPORTED_VERSIONS}; mlx-lm {version()} "
        f"lacks {missing[0]}{more}"
    )


def _name(target: str) -> str:
    return target.replace(":", ".")


def _resolve(target: str) -> Tuple[Any, Optional[str]]:
    """The object named ``module:qualname`` and None, or None and what is missing."""
    module, _, qualname = target.partition(":")
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # an mlx-lm module that does not import
        return None, f"{module} (import failed: {type(e).__name__}: {e})"
    for part in qualname.split("."):
        if not hasattr(obj, part):
            return None, _name(target)
        obj = getattr(obj, part)
    # The stock function under a wrapper (functools.wraps): under ours once
    # patched, under another plugin's.
    return inspect.unwrap(obj) if callable(obj) else obj, None


def _parameters(fn: Any) -> str:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return "?"
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return ", ".join(stars.get(p.kind, "") + p.name for p in params)


def _codes(fn: Any) -> Iterator[CodeType]:
    """A function's code and the code of the functions defined in it."""
    stack = [getattr(fn, "__code__", None)]
    while stack:
        code = stack.pop()
        if isinstance(code, CodeType):
            yield code
            stack.extend(c for c in code.co_consts if isinstance(c, CodeType))


def _names_used(fn: Any) -> set:
    return {name for code in _codes(fn) for name in code.co_names}


def _attributes_set(fn: Any) -> set:
    return {
        i.argval
        for code in _codes(fn)
        for i in dis.get_instructions(code)
        if i.opname == "STORE_ATTR"
    }
