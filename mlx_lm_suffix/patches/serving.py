"""Server-side state of ``mlx_lm.server --draft suffix``.

Plain logic called from the thin wrappers of :mod:`mlx_lm_suffix.patches.server`:

- :class:`SuffixServing`, one per server (its parsed CLI namespace): a drafter
  per loaded model (kept for the server's lifetime, so switching models back
  and forth keeps each model's cache), the cache file
  (:class:`~mlx_lm_suffix.persistence.CacheFile`), the stats, and the
  server's lifetime (SIGTERM, orderly exit).
- Requests: :func:`request_info` validates the per-request fields and
  computes the cache scope; :func:`note_prompt` / :func:`batch_row_options`
  carry it from the tokenizer call to the batch row (same thread);
  :func:`single_stream_generate` routes the server's single-request path to
  suffix decoding; :func:`check_for_model` refuses, in the generation
  thread, what only the loaded model can tell is invalid (``logit_bias``
  ids past its vocabulary) where the handler could not
  (:class:`RequestRefused`, answered 400).
- Failures: :func:`generate_restarting` restarts the generation loop after
  failing the requests in flight; :func:`answer_error` answers a POST whose
  handling raised.

Modules that import mlx_lm (batch, verification, mlx_lm itself) are
imported where they are used: this module is imported while mlx-lm is
being patched, which can happen while one of them is half imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Hashable,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
)
from urllib.parse import urlsplit

from .. import ranks
from ..drafter import PRIVATE, SuffixDrafter
from ..metrics import METRICS_PATH, ServerMetrics
from ..persistence import CacheFile, CacheFileRefused, model_id, vocabulary_size
from ..stats import BatchDraftStats, RequestUsage
from . import validation
from .args import HEADER_SCOPE, SUFFIX, drafter_from_args, enabled

if TYPE_CHECKING:
    from ..batch import RowOptions

logger = logging.getLogger("mlx_lm_suffix.serving")

STATS_PATH = "/v1/suffix/stats"
#: Usage fields added to each response.
USAGE_DRAFTED = "draft_tokens"
USAGE_ACCEPTED = "accepted_draft_tokens"
_STATE_ATTR = "_mlx_lm_suffix_serving"
_REQUEST_ATTR = "_mlx_lm_suffix"
_MODEL_ATTR = "_mlx_lm_suffix_server_entry"


# ------------------------------------------------------------------ state
@dataclass
class ModelEntry:
    """Suffix state of one model (one ``ModelProvider.model_key``)."""

    key: Tuple[Any, ...]
    model_id: str
    name: str  # shown in the stats: a local model's folder name, or its repo id
    drafter: Optional[SuffixDrafter]  # None: the model cannot roll back
    batch_stats: BatchDraftStats
    # Whether requests wait in the server's queue (SuffixServing.requests_waiting).
    requests_waiting: Callable[[], bool]
    # The length of the model's logits vector: token ids are below it.
    output_size: int = 0
    persisted: bool = False
    # The model's batch generators alive (the server's generation thread).
    generators: "weakref.WeakSet" = field(default_factory=weakref.WeakSet)


@dataclass
class RequestInfo:
    """What the HTTP handler decided for one request."""

    drafting: bool
    num_draft_tokens: int
    scope: Hashable
    usage: RequestUsage
    arrived: float = field(default_factory=time.perf_counter)
    # For the metrics (mlx_lm_suffix.metrics): the model that served it (set
    # as it began generating), its prompt and emitted tokens, when the first
    # and last token reached its handler, and mlx-lm's finish reason.
    model: Optional[str] = None
    prompt_tokens: int = 0
    tokens: int = 0
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    finish_reason: Optional[str] = None


class SuffixServing:
    """State of one ``mlx_lm.server --draft suffix``."""

    def __init__(self, cli_args: Any):
        self.cli_args = cli_args
        self.scope = getattr(cli_args, "suffix_cache_scope", "global") or "global"
        path = getattr(cli_args, "suffix_cache_file", None)
        # Distributed: rank 0 drafts for every rank (mlx_lm_suffix.ranks), so
        # only it keeps the cache file.
        self.cache_file = CacheFile(path) if path and not ranks.following() else None
        self.num_draft_tokens = cli_args.num_draft_tokens
        self._lock = threading.RLock()
        self.entries: Dict[Tuple[Any, ...], ModelEntry] = {}
        # The generation thread's request queue (ResponseGenerator.requests).
        self.requests: Any = None
        self.metrics = ServerMetrics(self)

    def requests_waiting(self) -> bool:
        """Whether requests wait in the server's queue, not yet taken by the
        generation thread (which inserts them into its batch between runs of
        steps)."""
        queue = self.requests
        return queue is not None and not queue.empty()

    def on_model_loaded(self, model_path: str, model: Any, tokenizer: Any, key: Any) -> ModelEntry:
        """Register (or find again) the drafter of a model just loaded."""
        from mlx_lm.generate import _merge_caches
        from mlx_lm.models.cache import make_prompt_cache

        from .. import rollback

        with self._lock:
            entry = self.entries.get(key)
            if entry is None:
                mid = model_id(model_path, tokenizer)
                cache = make_prompt_cache(model)
                drafter = None
                if rollback.supports(cache):
                    drafter = drafter_from_args(self.cli_args)
                    drafter.policy.ensure_cost(model)  # at load, not in a request
                    try:
                        batch_ok = rollback.supports_batch(_merge_caches([cache]))
                    except Exception:
                        batch_ok = False
                    if not batch_ok:
                        logger.warning(
                            "mlx-lm-suffix: the batched cache of %s cannot roll rows "
                            "back; concurrent (batched) requests are served without "
                            "drafting, single requests with it.",
                            model_path,
                        )
                else:
                    logger.warning(
                        "mlx-lm-suffix: the cache of %s (%s) cannot be rolled back; "
                        "serving it without suffix drafting.",
                        model_path,
                        rollback.describe(cache),
                    )
                entry = ModelEntry(
                    key, mid, _model_name(model_path), drafter, BatchDraftStats(), self.requests_waiting,
                    output_size=output_size(model, tokenizer),
                )
                self.entries[key] = entry
            # Kept on the model (modules are unhashable dicts).
            object.__setattr__(model, _MODEL_ATTR, entry)
            if self.cache_file is not None:
                entry.persisted = self.cache_file.attach(
                    entry.model_id, entry.drafter, vocabulary_size(model, tokenizer)
                )
            return entry

    def output_size_for(self, key: Tuple[Any, ...]) -> Optional[int]:
        """The logits length of the model with provider key ``key``, if it
        has been loaded (an entry is never removed nor changed)."""
        with self._lock:
            entry = self.entries.get(key)
        return entry.output_size if entry is not None else None

    def save(self) -> None:
        """Save the cache file, if any, where it changed."""
        if self.cache_file is not None:
            self.cache_file.save()

    @contextlib.contextmanager
    def lifetime(self) -> Iterator[None]:
        """Around the server's ``run``: the cache file saved while it runs and
        after (:meth:`CacheFile.saving`), SIGTERM handled as Ctrl-C after a
        save, and :func:`exit_after_shutdown` armed once it returns."""
        global _shutdown_done
        saving = self.cache_file.saving() if self.cache_file else contextlib.nullcontext()
        # Distributed: rank 0 answers HTTP and drafts for every rank.
        args, operator = self.cli_args, not ranks.following()
        log = self.metrics.logging(getattr(args, "suffix_log_interval", 0) if operator else 0)
        listen = self.metrics.listening(getattr(args, "suffix_metrics_host", None),
                                        getattr(args, "suffix_metrics_port", None) if operator else None)
        with saving, _sigterm_as_ctrl_c(self.save), log, listen:
            try:
                yield
            except KeyboardInterrupt:
                pass
        _shutdown_done = True

    def abandon_batches(self) -> None:
        """Stop the drafter requests of every batch generator (after the
        generation loop failed and dropped them)."""
        with self._lock:
            entries = list(self.entries.values())
        for e in entries:
            for generator in list(e.generators):
                generator.close()

    # ------------------------------------------------------------- stats
    def drafter_snapshots(self) -> List[Tuple[str, Dict[str, Any]]]:
        """``(model name, its drafter's snapshot)`` of each loaded model that drafts."""
        with self._lock:
            entries = list(self.entries.values())
        return [(e.name, e.drafter.snapshot()) for e in entries if e.drafter is not None]

    def stats_payload(self) -> Dict[str, Any]:
        """The body of ``GET /v1/suffix/stats``, for anyone who can reach the
        server: settings, the drafters' limits and the batch counters, and
        with the global cache scope the counters summed over all requests
        (drafted, accepted, tokens, cache occupancy, the calibration and
        cost curves). Where the cache is partitioned by tenant
        (``--suffix-cache-scope`` user or header:NAME) those traffic
        counters are left out (``traffic_counters: false``): they are every
        tenant's traffic. Nothing in it names a file or path (models by
        folder name or repo id, whether a cache file is set), a scope or a
        header."""
        traffic = self.scope == "global"
        keys = ("drafted", "accepted", "tokens", "steps", "requests")
        totals = dict.fromkeys(keys, 0)
        totals.update(active_requests=0, cached_requests=0, cached_tokens=0, tree_responses=0)
        batch = BatchDraftStats()
        models = []
        with self._lock:
            entries = list(self.entries.values())
        for e in entries:
            m: Dict[str, Any] = {"model": e.name, "drafting": e.drafter is not None}
            if e.drafter is not None:
                m["limits"] = e.drafter.config()
                if traffic:
                    snap = e.drafter.snapshot()
                    m.update(snap)
                    for k in totals:
                        totals[k] += snap[k]
            m["batch"] = e.batch_stats.as_dict()
            m["cache_file"] = e.persisted
            batch.merge(e.batch_stats)
            models.append(m)
        payload: Dict[str, Any] = {
            "object": "suffix.stats",
            "draft": SUFFIX,
            "num_draft_tokens": self.num_draft_tokens,
            "policy": getattr(self.cli_args, "suffix_policy", None),
            "scope": "header" if self.scope.startswith(HEADER_SCOPE) else self.scope,
            "cache_file": self.cache_file is not None,
            "traffic_counters": traffic,
        }
        if traffic:
            payload.update(
                totals,
                acceptance_rate=totals["accepted"] / totals["drafted"] if totals["drafted"] else 0.0,
                tokens_per_step=totals["tokens"] / totals["steps"] if totals["steps"] else 0.0,
            )
        payload.update(batch=batch.as_dict(), models=models)
        return payload


def output_size(model: Any, tokenizer: Any) -> int:
    """The length of ``model``'s logits vector: the shape of a one-token
    forward on a scratch cache, built lazily and never evaluated (no
    compute); :func:`~mlx_lm_suffix.persistence.vocabulary_size` where that
    fails. Token ids at or past it index past the logits (a ``logit_bias``
    there crashes the process); the tokenizer may know fewer ids."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    try:
        n = int(model(mx.array([[0]]), cache=make_prompt_cache(model)).shape[-1])
    except Exception:
        n = 0
    return n if n > 0 else vocabulary_size(model, tokenizer)


def _model_name(model_path: str) -> str:
    path = Path(model_path).expanduser()
    return path.resolve().name if path.exists() else str(model_path)


#: Seconds a SIGTERM waits for the orderly shutdown (the generation thread
#: ends its step) before the process exits without it: a step is a
#: forward, milliseconds to a second or so on a Mac's GPU, but a prompt's
#: prefill runs all its chunks in one step (minutes for a long prompt on a
#: CPU), and supervisors kill what outlasts their grace (``docker stop``:
#: 10 s), losing the save. The cache file is saved before the wait.
SHUTDOWN_GRACE_S = 5.0


@contextlib.contextmanager
def _sigterm_as_ctrl_c(before: Callable[[], None]) -> Iterator[None]:
    """In the main thread, SIGTERM calls ``before`` and then stops the
    server as Ctrl-C does (KeyboardInterrupt), exiting the process with
    status 0 if that has not ended within :data:`SHUTDOWN_GRACE_S`; a second
    one only calls ``before``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = []

    def on_sigterm(signum, frame):
        before()
        if not interrupted:
            interrupted.append(signum)
            watchdog = threading.Timer(SHUTDOWN_GRACE_S, _exit_unfinished)
            watchdog.daemon = True
            watchdog.start()
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


_state_lock = threading.Lock()
_shutdown_done = False


def _exit_unfinished() -> None:
    """The orderly shutdown outlasted its grace: exit (the cache file was
    saved when SIGTERM came; requests in flight end cut, as they would)."""
    logger.warning("mlx-lm-suffix: the generation thread did not stop within %.0f s of "
                   "SIGTERM; exiting without waiting for it", SHUTDOWN_GRACE_S)
    _exit_now()


def _exit_now() -> None:
    import sys

    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            f.flush()
    os._exit(0)


def exit_after_shutdown() -> None:
    """End the process with status 0 once a suffix server has shut down in
    order (HTTP server stopped, generation thread joined, cache saved).

    Interpreter teardown after mlx_lm.server can abort in MLX's stream
    threads ("terminate called without an active exception", SIGABRT; seen
    with the stock server on Ctrl-C too); there is nothing left to clean up.
    """
    if _shutdown_done:
        _exit_now()


def state_for(cli_args: Any) -> Optional[SuffixServing]:
    """The suffix state of the server with these CLI args (None: stock)."""
    state = getattr(cli_args, _STATE_ATTR, False)
    if state is not False:
        return state
    with _state_lock:
        state = getattr(cli_args, _STATE_ATTR, False)
        if state is False:
            state = None
            if enabled(cli_args):
                state = SuffixServing(cli_args)
            setattr(cli_args, _STATE_ATTR, state)
    return state


#: Why a distributed suffix server takes no request that stock serves one at
#: a time (mlx-lm 0.32.2 ResponseGenerator._serve_single raises
#: NotImplementedError on rank 0 alone when its client disconnects, and the
#: other ranks wait for it forever).
SINGLE_PATH_DISTRIBUTED = (
    "in distributed mode mlx_lm.server serves it one request at a time and "
    "cannot stop that request on every rank if its client disconnects"
)

#: Why a distributed suffix server refuses ``--pipeline``: the ranks of
#: mlx-lm 0.32.2's batched pipeline serving can sample different tokens
#: (stock's answers then differ from one process's; found on Qwen3.5), and
#: drafts verified against different tokens would take different forwards.
PIPELINE_DISTRIBUTED = (
    "the ranks of mlx-lm's batched pipeline serving do not always sample the "
    "same tokens, and suffix decoding needs them to; serve with tensor "
    "parallelism (without --pipeline)"
)


def prepare_run(state: SuffixServing) -> None:
    """Start-up work in the main thread: refuse what a distributed suffix
    server does not support, and check the cache file against the default
    model. Exits the process when either fails."""
    distributed = ranks.group() is not None
    if distributed and getattr(state.cli_args, "kv_bits", None) is not None:
        logger.error("mlx-lm-suffix: --kv-bits is not supported with --draft suffix: %s.", SINGLE_PATH_DISTRIBUTED)
        raise SystemExit(2)
    if distributed and getattr(state.cli_args, "pipeline", False):
        logger.error("mlx-lm-suffix: --pipeline is not supported with --draft suffix: %s.", PIPELINE_DISTRIBUTED)
        raise SystemExit(2)
    model = getattr(state.cli_args, "model", None)
    if state.cache_file is None or not model:
        return
    try:
        state.cache_file.check_at_start(model)
    except CacheFileRefused as e:
        logger.error("mlx-lm-suffix: %s", e)
        raise SystemExit(2) from None


# --------------------------------------------------------------- requests
def scope_key(body: Dict[str, Any], headers: Any, mode: str = "user") -> Hashable:
    """A request's cache scope for ``--suffix-cache-scope`` ``mode``.

    ``user``: a hash of the API key (``Authorization: Bearer ...``) and the
    ``user`` field, both as the client sent them. ``header:NAME``: a hash of
    header NAME's value alone (set by a trusted proxy); without it,
    :data:`~mlx_lm_suffix.drafter.PRIVATE`. Raises ``ValueError`` for a
    ``user`` that is not a string, or NAME sent more than once."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ValueError("user must be a string")
    if mode.startswith(HEADER_SCOPE):
        name = mode[len(HEADER_SCOPE) :]
        values = [v.strip() for v in (headers.get_all(name) or [])] if headers else []
        if len(values) > 1:
            raise ValueError(f"more than one {name} header")
        if not values or not values[0]:
            return PRIVATE
        h = hashlib.sha256(b"mlx-lm-suffix scope\0header\0")
        h.update(values[0].encode())
        return "header:" + h.hexdigest()[:32]
    auth = headers.get("Authorization") if headers is not None else None
    key = None
    if auth:
        parts = auth.split(None, 1)
        key = parts[1].strip() if len(parts) == 2 and parts[0].lower() == "bearer" else auth
    if not user and not key:
        return "anonymous"
    h = hashlib.sha256(b"mlx-lm-suffix scope\0")
    h.update(f"key={key or ''}\0user={user or ''}".encode())
    return "user:" + h.hexdigest()[:32]


class DraftRefused(ValueError):
    """``draft_model: "suffix"`` sent to a server started without ``--draft suffix``."""


class RequestRefused(ValueError):
    """A request that is invalid for its model (HTTP 400 with this message)."""


class Refused(BaseException):
    """A :class:`RequestRefused` of the generation thread on its way from
    ``ResponseGenerator.generate`` to ``do_POST`` (see
    :mod:`mlx_lm_suffix.patches.server`), which answers 400 with its
    message: not an ``Exception``, so that stock ``handle_completion``'s
    ``except Exception`` (HTTP 404) lets it pass."""


def check_logit_bias(bias: Any, size: Optional[int]) -> None:
    """Raise :class:`RequestRefused` for a ``logit_bias`` key that is not a
    token id of the model: negative, or at or past ``size`` (its logits'
    length; None: not known yet). Stock indexes the logits with them
    unchecked, which crashes the process. Keys that are not ints are left
    to stock's validation."""
    if not isinstance(bias, dict):
        return
    for key in bias:
        if isinstance(key, int) and (key < 0 or (size is not None and key >= size)):
            ids = f"0 to {size - 1}" if size is not None else "0 or more"
            raise RequestRefused(
                f"logit_bias key {key} is not a token id of this model (its token ids are {ids})"
            )


def _requested_key(handler: Any) -> Optional[Tuple[Any, ...]]:
    """The ``ModelProvider.model_key`` of the request's model once loaded:
    its names mapped as mlx-lm 0.32.2 ``ModelProvider.load`` maps them (a
    suffix server's requests all ask for the default draft model)."""
    provider = handler.response_generator.model_provider
    try:
        model, adapter = handler.requested_model, handler.adapter
        adapter = provider._adapter_map.get(model, adapter)
        model = provider._model_map.get(model, model)
        draft = provider._draft_model_map.get("default_model", "default_model")
    except (AttributeError, TypeError):
        return None
    return (model, adapter, draft)


def wants_logprobs(handler: Any) -> bool:
    """Whether the response carries logprobs (``logprobs``, or
    ``top_logprobs`` > 0, which stock answers with them too)."""
    top = getattr(handler, "top_logprobs", -1)
    return getattr(handler, "logprobs", False) is True or (isinstance(top, int) and top > 0)


def request_info(handler: Any) -> Optional[RequestInfo]:
    """Validate the suffix fields of a request (after stock validation).

    A request's ``num_draft_tokens`` is capped by the server's
    ``--num-draft-tokens`` (on every path, prompt copies included). Raises ``ValueError`` (the handler answers HTTP 400). Normalises the
    handler's ``requested_draft_model`` so the request batches with others.
    """
    state = state_for(handler.response_generator.cli_args)
    draft = handler.requested_draft_model
    if state is None:
        if draft == SUFFIX:
            raise DraftRefused("draft_model 'suffix' needs a server started with --draft suffix")
        return None
    if ranks.group() is not None and handler.seed is not None:
        raise ValueError(f"seed is not supported with --draft suffix: {SINGLE_PATH_DISTRIBUTED}")
    if handler.seed is not None and not 0 <= handler.seed < 2**64:
        # mx.random.seed takes a uint64 (stock: a TypeError in the generation
        # thread, the connection dropped).
        raise ValueError(f"seed must be an integer from 0 to {2**64 - 1}, got {handler.seed}")
    if handler.max_tokens < 1:
        # mlx-lm 0.32.0 validates max_tokens >= 0, and 0 then fails in the
        # batch (HTTP 500); 0.32.1 asks for at least 1 itself, in these words.
        raise ValueError("max_tokens must be at least 1")
    if draft is not None and not isinstance(draft, str):
        raise ValueError(f"draft_model must be a string, got {draft!r}")
    if draft not in (SUFFIX, "default_model", None):
        raise ValueError(
            f"Unknown draft_model {draft!r}: this server drafts with suffix decoding; "
            f"use 'suffix' (the default) or null to turn drafting off"
        )
    n = handler.num_draft_tokens
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"num_draft_tokens must be a non-negative integer, got {n!r}")
    if n < 0:
        raise ValueError(f"num_draft_tokens must be a non-negative integer, got {n}")
    _check_body(handler)
    # Token ids past the model's logits (and top_k): checked here where the
    # requested model has been loaded before (its size never changes), else
    # in the generation thread once it is (check_for_model).
    key = _requested_key(handler)
    size = state.output_size_for(key) if key is not None else None
    check_logit_bias(getattr(handler, "logit_bias", None), size)
    validation.check_generation_fields(validation.fields_of_handler(handler), size)
    scope = None
    if state.scope != "global":
        scope = scope_key(handler.body, handler.headers, state.scope)
    handler.requested_draft_model = "default_model"
    # --num-draft-tokens is a hard limit: a request may lower it, not raise it.
    n = min(n, state.num_draft_tokens)
    # A verification forward's logprobs (and the K/V it leaves in the cache)
    # differ from one-token steps' in the last bits, and so does the order
    # of stock's unsorted top_logprobs: a request for them is not drafted.
    drafting = draft is not None and n > 0 and not wants_logprobs(handler)
    return RequestInfo(
        drafting=drafting,
        num_draft_tokens=n if drafting else 0,
        scope=scope,
        usage=RequestUsage(),
    )


def _check_body(handler: Any) -> None:
    """Raise ``ValueError`` for body fields stock would fail on in the
    generation thread, ending it (its checks come later)."""
    if urlsplit(handler.path).path == "/v1/completions" and "prompt" in handler.body:
        prompt = handler.body["prompt"]
        if not isinstance(prompt, str) or not prompt:
            # Stock: an empty one ends the generation thread, other types
            # fail in the tokenizer.
            raise ValueError("prompt must be a non-empty string")
    # Stock takes `body.get("stop") or []`, a string as one word, and
    # iterates anything else: an object's keys are words too. Words that
    # are not strings: a TypeError in the generation thread, which ends it.
    stop = handler.body.get("stop") or []
    if not (isinstance(stop, str) or (
            isinstance(stop, (list, dict)) and all(isinstance(w, str) for w in stop))):
        raise ValueError("stop must be a string or a list of strings")
    options = handler.body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ValueError("stream_options must be an object")


def check_for_model(provider: Any, args: Any, request: Any = None) -> None:
    """In the generation thread, with the request's model loaded
    (``provider.model``; ``args``: its ``GenerationArguments``): raise
    :class:`RequestRefused` for what the handler could not check before
    that model was loaded (``logit_bias`` ids past its logits, ``top_k``);
    the request's info learns which model serves it."""
    if state_for(provider.cli_args) is None:
        return
    entry = _entry_for_model(provider.model)
    size = entry.output_size if entry is not None else None
    check_logit_bias(args.logits.logit_bias, size)
    try:
        validation.check_generation_fields(validation.fields_of_args(args), size)
    except ValueError as e:
        raise RequestRefused(str(e)) from None
    info = getattr(request, _REQUEST_ATTR, None)
    if info is not None and entry is not None:
        info.model = entry.name


def stream_options_with_usage(options: Any) -> Any:
    """``stream_options`` with ``include_usage`` (false where it is
    missing): mlx-lm 0.32.2 ``APIHandler.handle_completion`` reads
    ``stream_options["include_usage"]`` after the last event and, on a
    KeyError, ends the stream without ``[DONE]``."""
    if isinstance(options, dict) and "include_usage" not in options:
        return {**options, "include_usage": False}
    return options


def attach_request_info(request: Any, info: Optional[RequestInfo]) -> None:
    if info is not None:
        setattr(request, _REQUEST_ATTR, info)


def add_usage(response: Dict[str, Any], info: Optional[RequestInfo]) -> Dict[str, Any]:
    """Add the request's draft counters to a response's ``usage``."""
    usage = response.get("usage") if isinstance(response, dict) else None
    if info is not None and isinstance(usage, dict):
        usage[USAGE_DRAFTED] = info.usage.drafted
        usage[USAGE_ACCEPTED] = info.usage.accepted
    return response


def is_stats_path(path: str) -> bool:
    return urlsplit(path).path.rstrip("/") == STATS_PATH


def is_metrics_path(path: str) -> bool:
    return urlsplit(path).path.rstrip("/") == METRICS_PATH


def timed_responses(request: Any, ctx: Any, responses: Iterator[Any]) -> Iterator[Any]:
    """The token responses of a request that began generating (``ctx``: its
    ``GenerationContext``), as its handler reads them, noted on the
    request's info for the metrics: tokens, when the first and last came,
    the finish reason."""
    info = getattr(request, _REQUEST_ATTR, None)
    if info is None:
        return responses
    info.prompt_tokens = len(ctx.prompt)

    def noted() -> Iterator[Any]:
        for r in responses:
            info.last_token_at = time.perf_counter()
            if info.first_token_at is None:
                info.first_token_at = info.last_token_at
            info.tokens += 1
            info.finish_reason = r.finish_reason or info.finish_reason
            yield r

    return noted()


def observe_post(handler: Any, started: float, error: Optional[BaseException]) -> None:
    """A completion POST of a suffix server ended (``started``: when its
    handler began; ``error``: what ended its answer, if anything): count it
    in the metrics."""
    outcome = None
    if isinstance(error, (BrokenPipeError, ConnectionResetError)):
        outcome = "abort"
    elif error is not None:
        outcome = "error"
    state = state_for(handler.response_generator.cli_args)
    state.metrics.observe(urlsplit(handler.path).path, getattr(handler, _STATUS_ATTR, None),
                          getattr(handler, _REQUEST_ATTR, None), started, outcome)


_STATUS_ATTR = "_mlx_lm_suffix_status"


def start_post(handler: Any) -> float:
    """A POST begins on a suffix server's handler (which a kept-alive
    connection reuses): forget the last request's; returns the time."""
    setattr(handler, _REQUEST_ATTR, None)
    setattr(handler, _STATUS_ATTR, None)
    return time.perf_counter()


def note_status(handler: Any, code: int) -> None:
    """The handler sent HTTP status ``code`` (the last one sent counts)."""
    setattr(handler, _STATUS_ATTR, code)


# A request being admitted by the server's generation thread: set when its
# prompt is tokenized, taken by the batch insert or single-request call that
# follows in the same thread.
_admission = threading.local()


def note_prompt(cli_args: Any, request: Any, prompt: Sequence[int]) -> None:
    if state_for(cli_args) is None:
        return
    if len(prompt) == 0:
        # Stock inserts it into the batch, whose ValueError ends the
        # generation thread; raised here, it fails this request only.
        raise ValueError("The prompt is empty: it encodes to no tokens.")
    _admission.value = (getattr(request, _REQUEST_ATTR, None), list(prompt))


def _take_admission() -> Tuple[Optional[RequestInfo], Optional[List[int]]]:
    value = getattr(_admission, "value", None)
    _admission.value = None
    return value if value is not None else (None, None)


def batch_row_options(segments: Sequence[Sequence[int]], all_tokens: Sequence[int]) -> RowOptions:
    """Drafting options of a sequence the server inserts into its batch."""
    from ..batch import RowOptions

    info, prompt = _take_admission()
    full = list(all_tokens) + [t for s in segments for t in s]
    if info is None or prompt != full:
        # Not the request we were told about: no drafting, nothing cached.
        return RowOptions(use_drafter=False)
    return RowOptions(
        num_draft_tokens=info.num_draft_tokens,
        scope=info.scope,
        prompt=prompt,
        usage=info.usage,
        arrived=info.arrived,
    )


def make_batch_generator(stock_cls: Callable[..., Any], model: Any, **kwargs: Any) -> Any:
    """The server's ``BatchGenerator(model, ...)``: a suffix batch generator
    for a model registered by a suffix server, else the stock one."""
    entry = _entry_for_model(model)
    if entry is None or entry.drafter is None:
        return stock_cls(model, **kwargs)
    from ..batch import SuffixBatchGenerator

    generator = SuffixBatchGenerator(
        model,
        entry.drafter,
        options_source=batch_row_options,
        stats=entry.batch_stats,
        requests_waiting=entry.requests_waiting,
        **kwargs,
    )
    entry.generators.add(generator)
    return generator


def _entry_for_model(model: Any) -> Optional[ModelEntry]:
    return getattr(model, _MODEL_ATTR, None)


def on_model_loaded(provider: Any, model_path: str) -> None:
    """``provider`` (a ``ModelProvider``) loaded the model at ``model_path``."""
    state = state_for(provider.cli_args)
    if state is None or provider.model is None:
        return
    state.on_model_loaded(model_path, provider.model, provider.tokenizer, provider.model_key)


def single_stream_generate(
    stream_generate: Callable[..., Any],
    model: Any,
    tokenizer: Any,
    prompt: Any,
    max_tokens: int,
    draft_model: Any,
    kwargs: Dict[str, Any],
):
    """The server's single-request ``stream_generate`` call, with the suffix
    drafter of the model when the request being served asked for it."""
    info, full = _take_admission()
    entry = _entry_for_model(model)
    if (
        draft_model is not None
        or info is None
        or entry is None
        or entry.drafter is None
        or kwargs.get("input_embeddings") is not None
        or not isinstance(prompt, list)
        or len(prompt) > len(full)
        or full[len(full) - len(prompt) :] != prompt
    ):
        return stream_generate(
            model, tokenizer, prompt, max_tokens=max_tokens, draft_model=draft_model, **kwargs
        )
    kwargs = dict(kwargs)
    kwargs.pop("input_embeddings", None)
    kwargs.update(
        num_draft_tokens=info.num_draft_tokens,
        draft_prompt=full,
        draft_scope=info.scope,
        draft_usage=info.usage,
    )
    return stream_generate(
        model, tokenizer, prompt, max_tokens=max_tokens, draft_model=entry.drafter, **kwargs
    )


# -------------------------------------------------------------- failures
_IN_FLIGHT_ATTR = "_mlx_lm_suffix_in_flight"
#: What a client is told when generation failed (the details go to the log:
#: one request's failure fails every request of its batch).
GENERATION_FAILED = "generation failed (details in the server log)"


def _in_flight(generator: Any) -> "weakref.WeakSet":
    queues = getattr(generator, _IN_FLIGHT_ATTR, None)
    if queues is None:
        queues = weakref.WeakSet()
        setattr(generator, _IN_FLIGHT_ATTR, queues)
    return queues


def note_request_taken(generator: Any, item: Any) -> None:
    """The generation thread took ``(rqueue, request, args)`` off the queue."""
    if item is not None and state_for(generator.cli_args) is not None:
        _in_flight(generator).add(item[0])


def generate_restarting(generator: Any, stock_generate: Callable[[Any], None]) -> None:
    """The generation loop (``ResponseGenerator._generate``) of a suffix server.

    Stock ``_run_generate`` runs the loop once: any exception of it (e.g. in
    a batched forward) ends the thread, every later request then fails with
    "generation thread died", and the requests in flight wait for it to
    notice. Here the requests in flight get a generic error
    (:data:`GENERATION_FAILED`; the exception goes to the log), the drafter requests
    of the abandoned batch are stopped, and the loop runs again (it keeps the
    loaded model and prompt cache). A loop that fails before taking any
    request (e.g. the model does not load), or once the server is stopping,
    raises to stock ``_run_generate``, which ends the thread; so does any
    loop in distributed mode.
    """
    state = state_for(generator.cli_args)
    if state is not None:
        # mlx-lm 0.32.2: ResponseGenerator.requests, the Queue its HTTP
        # handlers put requests in (none: no signal).
        requests = getattr(generator, "requests", None)
        state.requests = requests if hasattr(requests, "empty") else None
    if state is None or ranks.group() is not None:
        # Distributed: a loop run again on one rank would not pair its
        # collectives with the other ranks'; it ends, as stock's does.
        return stock_generate(generator)
    queues = _in_flight(generator)
    while True:
        queues.clear()  # (finished requests' queues are gone or drained)
        try:
            return stock_generate(generator)
        except Exception as e:
            taken = list(queues)
            for q in taken:
                # (extra items in finished requests' queues are never read)
                q.put(RuntimeError(GENERATION_FAILED))
            state.abandon_batches()
            if generator._stop or not taken:
                raise
            logger.exception("mlx-lm-suffix: the generation loop failed: %s", e)
            logger.warning(
                "mlx-lm-suffix: failed %d request(s) in flight; generation restarted",
                len(taken),
            )


def answer_error(handler: Any, error: BaseException) -> None:
    """Answer a POST whose handling raised (stock lets the exception close
    the connection without a response): a JSON error while nothing was
    sent, an error event on a started stream. A failure in generation is
    answered with :data:`GENERATION_FAILED` (its details go to the log); a
    failure before it (the request's own body) with its message. A client
    that went away gets nothing."""
    handler.close_connection = True
    if isinstance(error, (BrokenPipeError, ConnectionResetError)):
        logger.debug("mlx-lm-suffix: client disconnected: %s", error)
        return
    # A refusal raised in generation is the request's own (its parameters).
    generating = getattr(handler, _GENERATING_ATTR, False) and not isinstance(error, RequestRefused)
    logger.error("mlx-lm-suffix: request failed: %s", error, exc_info=generating)
    message = GENERATION_FAILED if generating else str(error) or type(error).__name__
    buffered = getattr(handler, "_headers_buffer", None)
    try:
        if buffered or buffered is None:  # no header reached the client
            handler._headers_buffer = []
            if isinstance(error, UnicodeDecodeError):
                message = f"Invalid JSON in request body: {error}"
            body = json.dumps({"error": message}).encode()
            handler._set_completion_headers(500 if generating else 400)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)
        elif getattr(handler, "stream", False):
            kind, code = ("server_error", 500) if generating else ("invalid_request_error", 400)
            event = {"error": {"message": message, "type": kind, "code": code}}
            handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        handler.wfile.flush()
    except OSError:
        pass


_GENERATING_ATTR = "_mlx_lm_suffix_generating"


def mark_generating(handler: Any, generating: bool = True) -> None:
    """Whether the request being handled reached generation (an error after
    that is the server's: 500)."""
    setattr(handler, _GENERATING_ATTR, generating)
