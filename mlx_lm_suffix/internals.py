"""The one door to mlx-lm's and arctic-inference's internals.

Every private attribute of mlx-lm (0.32.0 to 0.32.2) or arctic-inference
(0.3.0) that the plugin reads or writes is read or written here, each by a
small named function; the rest of the package calls these. What they rely
on is declared beside them: :data:`SETS` (the attributes a method of mlx-lm
sets, which these functions read or write) and :data:`LOOKS_UP` (names a
function of mlx-lm looks up, whose behaviour a function here restates), both
checked by :mod:`~mlx_lm_suffix.patches.compat` before anything is patched,
so that an mlx-lm that renames one is refused in one place with one message;
:data:`ARCTIC` is checked when the first suffix tree is made.

The patches themselves (:mod:`~mlx_lm_suffix.patches`) name the mlx-lm
functions they wrap as data and are checked alike.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar

import mlx.core as mx

V = TypeVar("V")


# ------------------------------------------------------------------ caches
# mlx-lm 0.32.2 BatchKVCache._idx: its buffer's filled length (an int, so
# read without waiting for a queued forward; each row's ``offset`` is an
# array that forward produces).
def filled(cache: Any) -> int:
    """A ``BatchKVCache``'s filled length: a bound on its longest row."""
    return cache._idx


# mlx-lm 0.32.2 model arguments that name an attention window (the
# ModelArgs of its families with sliding-window layers), and the layer types
# some of them list instead.
WINDOW_ARGS = ("sliding_window", "window_size", "sliding_window_size",
               "attention_window_size", "loop_window_size", "sliding_window_pattern")


def windowed(model: Any) -> bool:
    """Whether ``model``'s configuration (or its ``text_config``, a
    multimodal model's) names an attention window (then a mask may read a
    cache's positions by slot)."""
    def field(config: Any, name: str) -> Any:
        return config.get(name) if isinstance(config, dict) else getattr(config, name, None)

    args = getattr(model, "args", None)
    for config in (args, field(args, "text_config")):
        if any(field(config, name) for name in WINDOW_ARGS):
            return True
        if any("sliding" in str(t) for t in field(config, "layer_types") or ()):
            return True
    return False


# mlx-lm 0.32.2 BatchRotatingKVCache._offset (positions fed, padding
# included, since the batch cache was made; merge starts it at the buffer's
# length) and _idx (its write index).
def window_fed(cache: Any) -> int:
    """The positions a ``BatchRotatingKVCache`` has been fed."""
    return cache._offset


def cut_window_buffer(cache: Any) -> None:
    """A ``BatchRotatingKVCache``'s buffer cut to its write index (a
    multi-token update leaves it in time order, and mlx-lm's next one-token
    update sizes the window by the buffer's length)."""
    end = cache._idx
    cache.keys, cache.values = cache.keys[..., :end, :], cache.values[..., :end, :]


# mlx-lm 0.32.2 BatchRotatingKVCache._temporal_order(): the buffer put in
# time order (what its multi-token update does first).
def time_order(cache: Any) -> None:
    """Put a ``BatchRotatingKVCache``'s buffer in time order."""
    cache._temporal_order()


# -------------------------------------------------------- GenerationBatch
# mlx-lm 0.32.2 GenerationBatch keeps, between steps: _next_tokens (each
# row's pending token, an array, with _next_logprobs), _current_tokens and
# _current_logprobs (what the last step fed), _token_context (each row's
# tokens for its logits processors), _num_tokens and _matchers (each row's
# emitted count and stop sequence matcher, tested by next()).
def pending_tokens(batch: Any) -> mx.array:
    """Each row's pending token: the one its next step feeds."""
    return batch._next_tokens


def pending_logprobs(batch: Any) -> List[mx.array]:
    """The logprobs each row's pending token was sampled from."""
    return batch._next_logprobs


def set_pending(batch: Any, fed: mx.array, fed_logprobs: List[mx.array], tokens: mx.array,
                logprobs: List[mx.array]) -> None:
    """After a forward that fed each row ``fed`` first (its pending token),
    as stock's step leaves the batch: ``tokens`` and ``logprobs`` are each
    row's next pending token."""
    batch._current_tokens, batch._current_logprobs = fed, fed_logprobs
    batch._next_tokens, batch._next_logprobs = tokens, logprobs


def count_token(batch: Any, i: int, token: int) -> Optional[str]:
    """Row ``i`` emits ``token``: counted and tested as mlx-lm 0.32.2
    ``GenerationBatch.next`` tests the one token a step emits (its count
    against ``max_tokens``, then its stop sequences). Returns the finish
    reason, if any."""
    batch._num_tokens[i] += 1
    reason = "length" if batch._num_tokens[i] >= batch.max_tokens[i] else None
    if batch._matchers[i].advance(token):
        reason = "stop"
    return reason


def refresh_token_context(batch: Any, i: int) -> None:
    """Row ``i``'s logits processors see ``batch.tokens[i]`` again (after
    its cache took several tokens at once)."""
    from mlx_lm.models.cache import TokenBuffer

    batch._token_context[i] = TokenBuffer(batch.tokens[i])


# --------------------------------------------------------- BatchGenerator
# mlx-lm 0.32.2 BatchGenerator: _generation_batch (the rows generating);
# _next() runs one generation step, then admits waiting sequences
# (_unprocessed_sequences) into the prompt batch (_prompt_batch) while it
# and the generation batch have room, and prefills the next chunk of each
# prompt being processed (_currently_processing: [segments, done, total]),
# timed in _counters.
def generation_batch(generator: Any) -> Any:
    """A ``BatchGenerator``'s batch of generating rows."""
    return generator._generation_batch


def set_generation_batch(generator: Any, batch: Any) -> None:
    generator._generation_batch = batch


def prefill_tokens(generator: Any) -> Optional[int]:
    """The prompt tokens that a ``BatchGenerator``'s next ``_next`` call
    prefills after its generation step, or None if it has no prompts. As
    mlx-lm 0.32.2's ``_next`` decides: no prompts when the generation batch
    is full, else those being processed and the waiting ones it admits; the
    next chunk (up to ``prefill_step_size`` tokens of the current segment)
    of each, but of those down to their last token, which join the
    generation batch instead."""
    room = generator.completion_batch_size - len(generator._generation_batch)
    if room <= 0:
        return None
    waiting = generator._unprocessed_sequences
    admitted = min(generator.prefill_batch_size - len(generator._prompt_batch), room, len(waiting))
    segments = [seq[0] for seq in generator._currently_processing]
    segments += [waiting[i][1] for i in range(max(admitted, 0))]
    if not segments:
        return None
    return sum(
        min(len(s[0]), generator.prefill_step_size)
        for s in segments
        if not (len(s) == 1 and len(s[0]) == 1)
    )


def prefill_seconds_per_token(generator: Any) -> Optional[float]:
    """A ``BatchGenerator``'s mean prefill time per prompt token so far
    (None before any prefill)."""
    counters = generator._counters
    return counters.prompt_time / counters.prompt_tokens if counters.prompt_tokens else None


# ------------------------------------------------------------------ server
# mlx-lm 0.32.2 ResponseGenerator._stop: set once the server is stopping.
def stopping(response_generator: Any) -> bool:
    return bool(response_generator._stop)


# mlx-lm 0.32.2 APIHandler: BaseHTTPRequestHandler buffers headers in
# _headers_buffer until end_headers() sends them (None before the first);
# _set_completion_headers(status) starts a JSON response.
def headers_unsent(handler: Any) -> bool:
    """Whether no header of the response has reached the client yet."""
    buffered = getattr(handler, "_headers_buffer", None)
    return buffered is None or bool(buffered)


def start_json_response(handler: Any, status: int) -> None:
    """Drop any header not sent yet and start a JSON response."""
    handler._headers_buffer = []
    handler._set_completion_headers(status)


# mlx-lm 0.32.2 ModelProvider.load maps a request's names through
# _model_map, _adapter_map and _draft_model_map, and keys its model by the
# mapped (model, adapter, draft model).
def model_key(provider: Any, model: Any, adapter: Any, draft: Any = "default_model"
              ) -> Optional[Tuple[Any, ...]]:
    """The ``model_key`` a provider gives the model a request names once
    loaded (None where the names cannot be mapped)."""
    try:
        adapter = provider._adapter_map.get(model, adapter)
        model = provider._model_map.get(model, model)
        draft = provider._draft_model_map.get(draft, draft)
    except (AttributeError, TypeError):
        return None
    return (model, adapter, draft)


# mlx-lm 0.32.2 main() -> run() serves HTTP through the module global
# _run_http_server(host, port, response_generator, server_class,
# handler_class) (compat checks its parameters, and that run looks it up).
def serve_http_with(server_class: Any) -> None:
    """``mlx_lm.server``'s HTTP server is made of ``server_class`` from now
    on, where no other class is passed (the bench's stock servers listen as
    a suffix server does)."""
    import mlx_lm.server as server

    run_http = server._run_http_server

    def run_http_server(*args: Any, **kwargs: Any) -> Any:
        return run_http(*args, **{"server_class": server_class, **kwargs})

    server._run_http_server = run_http_server


# mlx-lm 0.32.2 _make_logits_processors(args): the module global that
# ResponseGenerator calls once per request, on its batched path
# (_generate) and its single one (_serve_single) (compat checks both look
# it up, and its parameters).
def add_logits_processors(extra: Callable[[Any], List[Any]]) -> None:
    """Every request ``mlx_lm.server`` serves from now on gets
    ``extra(args)``'s logits processors after its own (``args``: the
    request's generation arguments)."""
    import mlx_lm.server as server

    stock = server._make_logits_processors

    def make(args: Any) -> List[Any]:
        return list(stock(args) or []) + list(extra(args))

    server._make_logits_processors = make


def merge_caches(caches: List[List[Any]]) -> List[Any]:
    """One batch cache of several sequences' caches (mlx-lm 0.32.2
    ``mlx_lm.generate._merge_caches``)."""
    from mlx_lm.generate import _merge_caches

    return _merge_caches(caches)


# ------------------------------------------------------- arctic-inference
#: What of arctic-inference 0.3.0's ``SuffixDecodingCache`` is used beside
#: its public methods: the C++ trees themselves (a request's own, and the
#: global one with each active request's sequence id), so that a step's
#: extend and walks cost no wrapper (its ``speculate`` converts every field
#: of both trees' drafts).
ARCTIC = ("_local_trees", "_global_tree", "_req_to_seq_id")


def own_tree(cache: Any, req_id: int) -> Any:
    """The C++ suffix tree of an active request's own tokens."""
    return cache._local_trees[req_id]


def global_tree(cache: Any) -> Any:
    """The C++ suffix tree of the cache's responses (active ones included)."""
    return cache._global_tree


def global_sequence(cache: Any, req_id: int) -> Optional[int]:
    """The global tree's sequence id of an active request (None: it has
    none, the cache keeps no responses)."""
    return cache._req_to_seq_id.get(req_id)


def check_arctic(cache: Any) -> None:
    """Raise where arctic-inference lacks what :data:`ARCTIC` names."""
    missing = [a for a in ARCTIC if not hasattr(cache, a)]
    if missing:
        raise RuntimeError(
            f"arctic-inference's SuffixDecodingCache lacks {', '.join(missing)}: "
            "mlx-lm-suffix needs arctic-inference 0.3.0"
        )


# ------------------------------------------------------------ bookkeeping
class Attached(Generic[V]):
    """Values the plugin attaches to objects it does not own (models,
    parsed command lines, requests, handlers), kept in a mapping it owns:
    keyed by the object's identity, dropped when the object is collected
    (mlx-lm's models are dicts, and its requests and namespaces define
    ``__eq__``, so they are no dict keys of their own)."""

    def __init__(self) -> None:
        self._values: Dict[int, Tuple[Any, V]] = {}

    def get(self, obj: Any, default: Optional[V] = None) -> Optional[V]:
        entry = self._values.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else default

    def set(self, obj: Any, value: V) -> None:
        key = id(obj)
        self._values[key] = (weakref.ref(obj, lambda _, key=key: self._values.pop(key, None)),
                             value)

    def pop(self, obj: Any, default: Optional[V] = None) -> Optional[V]:
        value = self.get(obj, default)
        self._values.pop(id(obj), None)
        return value


# ------------------------------------------------------------------ checks
#: Methods of mlx-lm and the attributes they set on their instances, which
#: the functions above read or write (checked by compat).
SETS: Dict[str, Tuple[str, ...]] = {
    "mlx_lm.generate:GenerationBatch.__init__": (
        "_current_tokens", "_current_logprobs", "_next_tokens", "_next_logprobs",
        "_token_context", "_num_tokens", "_matchers",
    ),
    "mlx_lm.generate:BatchGenerator.__init__": (
        "_generation_batch", "_prompt_batch", "_unprocessed_sequences",
        "_currently_processing", "_counters", "completion_batch_size",
        "prefill_batch_size", "prefill_step_size",
    ),
    "mlx_lm.models.cache:BatchKVCache.__init__": ("_idx",),
    "mlx_lm.models.cache:BatchRotatingKVCache.__init__": ("keys", "values", "_idx", "_offset"),
    "mlx_lm.server:ModelProvider.__init__": ("_model_map", "_adapter_map", "_draft_model_map"),
    "mlx_lm.server:ResponseGenerator.__init__": ("_stop",),
}

#: Functions of mlx-lm and the names they look up, where a function above
#: restates what they do (checked by compat).
LOOKS_UP: Dict[str, Tuple[str, ...]] = {
    # count_token: next()'s per-token finish test
    "mlx_lm.generate:GenerationBatch.next": ("_num_tokens", "max_tokens", "_matchers"),
    # prefill_tokens: _next() steps first, then admits and prefills
    "mlx_lm.generate:BatchGenerator._next": (
        "_generation_batch", "_prompt_batch", "_unprocessed_sequences",
        "_currently_processing", "_counters", "prefill_step_size",
    ),
    # model_key: load() maps a request's names so
    "mlx_lm.server:ModelProvider.load": ("_load", "_model_map", "_adapter_map",
                                         "_draft_model_map"),
}

#: Private functions and methods of mlx-lm called here, with their
#: parameters (checked by compat).
CALLS: Dict[str, Optional[str]] = {
    "mlx_lm.generate:_merge_caches": None,
    "mlx_lm.models.cache:BatchRotatingKVCache._temporal_order": "self",
    "mlx_lm.server:APIHandler._set_completion_headers": "self, status_code",
}
